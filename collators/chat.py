"""Conversations in the ``messages`` format to ``input_ids`` and assistant-only ``labels``."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from packed_ce.columns import IGNORE_INDEX, INPUT_IDS, LABELS

from .checks import positive_int
from .images import image_parts

logger = logging.getLogger(__name__)

# Part of every tokenize cache's key: bump it when the tokens or labels change for the same inputs.
LABELS_VERSION = 2  # 2: a row's template columns and system prompt column are rendered

# The columns of a conversation that its chat template reads beside ``messages``, as trl 1.16's
# SFTTrainer passes them to ``apply_chat_template``: ``tools`` (a list of tool definitions, or its
# JSON text) and ``chat_template_kwargs`` (a dict of template variables, spread into the call);
# and ``documents`` (a list, or its JSON text), which trl leaves out and PackedSFTTrainer passes on.
TEMPLATE_COLUMNS = ("tools", "documents", "chat_template_kwargs")
# A per-row system prompt in a column of its own, which no chat template reads (trl leaves it
# out): rendered as the conversation's first turn, a system message (by PackedSFTTrainer too).
SYSTEM_COLUMNS = ("system", "system_prompt")

# ``{% generation %}`` / ``{%- generation -%}``: the template marks the assistant output itself.
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Stands in for one assistant message's content when the template rewrites earlier turns (see
# ``_content_chars``): a private-use character no tokenizer merges with its neighbours' text.
_SENTINEL = "\ue000"


def tokenize_conversation(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    max_length: int | None = None,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    skip_no_assistant: bool = False,
    ignore_index: int = IGNORE_INDEX,
    **template_kwargs,
) -> dict[str, list[int]] | None:
    r"""Tokenize one conversation and label the tokens of every assistant turn.

    ``input_ids`` are ``tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]``;
    ``labels`` equal them on every assistant turn, its closing token(s) included (``<|im_end|>``,
    ``<|eot_id|>``, ...) so the model learns to stop, and are ``ignore_index`` elsewhere (other
    turns, role headers, separators).

    Assistant tokens come from the template's ``{% generation %}`` mask if it has one; else what
    rendering up to message ``i`` adds to the render up to ``i - 1`` with the generation prompt,
    trained up to its last special token; else (templates that re-render earlier turns) the
    message's content located in the full render plus the closing special token after it (tool calls
    then need generation markers).

    Args:
        tokenizer: ``transformers.PreTrainedTokenizerBase`` with a chat template (a fast one without
            markers).
        messages: ``[{"role": ..., "content": ...}, ...]`` (or ``tool_calls`` for an assistant).
        max_length: keep the first ``max_length`` tokens.
        tools, chat_template, **template_kwargs: for the template.
        skip_no_assistant: return ``None`` instead of raising for a conversation without an
            assistant turn.
        ignore_index: the label of untrained tokens (default: -100).

    Returns:
        ``dict`` of equal-length ``input_ids`` and ``labels``, or ``None`` for a skipped
        conversation.

    Raises:
        ValueError: the tokenizer has no chat template, a message lacks ``role`` or ``content``, the
            conversation has no assistant turn (unless skipped), or an assistant turn cannot be
            located.

    Example:
        >>> from collators import load_default_tokenizer, tokenize_conversation
        >>> tokenizer = load_default_tokenizer()
        >>> messages = [
        ...     {"role": "user", "content": "Hi"},
        ...     {"role": "assistant", "content": "Hello"},
        ... ]
        >>> example = tokenize_conversation(tokenizer, messages)
        >>> tokenizer.decode(example["input_ids"])
        '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n'
        >>> tokenizer.decode([t for t in example["labels"] if t != -100])
        'Hello<|im_end|>'
    """
    if max_length is not None:
        positive_int(max_length, "max_length")
    _check_messages(messages)
    image_part = next(
        (i for i, message in enumerate(messages) if image_parts(message.get("content"))), None
    )
    if image_part is not None:
        raise ValueError(
            f"`messages[{image_part}]` has image parts, which a tokenizer cannot turn into the "
            "model's image tokens: tokenize it with the model's processor "
            "(collators.tokenize_vision_conversation, or tokenize_dataset(data, processor))."
        )
    labelled = label_conversation(
        tokenizer,
        messages,
        tools=tools,
        chat_template=chat_template,
        skip_no_assistant=skip_no_assistant,
        ignore_index=ignore_index,
        with_text=False,
        **template_kwargs,
    )
    if labelled is None:
        return None
    _, input_ids, labels = labelled
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {INPUT_IDS: input_ids, LABELS: labels}


def label_conversation(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    skip_no_assistant: bool = False,
    ignore_index: int = IGNORE_INDEX,
    with_text: bool = True,
    **template_kwargs,
) -> tuple[str | None, list[int], list[int]] | None:
    """The rendered text of a conversation, its tokens and their assistant-only labels.

    What :func:`tokenize_conversation` does before truncating: ``input_ids`` are the tokens of the
    text (``tokenizer(text, add_special_tokens=False)``), so a token's offsets locate it in the
    text (``collators.vision`` maps them onto a processor's expanded text).

    Returns:
        ``(text, input_ids, labels)`` (``text`` None with ``with_text=False`` where the labels
        need no render of it), or None for a conversation without an assistant turn with
        ``skip_no_assistant``.

    Raises:
        ValueError: as :func:`tokenize_conversation`.
    """
    template = _resolve_template(tokenizer, chat_template, tools)
    _check_messages(messages)
    messages = [dict(message) for message in messages]
    assistant_turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant_turns:
        if skip_no_assistant:
            return None
        raise ValueError(
            "`messages` has no assistant turn, so there is nothing to train on "
            "(pass skip_no_assistant=True to skip such conversations)."
        )

    render_kwargs = dict(template_kwargs, tools=tools, chat_template=chat_template)
    text = _render(tokenizer, messages, render_kwargs) if with_text else None
    if _GENERATION_MARKER.search(template) and getattr(tokenizer, "is_fast", False):
        encoding = tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **render_kwargs,
        )
        input_ids = list(encoding[INPUT_IDS])
        labels = [t if m else ignore_index for t, m in zip(input_ids, encoding["assistant_masks"])]
    else:
        text = text or _render(tokenizer, messages, render_kwargs)
        input_ids, labels = _label_by_rendering(
            tokenizer, messages, assistant_turns, text, render_kwargs, ignore_index
        )
    return text, input_ids, labels


def template_inputs(row: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of ``apply_chat_template`` that a row's :data:`TEMPLATE_COLUMNS` give, as trl
    passes them: ``tools`` and ``documents`` decoded from JSON text, ``chat_template_kwargs``
    spread (a missing or None column gives nothing).

    Example:
        >>> template_inputs({"tools": '[{"name": "f"}]', "chat_template_kwargs": {"think": False}})
        {'tools': [{'name': 'f'}], 'think': False}
    """
    inputs = {}
    for name in ("tools", "documents"):
        value = row.get(name)
        if value is not None:
            inputs[name] = json.loads(value) if isinstance(value, str) else value
    return {**inputs, **(row.get("chat_template_kwargs") or {})}


def with_system_prompt(messages, prompt, where: str) -> list:
    """``messages`` opened by ``prompt`` (a row's system prompt column; None or "" for none) as a
    system turn.

    Raises:
        TypeError naming ``where``: a prompt that is not a string.
        ValueError naming ``where``: the messages open with a system turn already.
    """
    if prompt is None or prompt == "":
        return list(messages)
    if not isinstance(prompt, str):
        raise TypeError(f"{where}'s system prompt must be a string, got {type(prompt).__name__}.")
    if messages and isinstance(messages[0], Mapping) and messages[0].get("role") == "system":
        raise ValueError(
            f"{where} has a system prompt in its column and a system turn opening its messages: "
            "keep one of them."
        )
    return [{"role": "system", "content": prompt}, *messages]


def system_column(names, where: str = "dataset") -> str | None:
    """The one of :data:`SYSTEM_COLUMNS` among ``names``, or None.

    Raises:
        ValueError naming ``where``: it has more than one.
    """
    found = [name for name in SYSTEM_COLUMNS if name in names]
    if len(found) > 1:
        raise ValueError(f"`{where}` has the system prompt columns {found}: keep one of them.")
    return found[0] if found else None


def _resolve_template(tokenizer, chat_template: str | None, tools) -> str:
    if chat_template is not None:
        return chat_template
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "`tokenizer` has no chat template: set `tokenizer.chat_template` or pass "
            "`chat_template=`."
        )
    # A tokenizer may hold several named templates (e.g. "default" and "tool_use").
    return tokenizer.get_chat_template(None, tools)


# ShareGPT's keys of a message, in place of the ``messages`` format's ``role`` and ``content``
SHAREGPT_KEYS = ("from", "value")
SHAREGPT_FIX = (
    "map them to 'role' and 'content' (and the roles 'human' and 'gpt' to 'user' and "
    "'assistant'), e.g. dataset.map(lambda row: {'messages': [{'role': {'human': 'user', "
    "'gpt': 'assistant'}.get(m['from'], m['from']), 'content': m['value']} for m in "
    "row['messages']]})"
)


def is_conversation(value) -> bool:
    """Whether ``value`` looks like a conversation: a non-empty list of messages with a ``role``
    (the ``messages`` format) or ``from`` (ShareGPT's).
    """
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and len(value) > 0
        and isinstance(value[0], Mapping)
        and any(value[0].get(key) is not None for key in ("role", "from"))
    )


def conversations_column(dataset, names) -> str | None:
    """The first of ``names`` whose value in ``dataset``'s first row is a conversation, or None."""
    first = next(iter(dataset), None) or {}
    return next((name for name in names if is_conversation(first.get(name))), None)


def sharegpt_keys(message) -> str | None:
    """Where ``message`` has ShareGPT's ``from`` / ``value`` in place of ``role`` / ``content``:
    those keys and the fix; else None.
    """
    # a data set's rows of mixed formats hold every key, None where a row has none
    if not isinstance(message, Mapping) or message.get("role") is not None:
        return None
    found = [key for key in SHAREGPT_KEYS if message.get(key) is not None]
    if not found:
        return None
    return f"has ShareGPT's key(s) {found}, not 'role' and 'content': {SHAREGPT_FIX}"


def _check_messages(messages) -> None:
    if (
        isinstance(messages, (str, bytes))
        or not isinstance(messages, Sequence)
        or len(messages) == 0
    ):
        raise ValueError(
            "`messages` must be a non-empty list of {'role': ..., 'content': ...} dicts."
        )
    for index, message in enumerate(messages):
        sharegpt = sharegpt_keys(message)
        if sharegpt:
            raise ValueError(f"`messages[{index}]` {sharegpt}.")
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"`messages[{index}]` has no 'role': {message!r}")
        if message.get("content") is None and not message.get("tool_calls"):
            raise ValueError(
                f"`messages[{index}]` has no 'content' (nor 'tool_calls'): {message!r}"
            )


def _render(tokenizer, messages, render_kwargs, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **render_kwargs
    )


def _label_by_rendering(tokenizer, messages, assistant_turns, text, render_kwargs, ignore_index):
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "`tokenizer` is not a fast tokenizer and its chat template has no {% generation %} "
            "markers: locating the assistant tokens needs one or the other."
        )
    # Exactly what apply_chat_template(tokenize=True) does with the rendered text.
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding[INPUT_IDS])
    offsets = [tuple(span) for span in encoding["offset_mapping"]]
    token_at = [-1] * len(text)
    for token, (start, end) in enumerate(offsets):
        token_at[start:end] = [token] * (end - start)
    special_ids = set(tokenizer.all_special_ids)
    special_ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    is_special = [token in special_ids for token in input_ids]

    labels = [ignore_index] * len(input_ids)
    for turn in assistant_turns:
        span = _turn_span(tokenizer, messages, turn, text, render_kwargs)
        if span is not None:
            first, last = _tokens_in(token_at, *span)
            # separators after the closing special token are the template's layout: untrained
            specials = [t for t in range(first, last + 1) if is_special[t]]
            if specials:
                last = specials[-1]
        else:
            start, end = _content_chars(tokenizer, messages, turn, text, render_kwargs)
            first, last = _content_and_closing_tokens(
                text, offsets, token_at, is_special, start, end, turn
            )
        labels[first : last + 1] = input_ids[first : last + 1]
    return input_ids, labels


def _turn_span(tokenizer, messages, turn, text, render_kwargs):
    """Characters that assistant message ``turn`` adds after its generation prompt, or None."""
    if turn == 0:
        return None
    head = _render(tokenizer, messages[:turn], render_kwargs, add_generation_prompt=True)
    body = (
        text
        if turn == len(messages) - 1
        else _render(tokenizer, messages[: turn + 1], render_kwargs)
    )
    if not (body.startswith(head) and text.startswith(body)) or len(body) == len(head):
        return None
    return len(head), len(body)


def _content_chars(tokenizer, messages, turn, text, render_kwargs) -> tuple[int, int]:
    """Characters of message ``turn``'s content in the full render, found with a stand-in."""
    stand_in = [dict(message) for message in messages]
    stand_in[turn]["content"] = _SENTINEL
    stand_in[turn].pop("tool_calls", None)
    other = _render(tokenizer, stand_in, render_kwargs)
    start = _common_prefix(text, other)
    suffix = _common_prefix(text[start:][::-1], other[start:][::-1])
    if other[start : len(other) - suffix] != _SENTINEL:
        raise ValueError(
            f"Cannot locate assistant message {turn} of `messages` in the rendered conversation: "
            "the chat template rewrites earlier turns and does not render this message's content "
            "verbatim. Add {% generation %} markers around the assistant output in the template."
        )
    return start, len(text) - suffix


def _content_and_closing_tokens(
    text, offsets, token_at, is_special, start, end, turn
) -> tuple[int, int]:
    if end > start:
        first, last = _tokens_in(token_at, start, end)
        probe = last + 1
    else:
        first = last = None
        probe = next((t for t, (s, _) in enumerate(offsets) if s >= start), len(offsets))
    # to the closing special token past whitespace; plain text closing the turn stays untrained
    while probe < len(offsets):
        if is_special[probe]:
            return (probe if first is None else first), probe
        if text[offsets[probe][0] : offsets[probe][1]].strip():
            break
        probe += 1
    if first is None:
        raise ValueError(f"Assistant message {turn} of `messages` renders to no tokens.")
    return first, last


def _tokens_in(token_at, start: int, end: int) -> tuple[int, int]:
    """First and last token overlapping characters [start, end), zero-width ones between too."""
    covered = [t for t in token_at[start:end] if t >= 0]
    return covered[0], covered[-1]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
