"""``packed_ce.cross_entropy`` and ``PackedCrossEntropyLoss``: the public loss on logits."""

from __future__ import annotations

import torch
from torch import nn

from .options import Boundaries, LossOptions, changed_fields, split_keywords
from .pipeline import run_loss
from .reference import loss_from_targets, token_stats_rows
from .runtime import resolve_backend
from .validation import check_tensor


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
    options: LossOptions | None = None,
    **keywords,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Cross entropy that can average per packed sequence instead of per token.

    Per target ``t`` with logits row ``x`` (after ``softcap``: ``x = softcap * tanh(x / softcap)``),
    ``lse = logsumexp(x)`` and target ``y``::

        l_t = (1 - eps) * (lse - x[y]) + eps * (lse - mean_j x[j]) + z_loss_scale * lse**2

    With ``is_packed=False`` every target weighs 1; with ``is_packed=True`` a target of sequence
    ``s`` weighs ``1 / n_s`` (``n_s`` = targets in ``s``), so "sum" is the sum of per-sequence
    mean losses and "mean" divides it by the number of sequences that have a target: the loss of
    training the same sequences unpacked, one per row, averaging per sequence.

    A conversation cut into pieces (``pack_dataset(..., overflow="split")``, context-parallel
    shards) keeps its weight through ``seq_targets``, and conversations can weigh more or less
    through ``seq_weights``: a target of sequence ``s`` then weighs

        w_t = seq_weights[s] / seq_targets[s]     (is_packed=True)
        w_t = seq_weights[s]                      (is_packed=False: a weighted token mean)

    (defaults: weight 1, ``seq_targets`` = the sequence's own target count), and "mean" divides
    by the weight mass ``D = sum_t w_t``. Over all the pieces of a conversation its targets'
    weights add up to its weight, so summed over an epoch every conversation weighs exactly its
    weight, however it was cut.

    Args:
        logits: ``(N, V)`` or ``(B, T, V)``, float32/bfloat16/float16 (float64 too with
            ``backend="torch"``).
        labels: ``(N,)`` or ``(B, T)`` integer class indices or ``ignore_index``.
        cu_seqlens: ``(S+1,)`` int32/int64 on the logits' device, ``0 = c_0 <= ... <= c_S = N``;
            sequence ``s`` is tokens ``[c_s, c_{s+1})`` of the flattened ``N = B*T`` tokens.
        position_ids: instead of ``cu_seqlens``, ``N`` entries; a sequence starts at token 0 of
            each row and wherever ``position_ids[t] != position_ids[t-1] + 1``.
        num_items_in_batch: the global ``D`` (int or 0-d tensor) when one optimiser step spans
            several micro-batches or processes (:func:`packed_ce.count_normaliser` counts it).
        seq_targets: ``(S,)`` integer, aligned with ``cu_seqlens`` (needed; not with
            ``position_ids``), ``is_packed=True`` only: the number of targets of the whole
            conversation each sequence is a piece of, ``>= 1`` and at least the sequence's own
            count (``PackedCollator`` and ``collators.shard_batch`` return it).
        seq_weights: ``(S,)`` float, aligned with ``cu_seqlens`` (needed), finite, ``>= 0``,
            not requiring a gradient: each sequence's conversation weight, of any scale ("mean"
            divides them by ``D`` in float64 first: a mass outside float32's range is exact).
        options: a :class:`packed_ce.LossOptions`; the keywords below override its fields.
        **keywords: the fields of :class:`packed_ce.LossOptions`: ``is_packed=False``,
            ``shift=False``, ``ignore_index=-100``, ``reduction="mean"``,
            ``label_smoothing=0.0``, ``z_loss_scale=0.0``, ``softcap=None``,
            ``return_z_loss=False``, ``return_token_stats=False``, ``inplace_backward=False``,
            ``backend="auto"``, ``validate=True`` (each explained there). ``reduction``: "mean" (``sum / D``),
            "sum", or "none" (per token, ``labels``-shaped, summing to "sum"); ``D`` =
            ``num_items_in_batch`` if given, else the number of targets (``is_packed=False``)
            or of sequences with a target (``is_packed=True``), or with ``seq_targets`` /
            ``seq_weights`` the weight mass; ``D == 0`` gives loss 0 and zero gradients.

    Returns:
        The loss (float32; float64 for float64 logits on the torch backend): 0-d for "mean" and
        "sum", ``labels``-shaped for "none"; with ``return_z_loss`` the pair ``(loss, z_loss)``;
        with ``return_token_stats`` a :class:`packed_ce.TokenStats` after them (``(loss, stats)``
        or ``(loss, z_loss, stats)``): entropy and top-1 sums over the targets, from the same
        pass over the logits, for any reduction.
        The gradient of ``logits`` has the logits' dtype.

    Raises:
        ValueError / TypeError naming the argument, for an unknown keyword, an option of the
        wrong type or out of range (NaN and infinite floats included), labels outside
        ``[0, V)`` other than ``ignore_index``, malformed ``cu_seqlens``, a negative or
        non-finite ``num_items_in_batch`` (a Python number must be an int), mismatched shapes,
        ``is_packed=True`` without boundaries, a bad ``seq_targets`` / ``seq_weights``, or
        ``inplace_backward=True`` with logits that are not contiguous. RuntimeError for a second backward through one call on the Triton
        backend (its gradient is scaled in place) and for ``create_graph=True`` there (its
        gradient has no graph); the torch backend is plain autograd and allows both.

    What is checked when: types, shapes, dtypes, devices, options and a Python-number
    ``num_items_in_batch`` always, on the host, for free. The values on the device (label range,
    ``cu_seqlens`` contents, a tensor ``num_items_in_batch``) only with ``validate=True`` outside
    ``torch.compile`` and CUDA-graph capture: on the CPU and on the torch backend inside the call,
    on CUDA with the kernel on the device without a host sync, the error then raised by the next
    loss call or :func:`packed_ce.check_pending` (this call's loss is NaN). Unchecked, both backends give the
    same result on bad values: NaN for an out-of-range label and for a negative or non-finite
    ``num_items_in_batch``; ``cu_seqlens`` read clamped to ``[0, N]``, made non-decreasing and
    from 0 to ``N`` (:func:`packed_ce.validation.clamp_cu_seqlens`).

    A ``-inf`` logit (a masked entry) gives ``F.cross_entropy``'s finite loss and a zero
    gradient there on both backends; with ``label_smoothing > 0`` the exact loss is ``+inf``.

    Example:
        >>> import torch, packed_ce
        >>> logits = torch.zeros(5, 4)                       # uniform: every l_t = log 4
        >>> labels = torch.tensor([1, 2, 3, -100, 0])
        >>> cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
        >>> packed_ce.cross_entropy(logits, labels, cu_seqlens=cu_seqlens, is_packed=True)
        tensor(1.3863)
    """
    check_tensor("logits", logits)
    options, _ = split_keywords(keywords, options)
    backend = resolve_backend(options.backend, logits)
    boundaries = Boundaries(
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        num_items_in_batch=num_items_in_batch,
        seq_targets=seq_targets,
        seq_weights=seq_weights,
    )
    if options.inplace_backward and not logits.is_contiguous():
        # an expanded (stride-0) or overlapping view would receive several rows' gradients in
        # one place, and a strided one would be copied (nothing written where the caller looks)
        raise ValueError(
            "inplace_backward=True writes the gradient into the storage of logits, which must "
            f"be contiguous (got shape {tuple(logits.shape)}, strides {logits.stride()}): "
            "pass logits.contiguous() or inplace_backward=False"
        )

    def run(prepared, stats):
        if backend == "torch":
            if stats is not None:
                flat = logits.reshape(-1, logits.shape[-1])
                stats[:, :2] = token_stats_rows(flat, prepared.targets, options)
            return loss_from_targets(logits, prepared, options, stats)
        from .kernels.cross_entropy import triton_cross_entropy

        rows = logits.reshape(-1, logits.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return triton_cross_entropy(
            rows,
            prepared.targets,
            prepared.coef,
            label_smoothing=options.label_smoothing,
            z_loss_scale=options.z_loss_scale,
            softcap=0.0 if options.softcap is None else options.softcap,
            reduce=options.reduction != "none",
            inplace_backward=options.inplace_backward,
            stats=stats,
        )

    return run_loss(
        run,
        labels,
        boundaries,
        options,
        backend=backend,
        logits_shape=logits.shape,
        dtype=logits.dtype,
        device=logits.device,
    )


class PackedCrossEntropyLoss(nn.Module):
    """Module form of :func:`cross_entropy`: holds the keyword options.

    Args:
        **options: the fields of :class:`packed_ce.LossOptions` (the keywords of
            :func:`cross_entropy` except the tensors), checked here, once.

    Example:
        >>> loss_fn = PackedCrossEntropyLoss(is_packed=True, shift=True)
        >>> loss_fn
        PackedCrossEntropyLoss(is_packed=True, shift=True)
        >>> logits = torch.zeros(5, 4)                       # uniform: every l_t = log 4
        >>> labels = torch.tensor([-100, 1, 2, -100, 3])
        >>> loss_fn(logits, labels, cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32))
        tensor(1.3863)
    """

    def __init__(self, **options):
        super().__init__()
        self.options, _ = split_keywords(options)

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        *,
        seq_targets: torch.Tensor | None = None,
        seq_weights: torch.Tensor | None = None,
    ):
        return cross_entropy(
            logits,
            labels,
            cu_seqlens=cu_seqlens,
            position_ids=position_ids,
            num_items_in_batch=num_items_in_batch,
            seq_targets=seq_targets,
            seq_weights=seq_weights,
            options=self.options,
        )

    def extra_repr(self) -> str:
        return changed_fields(self.options)
