"""Assistant-only labels for four chat formats, checked against an independent computation.

The tokenizers are byte-pair encoders trained in memory on a few strings, so nothing is downloaded.
ChatML and the Llama-3-style format use byte-level pre-tokenization (GPT-2/Llama-3 family), the
Mistral- and Gemma-style formats a SentencePiece-like metaspace one, with and without offset trimming:
the labelling must not depend on how a tokenizer reports whitespace.
"""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from collators import templates, tokenize_conversation, tokenize_dataset

IGNORE = -100

WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    # The same text as the user turn: a search that is not anchored per message would find the user's.
    {"role": "assistant", "content": "Hi"},
    {"role": "user", "content": "Say café twice,\nthen stop."},
    {"role": "assistant", "content": "Café café.\nDone!"},
]

WITH_TOOLS = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "content": "sunny, 21C"},
    {"role": "assistant", "content": "It is sunny and 21C in Paris."},
]


def _call_json(call):
    return json.dumps(call["function"], ensure_ascii=False)


# Per format: the special tokens, the token closing each assistant turn, what the template renders for an
# assistant message (the text the model must produce, before the closing token), and the test conversations.
FORMATS = {
    "chatml": dict(
        template=templates.CHATML_TEMPLATE,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        closing="<|im_end|>",
        output=lambda m: m.get("content", "")
        + "".join(f"<tool_call>\n{_call_json(c)}\n</tool_call>" for c in m.get("tool_calls", [])),
        conversations=[MULTI_TURN, WITH_TOOLS],
        metaspace=False,
    ),
    "llama3": dict(
        template=templates.LLAMA3_TEMPLATE,
        specials=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        closing="<|eot_id|>",
        output=lambda m: "".join(_call_json(c) for c in m["tool_calls"]) if "tool_calls" in m else m["content"].strip(),
        conversations=[MULTI_TURN, WITH_TOOLS],
        metaspace=False,
    ),
    "mistral": dict(
        template=templates.MISTRAL_TEMPLATE,
        specials=["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        bos="<s>",
        eos="</s>",
        closing="</s>",
        output=lambda m: "[TOOL_CALLS] [" + ", ".join(_call_json(c) for c in m["tool_calls"]) + "]"
        if "tool_calls" in m
        else " " + m["content"],  # the space after [/INST] is the answer's first character
        conversations=[MULTI_TURN, WITH_TOOLS],
        metaspace=True,
    ),
    "gemma": dict(
        template=templates.GEMMA_TEMPLATE,
        specials=["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
        closing="<end_of_turn>",
        output=lambda m: m["content"].strip(),
        conversations=[MULTI_TURN],  # the format has no tool turns
        metaspace=True,
    ),
}

CORPUS = [
    "Hi there, you are terse. Say cafe twice, then stop. Weather in Paris? It is sunny and 21C.",
    "system user assistant model tool ipython get_weather city arguments name function",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} Use tools when needed. Done!',
]


def build_tokenizer(spec, *, trim_offsets=False, template=None):
    """A small BPE trained in memory, wrapped the way a hub tokenizer would be."""
    backend = Tokenizer(models.BPE(unk_token=None))
    if spec["metaspace"]:
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        alphabet = []
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=spec["specials"], initial_alphabet=alphabet + list("éÉ\n"), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec["bos"],
        eos_token=spec["eos"],
        pad_token=spec["specials"][0] if spec["bos"] is None else None,
        chat_template=template or spec["template"],
    )


def expected_labels(tokenizer, spec, messages, tools=None, out_of_order=()):
    """Independent labelling: find each message's rendered text in order, map characters to tokens.

    Roles in `out_of_order` are rendered elsewhere by the template and not searched for.
    """
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    closing_id = tokenizer.convert_tokens_to_ids(spec["closing"])
    labels = [IGNORE] * len(ids)
    cursor = 0
    for message in messages:
        if message["role"] in out_of_order:
            continue
        if message["role"] != "assistant":
            cursor = text.index(message["content"].strip(), cursor) + len(message["content"].strip())
            continue
        output = spec["output"](message)
        start = text.index(output, cursor)
        cursor = start + len(output)
        covered = [t for t, (s, e) in enumerate(offsets) if s < cursor and e > start]
        closing = covered[-1] + 1
        assert ids[closing] == closing_id, "the token after an assistant turn must be the format's closing token"
        for t in covered + [closing]:
            labels[t] = ids[t]
    return ids, labels


# Byte-level tokenizers are also run with trimmed offsets (whitespace left out of token spans), the GPT-2
# default; offset trimming does not exist for the metaspace ones.
CASES = []
for name, spec in FORMATS.items():
    for index, conversation in enumerate(spec["conversations"]):
        kind = "tools" if conversation is WITH_TOOLS else "multi_turn"
        for trim in [False] if spec["metaspace"] else [False, True]:
            CASES.append(pytest.param(name, index, trim, id=f"{name}-{kind}" + ("-trimmed" if trim else "")))


@pytest.mark.parametrize("name, index, trim_offsets", CASES)
def test_labels_match_independent_computation(name, index, trim_offsets):
    spec = FORMATS[name]
    tokenizer = build_tokenizer(spec, trim_offsets=trim_offsets)
    messages = spec["conversations"][index]
    tools = TOOLS if messages is WITH_TOOLS else None

    example = tokenize_conversation(tokenizer, messages, tools=tools)
    ids, labels = expected_labels(tokenizer, spec, messages, tools)

    # input_ids are the template's own tokenization, whatever container apply_chat_template returns.
    reference = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert example["input_ids"] == list(reference) == ids
    assert example["labels"] == labels

    closing_id = tokenizer.convert_tokens_to_ids(spec["closing"])
    num_assistant = sum(m["role"] == "assistant" for m in messages)
    assert sum(1 for t in example["labels"] if t == closing_id) == num_assistant


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral", "gemma"])
def test_nothing_from_other_turns_is_trained(name):
    spec = FORMATS[name]
    tokenizer = build_tokenizer(spec)
    trained = [t for t in tokenize_conversation(tokenizer, MULTI_TURN)["labels"] if t != IGNORE]
    decoded = tokenizer.decode(trained)
    for message in MULTI_TURN:
        if message["role"] in ("system", "user") and message["content"] != "Hi":
            assert message["content"] not in decoded
    assert decoded.count(spec["closing"]) == 2
    for header in ("user", "system", "assistant", "model", "[INST]", "<|start_header_id|>", "<start_of_turn>"):
        assert header not in decoded


def test_generation_markers_and_rendering_agree():
    """ChatML with {% generation %} (template mask) and without (render-and-diff) label the same tokens."""
    spec = FORMATS["chatml"]
    plain = spec["template"].replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    with_markers, without = build_tokenizer(spec), build_tokenizer(spec, template=plain)
    for messages in (MULTI_TURN, WITH_TOOLS):
        assert tokenize_conversation(with_markers, messages) == tokenize_conversation(without, messages)


# The system prompt goes into the *last* user turn (as some Mistral releases do): rendering a prefix of the
# conversation then puts it elsewhere, so the render-and-diff method must fall back to content search.
SYSTEM_LAST_TEMPLATE = (
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{%- set loop_messages = messages[1:] if system else messages %}"
    "{%- set last_user = namespace(i=-1) %}"
    "{%- for m in loop_messages %}"
    "{%- if m['role'] == 'user' %}{%- set last_user.i = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{{- bos_token }}"
    "{%- for m in loop_messages %}"
    "{%- if m['role'] == 'user' %}"
    "{%- set prefix = system + '\\n\\n' if system and loop.index0 == last_user.i else '' %}"
    "{{- '[INST] ' + prefix + m['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def test_template_that_rewrites_history_falls_back_to_content_search():
    spec = dict(FORMATS["mistral"], template=SYSTEM_LAST_TEMPLATE)
    tokenizer = build_tokenizer(spec)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    # Content search finds the content, not the space the template writes before it; with answers whose first
    # word absorbs that space ("▁Hi", "▁It") both ways of locating a turn give the same tokens.
    assert tokenizer.tokenize(" Hi It")[:2] == ["▁Hi", "▁It"]
    example = tokenize_conversation(tokenizer, messages)
    expected = expected_labels(tokenizer, spec, messages, out_of_order=("system",))
    assert (example["input_ids"], example["labels"]) == expected


def test_max_length_truncates_ids_and_labels_together():
    tokenizer = build_tokenizer(FORMATS["chatml"])
    full = tokenize_conversation(tokenizer, MULTI_TURN)
    cut = tokenize_conversation(tokenizer, MULTI_TURN, max_length=10)
    assert cut == {"input_ids": full["input_ids"][:10], "labels": full["labels"][:10]}


def test_errors_name_the_argument():
    tokenizer = build_tokenizer(FORMATS["chatml"])
    no_template = build_tokenizer(FORMATS["chatml"])
    no_template.chat_template = None
    with pytest.raises(ValueError, match="`tokenizer` has no chat template"):
        tokenize_conversation(no_template, MULTI_TURN)
    with pytest.raises(ValueError, match=r"`messages\[1\]` has no 'role'"):
        tokenize_conversation(tokenizer, [{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match=r"`messages\[0\]` has no 'content'"):
        tokenize_conversation(tokenizer, [{"role": "user"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ValueError, match="`messages` must be a non-empty list"):
        tokenize_conversation(tokenizer, [])
    only_user = [{"role": "user", "content": "anyone?"}]
    with pytest.raises(ValueError, match="`messages` has no assistant turn"):
        tokenize_conversation(tokenizer, only_user)
    assert tokenize_conversation(tokenizer, only_user, skip_no_assistant=True) is None


def test_tokenize_dataset_counts_skipped_conversations(caplog):
    from datasets import Dataset

    tokenizer = build_tokenizer(FORMATS["chatml"])
    only_user = [{"role": "user", "content": "anyone?"}]
    dataset = Dataset.from_dict({"messages": [MULTI_TURN, only_user, WITH_TOOLS[:3], only_user],
                                 "weight": [2.0, 1.0, 0.5, 3.0], "source": ["a", "b", "c", "d"], "id": [10, 11, 12, 13]})
    with caplog.at_level("WARNING", logger="collators.tokenize_data"):
        tokenized = tokenize_dataset(dataset, tokenizer)
    assert "Skipped 2 of 4 conversations" in caplog.text
    # Every other column stays beside the tokens, on the rows of the kept conversations.
    assert tokenized.column_names == ["weight", "source", "id", "input_ids", "labels"]
    assert tokenized[0] == {"weight": 2.0, "source": "a", "id": 10, **tokenize_conversation(tokenizer, MULTI_TURN)}
    assert tokenized[1] == {"weight": 0.5, "source": "c", "id": 12,
                            **tokenize_conversation(tokenizer, WITH_TOOLS[:3])}
    with pytest.raises(ValueError, match=r"already has the column\(s\) \['labels'\]"):
        tokenize_dataset(dataset.add_column("labels", [[1]] * 4), tokenizer)
    with pytest.raises(ValueError, match="`dataset` row 1: `messages` has no assistant turn"):
        tokenize_dataset(dataset, tokenizer, skip_no_assistant=False)


def test_conversations_in_another_column_or_format_are_named_with_the_fix():
    """A `conversation` column was "no column 'messages'" alone; ShareGPT's `from` / `value` keys
    were "has no 'role'"."""
    from datasets import Dataset

    tokenizer = build_tokenizer(FORMATS["chatml"])
    renamed = Dataset.from_dict({"id": [1], "conversation": [MULTI_TURN]})
    with pytest.raises(ValueError, match=r"no column 'messages'; its columns are \['id', 'conversation'\]: pass "
                                         r"messages_column='conversation'"):
        tokenize_dataset(renamed, tokenizer)
    assert tokenize_dataset(renamed, tokenizer, messages_column="conversation")["input_ids"] == [
        tokenize_conversation(tokenizer, MULTI_TURN)["input_ids"]]
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
                for m in MULTI_TURN]
    with pytest.raises(ValueError, match=r"`dataset` row 0: `messages\[0\]` has ShareGPT's key\(s\) \['from', 'value'\]"):
        tokenize_dataset(Dataset.from_dict({"messages": [sharegpt]}), tokenizer)
    # the fix the message names
    fixed = Dataset.from_dict({"messages": [sharegpt]}).map(
        lambda row: {'messages': [{'role': {'human': 'user', 'gpt': 'assistant'}.get(m['from'], m['from']),
                                   'content': m['value']} for m in row['messages']]})
    assert tokenize_dataset(fixed, tokenizer)["input_ids"] == [tokenize_conversation(tokenizer, MULTI_TURN)["input_ids"]]
