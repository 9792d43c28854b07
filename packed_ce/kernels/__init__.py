"""Triton kernels and their launchers; import only where Triton is installed."""
