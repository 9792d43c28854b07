"""Batches for training: packed (one row, exact boundaries) and padded (the unpacked baseline).

Both describe their sequences with `cu_seqlens` over the flattened tokens and count the sequences
that have a target in `num_sequences`, so one call

    packed_ce.cross_entropy(logits, batch["labels"], cu_seqlens=batch["cu_seqlens"],
                            is_packed=True, shift=True)

averages per conversation the same way for either batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .chat import IGNORE_INDEX


def _flatten(parts: list) -> np.ndarray:
    """Concatenate token sequences to one int64 array."""
    if all(isinstance(part, list) for part in parts):
        # Extending Python lists and converting once is several times faster than torch.tensor(list).
        flat: list[int] = []
        for part in parts:
            flat.extend(part)
        return np.fromiter(flat, dtype=np.int64, count=len(flat))
    return np.concatenate([np.asarray(part, dtype=np.int64).reshape(-1) for part in parts])


class PackedCollator:
    """Concatenate conversations into one row with exact sequence boundaries (padding-free batches).

    Takes tokenized conversations (`input_ids`, `labels`) or rows of `pack_dataset` / `pack_stream` (which
    add `seq_lengths`, the length of each conversation in the row) and returns one row of `T` tokens:

    - `input_ids` `(1, T)` int64: the tokens, back to back.
    - `labels` `(1, T)` int64: aligned with `input_ids` (the model or the loss shifts them), with the first label
      of every sequence set to `ignore_index`. With the usual shift the last token of one conversation would
      otherwise be trained to predict the first token of the next; a plain shifted loss (transformers'
      built-in one) then never trains across a boundary.
    - `position_ids` `(1, T)` int64: `0, 1, 2, ...` restarting at every sequence.
    - `cu_seqlens` `(S + 1,)` int32: cumulative sequence lengths, `cu_seqlens[0] == 0`, `cu_seqlens[-1] == T`.
    - `max_seqlen` (`int`): the longest sequence.
    - `num_sequences` (`int`): the sequences with at least one target, i.e. a label other than
      `ignore_index` after the first position: the denominator of a per-sequence mean.
    - with `return_varlen_kwargs=True`, transformers' flash-attention keywords: `cu_seq_lens_q`,
      `cu_seq_lens_k` (the `cu_seqlens` tensor) and `max_length_q`, `max_length_k` (`max_seqlen`).

    There is deliberately no `attention_mask`. Transformers recognises a packed row from `position_ids`
    alone, and only when no `attention_mask` and no KV cache are given: sdpa and eager attention then build a
    block-diagonal causal mask, flash attention uses the varlen keywords. Call the model with
    `model(**batch, use_cache=False)`; the extra keys travel through `**kwargs` untouched.

    With `pad_to_multiple_of`, `T` is rounded up by a padding segment of `pad_token_id` tokens: its own
    sequence in `cu_seqlens`, positions `0, 1, ...`, all labels `ignore_index`, not counted in `num_sequences`.

    Args:
        pad_to_multiple_of (`int`, *optional*): round `T` up to a multiple of this (fixed shapes help compiled
            kernels).
        pad_token_id (`int`, *optional*, defaults to 0): token of the padding segment.
        ignore_index (`int`, *optional*, defaults to -100): label of untrained tokens.
        return_varlen_kwargs (`bool`, *optional*, defaults to `True`): add transformers' varlen keywords.

    Example:

    >>> from collators import PackedCollator
    >>> examples = [
    ...     {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
    ...     {"input_ids": [8, 9, 10, 11], "labels": [-100, -100, 10, 11]},
    ...     {"input_ids": [12, 13], "labels": [-100, -100]},
    ... ]
    >>> batch = PackedCollator()(examples)
    >>> batch["input_ids"]
    tensor([[ 5,  6,  7,  8,  9, 10, 11, 12, 13]])
    >>> batch["labels"]
    tensor([[-100,    6,    7, -100, -100,   10,   11, -100, -100]])
    >>> batch["position_ids"]
    tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]])
    >>> batch["cu_seqlens"], batch["max_seqlen"], batch["num_sequences"]
    (tensor([0, 3, 7, 9], dtype=torch.int32), 4, 2)
    """

    def __init__(
        self,
        *,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int = 0,
        ignore_index: int = IGNORE_INDEX,
        return_varlen_kwargs: bool = True,
    ):
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"`pad_to_multiple_of` must be a positive int, got {pad_to_multiple_of}.")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index
        self.return_varlen_kwargs = return_varlen_kwargs

    def __repr__(self) -> str:
        return (
            f"PackedCollator(pad_to_multiple_of={self.pad_to_multiple_of}, pad_token_id={self.pad_token_id}, "
            f"ignore_index={self.ignore_index}, return_varlen_kwargs={self.return_varlen_kwargs})"
        )

    def __call__(self, examples: Sequence[Mapping]) -> dict:
        """Collate `examples` (dicts with `input_ids`, optionally `labels` and `seq_lengths`) into one packed row.

        A missing `labels` means every token is trained (`labels = input_ids`); a missing `seq_lengths` means the
        example is one sequence.
        """
        id_parts, label_parts, seq_lengths = [], [], []
        for index, example in enumerate(examples):
            input_ids = example["input_ids"]
            labels = example.get("labels", input_ids)
            lengths = example.get("seq_lengths")
            lengths = [len(input_ids)] if lengths is None else [int(n) for n in lengths]
            if len(labels) != len(input_ids) or sum(lengths) != len(input_ids):
                raise ValueError(
                    f"`examples[{index}]` has {len(input_ids)} input_ids, {len(labels)} labels and seq_lengths "
                    f"summing to {sum(lengths)}: they must agree."
                )
            id_parts.append(input_ids)
            label_parts.append(labels)
            seq_lengths += lengths
        input_ids, labels = _flatten(id_parts), _flatten(label_parts)
        # Empty sequences have no token to carry a position or a boundary.
        lengths = np.array([n for n in seq_lengths if n > 0], dtype=np.int64)
        if lengths.size == 0:
            raise ValueError("`examples` holds no token.")

        num_padding = -len(input_ids) % self.pad_to_multiple_of if self.pad_to_multiple_of else 0
        if num_padding:
            input_ids = np.concatenate((input_ids, np.full(num_padding, self.pad_token_id, dtype=np.int64)))
            labels = np.concatenate((labels, np.full(num_padding, self.ignore_index, dtype=np.int64)))
            lengths = np.append(lengths, num_padding)

        cu_seqlens = np.concatenate(([0], np.cumsum(lengths)))
        starts = cu_seqlens[:-1]
        labels[starts] = self.ignore_index
        position_ids = np.arange(len(input_ids), dtype=np.int64) - np.repeat(starts, lengths)
        has_target = np.add.reduceat(labels != self.ignore_index, starts) > 0
        max_seqlen = int(lengths.max())

        cu_seqlens = torch.from_numpy(cu_seqlens.astype(np.int32))
        batch = {
            "input_ids": torch.from_numpy(input_ids)[None],
            "labels": torch.from_numpy(labels)[None],
            "position_ids": torch.from_numpy(position_ids)[None],
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max_seqlen,
            "num_sequences": int(has_target.sum()),
        }
        if self.return_varlen_kwargs:
            batch.update(
                cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen
            )
        return batch


class PaddedCollator:
    """Pad conversations to a `(B, T)` batch: the unpacked baseline, with the same boundary metadata.

    Returns:

    - `input_ids` `(B, T)` int64, right-padded with `pad_token_id`;
    - `attention_mask` `(B, T)` int64, 1 on real tokens;
    - `labels` `(B, T)` int64, `ignore_index` on padding and on the first token of each conversation (as in
      `PackedCollator`, so both batches hold exactly the same targets);
    - `cu_seqlens` `(B + 1,)` int32, `arange(B + 1) * T`: each row is one sequence of the flattened `B * T`
      tokens (its padding included, which has no target);
    - `num_sequences` (`int`): rows with at least one target.

    Args:
        pad_token_id (`int`, *optional*, defaults to 0): padding token.
        pad_to_multiple_of (`int`, *optional*): round `T` up to a multiple of this.
        ignore_index (`int`, *optional*, defaults to -100): label of untrained tokens.

    Example:

    >>> from collators import PaddedCollator
    >>> examples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    >>> batch = PaddedCollator(pad_token_id=0)(examples)
    >>> batch["input_ids"], batch["attention_mask"], batch["labels"]
    (tensor([[5, 6, 7],
            [8, 9, 0]]), tensor([[1, 1, 1],
            [1, 1, 0]]), tensor([[-100,    6,    7],
            [-100,    9, -100]]))
    >>> batch["cu_seqlens"], batch["num_sequences"]
    (tensor([0, 3, 6], dtype=torch.int32), 2)
    """

    def __init__(
        self, pad_token_id: int = 0, *, pad_to_multiple_of: int | None = None, ignore_index: int = IGNORE_INDEX
    ):
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"`pad_to_multiple_of` must be a positive int, got {pad_to_multiple_of}.")
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.ignore_index = ignore_index

    def __repr__(self) -> str:
        return (
            f"PaddedCollator(pad_token_id={self.pad_token_id}, pad_to_multiple_of={self.pad_to_multiple_of}, "
            f"ignore_index={self.ignore_index})"
        )

    def __call__(self, examples: Sequence[Mapping]) -> dict:
        """Collate `examples` (dicts with `input_ids` and optionally `labels`, one conversation each)."""
        if len(examples) == 0:
            raise ValueError("`examples` is empty.")
        lengths = [len(example["input_ids"]) for example in examples]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width += -width % self.pad_to_multiple_of
        input_ids = np.full((len(examples), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(examples), width), self.ignore_index, dtype=np.int64)
        attention_mask = np.zeros((len(examples), width), dtype=np.int64)
        for row, (example, length) in enumerate(zip(examples, lengths)):
            seq_lengths = example.get("seq_lengths")
            if seq_lengths is not None and len(seq_lengths) > 1:
                raise ValueError(
                    f"`examples[{row}]` is a packed row; PaddedCollator takes one conversation per example."
                )
            row_labels = example.get("labels", example["input_ids"])
            if len(row_labels) != length:
                raise ValueError(f"`examples[{row}]` has {length} input_ids but {len(row_labels)} labels.")
            input_ids[row, :length] = np.asarray(example["input_ids"], dtype=np.int64)
            labels[row, 1:length] = np.asarray(row_labels, dtype=np.int64)[1:]
            attention_mask[row, :length] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
            "cu_seqlens": torch.arange(len(examples) + 1, dtype=torch.int32) * width,
            "num_sequences": int((labels != self.ignore_index).any(axis=1).sum()),
        }
