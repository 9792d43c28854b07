"""The trainers' checks of a data set, before any tokenisation or packing where the data allow.

Bad ``weight`` / ``source`` values, an empty data set, and conversations without a target (which
the per-conversation mean leaves out: a data set of them would train on nothing while looking
fine) are refused naming the row, or with ``skip_no_assistant`` skipped and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import datasets
import numpy as np
import pyarrow.compute as pc

from collators.checks import targets_per_sequence
from packed_ce.columns import INPUT_IDS, LABELS, SEQ_LENGTHS, SEQ_TARGETS, SEQUENCE_COLUMNS

logger = logging.getLogger(__name__)

# Rows read at a time from Arrow: bounded memory however large the data set.
_BATCH_ROWS = 65536


def check_datasets(
    arguments: dict,
    trainer: str,
    skip: bool,
    *,
    assistant_only: bool = False,
    text_field: str | None = None,
    names: tuple[str, ...] = ("train_dataset", "eval_dataset"),
) -> None:
    """A trainer's checks before its construction, on its bound ``train_dataset`` and
    ``eval_dataset`` arguments (or the data set arguments ``names`` of a later call), which are
    replaced in ``arguments`` by the rows kept: the columns,
    not empty, and (with ``assistant_only``, for conversational data) an assistant turn or (for
    tokenised data) a target in every conversation, or ``skip`` them. With ``text_field`` (trl's
    ``dataset_text_field``), the conversations where trl reads them
    (:func:`check_conversation_columns`).
    """
    if not isinstance(skip, bool):
        raise TypeError(
            f"{trainer}: skip_no_assistant must be a bool, got {type(skip).__name__} {skip!r}."
        )

    def check(dataset, name):
        check_columns(dataset, name)
        check_not_empty(dataset, name)
        if text_field is not None:
            check_conversation_columns(dataset, name, trainer, text_field, assistant_only)
        if assistant_only:
            dataset = skip_or_refuse_without_assistant(dataset, name, trainer, skip)
        return skip_or_refuse_without_targets(dataset, name, trainer, skip)

    for name in names:
        if arguments.get(name) is not None:
            arguments[name] = each_dataset(arguments[name], name, check)


def each_dataset(argument, name: str, check: Callable):
    """``check(dataset, name)`` on a ``train_dataset`` / ``eval_dataset`` argument (a data set, a
    dict of them, or None), keeping its shape: what ``check`` returns replaces each data set. A
    dict's data sets are named ``name['<key>']``.
    """
    if argument is None:
        return None
    if isinstance(argument, dict):
        return {key: check(data, f"{name}[{key!r}]") for key, data in argument.items()}
    return check(argument, name)


def check_columns(dataset, name: str) -> None:
    """Checks the per-conversation columns of a data set (``packed_ce.columns.SEQUENCE_COLUMNS``):
    ``weight`` / ``source`` one value per row, ``seq_weights`` / ``seq_sources`` / ``seq_targets``
    of packed rows one per sequence, each value as the column checks it and all of a column
    together (weights: not all 0, within a ratio the loss carries).

    Args:
        dataset: a ``datasets.Dataset`` (an ``IterableDataset`` is not read here).
        name: how the data set is called in errors (``train_dataset``).

    Raises:
        TypeError / ValueError naming the row (and the sequence of a packed row): a weight not a
            real number, NaN, infinite, negative or not carried exactly, a source not a string;
            naming the data set when every weight is 0.
    """
    columns = getattr(dataset, "column_names", None) or []
    for column in SEQUENCE_COLUMNS:
        found = []  # (values, where) of the per-conversation and the packed rows' column
        if column.column in columns:
            values = [
                column.check(value, f"{name}[{row}][{column.column!r}]")
                for row, value in enumerate(dataset[column.column])
            ]
            found.append((values, lambda i, c=column.column: f"{name}[{i}][{c!r}]"))
        if column.key in columns:  # rows packed by collators.pack_dataset: one per sequence
            per_row = [
                column.values(values, f"{name}[{row}][{column.key!r}]")
                for row, values in enumerate(dataset[column.key])
            ]
            rows = np.repeat(np.arange(len(per_row)), [len(values) for values in per_row])
            starts = np.searchsorted(rows, rows)  # each value's index in its row: i - starts[i]
            values = [value for row_values in per_row for value in row_values]
            found.append(
                (values, lambda i, k=column.key: f"{name}[{rows[i]}][{k!r}][{i - starts[i]}]")
            )
        if column.check_together is not None:
            for values, where in found:
                column.check_together(np.asarray(values, dtype=np.float64), where, name)


def check_conversation_columns(
    dataset, name: str, trainer: str, text_field: str, assistant_only: bool
) -> None:
    """Conversations where trl reads them, found from the first row: in ``messages`` with ``role``
    and ``content`` keys. trl's errors for a column of another name (``conversation``, or ShareGPT's
    ``conversations`` under ``assistant_only_loss``) named no column, ShareGPT's ``from`` /
    ``value`` keys inside ``messages`` read as conversations without an assistant turn, and trl's
    conversion of ShareGPT's ``conversations`` keeps its roles ``human`` and ``gpt``, which a
    template renders as they are.

    Raises:
        ValueError naming the column (and the fix, a rename) or the message and its keys (and the
        fix, a map).
    """
    from trl.data_utils import is_conversational_from_value

    from collators.chat import SHAREGPT_FIX, is_conversation, sharegpt_keys

    first = next(iter(dataset), None) if isinstance(dataset, datasets.IterableDataset) else None
    if isinstance(dataset, datasets.Dataset) and dataset.num_rows:
        first = dataset[0]
    if not isinstance(first, dict):
        return
    read = {INPUT_IDS, "messages", "prompt", "completion", text_field}
    roles = {m.get("from") for m in first.get("conversations") or [] if isinstance(m, dict)}
    if not assistant_only and is_conversational_from_value(first) and not roles & {"human", "gpt"}:
        read.add("conversations")  # trl renames it and its keys (not ShareGPT's roles) itself
    if not read & set(first):
        found = next((column for column, value in first.items() if is_conversation(value)), None)
        if found is not None:
            sharegpt = sharegpt_keys(first[found][0])
            # trl converts ShareGPT's column, keeping its roles, and refuses it with
            # assistant_only_loss
            why = (
                "whose roles trl's conversion keeps as they are (and which it refuses with "
                "assistant_only_loss)"
                if found == "conversations" and sharegpt
                else f"which {trainer} (as trl) reads from 'messages'"
            )
            raise ValueError(
                f"`{name}` has no 'messages' column, and its column {found!r} holds "
                f"conversations, {why}: rename it, dataset.rename_column({found!r}, 'messages')"
                + (f"; its messages have ShareGPT's keys: {SHAREGPT_FIX}" if sharegpt else "")
                + "."
            )
    for index, message in enumerate(first.get("messages") or []):
        sharegpt = sharegpt_keys(message)
        if sharegpt:
            raise ValueError(f"`{name}[0]['messages'][{index}]` {sharegpt}.")


def check_not_empty(dataset, name: str) -> None:
    """ValueError naming ``dataset`` when it has no row (an ``IterableDataset`` is not counted)."""
    try:
        size = len(dataset)
    except TypeError:  # an IterableDataset: read lazily, never counted here
        return
    if size == 0:
        raise ValueError(f"`{name}` is empty: give the trainer at least one conversation.")


def skip_or_refuse_without_assistant(dataset, name: str, trainer: str, skip: bool):
    """Conversational data (a ``messages`` column) whose rows all have an assistant turn.

    Under ``assistant_only_loss`` a conversation without one has no target. Found before any
    tokenisation: with ``skip`` the others are kept (the count logged), else ValueError naming the
    first such row. Other data sets are returned as they are.
    """
    if not isinstance(dataset, datasets.Dataset) or "messages" not in dataset.column_names:
        return dataset
    from collators.chat import sharegpt_keys

    rows = dataset.select_columns(["messages"]).iter(batch_size=_BATCH_ROWS)
    conversations = (messages for batch in rows for messages in batch["messages"])
    missing = []
    for row, messages in enumerate(conversations):
        if any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages or []):
            continue
        for index, message in enumerate(messages or []):
            keys = sharegpt_keys(message)
            if keys:  # its roles are under another key: skipping it would leave out its data
                raise ValueError(f"`{name}[{row}]['messages'][{index}]` {keys}.")
        missing.append(row)
    if missing and not skip:
        raise ValueError(
            f"`{name}[{missing[0]}]['messages']` has no assistant turn, so assistant_only_loss "
            f"leaves it nothing to train on: pass skip_no_assistant=True to {trainer} to skip such "
            "conversations (counted and logged), or remove them."
        )
    return _drop_rows(dataset, missing, name)


def skip_or_refuse_without_targets(
    dataset, name: str, trainer: str, skip: bool, ignore_index: int = -100
):
    """A tokenised data set (``input_ids``, ``labels``, optionally ``seq_lengths``) whose
    conversations all have a target under the causal shift.

    Without a target, a row is skipped with ``skip`` (counted), else refused by name; in a packed
    row it stays, weighing nothing. Split pieces (``seq_targets``) are not checked: their targets
    may lie in another row.

    Raises:
        ValueError naming the row and the fix; naming the data set when no row is left (packed:
            no conversation has a target).
    """
    if not isinstance(dataset, datasets.Dataset) or not {INPUT_IDS, LABELS} <= set(
        dataset.column_names
    ):
        return dataset
    columns = dataset.column_names
    packed, split = SEQ_LENGTHS in columns, SEQ_TARGETS in columns
    read = [INPUT_IDS, LABELS] + [SEQ_LENGTHS] * packed
    missing, counted, row = [], 0, 0
    for table in dataset.select_columns(read).with_format("arrow").iter(batch_size=_BATCH_ROWS):
        tokens = pc.fill_null(pc.list_value_length(table[INPUT_IDS]), 0).to_numpy(
            zero_copy_only=False
        )
        labels = table[LABELS].combine_chunks()
        label_counts = pc.fill_null(pc.list_value_length(labels), 0).to_numpy(zero_copy_only=False)
        for offset in np.flatnonzero((tokens != label_counts) | (tokens == 0)):
            at = f"`{name}[{row + offset}]`"
            if tokens[offset] == 0:
                if skip and not packed:
                    continue  # no token, so no target: skipped below
                raise ValueError(
                    f"{at} is empty (no token), so it has nothing to train on: remove it"
                    + (
                        ""
                        if packed
                        else f", or pass skip_no_assistant=True to {trainer} to skip such rows"
                    )
                    + "."
                )
            raise ValueError(
                f"{at} has {label_counts[offset]} labels for {tokens[offset]} input_ids: give one "
                "label per token (-100 where nothing is trained)."
            )
        if packed:
            lengths_column = table[SEQ_LENGTHS].combine_chunks()
            lengths = (
                pc.list_flatten(lengths_column).to_numpy(zero_copy_only=False).astype(np.int64)
            )
            per_row = pc.fill_null(pc.list_value_length(lengths_column), 0).to_numpy(
                zero_copy_only=False
            )
        else:
            lengths, per_row = tokens.astype(np.int64), np.ones(len(tokens), dtype=np.int64)
        values = pc.list_flatten(labels).to_numpy(zero_copy_only=False).astype(np.int64)
        # seq_lengths that do not cover their rows: the collator's error
        if lengths.sum() != values.size:
            row += len(tokens)
            continue
        without = targets_per_sequence(values, lengths, ignore_index) == 0
        counted += int(per_row.sum())
        if not split and without.any():
            rows = np.repeat(np.arange(len(per_row)), per_row)
            first = int(np.flatnonzero(without)[0])
            if not skip:
                within = first - int(np.searchsorted(rows, rows[first]))
                where = f"`{name}[{row + rows[first]}]`" + (
                    f", sequence {within} of its seq_lengths," if packed else ""
                )
                raise ValueError(
                    f"{where} has no target (no label other than {ignore_index} after its first "
                    "token), so it has nothing to train on: pass skip_no_assistant=True to "
                    f"{trainer} to skip such conversations (counted and logged), or remove them."
                )
            missing.extend((row + rows[without]).tolist())
        row += len(tokens)
    if packed:
        if missing and len(missing) == counted:
            raise ValueError(
                f"no conversation of `{name}` has a target ({counted} in its packed rows, none "
                f"with a label other than {ignore_index} after its first token), so nothing would "
                "train: "
                "pack conversations with assistant turns (collators.pack_dataset counts those "
                "truncation leaves without one: raise its max_length, or overflow='split')."
            )
        if missing:
            logger.warning(
                "%s: %d of %d conversations have no target; they stay in their packed rows and "
                "weigh nothing (skip_no_assistant=True).",
                name,
                len(missing),
                counted,
            )
        return dataset
    return _drop_rows(dataset, missing, name)


# A column of each row's index in the data set given to trl, to find the rows its preparation drops.
ROW_INDEX = "packed_ce_row"


def numbered(dataset):
    """``dataset`` with :data:`ROW_INDEX` (a ``datasets.Dataset``; any other data as it is)."""
    if not isinstance(dataset, datasets.Dataset):
        return dataset
    return dataset.add_column(ROW_INDEX, list(range(dataset.num_rows)))


def skip_or_refuse_dropped(
    prepared, given: int, name: str, trainer: str, skip: bool, max_length: int | None
):
    """TRL's preparation after truncating to ``max_length`` drops, without a word, the rows left
    without a target. Those rows (missing from :data:`ROW_INDEX`) are an error naming the first,
    or with ``skip`` a logged count (an error when none is left); the index column is removed.

    Args:
        prepared: trl's prepared data set, from :func:`numbered` data of ``given`` rows.
    """
    if not isinstance(prepared, datasets.Dataset) or ROW_INDEX not in prepared.column_names:
        return prepared
    kept = np.zeros(given, dtype=bool)
    kept[np.asarray(prepared[ROW_INDEX], dtype=np.int64)] = True
    prepared = prepared.remove_columns(ROW_INDEX)
    dropped = np.flatnonzero(~kept)
    fixes = (
        "raise max_length, or use packing=True with packing_strategy='bfd_split' (long "
        "conversations split across rows, every target trained once)"
    )
    if dropped.size and dropped.size == given:
        raise ValueError(
            f"no conversation of `{name}` has a target left after truncation to "
            f"max_length={max_length} ({given} of {given} without one), so nothing would train: "
            f"{fixes}."
        )
    if dropped.size and not skip:
        raise ValueError(
            f"`{name}[{dropped[0]}]` has no target left after truncation to "
            f"max_length={max_length} ({dropped.size} such rows): {fixes}, or pass "
            f"skip_no_assistant=True to {trainer} to skip them (counted and logged)."
        )
    if dropped.size:
        logger.warning(
            "%s: skipped %d of %d conversations without a target after truncation to max_length=%s "
            "(skip_no_assistant=True).",
            name,
            dropped.size,
            given,
            max_length,
        )
    return prepared


def _drop_rows(dataset, rows: list[int], name: str):
    """``dataset`` without ``rows`` (logged); ValueError naming it when none is left."""
    if not rows:
        return dataset
    if len(rows) == len(dataset):
        raise ValueError(
            f"no conversation of `{name}` has a target ({len(rows)} skipped with "
            "skip_no_assistant=True): nothing would train."
        )
    logger.warning(
        "%s: skipped %d of %d conversations without a target (skip_no_assistant=True).",
        name,
        len(rows),
        len(dataset),
    )
    drop = set(rows)
    return dataset.select([i for i in range(len(dataset)) if i not in drop])
