"""Tree attention as our own flash-style Triton kernels that read ``subtree_end`` directly.

``tree_attention(..., backend="triton")`` runs here (imported on first use, so the package imports
without Triton). Three kernels: the forward (output and the log-sum-exp, saved for the backward),
dQ, and dK with dV. They take Megatron's [n, b, heads, dim] tensors as they are (any strides),
grouped-query heads without repeating keys or values (a query head reads its group's), a value
head dim other than the query's (multi-latent attention), a depth window, a sink logit per head
(Megatron's "off-by-one" / "learnable" softmax), and fp16 / bf16 / fp32 inputs with fp32
accumulation. Queries may be a subset of the keys (a context-parallel rank's rows, a trunk-reuse
part): they then carry their places among the keys, the ``TreeRows`` facts every backend reads
(:meth:`~megatron_tree.core.mask.TreeMaskPlan.query_positions`).

The mask is the tree's O(N) encoding: key k is visible to the queries at positions
``[k, subtree_end[k])`` (and, under a depth window w, only to those at most w levels below it).
Once per micro-batch (and tile size and window) the plan gets the per-key-tile facts, O(N) work and
O(N / B) memory, nothing N x N (:func:`tile_facts`): the largest and smallest ``subtree_end`` of
each key tile, under a window its largest and smallest depth, and the range of query rows that can
see it (for the dK / dV kernel, which walks query tiles). Every (query tile, key tile) pair is then
classified on the fly, in the kernel, by :func:`_tile_kind` (and on the host, for counting, by
:func:`tile_kinds`, the same rule):

* **skipped**: the key tile starts after the query tile's last position (above the diagonal: the
  loops never reach it), or every key's subtree ends at or before the tile's first query
  (``max_end <= qmin``), or, under a window, every query that could see the tile lies more than
  the window below the tile's deepest key;
* **full**: the whole key tile lies at or before the first query and every key's subtree reaches
  past the last query (``kstart + B - 1 <= qmin and min_end > qmax``), and under a window the
  tile's deepest query is within the window of its shallowest key: computed without a mask;
* **partial**: everything else: the mask is evaluated per element from ``subtree_end`` (and the
  depths) of the tile's keys.

These are the rules of the FlexAttention block mask (:func:`~megatron_tree.core.mask.
tree_block_layout`), so both compute the same tiles; the kernel needs O(N / B) metadata instead of
O(N^2 / B^2) block lists, and compiles once per dtype / head dims / flags, not per shape.

One configuration, no autotuning (the autotuner's benchmarker does not run in Triton's
interpreter): square tiles of ``min(block_size, TILE)`` tokens, ``NUM_WARPS`` warps,
``NUM_STAGES`` stages. Chosen, not measured: no GPU has run these kernels yet (docs/gpu.md).

In Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported) the kernels
run on CPU tensors; the tests run them that way. Two interpreter limits shape its bf16 path
(``DOT_FP32``, interpreter only): it has no bf16 ``tl.dot``, so a bf16 tile is converted to fp32
before each product, and it converts fp32 to bf16 by truncation (a GPU rounds to nearest), so the
kernels write fp32 results that the host rounds to bf16 with torch. On a GPU bf16 tiles feed the
tensor cores as they are and the kernels store bf16.

Legend: nq query rows, nk keys, b micro-batch rows, r mask rows (1 or b), np / ng query heads /
key-value groups, hn / hv query-key / value head dims, B tile, nkt = ceil(nk / B) key tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .tree import tree_depth

__all__ = ["TILE", "tile_facts", "tile_kinds", "triton_tree_attention"]

TILE = 64  # the tile edge on a GPU (tokens); a smaller power-of-two block_size gives smaller tiles
NUM_WARPS = 8
NUM_STAGES = 2
LOG2E = 1.4426950408889634

# Rows of the per-key-tile facts [r, FACTS, nkt] (tile_facts), as Triton constants; .value on the
# host.
MAX_END = tl.constexpr(0)  # the tile's largest subtree_end
MIN_END = tl.constexpr(1)  # its smallest
MAX_DEPTH = tl.constexpr(2)  # its deepest key's depth (under a window)
MIN_DEPTH = tl.constexpr(3)  # its shallowest key's depth (under a window)
FIRST_ROW = tl.constexpr(4)  # the first query row at or after the tile's start
END_ROW = tl.constexpr(5)  # one past the last query row before the tile's largest subtree_end
FACTS = 6
_BIG = tl.constexpr(2**30)  # an int32 sentinel above every position and depth


def interpreted() -> bool:
    """Whether this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` was set
    when it was imported)."""
    return isinstance(_forward_kernel, InterpretedFunction)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


# Reductions through tl.reduce with our own combine functions rather than tl.max / tl.min / tl.sum:
# those are Triton library functions decorated when triton was imported, so in the interpreter they
# work only if TRITON_INTERPRET=1 was set before triton's own import; ours need it only before this
# module's (the same holds for tl.zeros, hence tl.full).
@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _tile_kind(
    qpos,
    qdepth,
    qvalid,
    qmin,
    qmax,
    qdepth_max,
    kstart,
    facts,
    num_key_tiles,
    j,
    window,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """(visit, full) of query tile ``qpos`` [BM] against key tile ``j`` (starting at ``kstart``),
    from that tile's facts (``facts`` points at the mask row's [FACTS, nkt])."""
    max_end = tl.load(facts + MAX_END * num_key_tiles + j)
    min_end = tl.load(facts + MIN_END * num_key_tiles + j)
    visit = (kstart <= qmax) & (max_end > qmin)
    full = (kstart + BLOCK_N - 1 <= qmin) & (min_end > qmax)
    if WINDOW:
        deepest_key = tl.load(facts + MAX_DEPTH * num_key_tiles + j)
        shallowest_key = tl.load(facts + MIN_DEPTH * num_key_tiles + j)
        # Only the queries before max_end can see a key of the tile.
        lowest = tl.reduce(tl.where(qvalid & (qpos < max_end), qdepth, _BIG), 0, _minimum)
        visit = visit & (lowest - deepest_key <= window)
        full = full & (qdepth_max - shallowest_key <= window)
    return visit, full


@triton.jit
def _allowed(qpos, qdepth, cols, kvalid, ends, key_depth, window, WINDOW: tl.constexpr):
    """bool [BM, BN]: query ``qpos`` [BM] sees key ``cols`` [BN] (the tree mask, per element)."""
    end = tl.load(ends + cols, mask=kvalid, other=0)
    ok = (cols[None, :] <= qpos[:, None]) & (qpos[:, None] < end[None, :])
    if WINDOW:
        kd = tl.load(key_depth + cols, mask=kvalid, other=0)
        ok = ok & (qdepth[:, None] - kd[None, :] <= window)
    return ok


@triton.jit
def _query_tile(
    qpos_ptr,
    qdepth_ptr,
    rows,
    nq,
    IDENTITY: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """(qvalid, qpos, qdepth, qmin, qmax, qdepth_max) of the query rows ``rows`` [BM]."""
    qvalid = rows < nq
    if IDENTITY:
        qpos = rows
    else:
        qpos = tl.load(qpos_ptr + rows, mask=qvalid, other=0)
    qmin = tl.reduce(tl.where(qvalid, qpos, _BIG), 0, _minimum)
    qmax = tl.reduce(tl.where(qvalid, qpos, -1), 0, _maximum)
    if WINDOW:
        qdepth = tl.load(qdepth_ptr + rows, mask=qvalid, other=0)
        qdepth_max = tl.reduce(tl.where(qvalid, qdepth, -1), 0, _maximum)
    else:
        qdepth = qpos
        qdepth_max = qmax
    return qvalid, qpos, qdepth, qmin, qmax, qdepth_max


@triton.jit
def _forward_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    ENDS,
    KEY_DEPTH,
    QPOS,
    QUERY_DEPTH,
    FACTS_PTR,
    SINK,
    COUNTS,
    stride_qn,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_on,
    stride_ob,
    stride_oh,
    stride_mask_row,
    stride_qdepth_row,
    stride_facts_row,
    nq,
    nk,
    num_heads,
    group_size,
    num_key_tiles,
    window,
    scale_log2,
    HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IDENTITY: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    COUNT: tl.constexpr,
):
    """One query tile of one (row, head): OUT [nq, b, np, hv] and LSE [b * np, nq] (base 2, fp32,
    the sink included). Grid (ceil(nq / BM), b * np). Last-dim strides are 1."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    g = h // group_size
    ends = ENDS + b * stride_mask_row
    key_depth = KEY_DEPTH + b * stride_mask_row
    facts = FACTS_PTR + b * stride_facts_row
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qvalid, qpos, qdepth, qmin, qmax, qdepth_max = _query_tile(
        QPOS, QUERY_DEPTH + b * stride_qdepth_row, rows, nq, IDENTITY, WINDOW
    )
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + d[None, :],
        mask=qvalid[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    # Keys after the tile's last query are never visible: the loop stops at its diagonal tile.
    for j in range(0, qmax // BLOCK_N + 1):
        kstart = j * BLOCK_N
        visit, full = _tile_kind(
            qpos,
            qdepth,
            qvalid,
            qmin,
            qmax,
            qdepth_max,
            kstart,
            facts,
            num_key_tiles,
            j,
            window,
            BLOCK_N,
            WINDOW,
        )
        if COUNT:
            kind = tl.where(visit, tl.where(full, 1, 2), 0)
            tl.atomic_add(COUNTS + kind, 1)
        if visit:
            cols = kstart + tl.arange(0, BLOCK_N)
            kvalid = cols < nk
            k = tl.load(
                k_base + cols[:, None] * stride_kn + d[None, :],
                mask=kvalid[:, None] & (d[None, :] < HEAD_DIM),
                other=0.0,
            )
            v = tl.load(
                v_base + cols[:, None] * stride_vn + dv[None, :],
                mask=kvalid[:, None] & (dv[None, :] < VALUE_DIM),
                other=0.0,
            )
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BM, BN]
            if not full:
                ok = _allowed(qpos, qdepth, cols, kvalid, ends, key_depth, window, WINDOW)
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _maximum))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.reduce(p, 1, _add)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    if HAS_SINK:
        # One more logit per row with no value (Megatron's SoftmaxOne).
        sink = tl.load(SINK + h) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    l_safe = tl.where(qvalid, l_i, 1.0)  # every real row sees itself, so l_i > 0 there
    out = acc / l_safe[:, None]
    tl.store(
        OUT + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + dv[None, :],
        out.to(OUT.dtype.element_ty),
        mask=qvalid[:, None] & (dv[None, :] < VALUE_DIM),
    )
    tl.store(LSE + bh * nq + rows, m_i + tl.math.log2(l_safe), mask=qvalid)


@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    DSUM,
    ENDS,
    KEY_DEPTH,
    QPOS,
    QUERY_DEPTH,
    FACTS_PTR,
    stride_qn,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_don,
    stride_dob,
    stride_doh,
    stride_dqn,
    stride_dqb,
    stride_dqh,
    stride_mask_row,
    stride_qdepth_row,
    stride_facts_row,
    nq,
    nk,
    num_heads,
    group_size,
    num_key_tiles,
    window,
    scale_log2,
    scale,
    HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IDENTITY: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    SINK_GRAD: tl.constexpr,
):
    """dQ [nq, b, np, hn] of one query tile of one (row, head), over the key tiles it sees (the
    forward's loop). Grid (ceil(nq / BM), b * np). With ``SINK_GRAD`` also DSUM [b * np, nq] =
    sum_k P_k dP_k in fp32 (``DELTA`` recomputed without the output's rounding), for the sink's
    gradient."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    g = h // group_size
    ends = ENDS + b * stride_mask_row
    key_depth = KEY_DEPTH + b * stride_mask_row
    facts = FACTS_PTR + b * stride_facts_row
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qvalid, qpos, qdepth, qmin, qmax, qdepth_max = _query_tile(
        QPOS, QUERY_DEPTH + b * stride_qdepth_row, rows, nq, IDENTITY, WINDOW
    )
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + d[None, :],
        mask=qvalid[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + dv[None, :],
        mask=qvalid[:, None] & (dv[None, :] < VALUE_DIM),
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + bh * nq + rows, mask=qvalid, other=float("inf"))
    delta = tl.load(DELTA + bh * nq + rows, mask=qvalid, other=0.0)
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    dsum = tl.full([BLOCK_M], 0.0, tl.float32)
    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    for j in range(0, qmax // BLOCK_N + 1):
        kstart = j * BLOCK_N
        visit, full = _tile_kind(
            qpos,
            qdepth,
            qvalid,
            qmin,
            qmax,
            qdepth_max,
            kstart,
            facts,
            num_key_tiles,
            j,
            window,
            BLOCK_N,
            WINDOW,
        )
        if visit:
            cols = kstart + tl.arange(0, BLOCK_N)
            kvalid = cols < nk
            k = tl.load(
                k_base + cols[:, None] * stride_kn + d[None, :],
                mask=kvalid[:, None] & (d[None, :] < HEAD_DIM),
                other=0.0,
            )
            v = tl.load(
                v_base + cols[:, None] * stride_vn + dv[None, :],
                mask=kvalid[:, None] & (dv[None, :] < VALUE_DIM),
                other=0.0,
            )
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            p = tl.math.exp2(s - lse[:, None])  # [BM, BN] probabilities
            if not full:
                ok = _allowed(qpos, qdepth, cols, kvalid, ends, key_depth, window, WINDOW)
                p = tl.where(ok, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
            if SINK_GRAD:
                dsum += tl.reduce(p * dp, 1, _add)
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=qvalid[:, None] & (d[None, :] < HEAD_DIM),
    )
    if SINK_GRAD:
        tl.store(DSUM + bh * nq + rows, dsum, mask=qvalid)


@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    ENDS,
    KEY_DEPTH,
    QPOS,
    QUERY_DEPTH,
    FACTS_PTR,
    stride_qn,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_don,
    stride_dob,
    stride_doh,
    stride_dkn,
    stride_dkb,
    stride_dkh,
    stride_dvn,
    stride_dvb,
    stride_dvh,
    stride_mask_row,
    stride_qdepth_row,
    stride_facts_row,
    nq,
    nk,
    num_heads,
    num_groups,
    group_size,
    num_key_tiles,
    window,
    scale_log2,
    scale,
    HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IDENTITY: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dK [nk, b, ng, hn] and dV [nk, b, ng, hv] of one key tile of one (row, group), summed over
    the group's query heads and the query tiles that can see the tile (rows ``[FIRST_ROW,
    END_ROW)`` of its facts). One program owns its tile: no atomics. Grid (nkt, b * ng)."""
    j = tl.program_id(0)
    bg = tl.program_id(1)
    b = bg // num_groups
    g = bg % num_groups
    ends = ENDS + b * stride_mask_row
    key_depth = KEY_DEPTH + b * stride_mask_row
    facts = FACTS_PTR + b * stride_facts_row
    kstart = j * BLOCK_N
    cols = kstart + tl.arange(0, BLOCK_N)
    kvalid = cols < nk
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = tl.load(
        K + b * stride_kb + g * stride_kh + cols[:, None] * stride_kn + d[None, :],
        mask=kvalid[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    v = tl.load(
        V + b * stride_vb + g * stride_vh + cols[:, None] * stride_vn + dv[None, :],
        mask=kvalid[:, None] & (dv[None, :] < VALUE_DIM),
        other=0.0,
    )
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    end = tl.load(ends + cols, mask=kvalid, other=0)
    if WINDOW:
        kd = tl.load(key_depth + cols, mask=kvalid, other=0)
    first_row = tl.load(facts + FIRST_ROW * num_key_tiles + j)
    end_row = tl.load(facts + END_ROW * num_key_tiles + j)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dvacc = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
    for hh in range(0, group_size):
        h = g * group_size + hh
        bh = b * num_heads + h
        for i in range(first_row // BLOCK_M, (end_row + BLOCK_M - 1) // BLOCK_M):
            rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
            qvalid, qpos, qdepth, qmin, qmax, qdepth_max = _query_tile(
                QPOS, QUERY_DEPTH + b * stride_qdepth_row, rows, nq, IDENTITY, WINDOW
            )
            visit, full = _tile_kind(
                qpos,
                qdepth,
                qvalid,
                qmin,
                qmax,
                qdepth_max,
                kstart,
                facts,
                num_key_tiles,
                j,
                window,
                BLOCK_N,
                WINDOW,
            )
            if visit:
                q = tl.load(
                    Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + d[None, :],
                    mask=qvalid[:, None] & (d[None, :] < HEAD_DIM),
                    other=0.0,
                )
                do = tl.load(
                    DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + dv[None, :],
                    mask=qvalid[:, None] & (dv[None, :] < VALUE_DIM),
                    other=0.0,
                )
                if DOT_FP32:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                # Rows past nq get lse = inf, so probability 0.
                lse = tl.load(LSE + bh * nq + rows, mask=qvalid, other=float("inf"))
                delta = tl.load(DELTA + bh * nq + rows, mask=qvalid, other=0.0)
                s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2  # [BN, BM]
                p_t = tl.math.exp2(s_t - lse[None, :])
                if not full:
                    ok_t = (cols[:, None] <= qpos[None, :]) & (qpos[None, :] < end[:, None])
                    if WINDOW:
                        ok_t = ok_t & (qdepth[None, :] - kd[:, None] <= window)
                    p_t = tl.where(ok_t, p_t, 0.0)
                dvacc += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
                dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
                dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    tl.store(
        DK + b * stride_dkb + g * stride_dkh + cols[:, None] * stride_dkn + d[None, :],
        (dk * scale).to(DK.dtype.element_ty),
        mask=kvalid[:, None] & (d[None, :] < HEAD_DIM),
    )
    tl.store(
        DV + b * stride_dvb + g * stride_dvh + cols[:, None] * stride_dvn + dv[None, :],
        dvacc.to(DV.dtype.element_ty),
        mask=kvalid[:, None] & (dv[None, :] < VALUE_DIM),
    )


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


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
    min_end = tiles(ends, _BIG.value).amin(-1)
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
        min_depth = tiles(depth, _BIG.value).amin(-1)
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
        lowest = torch.where(seen > 0, lowest, _BIG.value)
        visit &= lowest - tile[MAX_DEPTH.value][None, :] <= window
        full &= qdepth.amax(1, keepdim=True) - tile[MIN_DEPTH.value][None, :] <= window
    return torch.where(visit, torch.where(full, 1, 2), 0).to(torch.int8)


class _Layout:
    """One call's launch facts: the plan's tile facts and the kernels' constants."""

    def __init__(self, facts: dict, *, block: int, window: int | None, scale: float, dtype):
        self.facts = facts
        self.block = block
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
    _forward_kernel[grid](
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
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
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
    _dq_kernel[(triton.cdiv(nq, layout.block), b * num_heads)](
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
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        **constants,
    )
    _dkdv_kernel[(num_key_tiles, b * num_groups)](
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
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
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


def _check_inputs(query, key, value, block_size: int) -> int:
    """The tile edge for ``block_size``; ValueErrors for what the kernels do not take."""
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
    block = min(block_size, TILE)
    if block < 16 or block & (block - 1):
        raise ValueError(
            f"block_size={block_size}: backend='triton' uses square tiles of min(block_size, "
            f"{TILE}) tokens, which must be a power of two >= 16; pass e.g. block_size=64"
        )
    return block


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
    block = _check_inputs(query, key, value, block_size)
    nq, b, num_heads, _ = query.shape
    device = query.device

    def build():
        ends = plan.subtree_end.to(device)
        queries = plan.query_positions
        return tile_facts(ends, None if queries is None else queries.to(device), block, window)

    facts = plan._get(("triton", block, window, device), build)
    layout = _Layout(facts, block=block, window=window, scale=scale, dtype=query.dtype)
    q, k, v = (_last_dim_unit(t) for t in (query, key, value))
    if sink is not None:
        sink = sink.to(device=device, dtype=torch.float32).contiguous()
    out = _TreeAttention.apply(q, k, v, sink, layout)
    return out.reshape(nq, b, num_heads * value.shape[-1])


def count_tile_kinds(query, key, value, plan, *, block_size: int, window: int | None = None):
    """Run the forward kernel counting the tiles it visits: {"skipped", "full", "partial"} over the
    (query tile, key tile) pairs its loops reach (up to the diagonal), for every (row, head)
    program. For tests: the kernel's own decisions, to compare with :func:`tile_kinds`."""
    block = _check_inputs(query, key, value, block_size)
    facts = tile_facts(plan.subtree_end.to(query.device), plan.query_positions, block, window)
    layout = _Layout(facts, block=block, window=window, scale=1.0, dtype=query.dtype)
    counts = torch.zeros(3, dtype=torch.int32, device=query.device)
    _forward(query, key, value, None, layout, counts)
    return dict(zip(("skipped", "full", "partial"), counts.tolist()))
