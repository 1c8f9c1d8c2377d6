"""The Triton kernels of ``backend="triton"``: flash-style tree attention that reads
``subtree_end`` directly (launched, differentiated and fed by :mod:`~.triton_attention`).

Three kernels: the forward (output and the log-sum-exp, saved for the backward), dQ, and dK with
dV. They take Megatron's [n, b, heads, dim] tensors as they are (any strides), grouped-query heads
without repeating keys or values (a query head reads its group's), a value head dim other than the
query's (multi-latent attention), a depth window, a sink logit per head, and fp16 / bf16 / fp32
inputs with fp32 accumulation. Queries may be a subset of the keys: they then carry their places
among the keys.

The mask is the tree's O(N) encoding: key k is visible to the queries at positions
``[k, subtree_end[k])`` (and, under a depth window w, only to those at most w levels below it).
The kernels read per key tile the facts :func:`~.triton_attention.tile_facts` builds once per
micro-batch (rows ``MAX_END`` ... ``END_ROW`` of [r, FACTS, nkt]) and classify every (query tile,
key tile) pair on the fly by :func:`_tile_kind` (the host's :func:`~.triton_attention.tile_kinds`
is the same rule):

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
tree_block_layout`), so both compute the same tiles; the kernels need O(N / B) metadata instead of
O(N^2 / B^2) block lists, and compile once per dtype / head dims / flags, not per shape.

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

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["FACTS", "dkdv_kernel", "dq_kernel", "forward_kernel", "interpreted"]

# Rows of the per-key-tile facts [r, FACTS, nkt] (tile_facts), as Triton constants; .value on the
# host.
MAX_END = tl.constexpr(0)  # the tile's largest subtree_end
MIN_END = tl.constexpr(1)  # its smallest
MAX_DEPTH = tl.constexpr(2)  # its deepest key's depth (under a window)
MIN_DEPTH = tl.constexpr(3)  # its shallowest key's depth (under a window)
FIRST_ROW = tl.constexpr(4)  # the first query row at or after the tile's start
END_ROW = tl.constexpr(5)  # one past the last query row before the tile's largest subtree_end
FACTS = 6
BIG = tl.constexpr(2**30)  # an int32 sentinel above every position and depth


def interpreted() -> bool:
    """Whether this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` was set
    when it was imported)."""
    return isinstance(forward_kernel, InterpretedFunction)


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
        lowest = tl.reduce(tl.where(qvalid & (qpos < max_end), qdepth, BIG), 0, _minimum)
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
    qmin = tl.reduce(tl.where(qvalid, qpos, BIG), 0, _minimum)
    qmax = tl.reduce(tl.where(qvalid, qpos, -1), 0, _maximum)
    if WINDOW:
        qdepth = tl.load(qdepth_ptr + rows, mask=qvalid, other=0)
        qdepth_max = tl.reduce(tl.where(qvalid, qdepth, -1), 0, _maximum)
    else:
        qdepth = qpos
        qdepth_max = qmax
    return qvalid, qpos, qdepth, qmin, qmax, qdepth_max


@triton.jit
def forward_kernel(
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
def dq_kernel(
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
def dkdv_kernel(
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
