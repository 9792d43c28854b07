"""Helpers of the end-to-end tests: conversations, tiny models, the unpacked ground truth.

The ground truth never looks at packing: :func:`one_at_a_time` runs every conversation through
the model alone, takes transformers' own ``ForCausalLMLoss`` of it, and averages over the
conversations that have a target. That is unpacked per-sequence training, which the packed batch
with ``is_packed=True`` must reproduce.
"""

from __future__ import annotations

import functools
import socket

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from packed_ce_demo import build_model, tiny_config

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
    return build_model(
        tiny_config(vocab_size, model_type=arch, attn_implementation=attn, **fields), seed=seed
    )


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


def has_target(conversation: dict) -> bool:
    """True if the conversation trains at least one token (its first label is never a target)."""
    return any(label != IGNORE for label in conversation["labels"][1:])


def one_at_a_time(model, conversations: list[dict]) -> torch.Tensor:
    """The unpacked ground truth: transformers' loss of each conversation alone, averaged.

    Conversations without a target are left out, as the per-sequence mean leaves them out.
    """
    device = next(model.parameters()).device
    losses = []
    for conversation in filter(has_target, conversations):
        input_ids = torch.tensor([conversation["input_ids"]], device=device)
        labels = torch.tensor([conversation["labels"]], device=device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        losses.append(ForCausalLMLoss(logits, labels, logits.shape[-1]))
    return torch.stack(losses).mean()


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
    worst = max(errors, key=errors.get)
    assert (
        errors[worst] <= rtol
    ), f"{worst}: relative gradient error {errors[worst]:.2e} > {rtol:.0e}"
    return errors[worst]


def assert_loss_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = LOSS_RTOL
) -> float:
    error = relative_error(actual.reshape(()), expected.reshape(()))
    assert (
        error <= rtol
    ), f"loss {float(actual):.8f} vs {float(expected):.8f}: relative error {error:.2e}"
    return error


def free_port() -> int:
    """A TCP port nobody listens on now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
