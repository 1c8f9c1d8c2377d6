"""Launch configurations of our Triton tree-attention kernels, per GPU architecture and head dim.

One place decides the tile edge, warps and pipeline stages a launch uses
(:func:`launch_config`); the launcher (:mod:`~.triton_attention`) and the ahead-of-time compile
check (``scripts/compile_kernels.py``, docs/gpu.md) both read it, so the check compiles exactly what
a GPU would launch. The picks come from that check's table: every kernel compiled for sm_80 and
sm_90 on a CPU, its registers, spills and shared memory read off the cubin. No GPU has timed them
yet; the first GPU run may replace a pick by an autotuned one (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

__all__ = ["ARCHES", "SHARED_LIMIT", "LaunchConfig", "arch_of", "launch_config"]


@dataclass(frozen=True)
class LaunchConfig:
    """``tile``: the square tile edge (tokens; the plan's tile facts are built at it);
    ``num_warps``, ``num_stages``: Triton's launch options, one set for all three kernels."""

    tile: int
    num_warps: int
    num_stages: int


# The architectures the compile check covers (compute capability x 10) and their largest shared
# memory per block (bytes; CUDA's programming guide: 163 KB on sm_80, 227 KB on sm_90).
ARCHES = (80, 90)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}

# (arch, largest head dim of q/k and v) -> config; the first row whose head dim bound holds. Chosen
# from scripts/compile_kernels.py's table (docs/gpu.md, "Compiled for sm_80 and sm_90"): per row the
# config with the fewest spilled bytes, on sm_90 one that uses wgmma (64-row tiles, 8 warps) where
# its spills stay within the check's bound. num_stages changed nothing in any compile (1, 2, 3).
_TABLE = {
    80: (
        (64, LaunchConfig(32, 4, 2)),  # 64 / 8 spills 152 B in dK/dV under a window
        (128, LaunchConfig(64, 8, 2)),  # no spills
        (256, LaunchConfig(32, 4, 2)),  # MLA: no spills; 256: dK/dV 136 B (64 / 8: more)
    ),
    90: (
        (128, LaunchConfig(64, 8, 2)),  # wgmma; dK/dV spills up to 88 B at 128
        (256, LaunchConfig(32, 4, 2)),  # mma.sync, dK/dV <= 48 B: 64 / 8 spills 288 B (MLA), 664 B
    ),
}
# Triton's interpreter (CPU tensors): one fixed pick; the tests ask for smaller tiles by block_size.
INTERPRETER = LaunchConfig(64, 8, 2)


@cache
def arch_of(device: torch.device) -> int | None:
    """Compute capability x 10 of a CUDA ``device``; None for any other device (the interpreter).
    Cached: every attention call asks."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def launch_config(arch: int | None, head_dim: int, value_dim: int) -> LaunchConfig:
    """The launch configuration for compute capability ``arch`` (x 10; None: the interpreter) and
    query-key / value head dims. An architecture between two of :data:`ARCHES` takes the older's
    row (sm_86 / sm_89 run sm_80's); head dims above 256 are refused."""
    widest = max(head_dim, value_dim)
    if widest > 256:
        raise ValueError(
            f"backend='triton' takes head dims up to 256, got query-key {head_dim} / value "
            f"{value_dim}; use backend='flex' for wider heads"
        )
    if arch is None:
        return INTERPRETER
    known = [a for a in ARCHES if a <= arch]
    if not known:
        raise ValueError(
            f"backend='triton' needs compute capability 8.0 or newer (bf16 tensor cores), got "
            f"{arch / 10:.1f}; use backend='flex' or 'sdpa'"
        )
    for bound, config in _TABLE[known[-1]]:
        if widest <= bound:
            return config
    raise AssertionError("unreachable: the last row of every architecture bounds 256")
