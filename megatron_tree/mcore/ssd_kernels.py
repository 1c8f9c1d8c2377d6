"""Mamba-2 SSD on a packed tree with the kernel users have: mamba_ssm's Triton chunked scan.

``mamba_chunk_scan_combined`` takes one differentiable initial state per batch row and returns
the final states. A tree therefore runs through the torch path's level loop
(:func:`~megatron_tree.core.recurrent.scan_tree`): level by level of the
:class:`~megatron_tree.core.recurrent.RecurrentPlan`, one batch row per segment, one kernel call per
(level, length bucket), each segment starting from its parent segment's final state. A bucket's
shorter segments are padded at the right with dt = 0 and x = B = C = 0, which leaves the state
unchanged, so their final states are exact; that is why the already-processed dt is passed
(``dt_bias=None, dt_softplus=False``): a softplus of the padding's dt would not be 0.

mamba_ssm is imported on the first call only (CPU machines lack it).

Legend: K context positions, H heads, P head dim, G groups of B/C, N state dim, Bs segments of a
bucket, T a bucket's padded length.
"""

from __future__ import annotations

import torch

from ..core.recurrent import CHUNK, RecurrentPlan, scan_tree

__all__ = ["kernel_calls", "tree_ssd_mamba_ssm"]

MIN_KERNEL_CHUNK = 16  # the kernels' tl.dot tiles are at least 16 wide: no gain below it


def _chunk_scan():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as exc:  # absent, or a package without its compiled selective_scan_cuda
        raise ImportError(
            "tree_ssd_mamba_ssm needs mamba_ssm's Triton SSD kernels "
            f"(mamba_ssm.ops.triton.ssd_combined): `pip install mamba-ssm` ({exc}); "
            "without a GPU use megatron_tree.core.recurrent.tree_ssd"
        ) from exc
    return mamba_chunk_scan_combined


def kernel_calls(plan: RecurrentPlan) -> int:
    """``mamba_chunk_scan_combined`` calls per layer forward (one per (level, bucket))."""
    return plan.num_passes


def tree_ssd_mamba_ssm(x, dt, A, B, C, plan: RecurrentPlan, chunk: int = CHUNK) -> torch.Tensor:
    """Mamba-2 SSD over a packed tree, each position's output as its root path alone gives.

    Per head, state S [P, N] starts at 0 at a root: ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``,
    ``y_t = S_t C_t``; a segment starts from its parent segment's final state. The D skip, the z
    gate and dt's bias/softplus are the caller's.

    Args:
        x: [K, H, P]; K context positions in pre-order, their structure in ``plan``.
        dt: [K, H], already ``softplus(dt + dt_bias)`` and clamped (>= 0).
        A: [H], negative (``-exp(A_log)``).
        B, C: [K, G, N], H % G == 0 (head h reads group h // (H // G)).
        plan: the context's :class:`~megatron_tree.core.recurrent.RecurrentPlan`.
        chunk: the kernel's chunk length; a bucket shorter than it runs with the next power of
            two >= its length (at least 16), which changes rounding only.
    Returns:
        y [K, H, P] in x's dtype (no D skip). Differentiable in x, dt, A, B and C.
    """
    if x.dim() != 3 or dt.shape != x.shape[:2] or A.shape != x.shape[1:2]:
        raise ValueError(
            f"x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}: want [K, H, P], "
            "[K, H], [H]"
        )
    if B.shape != C.shape or B.dim() != 3 or B.shape[0] != x.shape[0] or x.shape[1] % B.shape[1]:
        raise ValueError(
            f"B {tuple(B.shape)}, C {tuple(C.shape)}: want [K, G, N] with H={x.shape[1]} a "
            "multiple of G"
        )
    kernel = _chunk_scan()

    def run(x, dt, B, C, *, initial_state, final_state):  # one bucket: [Bs, T, ...]
        c = min(chunk, max(MIN_KERNEL_CHUNK, 1 << (x.shape[1] - 1).bit_length()))
        res = kernel(
            x,
            dt,
            A,
            B,
            C,
            c,
            initial_states=initial_state,
            dt_softplus=False,
            return_final_states=final_state,
        )
        return res if final_state else (res, None)

    if plan.num_positions == 0:
        return x[:0]
    h, p, n = x.shape[1], x.shape[2], B.shape[2]
    return scan_tree(plan, (x, dt, B, C), (h, p, n), torch.float32, run)  # fp32: the kernel's
