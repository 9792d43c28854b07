"""From labels and sequence boundaries to per-token targets and loss coefficients.

Token ``t`` contributes ``coef[t] * l_t`` (``coef``, ``w_t``, ``D``, ``n_s``, ``m_s``, ``a_s``:
docs/reference.md, "The loss, exactly"), one ``(N,)`` coefficient per row, so the kernels know
nothing of sequences. No host sync or data-dependent shape: safe under CUDA graphs and
``torch.compile``.

Dimensions: N tokens, V vocabulary, S sequences, B rows and T tokens per row (N = B*T).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .columns import position_restarts
from .options import BOUNDARY_FIELDS, Boundaries, LossOptions, split_keywords
from .records import own_targets
from .validation import check_labels, check_tensor, checked_boundaries


@dataclass
class Targets:
    """What the loss needs to know about every token, independent of the logits.

    Attributes:
        targets: ``(N,)`` int64 class of each row, ``ignore_index`` where none.
        coef: ``(N,)`` float32 weight of the row in the reduced loss, 0 without a target.
    """

    targets: torch.Tensor
    coef: torch.Tensor


def sequence_ids(
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """Index of the sequence of every token, and an upper bound on the number of sequences.

    Args:
        labels: ``(N,)`` or ``(B, T)`` (without boundaries each row is one sequence).
        cu_seqlens: ``(S+1,)`` int32/int64 or None. position_ids: ``N`` entries or None.

    Returns:
        ``seq`` ``(N,)`` int64, non-decreasing, and ``S`` with ``0 <= seq < S``.
    """
    n = labels.numel()
    device = labels.device
    if cu_seqlens is not None:
        tokens = torch.arange(n, device=device, dtype=torch.int64)
        # right=True: an empty sequence [c, c) owns no token, the next one starts at c.
        seq = torch.searchsorted(cu_seqlens.to(torch.int64), tokens, right=True) - 1
        num_slots = cu_seqlens.numel() - 1
        # in range even for malformed, unchecked cu_seqlens
        return seq.clamp_(0, max(num_slots - 1, 0)), max(num_slots, 1)
    rows = labels.shape[0] if labels.dim() == 2 else 1
    row_len = n // rows if rows else 0
    if position_ids is not None:
        starts = position_restarts(position_ids.reshape(rows, row_len))
        return torch.cumsum(starts, 0) - 1, max(n, 1)
    seq = torch.arange(rows, device=device).repeat_interleave(row_len)
    return seq, max(rows, 1)


def _per_target_and_share(
    n_s: torch.Tensor, seq_targets: torch.Tensor | None, is_packed: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unweighted ``1 / m_s`` (``(S,)`` of ``dtype``; 0-d 1 with ``is_packed=False``) and each
    sequence's share of ``D`` (``n_s / m_s``, or ``n_s``), from the ``(S,)`` int64 counts ``n_s``.
    """
    if not is_packed:
        return torch.ones((), dtype=dtype, device=n_s.device), n_s
    # m_s; clamped to >= 1 (a bad seq_targets when validation is off): never 0 * inf = NaN
    # for the tokens without a target. The kernel clamps the same way.
    whole = n_s if seq_targets is None else seq_targets.to(torch.int64)
    per_target = 1.0 / whole.clamp(min=1).to(dtype)
    # n_s / m_s: 1 for a whole sequence with a target, its share of a split conversation
    share = (n_s > 0) if seq_targets is None else n_s.to(dtype) * per_target
    return per_target, share


def _targets_and_weights(
    labels: torch.Tensor,
    boundaries: Boundaries,
    options: LossOptions,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(N,)`` int64 targets, ``(N,)`` weights ``w_t`` of ``dtype`` and the default ``D`` (0-d:
    int64, or ``dtype`` with ``seq_targets`` / ``seq_weights``), in PyTorch.
    """
    cu_seqlens, position_ids = boundaries.cu_seqlens, boundaries.position_ids
    seq_targets, seq_weights = boundaries.seq_targets, boundaries.seq_weights
    shift, ignore_index = options.shift, options.ignore_index
    flat = labels.reshape(-1).to(torch.int64)
    per_sequence = options.is_packed or seq_weights is not None
    need_seq = per_sequence or (shift and (cu_seqlens is not None or position_ids is not None))
    seq, num_slots = (None, 0)
    if need_seq or (shift and labels.dim() == 2):
        seq, num_slots = sequence_ids(labels, cu_seqlens, position_ids)

    if shift:
        n = flat.numel()
        ignore = torch.full((1,), ignore_index, dtype=torch.int64, device=flat.device)
        nxt = torch.cat([flat[1:], ignore])[:n]  # [:n]: N = 0 stays empty
        if seq is None:
            targets = nxt
        else:
            last = torch.zeros(1, dtype=torch.bool, device=flat.device)
            same_seq = torch.cat([seq[1:] == seq[:-1], last])[:n]
            targets = torch.where(same_seq, nxt, ignore)
    else:
        targets = flat
    has_target = targets != ignore_index
    valid = has_target.to(dtype)
    if not per_sequence:
        # D: the targets
        return targets, valid, has_target.sum()

    n_s = torch.zeros(num_slots, dtype=torch.int64, device=flat.device)
    n_s.index_add_(0, seq, has_target.to(torch.int64))
    per_target, share = _per_target_and_share(n_s, seq_targets, options.is_packed, dtype)
    if seq_weights is not None:
        a_s = seq_weights.detach().to(dtype)
        per_target, share = a_s * per_target, a_s * share
    # malformed cu_seqlens (validation off) may give S = 0: slot 0 weighs 0, as in the kernel
    per_target = torch.nn.functional.pad(per_target, (0, num_slots - per_target.numel()))
    # valid tokens get w_t = a_s / m_s (packed) or a_s, the others 0 (selected, not multiplied:
    # a sequence without a target may weigh inf / m_s once divided by a tiny D; the kernel too)
    weight = torch.where(has_target, per_target[seq], 0.0)
    if seq_targets is None and seq_weights is None:
        # D: the sequences with a target, an exact integer count
        return targets, weight, share.sum()
    # D: the weight mass sum_s a_s n_s / m_s (packed) or sum_s a_s n_s, = sum_t w_t
    return targets, weight, share.to(dtype).sum()


def _weights_over_mass(
    labels: torch.Tensor, boundaries: Boundaries, options: LossOptions, dtype: torch.dtype
) -> Boundaries:
    """``boundaries`` for reduction "mean" with ``seq_weights``: the weights divided by ``D`` in
    float64, and ``num_items_in_batch`` replaced by what is left of ``D`` (1, or the 0 / NaN of a
    zero or bad ``D``).

    A mass formed in float32 breaks at scale (two weights of 3e38 give inf, a NaN loss; 1e-40 loses
    digits or falls below the normaliser's 1e-30 clamp); ``a_s / D`` in float64, rounded once, makes
    ``a_s / (m_s D)`` exact to ``dtype`` rounding at any scale. No host sync.
    """
    weights = boundaries.seq_weights.detach().to(torch.float64)  # (S,) a_s
    mass = boundaries.num_items_in_batch
    if mass is None:
        n_s = own_targets(
            labels, boundaries.cu_seqlens, shift=options.shift, ignore_index=options.ignore_index
        )
        _, share = _per_target_and_share(
            n_s, boundaries.seq_targets, options.is_packed, torch.float64
        )
        # a sequence without a target has no part in the mean: weight 0, so that its a_s / D
        # never overflows dtype (0 * inf = NaN in the weight mass of the kernel)
        weights = torch.where(share > 0, weights, 0.0)
        mass = (weights * share).sum()
    elif isinstance(mass, torch.Tensor):
        mass = mass.reshape(()).to(device=weights.device, dtype=torch.float64)
    else:  # a fill kernel: torch.tensor(n, device=cuda) would be a blocking host copy
        mass = torch.full((), float(mass), dtype=torch.float64, device=weights.device)
    usable = torch.isfinite(mass) & (mass > 0)
    weights = weights / torch.where(usable, mass, 1.0)
    # The rest of D for the normaliser: 1 divides by nothing more; 0 (loss 0, zero gradients),
    # a negative or non-finite D (NaN) keep their meaning there.
    rest = torch.where(usable, 1.0, mass)
    return dataclasses.replace(boundaries, seq_weights=weights.to(dtype), num_items_in_batch=rest)


def count_normaliser(
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
    options: LossOptions | None = None,
) -> torch.Tensor:
    """``D``, what reduction "mean" divides by when ``num_items_in_batch`` is not given.

    The weight mass ``sum_t w_t`` the loss uses: summed over a step's micro-batches and processes
    it is the step's ``num_items_in_batch``. Without ``seq_targets`` / ``seq_weights``: the number
    of targets (``is_packed=False``) or of sequences with a target (``is_packed=True``).

    Args:
        labels: ``(N,)`` or ``(B, T)`` integer. cu_seqlens, position_ids, seq_targets,
            seq_weights: as in :func:`packed_ce.cross_entropy`.
        options: the loss's :class:`packed_ce.options.LossOptions` (default ``LossOptions()``).

    Returns:
        0-d on the labels' device: int64 (an exact count), or float64 with ``seq_targets`` /
        ``seq_weights`` (a sum of fractions, exact to ~1e-16 over a step).

    Raises:
        TypeError / ValueError naming the argument, from metadata only; contents are not checked (a
            host sync): the count of malformed values is unspecified.

    Example:
        >>> labels = torch.tensor([-100, 5, -100, -100, -100, 7, 8])
        >>> cu_seqlens = torch.tensor([0, 2, 4, 7], dtype=torch.int32)
        >>> packed = LossOptions(is_packed=True, shift=True)
        >>> count_normaliser(labels, cu_seqlens=cu_seqlens, options=packed)  # the middle: none
        tensor(2)
        >>> count_normaliser(labels, cu_seqlens=cu_seqlens, options=LossOptions(shift=True))
        tensor(3)

        The last sequence is half of a conversation of 4 targets, weighing 3:

        >>> count_normaliser(labels, cu_seqlens=cu_seqlens, options=packed,
        ...                  seq_targets=torch.tensor([1, 1, 4]),
        ...                  seq_weights=torch.tensor([1.0, 1.0, 3.0]))
        tensor(2.5000, dtype=torch.float64)
    """
    check_tensor("labels", labels)
    options, _ = split_keywords({}, options)
    boundaries = checked_boundaries(
        cu_seqlens, position_ids, seq_targets=seq_targets, seq_weights=seq_weights
    )
    # checks seq_targets / seq_weights too (their rules in validation.TENSOR_RULES)
    check_labels(
        labels, boundaries, is_packed=options.is_packed, device=labels.device, name="labels"
    )
    return _targets_and_weights(labels, boundaries, options, torch.float64)[2]


def prepare_targets(
    labels: torch.Tensor,
    boundaries: Boundaries | None = None,
    options: LossOptions | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    use_kernel: bool = False,
    **keywords,
) -> Targets:
    """Targets and per-token coefficients (docs/reference.md, "The loss, exactly") for ``labels``.

    Args:
        labels: ``(N,)`` or ``(B, T)`` integer labels.
        boundaries: the call's :class:`packed_ce.options.Boundaries`, checked by the caller.
        options: the :class:`packed_ce.options.LossOptions` (``is_packed``, ``shift``,
            ``ignore_index``, ``reduction``).
        dtype: of the coefficients; float32 for the kernels, float64 for a float64 reference.
        use_kernel: with float32, two Triton launches (:mod:`packed_ce.kernels.targets`) instead
            of ~40 PyTorch ones, in eager mode; the reference keeps the PyTorch path, so each
            checks the other.
        **keywords: instead of the objects, their fields (``cu_seqlens=...``, ``shift=True``).

    Returns:
        :class:`Targets` with ``(N,)`` int64 targets and ``(N,)`` coefficients of ``dtype``.

    Example:
        Two sequences (tokens 0-2, 3-5), shifted: weights 1/2, 1/2 and 1, divided by 2 sequences.

        >>> labels = torch.tensor([-100, 4, 5, -100, -100, 6])
        >>> cu_seqlens = torch.tensor([0, 3, 6], dtype=torch.int32)
        >>> prepared = prepare_targets(labels, cu_seqlens=cu_seqlens, is_packed=True, shift=True)
        >>> prepared.targets
        tensor([   4,    5, -100, -100,    6, -100])
        >>> prepared.coef
        tensor([0.2500, 0.2500, 0.0000, 0.0000, 0.5000, 0.0000])

        The first sequence is now half of a conversation of 4 targets and the second weighs 2:
        ``w = (1/4, 1/4, 2)``, ``D = 1/4 + 1/4 + 2 = 2.5``.

        >>> prepared = prepare_targets(labels, cu_seqlens=cu_seqlens, is_packed=True, shift=True,
        ...                            seq_targets=torch.tensor([4, 1]),
        ...                            seq_weights=torch.tensor([1.0, 2.0]))
        >>> prepared.coef
        tensor([0.1000, 0.1000, 0.0000, 0.0000, 0.8000, 0.0000])
    """
    if keywords:
        tensors = {name: keywords.pop(name) for name in BOUNDARY_FIELDS & set(keywords)}
        boundaries = Boundaries(**tensors) if tensors else boundaries
        options, _ = split_keywords(keywords, options)
    labels = labels.contiguous()  # the kernels read labels and targets as dense (N,) arrays
    boundaries = boundaries if boundaries is not None else Boundaries()
    options = options if options is not None else LossOptions()
    if options.reduction == "mean" and boundaries.seq_weights is not None:
        boundaries = _weights_over_mass(labels, boundaries, options, dtype)
    # Under torch.compile the PyTorch path is traced instead: inductor fuses it by itself.
    kernels = use_kernel and dtype == torch.float32 and not torch.compiler.is_compiling()
    if kernels and boundaries.cu_seqlens is not None:
        from .kernels.targets import sequence_targets

        targets, weight, num_items = sequence_targets(
            labels.reshape(-1).to(torch.int64),
            boundaries.cu_seqlens,
            boundaries.seq_targets,
            boundaries.seq_weights,
            is_packed=options.is_packed,
            shift=options.shift,
            ignore_index=options.ignore_index,
        )
    else:
        targets, weight, num_items = _targets_and_weights(labels, boundaries, options, dtype)

    if options.reduction != "mean":
        return Targets(targets=targets, coef=weight)
    num_items_in_batch = boundaries.num_items_in_batch
    if num_items_in_batch is not None:
        num_items = num_items_in_batch
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.reshape(()).to(device=labels.device)
        else:
            # a fill kernel: torch.tensor(n, device=cuda) would be a blocking host copy
            num_items = torch.full((), float(num_items), device=labels.device)
    if kernels:
        from .kernels.targets import normalise

        return Targets(targets=targets, coef=normalise(weight.contiguous(), num_items))
    num_items = num_items.to(dtype)
    # D == 0: loss 0 and zero gradients, never 0/0; an unchecked negative or non-finite D: NaN
    # on every backend, not a loss of 0 or of the wrong sign
    scale = torch.where(num_items > 0, 1.0 / num_items.clamp(min=1e-30), 0.0)
    scale = torch.where(torch.isfinite(num_items) & (num_items >= 0), scale, float("nan"))
    return Targets(targets=targets, coef=weight * scale)
