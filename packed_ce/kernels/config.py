"""The launch configuration of the cross-entropy row kernel, as measured (benchmarks/NOTES.md)."""

from __future__ import annotations

import functools

import torch
import triton

from ..runtime import interpreting

# Bandwidth per SM below which a row of up to 32768 columns is held in one program's registers
# rather than read twice: a third fewer bytes, but no overlap with another row's program. At
# V=32000 (benchmarks/NOTES.md, v5) +16% on an H100 (25 GB/s per SM), -9% on an H200 (37).
ROW_ON_CHIP_MAX_BANDWIDTH_PER_SM = 30e9


@functools.cache
def bandwidth_per_sm(device_index: int) -> float:
    """Peak memory bandwidth per SM in bytes/s (inf where unknown: two passes, safe everywhere)."""
    props = torch.cuda.get_device_properties(device_index)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return float("inf")
    # double data rate: two transfers per clock
    return 2 * clock_khz * 1e3 * bus_bits / 8 / props.multi_processor_count


def launch_config(vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of ``vocab_size`` logits on ``device``; the kernel holds
    the row on chip where BLOCK_V >= vocab_size.
    """
    if interpreting():
        # The interpreter runs blocks as numpy arrays: small blocks keep tests quick and make
        # the multi-block loop and its masked tail run at test-sized vocabularies.
        return min(triton.next_power_of_2(vocab_size), 1024), 1
    block = triton.next_power_of_2(vocab_size)
    # One block per row, at most 32 fp32 columns per thread: measured on an H100 and an H200
    # at V=8000 and 16000 (benchmarks/NOTES.md, v5) as fast as or faster than two passes.
    if block <= 4096:
        return block, 8
    if block <= 16384:
        return block, 16
    if block <= 32768 and bandwidth_per_sm(device.index) < ROW_ON_CHIP_MAX_BANDWIDTH_PER_SM:
        return block, 32
    # Two passes over 4096-column blocks, 8 warps: faster on an H100 and an H200 (V=32000 to
    # 262144) than larger blocks, 16-32 warps, persistent or pipelined grids, and L2 hints.
    return 4096, 8
