"""The gated delta rule on a packed tree with the kernel users have: fla's Triton chunked rule.

fla's ``chunk_gated_delta_rule`` takes variable-length sequences packed in one row
(``cu_seqlens``), one differentiable initial state per sequence, and returns the final states. A
tree therefore runs level by level of the :class:`~megatron_tree.core.recurrent.RecurrentPlan`:
every segment of a level is one sequence of one kernel call (no padding: the level's buckets are
concatenated, each segment cut to its length), starting from its parent segment's final state (a
root segment from zero), so the whole recurrence is ``plan.num_levels`` kernel calls per layer. The
final states of the segments with children are kept, in the plan's processing order (the torch
path's :func:`~megatron_tree.core.recurrent.scan_tree` keeps the same order, so the plan's state
slots mean the same here).

fla is imported on the first call only (CPU machines lack it); ``kernel=`` takes any function with
fla's signature (the CPU tests pass the pure-torch rule there, so everything but the kernel call is
tested without a GPU).

Legend: K context positions, H heads, dk / dv key / value head dims, S a level's segments, L the
sum of their lengths.
"""

from __future__ import annotations

import torch

from ..core.recurrent import RecurrentPlan

__all__ = ["kernel_calls", "level_layout", "tree_gated_delta_rule_fla"]


def _fla_kernel():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise ImportError(
            "tree_gated_delta_rule_fla needs fla's Triton kernels (fla.ops.gated_delta_rule): "
            f"`pip install fla-core` ({exc}); without a GPU use "
            "megatron_tree.core.recurrent.tree_gated_delta_rule"
        ) from exc
    return chunk_gated_delta_rule


def kernel_calls(plan: RecurrentPlan) -> int:
    """``chunk_gated_delta_rule`` calls per layer forward (one per level of the plan)."""
    return plan.num_levels


def level_layout(plan: RecurrentPlan, level: int):
    """One level of ``plan`` as one varlen kernel call.

    Returns:
        positions: int64 [L], the level's context positions, segment after segment (each segment's
            positions in order), in the plan's processing order;
        cu_seqlens: int64 [S + 1], segment boundaries in ``positions`` (0 first, L last);
        init: int64 [S], each segment's state slot (0 = zeros, i = the i-th kept final state);
        keep: int64 [S'] indices into the S segments whose final states later levels read (None:
            none).
    """
    if not 0 <= level < plan.num_levels:
        raise ValueError(f"level={level}: the plan has levels 0..{plan.num_levels - 1}")
    k = plan.num_positions
    positions, lengths, init, keep = [], [], [], []
    offset = 0
    for bucket in plan.buckets[level]:
        valid = bucket.index < k
        positions.append(bucket.index[valid])  # row-major: segment after segment
        lengths.append(valid.sum(1))
        rows = bucket.index.shape[0]
        init.append(
            bucket.init
            if bucket.init is not None
            else torch.zeros(rows, dtype=torch.int64, device=bucket.index.device)
        )
        if bucket.keep is not None:
            keep.append(bucket.keep + offset)
        offset += rows
    lengths = torch.cat(lengths)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    return torch.cat(positions), cu_seqlens, torch.cat(init), torch.cat(keep) if keep else None


def tree_gated_delta_rule_fla(q, k, v, g, beta, plan: RecurrentPlan, kernel=None) -> torch.Tensor:
    """The gated delta rule over a packed tree, each position's output as its root path alone
    gives, one fla ``chunk_gated_delta_rule`` call per level of ``plan``.

    Per head, state S [dk, dv] starts at 0 at a root: ``S <- exp(g_t) S; S <- S + k_t (beta_t (v_t
    - S^T k_t))^T; o_t = S^T q_t``; a segment starts from its parent segment's final state.

    Args:
        q, k: [K, H, dk] (q already scaled, both already L2-normed if the layer does that); v: [K,
            H, dv]; g (log decay, <= 0), beta: [K, H]. K context positions in pre-order, their
            structure in ``plan``.
        plan: the context's :class:`~megatron_tree.core.recurrent.RecurrentPlan`.
        kernel: a function with fla's ``chunk_gated_delta_rule`` signature (None: fla's).
    Returns:
        o [K, H, dv] in v's dtype. Differentiable in q, k, v, g and beta (the initial states carry
        the gradient of each segment back to its parent segment).
    """
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want q, k [K, H, dk] "
            "and v [K, H, dv] with the same K and H"
        )
    if g.shape != q.shape[:2] or beta.shape != q.shape[:2]:
        raise ValueError(
            f"g {tuple(g.shape)}, beta {tuple(beta.shape)}: want [K, H] = {tuple(q.shape[:2])}"
        )
    if q.shape[0] != plan.num_positions:
        raise ValueError(
            f"q has {q.shape[0]} positions but the plan has {plan.num_positions}: build the plan "
            "from this context's subtree_end"
        )
    if plan.num_positions == 0:
        return v[:0]
    kernel = _fla_kernel() if kernel is None else kernel
    h, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    states = [torch.zeros(1, h, dk, dv, device=q.device, dtype=torch.float32)]
    outs, where = [], []
    for level in range(plan.num_levels):
        positions, cu_seqlens, init, keep = level_layout(plan, level)
        table = torch.cat(states) if len(states) > 1 else states[0]
        initial_state = table.index_select(0, init) if bool(init.any()) else None
        o, final = kernel(
            q[positions].unsqueeze(0),
            k[positions].unsqueeze(0),
            v[positions].unsqueeze(0),
            g[positions].unsqueeze(0).float(),
            beta[positions].unsqueeze(0),
            scale=1.0,
            initial_state=initial_state,
            output_final_state=keep is not None,
            cu_seqlens=cu_seqlens,
        )
        outs.append(o[0])
        where.append(positions)
        if keep is not None:
            states.append(final.float().index_select(0, keep))
    inverse = torch.empty_like(plan.inverse)
    flat = torch.cat(where)
    inverse[flat] = torch.arange(flat.shape[0], device=flat.device)
    return torch.cat(outs).index_select(0, inverse).to(v.dtype)
