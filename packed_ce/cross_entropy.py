"""``packed_ce.cross_entropy`` and ``PackedCrossEntropyLoss``: the public loss."""

from __future__ import annotations

import torch
from torch import nn

from .reference import cross_entropy_reference
from .runtime import resolve_backend
from .targets import check_arguments, check_values, prepare_targets

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    is_packed: bool = False,
    shift: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy that can average per packed sequence instead of per token.

    Per target ``t`` with logits row ``x`` (after ``softcap``: ``x = softcap * tanh(x / softcap)``),
    ``lse = logsumexp(x)`` and target ``y``::

        l_t = (1 - eps) * (lse - x[y]) + eps * (lse - mean_j x[j]) + z_loss_scale * lse**2

    With ``is_packed=False`` every target weighs 1; with ``is_packed=True`` a target of sequence
    ``s`` weighs ``1 / n_s`` (``n_s`` = targets in ``s``), so "sum" is the sum of per-sequence
    mean losses and "mean" divides it by the number of sequences that have a target: the loss of
    training the same sequences unpacked, one per row, averaging per sequence.

    Args:
        logits: ``(N, V)`` or ``(B, T, V)``, float32/bfloat16/float16 (float64 too with
            ``backend="torch"``).
        labels: ``(N,)`` or ``(B, T)`` integer class indices or ``ignore_index``.
        cu_seqlens: ``(S+1,)`` int32/int64 on the logits' device, ``0 = c_0 <= ... <= c_S = N``;
            sequence ``s`` is tokens ``[c_s, c_{s+1})`` of the flattened ``N = B*T`` tokens.
        position_ids: instead of ``cu_seqlens``, ``N`` entries; a sequence starts at token 0 of
            each row and wherever ``position_ids[t] != position_ids[t-1] + 1``.
        is_packed: weight targets by ``1 / n_s`` as above; needs ``cu_seqlens`` or
            ``position_ids``.
        shift: ``labels`` are aligned with the inputs (transformers' causal-LM convention): the
            target of ``logits[t]`` is ``labels[t+1]`` if ``t+1`` is in the same sequence (or
            row, without boundaries), else none. Never crosses a sequence boundary.
        ignore_index: label value that is not a target (0 loss, 0 gradient).
        reduction: "mean" (``sum / D``), "sum", or "none" (per token, ``labels``-shaped, summing
            to "sum"). ``D`` = ``num_items_in_batch`` if given, else the number of targets
            (``is_packed=False``) or of sequences with a target (``is_packed=True``). ``D == 0``
            gives loss 0 and zero gradients.
        label_smoothing: ``eps`` in ``[0, 1]``, PyTorch's meaning.
        z_loss_scale: weight of ``lse**2`` in each token's loss.
        softcap: if given, logits pass through ``softcap * tanh(x / softcap)`` first.
        num_items_in_batch: the global ``D`` (int or 0-d tensor) when one optimiser step spans
            several micro-batches or processes.
        return_z_loss: also return the z-term, reduced like the loss, detached (for logging;
            it is already included in the loss).
        inplace_backward: the kernel may write the gradient into the storage of ``logits``,
            which then no longer hold the logits (saves one ``(N, V)`` buffer). With False the
            input is never modified.
        backend: "triton" (the kernel; on CPU tensors through the Triton interpreter when
            ``TRITON_INTERPRET=1``), "torch" (the PyTorch reference), or "auto" (the kernel on
            CUDA, the reference elsewhere).
        validate: check label range and ``cu_seqlens`` contents (one host sync on CUDA, after
            the kernel is queued; skipped automatically under ``torch.compile`` and CUDA-graph
            capture). With False nothing syncs; an out-of-range label then gives a NaN loss
            instead of an error.

    Returns:
        The loss (float32; float64 for float64 logits on the torch backend): 0-d for "mean" and
        "sum", ``labels``-shaped for "none"; with ``return_z_loss`` the pair ``(loss, z_loss)``.
        The gradient of ``logits`` has the logits' dtype.

    Raises:
        ValueError / TypeError naming the argument, for labels outside ``[0, V)`` other than
        ``ignore_index``, malformed ``cu_seqlens``, mismatched shapes, an unknown ``reduction``
        or ``is_packed=True`` without boundaries.

    Example:
        >>> import torch, packed_ce
        >>> logits = torch.zeros(5, 4)                       # uniform: every l_t = log 4
        >>> labels = torch.tensor([1, 2, 3, -100, 0])
        >>> cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
        >>> packed_ce.cross_entropy(logits, labels, cu_seqlens=cu_seqlens, is_packed=True)
        tensor(1.3863)
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    backend = resolve_backend(backend, logits)
    check_arguments(
        logits.shape,
        logits.dtype,
        logits.device,
        labels,
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        is_packed=is_packed,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        softcap=softcap,
        num_items_in_batch=num_items_in_batch,
        allowed_dtypes=KERNEL_DTYPES if backend == "triton" else REFERENCE_DTYPES,
    )
    vocab = logits.shape[-1]
    boundaries = dict(cu_seqlens=cu_seqlens, position_ids=position_ids, is_packed=is_packed)
    options = dict(
        shift=shift,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
    )
    if backend == "torch":
        if validate:
            check_values(labels, vocab, ignore_index, cu_seqlens)
        loss, z_loss = cross_entropy_reference(
            logits,
            labels,
            **boundaries,
            **options,
            label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale,
            softcap=softcap,
        )
    else:
        from .kernels.cross_entropy import triton_cross_entropy

        prepared = prepare_targets(labels, **boundaries, **options, use_kernel=True)
        rows = logits.reshape(-1, vocab)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        loss, z_loss = triton_cross_entropy(
            rows,
            prepared.targets,
            prepared.coef,
            label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale,
            softcap=0.0 if softcap is None else softcap,
            reduce=reduction != "none",
            inplace_backward=inplace_backward,
        )
        if reduction == "none":
            loss, z_loss = loss.reshape(labels.shape), z_loss.reshape(labels.shape)
        if validate:
            # After the launch: the one host sync then waits for work already queued instead
            # of idling the GPU while the host prepares the kernel. The kernel is memory-safe
            # on bad values (NaN loss), so nothing wrong escapes: the error is raised here.
            check_values(labels, vocab, ignore_index, cu_seqlens)
    return (loss, z_loss) if return_z_loss else loss


class PackedCrossEntropyLoss(nn.Module):
    """Module form of :func:`cross_entropy`: holds the keyword options.

    Args:
        **options: any keyword of :func:`cross_entropy` except the tensors.

    Example:
        >>> loss_fn = PackedCrossEntropyLoss(is_packed=True, shift=True)
        >>> loss = loss_fn(logits, batch["labels"], cu_seqlens=batch["cu_seqlens"])  # doctest: +SKIP
    """

    def __init__(self, **options):
        super().__init__()
        for name in ("cu_seqlens", "position_ids"):
            if name in options:
                raise TypeError(f"{name} is passed to forward, not to the constructor")
        self.options = options

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ):
        options = dict(self.options)
        if num_items_in_batch is not None:
            options["num_items_in_batch"] = num_items_in_batch
        return cross_entropy(
            logits, labels, cu_seqlens=cu_seqlens, position_ids=position_ids, **options
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
