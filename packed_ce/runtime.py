"""Where the Triton kernels can run, and what the current context allows (tracing, grad mode)."""

from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels through its interpreter (``TRITON_INTERPRET=1``).

    The variable is read when a kernel is defined, so it must be set before ``packed_ce`` is
    imported; the interpreter runs kernels on CPU tensors.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Looked up once at import: torch.compile refuses to trace importlib's find_spec.
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` in ("auto", "triton", "torch"), as checked by
    :class:`packed_ce.options.LossOptions`.

    ``"auto"`` takes the Triton kernel on CUDA tensors and the PyTorch reference elsewhere (the
    interpreter is a correctness tool, far slower than PyTorch on the CPU).
    """
    if backend == "auto":
        return "triton" if tensor.is_cuda and TRITON_AVAILABLE else "torch"
    if backend == "triton":
        if not TRITON_AVAILABLE:
            raise ValueError("backend='triton' needs the triton package, which is not installed")
        on_cpu_interpreted = tensor.device.type == "cpu" and interpreting()
        if not tensor.is_cuda and not on_cpu_interpreted:
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got {tensor.device.type}), or "
                "TRITON_INTERPRET=1 set before importing packed_ce to run the kernel on CPU "
                "tensors through the interpreter"
            )
    return backend


def is_tracing() -> bool:
    """True under torch.compile or CUDA-graph capture, where a host sync is impossible."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_first_order(what: str, fix: str) -> None:
    """RuntimeError inside a backward run with ``create_graph=True`` (grad mode is on there).

    The kernels' gradients are computed outside autograd and carry no graph: a gradient of the
    gradient would silently be missing, so it is refused at the first backward instead.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} gives first-order gradients only (its backward builds no graph), so "
            f"create_graph=True cannot give a higher-order gradient: use {fix} for that"
        )
