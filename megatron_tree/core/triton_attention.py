"""Tree attention by our own Triton kernels (:mod:`~.triton_kernels`): their launch, autograd
and checks, and the per-tile facts they read.

``tree_attention(..., backend="triton")`` runs here (imported on first use, so the package imports
without Triton). The kernels take Megatron's [n, b, heads, dim] tensors as they are, grouped-query
heads, a value head dim other than the query's (multi-latent attention), a depth window, a sink
logit per head (Megatron's "off-by-one" / "learnable" softmax), and fp16 / bf16 / fp32 inputs.
Queries may be a subset of the keys (a context-parallel rank's rows, a trunk-reuse part): they
then carry their places among the keys, the ``TreeRows`` facts every backend reads
(:meth:`~megatron_tree.core.mask.TreeMaskPlan.query_positions`).

Once per micro-batch (and tile size and window) the plan gets the per-key-tile facts, O(N) work and
O(N / B) memory, nothing N x N (:func:`tile_facts`): the largest and smallest ``subtree_end`` of
each key tile, under a window its largest and smallest depth, and the range of query rows that can
see it (for the dK / dV kernel, which walks query tiles). The kernels classify every (query tile,
key tile) pair from them (skipped, full, partial; :mod:`~.triton_kernels`); :func:`tile_kinds` is
the same rule on the host, for counting and tests.

No autotuning (the autotuner's benchmarker does not run in Triton's interpreter): square tiles
of ``min(block_size, tile)`` tokens, the tile, warps and stages per architecture and head dim from
:func:`~.triton_tiles.launch_config`, chosen from the kernels' ahead-of-time compile for sm_80 and
sm_90, not from timings: no GPU has run these kernels yet (docs/gpu.md). In Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module, and so the kernels, is first imported) everything
runs on CPU tensors.

Legend: nq query rows, nk keys, b micro-batch rows, r mask rows (1 or b), np / ng query heads /
key-value groups, hn / hv query-key / value head dims, B tile, nkt = ceil(nk / B) key tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from .tree import tree_depth
from .triton_kernels import (
    BIG,
    FACTS,
    MAX_DEPTH,
    MAX_END,
    MIN_DEPTH,
    MIN_END,
    dkdv_kernel,
    dq_kernel,
    forward_kernel,
    interpreted,
)
from .triton_tiles import LaunchConfig, arch_of, launch_config

__all__ = ["FACTS", "TILE", "interpreted", "tile_facts", "tile_kinds", "triton_tree_attention"]

TILE = 64  # the default tile edge (tokens); a smaller power-of-two block_size gives smaller tiles
LOG2E = 1.4426950408889634


def tile_facts(
    subtree_end: torch.Tensor,
    query_positions: torch.Tensor | None,
    block_size: int,
    window: int | None = None,
) -> dict[str, torch.Tensor | None]:
    """What the kernels read besides the tensors, built once per micro-batch, tile size and window
    (O(N) work, O(N / B) per-tile memory), on ``subtree_end``'s device.

    Args:
        subtree_end: int [r, nk], the keys' encoding (key coordinates).
        query_positions: int64 [nq] ascending, the query rows' places among the keys; None when
            the queries are all the keys.
        block_size: the kernels' tile edge B.
        window: a depth window (see :func:`~megatron_tree.core.mask.allowed`), or None.

    Returns:
        ``ends`` int32 [r, nk]; ``key_depth`` int32 [r, nk] (a dummy [1] without a window);
        ``query_positions`` int32 [nq] or None; ``query_depth`` int32 [r, nq] (dummy without a
        window); ``facts`` int32 [r, FACTS, nkt]: per key tile its largest and smallest
        ``subtree_end``, its deepest and shallowest key (window only), the first query row at or
        after its start, and one past the last query row before its largest ``subtree_end`` (the
        rows whose tiles the dK / dV kernel walks).
    """
    ends = subtree_end.to(torch.int64)
    r, nk = ends.shape
    device = ends.device
    num_tiles = -(-nk // block_size)
    pad = num_tiles * block_size - nk
    tiles = lambda t, fill: F.pad(t, (0, pad), value=fill).view(r, num_tiles, block_size)  # noqa: E731
    max_end = tiles(ends, 0).amax(-1)
    min_end = tiles(ends, BIG.value).amin(-1)
    queries = torch.arange(nk, device=device) if query_positions is None else query_positions
    queries = queries.to(device=device, dtype=torch.int64)
    starts = torch.arange(num_tiles, device=device) * block_size
    first_row = torch.searchsorted(queries, starts).expand(r, -1)
    end_row = torch.searchsorted(queries, max_end.contiguous())
    zeros = torch.zeros_like(max_end)
    key_depth = query_depth = torch.zeros(1, dtype=torch.int32, device=device)
    max_depth = min_depth = zeros
    if window is not None:
        depth = torch.stack([tree_depth(row) for row in ends])  # [r, nk]
        max_depth = tiles(depth, -1).amax(-1)
        min_depth = tiles(depth, BIG.value).amin(-1)
        key_depth = depth.to(torch.int32).contiguous()
        query_depth = key_depth if query_positions is None else depth[:, queries]
        query_depth = query_depth.to(torch.int32).contiguous()
    facts = torch.stack([max_end, min_end, max_depth, min_depth, first_row, end_row], dim=1)
    return {
        "ends": ends.to(torch.int32).contiguous(),
        "key_depth": key_depth,
        "query_positions": None
        if query_positions is None
        else queries.to(torch.int32).contiguous(),
        "query_depth": query_depth,
        "facts": facts.to(torch.int32).contiguous(),
    }


def tile_kinds(
    subtree_end: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    *,
    block_size: int = TILE,
    window: int | None = None,
) -> torch.Tensor:
    """The kernels' classification of every (query tile, key tile) pair, computed on the host by
    the same rule as :func:`_tile_kind` (for counting and tests; the kernels never build it).

    Args:
        subtree_end: int [nk].
        query_positions: int64 [nq] ascending, or None (all keys are queries).
        block_size: the tile edge (query and key tiles alike).
        window: a depth window, or None.

    Returns:
        int8 [ceil(nq / B), ceil(nk / B)]: 0 skipped (above the diagonal included), 1 full,
        2 partial.
    """
    facts = tile_facts(subtree_end[None], query_positions, block_size, window)
    nk = subtree_end.shape[-1]
    tile = facts["facts"][0].to(torch.int64)  # [FACTS, nkt]
    queries = torch.arange(nk) if query_positions is None else query_positions.cpu()
    queries = queries.to(torch.int64).to(tile.device)
    nq = queries.shape[0]
    rows = -(-nq // block_size) * block_size
    # Padded rows repeat the last query: they change no minimum or maximum.
    qpos = F.pad(queries, (0, rows - nq), value=int(queries[-1])).view(-1, block_size)
    qmin, qmax = qpos[:, :1], qpos[:, -1:]
    kstart = torch.arange(tile.shape[1], device=tile.device)[None, :] * block_size
    max_end, min_end = tile[MAX_END.value][None, :], tile[MIN_END.value][None, :]
    visit = (kstart <= qmax) & (max_end > qmin)
    full = (kstart + block_size - 1 <= qmin) & (min_end > qmax)
    if window is not None:
        depth = tree_depth(subtree_end.to(torch.int64)).to(tile.device)
        qdepth = F.pad(depth[queries], (0, rows - nq), value=int(depth[queries[-1]]))
        qdepth = qdepth.view(-1, block_size)
        # The queries before max_end are a prefix of the (ascending) tile: its running minimum.
        seen = torch.searchsorted(qpos, max_end.expand(qpos.shape[0], -1).contiguous())
        lowest = torch.cummin(qdepth, dim=1).values.gather(1, (seen - 1).clamp(min=0))
        lowest = torch.where(seen > 0, lowest, BIG.value)
        visit &= lowest - tile[MAX_DEPTH.value][None, :] <= window
        full &= qdepth.amax(1, keepdim=True) - tile[MIN_DEPTH.value][None, :] <= window
    return torch.where(visit, torch.where(full, 1, 2), 0).to(torch.int8)


class _Layout:
    """One call's launch facts: the plan's tile facts and the kernels' constants."""

    def __init__(
        self,
        facts: dict,
        *,
        block: int,
        window: int | None,
        scale: float,
        dtype,
        launch: LaunchConfig,
    ):
        self.facts = facts
        self.block = block
        self.options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        self.window = window
        self.scale = scale
        self.dot_fp32 = dtype == torch.bfloat16 and interpreted()
        self.precision = "ieee" if dtype == torch.float32 else "tf32"
        # What the kernels store: fp32 where the interpreter would truncate to bf16.
        self.store_dtype = torch.float32 if self.dot_fp32 else dtype

    def mask_args(self, b: int) -> list:
        """ENDS, KEY_DEPTH, QPOS, QUERY_DEPTH, FACTS pointers (the last mask row is reused when
        the mask has one row for all b)."""
        f = self.facts
        qpos = f["query_positions"]
        return [f["ends"], f["key_depth"], f["ends"] if qpos is None else qpos, f["query_depth"]]

    def constants(self, head_dim: int, value_dim: int) -> dict:
        return dict(
            HEAD_DIM=head_dim,
            VALUE_DIM=value_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_DV=max(16, triton.next_power_of_2(value_dim)),
            BLOCK_M=self.block,
            BLOCK_N=self.block,
            IDENTITY=self.facts["query_positions"] is None,
            WINDOW=self.window is not None,
            DOT_FP32=self.dot_fp32,
            PRECISION=self.precision,
        )

    def strides(self) -> tuple[int, int, int]:
        """Row strides of the [r, nk] mask tensors, the [r, nq] query depths and the
        [r, FACTS, nkt] facts (0 when the mask has one row for all b)."""
        f = self.facts
        if f["ends"].shape[0] == 1:
            return 0, 0, 0
        return f["ends"].stride(0), f["query_depth"].stride(0), f["facts"].stride(0)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward(q, k, v, sink, layout: _Layout, counts: torch.Tensor | None = None):
    """q [nq, b, np, hn], k [nk, b, ng, hn], v [nk, b, ng, hv] -> (out [nq, b, np, hv],
    lse [b * np, nq] fp32, base 2)."""
    nq, b, num_heads, head_dim = q.shape
    nk, _, num_groups, value_dim = v.shape
    out = torch.empty((nq, b, num_heads, value_dim), dtype=layout.store_dtype, device=q.device)
    lse = torch.empty((b * num_heads, nq), dtype=torch.float32, device=q.device)
    facts = layout.facts["facts"]
    grid = (triton.cdiv(nq, layout.block), b * num_heads)
    forward_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        *layout.mask_args(b),
        facts,
        lse if sink is None else sink,
        lse if counts is None else counts,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(out),
        *layout.strides(),
        nq,
        nk,
        num_heads,
        num_heads // num_groups,
        facts.shape[-1],
        -1 if layout.window is None else layout.window,
        layout.scale * LOG2E,
        HAS_SINK=sink is not None,
        COUNT=counts is not None,
        **layout.options,
        **layout.constants(head_dim, value_dim),
    )
    return out.to(q.dtype), lse


def _backward(q, k, v, out, lse, grad_out, layout: _Layout, sink_grad: bool = False):
    """(dq, dk, dv) like q, k, v (contiguous), and, with ``sink_grad``, sum_k P_k dP_k
    [b * np, nq] fp32 (else None)."""
    nq, b, num_heads, head_dim = q.shape
    nk, _, num_groups, value_dim = v.shape
    delta = (grad_out.float() * out.float()).sum(-1)  # [nq, b, np]
    delta = delta.permute(1, 2, 0).reshape(b * num_heads, nq).contiguous()
    dq, dk, dv = (
        torch.empty(t.shape, dtype=layout.store_dtype, device=t.device) for t in (q, k, v)
    )
    dsum = torch.empty_like(delta) if sink_grad else None
    facts = layout.facts["facts"]
    num_key_tiles = facts.shape[-1]
    window = -1 if layout.window is None else layout.window
    constants = layout.constants(head_dim, value_dim)
    dq_kernel[(triton.cdiv(nq, layout.block), b * num_heads)](
        q,
        k,
        v,
        grad_out,
        dq,
        lse,
        delta,
        delta if dsum is None else dsum,
        *layout.mask_args(b),
        facts,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(grad_out),
        *_strides(dq),
        *layout.strides(),
        nq,
        nk,
        num_heads,
        num_heads // num_groups,
        num_key_tiles,
        window,
        layout.scale * LOG2E,
        layout.scale,
        SINK_GRAD=sink_grad,
        **layout.options,
        **constants,
    )
    dkdv_kernel[(num_key_tiles, b * num_groups)](
        q,
        k,
        v,
        grad_out,
        dk,
        dv,
        lse,
        delta,
        *layout.mask_args(b),
        facts,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(grad_out),
        *_strides(dk),
        *_strides(dv),
        *layout.strides(),
        nq,
        nk,
        num_heads,
        num_groups,
        num_heads // num_groups,
        num_key_tiles,
        window,
        layout.scale * LOG2E,
        layout.scale,
        **layout.options,
        **constants,
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsum


class _TreeAttention(torch.autograd.Function):
    """[nq, b, np, hn], [nk, b, ng, hn], [nk, b, ng, hv], sink [np] fp32 or None ->
    [nq, b, np, hv]; the log-sum-exp saved for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sink, layout):
        out, lse = _forward(q, k, v, sink, layout)
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sink, out, lse = ctx.saved_tensors
        grad_out = _last_dim_unit(grad_out)
        sink_grad = sink is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dsum = _backward(q, k, v, out, lse, grad_out, ctx.layout, sink_grad)
        dsink = None
        if sink_grad:
            # The sink's softmax column has no value: dS_sink = -P_sink * sum_k P_k dP_k per query
            # row (that sum from the dQ kernel in fp32, not rowsum(dO * O) of the rounded output:
            # summed over every row into one number per head, the output's rounding would add up).
            num_heads = sink.shape[0]
            p_sink = torch.exp2(sink[None, :, None] * LOG2E - lse.view(-1, num_heads, q.shape[0]))
            dsink = -(p_sink * dsum.view_as(p_sink)).sum(dim=(0, 2))
        return dq, dk, dv, dsink, None


def _check_inputs(query, key, value, block_size: int) -> tuple[int, LaunchConfig]:
    """The tile edge for ``block_size`` and the launch configuration; ValueErrors for what the
    kernels do not take."""
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"backend='triton' takes float16, bfloat16 or float32 inputs, got {query.dtype}; "
            "use backend='block_sparse' (or 'sdpa') for float64"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"backend='triton' needs query, key and value of one dtype, got {query.dtype}, "
            f"{key.dtype}, {value.dtype}"
        )
    if not query.is_cuda and not interpreted():
        raise ValueError(
            "backend='triton' runs on CUDA tensors, or on CPU tensors in Triton's interpreter "
            "(set TRITON_INTERPRET=1 before megatron_tree.core.triton_attention is imported); use "
            "backend='block_sparse' on the CPU"
        )
    if max(t.numel() for t in (query, key, value)) >= 2**31:
        raise ValueError(
            "backend='triton' indexes its tensors with 32-bit offsets, so each of query, key and "
            f"value must hold fewer than 2**31 elements (got {query.numel()}, {key.numel()}, "
            f"{value.numel()}); split the micro-batch (a smaller max_tokens_per_mb)"
        )
    launch = launch_config(arch_of(query.device), query.shape[-1], value.shape[-1])
    block = min(block_size, launch.tile)
    if block < 16 or block & (block - 1):
        raise ValueError(
            f"block_size={block_size}: backend='triton' uses square tiles of min(block_size, "
            f"{launch.tile}) tokens here, which must be a power of two >= 16; pass e.g. "
            "block_size=64"
        )
    return block, launch


def triton_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan,
    *,
    scale: float,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    block_size: int = TILE,
) -> torch.Tensor:
    """Tree attention by the Triton kernels (see the module docstring), differentiable in query,
    key, value and sink.

    Args:
        query: [nq, b, np, hn] (Megatron's layout; any strides).
        key: [nk, b, ng, hn].
        value: [nk, b, ng, hv].
        plan: the micro-batch's :class:`~megatron_tree.core.mask.TreeMaskPlan` (``subtree_end``
            [r, nk], r = 1 or b; ``query_positions`` [nq] when the queries are some of the keys).
            Its tile facts are built on first use and kept for the micro-batch.
        scale: the softmax scale.
        window: a depth window (see :func:`~megatron_tree.core.mask.allowed`), or None.
        sink: float [np], one sink logit per query head, or None.
        block_size: tiles are ``min(block_size, TILE)`` tokens square (a power of two >= 16).

    Returns:
        [nq, b, np * hv] in the query's dtype.
    """
    block, launch = _check_inputs(query, key, value, block_size)
    nq, b, num_heads, _ = query.shape
    device = query.device

    def build():
        ends = plan.subtree_end.to(device)
        queries = plan.query_positions
        return tile_facts(ends, None if queries is None else queries.to(device), block, window)

    facts = plan._get(("triton", block, window, device), build)
    layout = _Layout(
        facts, block=block, window=window, scale=scale, dtype=query.dtype, launch=launch
    )
    q, k, v = (_last_dim_unit(t) for t in (query, key, value))
    if sink is not None:
        sink = sink.to(device=device, dtype=torch.float32).contiguous()
    out = _TreeAttention.apply(q, k, v, sink, layout)
    return out.reshape(nq, b, num_heads * value.shape[-1])


def count_tile_kinds(query, key, value, plan, *, block_size: int, window: int | None = None):
    """Run the forward kernel counting the tiles it visits: {"skipped", "full", "partial"} over the
    (query tile, key tile) pairs its loops reach (up to the diagonal), for every (row, head)
    program. For tests: the kernel's own decisions, to compare with :func:`tile_kinds`."""
    block, launch = _check_inputs(query, key, value, block_size)
    facts = tile_facts(plan.subtree_end.to(query.device), plan.query_positions, block, window)
    layout = _Layout(facts, block=block, window=window, scale=1.0, dtype=query.dtype, launch=launch)
    counts = torch.zeros(3, dtype=torch.int32, device=query.device)
    _forward(query, key, value, None, layout, counts)
    return dict(zip(("skipped", "full", "partial"), counts.tolist()))
