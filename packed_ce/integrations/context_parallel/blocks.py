"""The attention of one ring step: this rank's queries against one rank's keys and values.

What a step adds to a query's running result is its block's output and log-sum-exp (``ring.py``
merges them); its backward takes the row's final output statistics, so that a block's gradient is
its share of the whole softmax's:

    P = exp(S - lse),  dV = P^T dO,  dS = P * (dO V^T - delta),  dQ = dS K,  dK = dS^T Q

with ``lse`` the row's log-sum-exp, ``delta = rowsum(dO * O) - dlse`` (``O`` the row's output,
``dlse`` the gradient reaching the log-sum-exp itself: the sinks read it), times the softcap's
derivative ``1 - tanh^2(S / softcap)`` where the scores are capped. Two implementations:

- :class:`DenseSteps` (the CPU, short rows): each planned block (:meth:`RowLayout.ring_blocks`)
  in plain PyTorch, in float32 at least, its scores ``(Hq, q1 - q0, k1 - k0)`` materialised;
- :class:`FlexSteps` (CUDA, long rows): one flex-attention call per step with the step's block
  mask (flex skips the empty 128-blocks); the backward recomputes the step under autograd and
  hands flex the gradients of its output and log-sum-exp that make its softmax the row's:
  ``w dO`` and ``w (rowsum(dO * O_s) - delta)`` with ``w = exp(lse_s - lse)``.
"""

from __future__ import annotations

import torch

from .layout import RowLayout


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Folds a block's result into the running one, in place: the softmax over the union of their
    keys is each part's weighted by ``exp(lse_part - lse_union)``.

    Args:
        out: ``(..., Lq, D)`` running output; lse: ``(..., Lq)`` its log-sum-exp (``-inf`` where
            no key was seen yet). block_out, block_lse: the block's, same shapes.
    """
    union = torch.logaddexp(lse, block_lse)
    # where neither part has seen a key both weights are 0 (exp(-inf)), not exp(-inf - -inf)
    safe = torch.where(union == float("-inf"), 0.0, union)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(
        block_out * torch.exp(block_lse - safe)[..., None]
    )
    lse.copy_(union)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a query that sees no key) as 0: ``exp(-inf - 0)`` weighs 0."""
    return torch.where(lse == float("-inf"), 0.0, lse)


class DenseSteps:
    """Each planned block of a step in plain PyTorch (module docstring).

    The heads are grouped by key head (``(Hkv, G, L, D)``: query head ``h`` reads key head
    ``h // G``, as ``repeat_interleave``), so no key is copied per query head.
    """

    def __init__(self, layout: RowLayout, window: int | None, scale: float, softcap):
        self.layout, self.window, self.scale, self.softcap = layout, window, scale, softcap
        self.plan = layout.ring_blocks(window)

    def active(self, step: int) -> bool:
        """Whether ``step`` has anything to compute."""
        return bool(self.plan[step])

    def _scores(self, query, key, block, step):
        """Capped, masked scores ``(Hkv, G, q1 - q0, k1 - k0)``, and ``tanh`` of the capped ones
        (None without a softcap).
        """
        q0, q1, k0, k1, full = block
        scores = torch.matmul(query[:, :, q0:q1], key[:, None, k0:k1].transpose(-1, -2))
        scores = scores * self.scale
        capped = None
        if self.softcap is not None:
            capped = torch.tanh(scores / self.softcap)
            scores = self.softcap * capped
        if not full:
            queries = torch.arange(q0, q1, device=query.device)[:, None]
            keys = torch.arange(k0, k1, device=query.device)[None, :]
            visible = self.layout.mask_mod(self.window, step)(None, None, queries, keys)
            scores = scores.masked_fill(~visible, float("-inf"))
        return scores, capped

    def forward(self, step: int, query, kv, out, lse) -> None:
        """Adds step ``step``'s blocks to the running ``out`` ``(Hkv, G, L, D)`` and ``lse``
        ``(Hkv, G, L)``; ``query`` ``(Hkv, G, L, D)``, ``kv`` ``(2, Hkv, L, D)``, all in the
        compute dtype.
        """
        key, value = kv[0], kv[1]
        for block in self.plan[step]:
            scores, _ = self._scores(query, key, block, step)
            block_lse = scores.logsumexp(-1)
            probabilities = torch.exp(scores - _finite(block_lse)[..., None])
            block_out = torch.matmul(probabilities, value[:, None, block.k0 : block.k1])
            rows = slice(block.q0, block.q1)
            merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)

    def backward(self, step: int, query, kv, lse, grad_out, delta, grad_query, grad_kv) -> None:
        """Adds step ``step``'s gradients (module docstring) to ``grad_query`` ``(Hkv, G, L, D)``
        and ``grad_kv`` ``(2, Hkv, L, D)``; ``lse``, ``delta`` ``(Hkv, G, L)`` are the row's.
        """
        key, value = kv[0], kv[1]
        for block in self.plan[step]:
            q0, q1, k0, k1, _ = block
            scores, capped = self._scores(query, key, block, step)
            probabilities = torch.exp(scores - _finite(lse[:, :, q0:q1])[..., None])
            grad = grad_out[:, :, q0:q1]
            grad_kv[1, :, k0:k1] += torch.matmul(probabilities.transpose(-1, -2), grad).sum(1)
            grad_scores = torch.matmul(grad, value[:, None, k0:k1].transpose(-1, -2))
            grad_scores = probabilities * (grad_scores - delta[:, :, q0:q1, None])
            if capped is not None:
                grad_scores = grad_scores * (1 - capped * capped)
            grad_scores = grad_scores * self.scale
            grad_query[:, :, q0:q1] += torch.matmul(grad_scores, key[:, None, k0:k1])
            grad_kv[0, :, k0:k1] += torch.matmul(
                grad_scores.transpose(-1, -2), query[:, :, q0:q1]
            ).sum(1)


# flex_attention compiled once per process and shared by every model (eager flex attention
# materialises the (L, L) scores); see integrations/trainers/seams.py, GLOBAL_STATE.
_compiled_flex_attention = None


def _flex_attention():
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


def _softcap_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


class FlexSteps:
    """Each step as one flex-attention call with the step's block mask (module docstring).

    Flex takes the heads ungrouped (``(1, Hq, L, D)``, ``enable_gqa``): the grouped views of the
    ring are reshaped on the way in and out, without a copy.
    """

    def __init__(self, layout: RowLayout, window: int | None, scale: float, softcap, device):
        self.layout, self.window, self.device = layout, window, device
        self.plan = layout.ring_blocks(window)
        score_mod = None if softcap is None else _softcap_mod(softcap)
        self.common = dict(score_mod=score_mod, scale=scale, enable_gqa=True)

    def active(self, step: int) -> bool:
        return bool(self.plan[step])

    def _call(self, step, query, key, value):
        """Flex over the step: ``query`` ``(Hkv, G, L, D)``, ``key``/``value`` ``(Hkv, L, D)`` ->
        output ``(Hkv, G, L, D)`` in the query's dtype, log-sum-exp ``(Hkv, G, L)`` float32.
        """
        from torch.nn.attention.flex_attention import AuxRequest

        heads, groups, local, dim = query.shape
        out, aux = _flex_attention()(
            query.reshape(1, heads * groups, local, dim),
            key[None],
            value[None],
            block_mask=self.layout.block_mask(self.window, step, self.device),
            return_aux=AuxRequest(lse=True),
            **self.common,
        )
        return out.view(heads, groups, local, dim), aux.lse.view(heads, groups, local)

    def forward(self, step: int, query, kv, out, lse) -> None:
        """As :meth:`DenseSteps.forward`; ``query`` and ``kv`` in the model's dtype."""
        block_out, block_lse = self._call(step, query, kv[0], kv[1])
        merge(out, lse, block_out.to(out.dtype), block_lse.to(lse.dtype))

    def backward(self, step: int, query, kv, lse, grad_out, delta, grad_query, grad_kv) -> None:
        """As :meth:`DenseSteps.backward`, by flex's own backward of the recomputed step."""
        with torch.enable_grad():
            inputs = [query.detach().requires_grad_(), kv[0].detach(), kv[1].detach()]
            inputs[1].requires_grad_()
            inputs[2].requires_grad_()
            block_out, block_lse = self._call(step, *inputs)
            weight = torch.exp(block_lse.to(lse.dtype) - _finite(lse))  # 0 where nothing is seen
            grad_block_out = (weight[..., None] * grad_out).to(block_out.dtype)
            reads = (grad_out * block_out.to(grad_out.dtype)).sum(-1)
            grad_block_lse = (weight * (reads - delta)).to(block_lse.dtype)
            grads = torch.autograd.grad(
                (block_out, block_lse), inputs, (grad_block_out, grad_block_lse)
            )
        grad_query += grads[0]
        grad_kv[0] += grads[1]
        grad_kv[1] += grads[2]
