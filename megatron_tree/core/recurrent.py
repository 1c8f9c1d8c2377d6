"""Recurrent layers (gated delta-net, short causal convolutions) on a packed tree, exactly.

A recurrent layer's state at a token depends only on the token's root path, so a trie is a set of
*segments*: maximal chains whose inner nodes have exactly one child (the compressed trie). In
pre-order a segment is a contiguous range of positions; it starts from its parent segment's final
state (its first token's parent is the parent segment's last token, a branch point), and a root
segment starts from zero, exactly as every sequence alone starts from zero. A padding position is a
root without children: a one-token segment.

Segments of one *level* (the number of segments above them) are independent once the levels above
are done, so the recurrence runs level by level, all segments of a level in one batched chunked
pass. :class:`RecurrentPlan` is that schedule, built once per micro-batch from the tree mask's
``subtree_end`` (the parent of a position is the last earlier position one level shallower, a
pre-order fact), with one host read; every layer and the recomputation reuse it. Within a level the
torch path pads segments to a common length; it groups them into length buckets (band j of a
level: lengths in (longest / 2^(j+1), longest / 2^j], so a bucket's longest segment is under twice
its shortest) and padding at most doubles a level's work: one
batched pass per (level, bucket), O(levels * log2(longest segment)) passes, never one per segment.

The short causal convolution reads, for each token, its ``width - 1`` nearest ancestors (parent,
grandparent, ...), zeros above the root: :meth:`RecurrentPlan.conv_window`.

Legend: K positions of the context (the tree's positions, or a trunk part's / CP rank's keys), S
segments, B segments of a bucket, T a bucket's padded length, H heads (batch folded in), dk / dv
key / value head dims, C chunk length, w convolution width.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .tree import tree_depth

__all__ = [
    "RecurrentPlan",
    "chunk_gated_delta_rule",
    "chunk_ssd",
    "gated_delta_rule_reference",
    "l2norm",
    "scan_tree",
    "ssd_reference",
    "tree_causal_conv",
    "tree_gated_delta_rule",
    "tree_ssd",
]

CHUNK = 64


def parents_from_subtree_end(subtree_end: torch.Tensor) -> torch.Tensor:
    """int64 [K]: each position's parent (-1 for roots and padding), from a pre-order
    ``subtree_end`` [K] alone: the parent of q is the last position before q one level shallower.
    Device ops only (one sort, one search)."""
    ends = subtree_end.to(torch.int64)
    n = ends.shape[0]
    depth = tree_depth(ends)
    pos = torch.arange(n, device=ends.device)
    order = torch.sort(depth * (n + 1) + pos).values  # positions grouped by depth, ascending
    found = torch.searchsorted(order, (depth - 1) * (n + 1) + pos) - 1
    parent = order.clamp(min=0)[found.clamp(min=0)] % (n + 1)
    return torch.where(depth > 0, parent, torch.full_like(parent, -1))


@dataclass(frozen=True)
class _Bucket:
    """Segments of one level padded to one length: ``index`` [B, T] context positions (K: a zero
    entry appended to the context); ``init`` [B], the slot of each segment's initial state in the
    state table (0 = zeros; None: all start from zero); ``keep``, the segments (indices into B)
    whose final states later segments start from (they take the table's next slots, in processing
    order; None: no segment has children, no state is kept)."""

    index: torch.Tensor
    init: torch.Tensor | None
    keep: torch.Tensor | None


def _segments(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host parents [K] -> the compressed trie's segments: (first position [S], length [S], parent
    segment [S], -1 for roots). A position starts a segment unless it continues its parent's
    only-child chain (in pre-order a first child comes right after its parent)."""
    k = parent.shape[0]
    pos = torch.arange(k)
    children = torch.bincount(parent[parent >= 0], minlength=k)
    starts_mask = (parent != pos - 1) | (children[parent.clamp(min=0)] != 1) | (parent < 0)
    starts = pos[starts_mask]
    lengths = torch.diff(starts, append=torch.tensor([k]))
    seg_of = torch.cumsum(starts_mask.long(), 0) - 1
    first_parent = parent[starts]
    return starts, lengths, torch.where(first_parent >= 0, seg_of[first_parent.clamp(min=0)], -1)


class RecurrentPlan:
    """The segment schedule of one micro-batch's context, built once (one host read) and shared by
    every recurrent layer and the recomputation.

    Args:
        subtree_end: int [K], the context's pre-order encoding (the tree's ``subtree_end``, or
            ``TreeRows.encoding()[0]`` for a trunk part's or a CP rank's keys).
    """

    def __init__(self, subtree_end: torch.Tensor):
        device = subtree_end.device
        self.parent = parents_from_subtree_end(subtree_end)
        self.num_positions = k = int(self.parent.shape[0])
        starts, lengths, parent_seg = _segments(self.parent.cpu())
        self.num_segments = s = int(starts.shape[0])
        level = torch.zeros(s, dtype=torch.int64)
        for _ in range(s):  # one round per level: a segment's level is its parent's + 1
            deeper = torch.where(parent_seg >= 0, level[parent_seg.clamp(min=0)] + 1, 0)
            if torch.equal(deeper, level):
                break
            level = deeper
        self.num_levels = int(level.max()) + 1 if s else 0
        # Processing order: by level, then by length band (a bucket: band j of a level holds the
        # lengths in (longest / 2^(j+1), longest / 2^j]), then by length. Segments with children
        # take state slots 1, 2, ... in that order.
        longest = torch.zeros(self.num_levels, dtype=torch.int64).scatter_reduce(
            0, level, lengths, "amax"
        )
        band = torch.floor(torch.log2(longest[level].double() / lengths.double())).long()
        order = torch.from_numpy(np.lexsort((-lengths.numpy(), band.numpy(), level.numpy())))
        has_children = torch.zeros(s, dtype=torch.bool)
        has_children[parent_seg[parent_seg >= 0]] = True
        slot = torch.zeros(s, dtype=torch.int64)
        slot[order] = torch.cumsum(has_children[order].long(), 0) * has_children[order]
        init = torch.where(parent_seg >= 0, slot[parent_seg.clamp(min=0)], 0)
        self.buckets: list[list[_Bucket]] = [[] for _ in range(self.num_levels)]
        host_index = []  # every bucket's [B, T] context positions, in processing order
        key = level[order] * 64 + band[order]
        for ids in torch.split(
            order, torch.unique_consecutive(key, return_counts=True)[1].tolist()
        ):
            cols = torch.arange(int(lengths[ids[0]]))
            index = torch.where(cols < lengths[ids, None], starts[ids, None] + cols, k)
            keep = has_children[ids].nonzero()[:, 0]
            host_index.append(index)
            self.buckets[int(level[ids[0]])].append(
                _Bucket(
                    index.to(device),
                    init[ids].to(device) if bool(init[ids].any()) else None,
                    keep.to(device) if len(keep) else None,
                )
            )
        # Row of the concatenated, flattened bucket outputs holding each context position.
        flat = (
            torch.cat([i.reshape(-1) for i in host_index])
            if host_index
            else torch.zeros(0, dtype=torch.int64)
        )
        inverse = torch.empty(k, dtype=torch.int64)
        valid = flat < k
        inverse[flat[valid]] = torch.arange(flat.shape[0])[valid]
        self.inverse = inverse.to(device)
        self._windows: dict[int, torch.Tensor] = {}

    @property
    def num_passes(self) -> int:
        """Batched chunked passes per layer of the torch path (one per (level, bucket))."""
        return sum(len(lv) for lv in self.buckets)

    def conv_window(self, width: int) -> torch.Tensor:
        """int64 [K, width]: column j is the ancestor ``width - 1 - j`` levels up (the last column
        the position itself), K (a zero row) above the root: a causal convolution's taps."""
        if width not in self._windows:
            self._windows[width] = self._build_window(width)
        return self._windows[width]

    def _build_window(self, width: int) -> torch.Tensor:
        cols = [torch.arange(self.num_positions, device=self.parent.device)]
        for _ in range(width - 1):
            prev = cols[-1]
            up = self.parent[prev.clamp(max=self.num_positions - 1)]
            cols.append(
                torch.where((prev < self.num_positions) & (up >= 0), up, self.num_positions)
            )
        return torch.stack(cols[::-1], dim=1)


def tree_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: RecurrentPlan
) -> torch.Tensor:
    """Depthwise causal convolution along every root path: x [K, ..., D], weight [D, w] (a
    ``Conv1d(groups=D)`` weight squeezed, tap w-1 on the token itself), bias [D] -> [K, ..., D]."""
    width = weight.shape[-1]
    taps = plan.conv_window(width)
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    windows = padded[taps]  # [K, w, ..., D]
    w = weight.t().reshape(width, *([1] * (x.dim() - 2)), weight.shape[0])
    out = (windows * w.to(x.dtype)).sum(1)
    return out if bias is None else out + bias.to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the q/k normalization of gated delta-nets)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q, k, v, g, beta, initial_state=None, chunk: int = CHUNK, final_state: bool = True
):
    """The gated delta rule on a batch of sequences, chunk by chunk (at least fp32 inside).

    Per head, with state S [dk, dv] starting at ``initial_state``:
    ``S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t``. In a chunk the
    corrections u solve one unit-lower-triangular system (the WY form), so each chunk is a few
    matmuls and only the chunk-to-chunk state is sequential. Right padding with k = v = beta = g
    = 0 leaves the state unchanged, so a padded sequence's final state is exact.

    Args:
        q, k: [B, T, H, dk] (q already scaled); v: [B, T, H, dv]; g (log decay, <= 0), beta: [B, T,
        H].
        initial_state: [B, H, dk, dv], or None (zeros, never materialized).
        final_state: compute the final state (False: skip the last chunk's state update).
    Returns:
        (o [B, T, H, dv] in v's dtype, final state [B, H, dk, dv] fp32 or wider, or None).
    """
    dtype = v.dtype
    bsz, t, h, dk = k.shape
    dv = v.shape[-1]
    c = max(1, min(chunk, t))
    pad = (-t) % c
    work = torch.promote_types(dtype, torch.float32)
    q, k, v, g, beta = (x.to(work).transpose(1, 2) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.reshape(bsz, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(bsz, h, n, c), beta.reshape(bsz, h, n, c)
    gam = g.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    # Strictly lower part read only (unit diagonal): (I + A) with A_ij = beta_i exp(gam_i - gam_j)
    # k_i.k_j.
    strict = k @ k.transpose(-1, -2) * decay * beta[..., :, None]
    solve = functools.partial(
        torch.linalg.solve_triangular, strict, upper=False, unitriangular=True
    )
    w = solve(k * (beta * gam.exp())[..., None])  # [B, H, n, C, dk]
    u = solve(v * beta[..., None])  # [B, H, n, C, dv]
    inner = q @ k.transpose(-1, -2) * decay
    state = None if initial_state is None else initial_state.to(work)
    out = []
    for i in range(n):
        gi = gam[:, :, i]
        if state is None:
            corr = u[:, :, i]
            out.append(inner[:, :, i] @ corr)
        else:
            corr = u[:, :, i] - w[:, :, i] @ state
            out.append((q[:, :, i] * gi.exp()[..., None]) @ state + inner[:, :, i] @ corr)
        if i == n - 1 and not final_state:
            break
        tail = (gi[..., -1:] - gi).exp()[..., None]
        update = (k[:, :, i] * tail).transpose(-1, -2) @ corr
        state = update if state is None else gi[..., -1, None, None].exp() * state + update
    o = torch.stack(out, 2).reshape(bsz, h, n * c, dv)[:, :, :t].transpose(1, 2)
    return o.to(dtype), state if final_state else None


def scan_tree(plan: RecurrentPlan, inputs, state_shape, dtype, scan) -> torch.Tensor:
    """Run a chunked recurrence over a packed tree, level by level, one batched call per bucket.

    Args:
        plan: the context's segment schedule.
        inputs: per-position tensors [K, ...] (first dims alike), gathered per bucket to [B, T,
            ...] (a zero row stands for padding: inputs must make a zero row leave the state
            unchanged).
        state_shape: one segment's state shape (e.g. [H, dk, dv]); states are kept in ``dtype``.
        scan: ``scan(*bucket_inputs, initial_state [B, *state_shape] or None, final_state: bool)
            -> (out [B, T, *out_shape], final [B, *state_shape] or None)``.
    Returns:
        out [K, *out_shape]: each position's output as its root path alone gives it.
    """
    zero = lambda x: torch.cat([x, x.new_zeros((1, *x.shape[1:]))])  # noqa: E731
    inputs = [zero(x) for x in inputs]
    states = [torch.zeros(1, *state_shape, device=inputs[0].device, dtype=dtype)]
    outs = []
    for level in plan.buckets:
        table = torch.cat(states) if len(states) > 1 else states[0]
        for bucket in level:
            idx = bucket.index
            init = None if bucket.init is None else table.index_select(0, bucket.init)
            out, final = scan(
                *(x[idx] for x in inputs), initial_state=init, final_state=bucket.keep is not None
            )
            outs.append(out.reshape(-1, *out.shape[2:]))
            if final is not None:
                states.append(final.index_select(0, bucket.keep))
    if not outs:
        raise ValueError("scan_tree: the plan has no positions")
    return torch.cat(outs).index_select(0, plan.inverse)


def tree_gated_delta_rule(
    q, k, v, g, beta, plan: RecurrentPlan, chunk: int = CHUNK
) -> torch.Tensor:
    """The gated delta rule over a packed tree: every position's output as its root path alone
    gives.

    Args:
        q, k: [K, H, dk] (q already scaled); v: [K, H, dv]; g, beta: [K, H]; K context positions in
            pre-order, their structure in ``plan``.
    Returns:
        o [K, H, dv].
    """
    if plan.num_positions == 0:
        return v[:0]
    h, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    scan = functools.partial(chunk_gated_delta_rule, chunk=chunk)
    work = torch.promote_types(v.dtype, torch.float32)
    return scan_tree(plan, (q, k, v, g, beta), (h, dk, dv), work, scan)


def chunk_ssd(x, dt, A, B, C, initial_state=None, chunk: int = CHUNK, final_state: bool = True):
    """Mamba-2's state-space dual (SSD) scan on a batch of sequences, chunk by chunk (at least fp32
    inside).

    Per head, with state S [P, N] starting at ``initial_state``:
    ``S <- exp(dt_t A) S + dt_t x_t B_t^T;  y_t = S C_t``. In a chunk the outputs are one masked
    (C B^T) product with the decays (the quadratic "attention" form) plus the entering state read
    through C; only the chunk-to-chunk state is sequential. Right padding with dt = 0 (and x = B = C
    = 0) leaves the state unchanged, so a padded sequence's final state is exact.

    Args:
        x: [b, T, H, P]; dt: [b, T, H] (after softplus and clamping, >= 0); A: [H] (negative);
        B, C: [b, T, H, N] (one row per head: groups already expanded).
        initial_state: [b, H, P, N], or None (zeros, never materialized).
        final_state: compute the final state (False: skip the last chunk's state update).
    Returns:
        (y [b, T, H, P] in x's dtype, without the D skip; final state [b, H, P, N] fp32 or wider,
        or None).
    """
    dtype = x.dtype
    bsz, t, h, p = x.shape
    c = max(1, min(chunk, t))
    pad = (-t) % c
    work = torch.promote_types(dtype, torch.float32)
    x, B, C = (v.to(work).transpose(1, 2) for v in (x, B, C))  # [b, H, T, ...]
    a = (dt.to(work) * A.to(work)).transpose(1, 2)  # [b, H, T] log decays
    dt = dt.to(work).transpose(1, 2)
    if pad:
        x, B, C = (torch.nn.functional.pad(v, (0, 0, 0, pad)) for v in (x, B, C))
        a, dt = (torch.nn.functional.pad(v, (0, pad)) for v in (a, dt))
    n = (t + pad) // c
    x, B, C = (v.reshape(bsz, h, n, c, v.shape[-1]) for v in (x, B, C))
    a, dt = a.reshape(bsz, h, n, c), dt.reshape(bsz, h, n, c)
    gam = a.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    xdt = x * dt[..., None]  # [b, H, n, C, P]
    inner = C @ B.transpose(-1, -2) * decay  # [b, H, n, C, C]
    state = None if initial_state is None else initial_state.to(work)
    out = []
    for i in range(n):
        y = inner[:, :, i] @ xdt[:, :, i]
        if state is not None:  # the entering state, decayed to each position, read through C
            y = y + (C[:, :, i] @ state.transpose(-1, -2)) * gam[:, :, i, :, None].exp()
        out.append(y)
        if i == n - 1 and not final_state:
            break
        gi = gam[:, :, i]
        tail = (gi[..., -1:] - gi).exp()[..., None]  # decay from each position to the chunk's end
        update = (xdt[:, :, i] * tail).transpose(-1, -2) @ B[:, :, i]  # [b, H, P, N]
        state = update if state is None else gi[..., -1, None, None].exp() * state + update
    y = torch.stack(out, 2).reshape(bsz, h, n * c, p)[:, :, :t].transpose(1, 2)
    return y.to(dtype), state if final_state else None


def _heads(groups: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H // G)."""
    g = groups.shape[-2]
    if heads % g:
        raise ValueError(f"{heads} heads cannot share {g} groups evenly")
    return groups.repeat_interleave(heads // g, dim=-2) if heads != g else groups


def tree_ssd(x, dt, A, B, C, plan: RecurrentPlan, chunk: int = CHUNK) -> torch.Tensor:
    """Mamba-2's SSD scan over a packed tree: every position's output as its root path alone
    gives (a segment starts from its parent segment's final state, a root from zero).

    Args:
        x: [K, H, P]; dt: [K, H] (after softplus and clamping, >= 0); A: [H] (negative,
        -exp(A_log)); B, C: [K, G, N] with H % G == 0 (head h reads group h // (H // G)); K context
        positions in pre-order, their structure in ``plan``.
    Returns:
        y [K, H, P] in x's dtype, without the D skip.
    """
    if plan.num_positions == 0:
        return x[:0]
    h, p = x.shape[1], x.shape[2]
    B, C = _heads(B, h), _heads(C, h)
    scan = functools.partial(chunk_ssd, A=A, chunk=chunk)

    def run(x, dt, B, C, *, initial_state, final_state):
        return scan(x, dt, B=B, C=C, initial_state=initial_state, final_state=final_state)

    work = torch.promote_types(x.dtype, torch.float32)
    return scan_tree(plan, (x, dt, B, C), (h, p, B.shape[-1]), work, run)


def ssd_reference(x, dt, A, B, C, initial_state=None):
    """Token-by-token SSD on one sequence, for tests: x [T, H, P], dt [T, H], A [H], B, C [T, H, N]
    -> (y [T, H, P], final state [H, P, N]), in the inputs' dtype."""
    t, h, p = x.shape
    state = x.new_zeros(h, p, B.shape[-1]) if initial_state is None else initial_state
    out = []
    for i in range(t):
        decay = (dt[i] * A).exp()[:, None, None]
        state = decay * state + (dt[i][:, None] * x[i])[:, :, None] * B[i][:, None, :]
        out.append(torch.einsum("hpn,hn->hp", state, C[i]))
    return torch.stack(out), state


def gated_delta_rule_reference(q, k, v, g, beta, initial_state=None):
    """Token-by-token gated delta rule on one sequence, for tests: q, k [T, H, dk], v [T, H, dv],
    g, beta [T, H] -> (o [T, H, dv], final state [H, dk, dv]), in the inputs' dtype."""
    t, h, dk = k.shape
    state = q.new_zeros(h, dk, v.shape[-1]) if initial_state is None else initial_state
    out = []
    for i in range(t):
        state = state * g[i].exp()[:, None, None]
        corr = (v[i] - torch.einsum("hk,hkv->hv", k[i], state)) * beta[i][:, None]
        state = state + k[i][:, :, None] * corr[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[i], state))
    return torch.stack(out), state
