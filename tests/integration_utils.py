"""Helpers of the end-to-end tests: conversations, tiny models, the unpacked ground truth.

The ground truth never looks at packing: :func:`one_at_a_time` runs every conversation through
the model alone, takes transformers' own ``ForCausalLMLoss`` of it, and averages over the
conversations that have a target. That is unpacked per-sequence training, which the packed batch
with ``is_packed=True`` must reproduce.
"""

from __future__ import annotations

import datetime
import functools
import os
import tempfile

import torch
import torch.distributed as dist
from transformers.loss.loss_utils import ForCausalLMLoss

from packed_ce_demo import split_rows  # noqa: F401  (re-exported for the tests)
from packed_ce.integrations import tiny_causal_lm

IGNORE = -100

# Relative tolerances of the float32 equivalence: the loss, and every parameter gradient as
# ||g - g_ref|| / ||g_ref|| (norm-wise: elementwise ratios of near-zero entries are noise).
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4

# Model families under test, with the configuration fields each one needs.
ARCHITECTURES = {
    "llama": {},
    "qwen2": {},
    # final_logit_softcapping low enough to change every loss; Gemma 2 has no sdpa path
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=2.0),
}


def tiny_model(arch: str, vocab_size: int, *, attn: str = "sdpa", seed: int = 0, **overrides):
    """A float32 tiny model of family ``arch`` with random weights fixed by ``seed``."""
    fields = {**ARCHITECTURES[arch], **overrides}
    return tiny_causal_lm(vocab_size, model_type=arch, attn_implementation=attn, seed=seed, **fields)


def synthetic_conversations(lengths: list[int], vocab_size: int, seed: int = 0) -> list[dict]:
    """Random conversations shaped like chat: alternating untrained and trained turns.

    A conversation of length 1 or whose turns are all untrained has no target.
    """
    gen = torch.Generator().manual_seed(seed)
    conversations = []
    for length in lengths:
        ids = torch.randint(0, vocab_size, (length,), generator=gen)
        turn = torch.randint(2, 8, (length,), generator=gen).cumsum(0)
        # turns alternate user (untrained) / assistant (trained) every few tokens
        trained = (torch.searchsorted(turn, torch.arange(length), right=True) % 2) == 1
        labels = torch.where(trained, ids, IGNORE)
        conversations.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return conversations


@functools.lru_cache(maxsize=None)
def _corpus(count: int):
    import collators

    tokenizer = collators.load_default_tokenizer()
    tokenized = collators.tokenize_dataset(collators.load_default_dataset(), tokenizer)
    by_length = sorted(range(tokenized.num_rows), key=lambda i: len(tokenized[i]["input_ids"]))
    # spread over the length distribution, shortest to the 95th percentile (about 20 to 150
    # tokens: the longest few would make the padded batch mostly padding and the test slow)
    last = int(0.95 * (len(by_length) - 1))
    picks = [by_length[round(k * last / (count - 1))] for k in range(count)]
    rows = tokenized.select(picks)
    return len(tokenizer), tuple((tuple(r["input_ids"]), tuple(r["labels"])) for r in rows)


def corpus_conversations(count: int = 10) -> tuple[int, list[dict]]:
    """``count`` tokenized conversations of the default corpus, short to long, and the vocab size."""
    vocab_size, rows = _corpus(count)
    return vocab_size, [{"input_ids": list(ids), "labels": list(labels)} for ids, labels in rows]


def parameter_updates(model, initial: dict) -> dict[str, torch.Tensor]:
    """``parameter - initial`` for every parameter: what the optimiser steps did."""
    return {name: p.detach().cpu() - initial[name] for name, p in model.named_parameters()}


def flat_relative_error(actual: dict, expected: dict) -> float:
    """:func:`relative_error` of all tensors of ``expected`` together, as one vector."""
    return relative_error(
        torch.cat([actual[name].reshape(-1) for name in expected]),
        torch.cat([expected[name].reshape(-1) for name in expected]),
    )


def has_target(conversation: dict) -> bool:
    """True if the conversation trains at least one token (its first label is never a target)."""
    return any(label != IGNORE for label in conversation["labels"][1:])


def one_at_a_time(model, conversations: list[dict], weights: list[float] | None = None) -> torch.Tensor:
    """The unpacked ground truth: transformers' loss of each conversation alone, averaged.

    With ``weights``, the weighted mean ``sum_c w_c mean_c / sum_c w_c``. Conversations without a
    target (or of weight 0) are left out, as the per-sequence mean leaves them out.
    """
    device = next(model.parameters()).device
    weights = [1.0] * len(conversations) if weights is None else weights
    losses, kept = [], []
    for conversation, weight in zip(conversations, weights):
        if not has_target(conversation) or weight == 0:
            continue
        input_ids = torch.tensor([conversation["input_ids"]], device=device)
        labels = torch.tensor([conversation["labels"]], device=device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        losses.append(ForCausalLMLoss(logits, labels, logits.shape[-1]))
        kept.append(weight)
    kept = torch.tensor(kept, device=device)
    return (torch.stack(losses) * kept).sum() / kept.sum()


def gradients(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient (zeros where a parameter got none)."""
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
    }


def loss_and_gradients(model, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``compute(model)`` (a 0-d loss), its backward, and the resulting gradients."""
    model.zero_grad(set_to_none=True)
    loss = compute(model)
    loss.backward()
    return loss.detach(), gradients(model)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (the norm of ``actual`` if 0)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.norm()
    return float((actual - expected).norm() / scale) if scale > 0 else float(actual.norm())


def assert_gradients_close(actual: dict, expected: dict, rtol: float = GRAD_RTOL) -> float:
    """Every gradient within ``rtol`` norm-wise; returns the worst relative error."""
    errors = {name: relative_error(actual[name], expected[name]) for name in expected}
    ranked = sorted(errors, key=errors.get, reverse=True)
    worst = ranked[0]
    assert errors[worst] <= rtol, (
        f"{worst}: relative gradient error {errors[worst]:.2e} > {rtol:.0e}; the next worst: "
        + ", ".join(f"{name} {errors[name]:.2e}" for name in ranked[1:5])
    )
    return errors[worst]


def assert_loss_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = LOSS_RTOL
) -> float:
    error = relative_error(actual.reshape(()), expected.reshape(()))
    assert (
        error <= rtol
    ), f"loss {float(actual):.8f} vs {float(expected):.8f}: relative error {error:.2e}"
    return error


# How long a spawned rank waits for the others (at its rendezvous and in each collective) before
# it fails rather than hang: far past the slowest legitimate wait on a loaded machine (eight ranks
# importing torch and transformers on two shared cores), short of blocking the suite.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def rendezvous(directory) -> str:
    """Where spawned ranks meet: a ``file://`` store in a new file under ``directory``.

    No TCP port: a port found free in the parent (bound, then closed) stayed free only until rank
    0 listened on it, the seconds the spawned ranks spend importing; on a loaded machine another
    connection could take it meanwhile, and rank 0 failed with EADDRINUSE.
    """
    handle, path = tempfile.mkstemp(prefix="rendezvous-", dir=directory)
    os.close(handle)  # an empty file: the store's own
    return f"file://{path}"


# Modules the ranks' processes start with: imported once, in the server that forks them.
RANK_PRELOAD = ["integration_utils", "accelerate", "peft"]


def spawn_ranks(function, args: tuple, nprocs: int) -> None:
    """Runs ``function(rank, *args)`` in ``nprocs`` new processes and waits for them (a rank that
    fails raises here, naming its error), like ``torch.multiprocessing.spawn``.

    The processes are forked from a server process (``forkserver``) that has imported torch,
    transformers and packed-ce once (``RANK_PRELOAD``) and computed nothing: a rank starts in a
    fraction of a second where a fresh interpreter spends about 5 s of CPU importing them (most
    of the distributed tests' time, 8 ranks on 2 cores). The server has run no OpenMP region and
    made no CUDA call, so its children's thread pools and CUDA start clean, as a spawned process's
    do. The ranks get the environment the test process had when the server started (its first
    call): a worker sets what it needs itself (:func:`start_rank`).
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts, once
    mp.start_processes(function, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def start_rank(rank: int, world: int, store: str, backend: str = "gloo", timeout=COLLECTIVE_TIMEOUT):
    """A spawned rank's process group, met at ``store`` (:func:`rendezvous`), and the environment
    accelerate reads to see the processes, all on this machine (it takes the group as it is); one
    thread (ranks on a small machine otherwise fight over its cores)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world, timeout=timeout)


# --- trl's SFTTrainer, one optimiser step over a small data set --------------------------------

# Conversation lengths that best-fit-decreasing packs into exactly four full rows of 32 tokens
# (25+7, 20+12, 18+14, 16+16), so that the number of rows, and with it the batch size of one
# optimiser step over the whole data set, is known before trl packs them.
SFT_LENGTHS = [20, 12, 18, 14, 25, 7, 16, 16]
SFT_ROW_LENGTH = 32
SFT_LR = 0.5


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``t0 .. t{V-1}`` (``t0`` unknown, ``t1`` padding, ``t2`` end):
    what trl needs next to pre-tokenized data, with no corpus or download."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        unk_token="t0",
        pad_token="t1",
        eos_token="t2",
    )


@functools.lru_cache(maxsize=None)
def sft_tokenizer():
    """The offline default tokenizer (ChatML template with generation markers), 3072 tokens."""
    import collators

    return collators.load_default_tokenizer()


def without_generation_markers(tokenizer):
    """A copy of ``tokenizer`` whose template has its ``{% generation %}`` markers taken out (trl
    refuses such a template with assistant_only_loss; PackedSFTTrainer labels it with
    collators.tokenize_conversation)."""
    import copy
    import re

    marker = r"\{%-?\s*(end)?generation\s*-?%\}"
    tokenizer = copy.deepcopy(tokenizer)
    assert re.search(marker, tokenizer.chat_template)
    tokenizer.chat_template = re.sub(marker, "", tokenizer.chat_template)
    return tokenizer


def sft_args(output_dir, **overrides):
    """An ``SFTConfig`` for exact comparisons: float32 (trl's default is bf16), plain steps."""
    from trl import SFTConfig

    fields = dict(
        output_dir=str(output_dir),
        max_steps=1,
        learning_rate=SFT_LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: compare raw gradient steps
        bf16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    return SFTConfig(**{**fields, **overrides})


def sgd(model, lr: float = SFT_LR):
    """Plain SGD at a constant rate, as a Trainer's ``optimizers`` pair: the step is the gradient."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def prepared_conversations(dataset) -> list[dict]:
    """The conversations of a trainer's prepared data set (packed rows split at ``seq_lengths``)."""
    rows = [dataset[i] for i in range(dataset.num_rows)]
    if "seq_lengths" in dataset.column_names:
        return split_rows(rows)
    return [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows]


def snapshot(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def per_conversation_sgd_step(
    model, conversations: list[dict], lr: float = SFT_LR, weights=None, extra=None
):
    """One SGD step of unpacked per-conversation training (weighted by ``weights``, plus
    ``extra(model)`` when given: a MoE router's loss); returns its loss, ``model`` stepped."""
    model.zero_grad(set_to_none=True)
    loss = one_at_a_time(model, conversations, weights)
    if extra is not None:
        loss = loss + extra(model)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return loss.detach()


# --- tool-calling and reasoning conversations ----------------------------------------------------


def _tool(name: str, description: str, **parameters) -> dict:
    properties = {key: {"type": kind} for key, kind in parameters.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(parameters)},
        },
    }


def _call(name: str, **arguments) -> dict:
    """An OpenAI-style tool call, its arguments as JSON text (as the API gives them)."""
    import json

    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


WEATHER = _tool("get_weather", "The weather in a city now.", city="string")
CALCULATOR = _tool("calculate", "Evaluates an arithmetic expression.", expression="string")
SEARCH = _tool("search", "Searches the web.", query="string")

# Tool definitions, assistant tool calls (one, two in parallel, none), tool results and thinking
# content, with the tools each conversation is given.
TOOL_CONVERSATIONS = [
    (
        [WEATHER],
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "reasoning_content": "The user wants the weather: call the tool.",
             "tool_calls": [_call("get_weather", city="Paris")]},
            {"role": "tool", "content": "sunny, 21C"},
            {"role": "assistant", "reasoning_content": "Report it.",
             "content": "It is sunny and 21C in Paris."},
        ],
    ),
    (
        [CALCULATOR, SEARCH],
        [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "What is 6 times 7, and who wrote Dune?"},
            {"role": "assistant", "reasoning_content": "Two questions: one tool each.",
             "tool_calls": [_call("calculate", expression="6*7"), _call("search", query="Dune author")]},
            {"role": "tool", "content": "42"},
            {"role": "tool", "content": "Frank Herbert"},
            {"role": "assistant", "content": "6 times 7 is 42, and Frank Herbert wrote Dune."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You are welcome."},
        ],
    ),
    (
        [WEATHER, CALCULATOR],
        [
            {"role": "user", "content": "Hi, how are you?"},
            {"role": "assistant", "reasoning_content": "A greeting: no tool needed.",
             "content": "Very well, thank you. How can I help?"},
        ],
    ),
    (
        [SEARCH],
        [
            {"role": "user", "content": "Find the tallest mountain."},
            {"role": "assistant", "tool_calls": [_call("search", query="tallest mountain")]},
            {"role": "tool", "content": "Mount Everest, 8849 m"},
            {"role": "assistant", "reasoning_content": "The search answered it.",
             "content": "Mount Everest, at 8849 m."},
        ],
    ),
]


def tool_dataset(tools_as_json: bool = True):
    """:data:`TOOL_CONVERSATIONS` as a ``datasets.Dataset`` of ``messages`` and ``tools`` (each
    row's tool definitions: JSON text, as trl's documentation writes them, or a list)."""
    import json

    from datasets import Dataset

    return Dataset.from_dict(
        {
            "messages": [messages for _, messages in TOOL_CONVERSATIONS],
            "tools": [json.dumps(tools) if tools_as_json else tools for tools, _ in TOOL_CONVERSATIONS],
        }
    )
