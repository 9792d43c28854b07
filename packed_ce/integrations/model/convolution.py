"""A hybrid family's short convolution kept within each conversation of a packed row.

transformers' gated delta rules and short convolutions call a module-level ``causal_conv1d_fn``:
the ``causal-conv1d`` package's kernel when it is installed (it takes ``seq_idx``), else a
PyTorch convolution over the whole row, whose first ``K - 1`` outputs of each conversation read
the end of the conversation before it (transformers 5.17 drops ``seq_idx`` silently; later ones
refuse it). :class:`WithinConversations` replaces that name in the family's modeling module: a
call without boundaries, or with ``causal-conv1d`` installed, is the family's own; a packed call
(``seq_idx``) runs one convolution over the whole row in which no tap crosses a boundary:

- fla's varlen convolution (``cu_seqlens``) on CUDA for one row when ``fla`` is installed;
- else the PyTorch convolution with each tap masked where its input lies in another
  conversation: ``y[t] = b + sum_d w[K-1-d] x[t-d] [seq(t-d) = seq(t)]``, exact on any device.

The replacement is process-wide (one per modeling module, installed once, listed in
``trainers/seams.py``'s ``GLOBAL_STATE``) because the family's forward looks the name up at each
call; it changes nothing for a call without ``seq_idx``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import torch
import torch.nn.functional as F
from torch import nn

from packed_ce.columns import CU_SEQ_LENS_Q
from packed_ce.layout import SEQ_IDX


@functools.lru_cache(maxsize=None)
def installed(package: str) -> bool:
    """Whether ``package`` can be imported (looked up once per process)."""
    return importlib.util.find_spec(package) is not None


class WithinConversations:
    """A family's ``causal_conv1d_fn`` whose packed calls keep each conversation to itself.

    Args:
        own: the family's function (kept, and called for every call without boundaries).
    """

    def __init__(self, own):
        self.own = own
        functools.update_wrapper(self, own)

    def __call__(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        """``hidden_states`` ``(B, D, T)``, ``weight`` ``(D, K)``, ``bias`` ``(D,)`` or None;
        returns ``(B, D, T)`` in the dtype of ``hidden_states``, activated.
        """
        seq_idx = kwargs.get(SEQ_IDX)
        if seq_idx is None or installed("causal_conv1d"):
            return self.own(hidden_states, weight, bias, activation=activation, **kwargs)
        cu_seqlens = kwargs.get(CU_SEQ_LENS_Q)
        if (
            hidden_states.is_cuda
            and hidden_states.shape[0] == 1
            and cu_seqlens is not None
            and activation in (None, "silu", "swish")
            and installed("fla")
        ):
            from fla.modules.causal_conv1d import causal_conv1d

            # fla's layout is (B, T, D); its varlen kernel restarts at every cu_seqlens entry
            out, _ = causal_conv1d(
                hidden_states.transpose(1, 2),
                weight,
                bias,
                activation=activation,
                cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=kwargs.get("cu_seqlens_cpu"),
            )
            return out.transpose(1, 2)
        return masked_convolution(hidden_states, weight, bias, activation, seq_idx)


def masked_convolution(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    seq_idx: torch.Tensor,
) -> torch.Tensor:
    """The depthwise causal convolution of each conversation alone, in one pass over the row.

    Args:
        hidden_states: ``(B, D, T)``. weight: ``(D, K)``. bias: ``(D,)`` or None.
        activation: a transformers activation name, or None.
        seq_idx: ``(B, T)`` integer, the conversation of each token.

    Returns:
        ``(B, D, T)`` in the dtype of ``hidden_states``, computed in ``weight``'s dtype as the
        family's own convolution is. The gradient follows through the taps' masks: a tap that
        crosses a boundary contributes neither value nor gradient.
    """
    from transformers.activations import ACT2FN

    x = hidden_states.to(weight.dtype)
    width = weight.shape[-1]
    steps = x.shape[-1]
    out = x * weight[:, -1, None]  # the tap at the token itself: always its conversation
    for back in range(1, width):  # the tap reading `back` tokens before
        shifted = F.pad(x, (back, 0))[..., :steps]
        before = F.pad(seq_idx, (back, 0), value=-1)[:, :steps]
        same = (before == seq_idx)[:, None].to(x.dtype)  # (B, 1, T)
        out = out + shifted * same * weight[:, width - 1 - back, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def install(mixer: nn.Module, name: str) -> None:
    """Replaces the function ``name`` of ``mixer``'s modeling module by :class:`WithinConversations`
    (once per module: a replaced one stays).
    """
    module = sys.modules[type(mixer).__module__]
    own = getattr(module, name, None)
    if own is not None and not isinstance(own, WithinConversations):
        setattr(module, name, WithinConversations(own))
