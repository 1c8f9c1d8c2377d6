"""``backend="triton"``: our Triton tree-attention kernels, run in Triton's interpreter on CPU
tensors, against an fp64 brute force whose visibility comes from the trie's parent links and depths
(never from ``subtree_end``), forward and backward; the kernel's own tile decisions against the host
rule; and a kernel broken on purpose (one tile short of the diagonal) failing the parity checks. A
model step with the kernels is in tests/test_triton_model_step.py.

The interpreter runs every program instance in numpy, so sizes are tiny (<= 128 positions, 16-token
tiles, 1-2 key/value groups) and the whole file takes about a minute of CPU (two minutes on two
busy cores). Its kernels must be built with ``TRITON_INTERPRET=1`` set; the ``interpreter``
fixture imports the kernel module that way (harness/triton.py). Nothing here builds a Megatron
model, so the file runs on one stack only (STACK_INDEPENDENT_TESTS in scripts/_python312.sh).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="backend='triton' needs the triton package")

from harness.models import VOCAB, branching_sequences, pack, trunk_sequences
from harness.triton import KERNELS, MODULE, interpreted_kernels
from megatron_tree.core.attention import tree_attention
from megatron_tree.core.context_parallel import context_parallel_split
from megatron_tree.core.mask import (
    build_attention_mask_from_trie,
    tree_attention_mask,
    tree_block_layout,
)
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.rows import KeyValueStore
from megatron_tree.testing.synthetic import pad_sequences, random_trie_sequences
from megatron_tree.testing.tolerances import BF16_FACTOR, FP32_ATTN_TOL

TILE = 16  # the kernels' tile in these tests (block_size=16): many tiles on tiny trees


@pytest.fixture(scope="module")
def interpreter():
    """The kernel module with its kernels in Triton's interpreter (for the module's tests)."""
    yield from interpreted_kernels()


# ------------------------------------------------------------------------------ references


def _visible(tree, window: int | None = None) -> torch.Tensor:
    """bool [N, N], True = query row attends key column, from parent links and depths alone."""
    n, parent, depth = tree.padded_length, tree.parent_index.tolist(), tree.position_ids.tolist()
    visible = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        k = q
        while k != -1 and (window is None or depth[q] - depth[k] <= window):
            visible[q, k] = True
            k = parent[k] if k < len(parent) else -1
    return visible


def _brute(q, k, v, visible, sink=None, scale=None):
    """Masked softmax attention, sink appended as a last logit column with no value, in the
    inputs' dtype. q [nq, b, np, hn], k [nk, b, ng, hn], v [nk, b, ng, hv], visible bool [nq, nk]
    or [b, nq, nk], sink [np] -> [nq, b, np * hv]."""
    nq, b, heads, dim = q.shape
    rep = heads // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scale = 1 / math.sqrt(dim) if scale is None else scale
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) * scale
    keep = visible[None, None] if visible.dim() == 2 else visible[:, None]
    scores = scores.masked_fill(~keep, float("-inf"))
    if sink is not None:
        column = sink.to(scores.dtype).reshape(1, heads, 1, 1).expand(b, heads, nq, 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("bhqk,kbhd->qbhd", probs, vv).reshape(nq, b, -1)


def _inputs(nq, nk, *, b=1, heads=2, groups=1, dim=8, value_dim=None, seed=0):
    """fp64 q [nq, b, np, hn], k [nk, b, ng, hn], v [nk, b, ng, hv], an output gradient."""
    g = torch.Generator().manual_seed(seed)
    value_dim = value_dim or dim
    shapes = [(nq, b, heads, dim), (nk, b, groups, dim), (nk, b, groups, value_dim)]
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    return q, k, v, torch.randn(nq, b, heads * value_dim, generator=g, dtype=torch.float64)


def _sink(kind: str | None, heads: int = 2):
    if kind is None:
        return None
    if kind == "zeros":
        return torch.zeros(heads, dtype=torch.float64)
    return torch.linspace(-1.0, 2.0, heads, dtype=torch.float64)  # "learned"


def _fwd_bwd(fn, tensors, grad_out):
    """(output, grads of <output, grad_out> w.r.t. ``tensors``) with fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def _errors(got, want):
    out, grads = got
    ref, ref_grads = want
    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    fwd = max_abs_error(out.double(), ref)
    grad = worst_error(max_abs_error(a.double(), b) for a, b in zip(grads, ref_grads))
    return fwd, grad


def _report(case, fwd, grad, tol):
    print(f"PARITY {case}: fwd {fwd:.2e} grad {grad:.2e} tol {tol:.0e}")


# ------------------------------------------------------------------------------ the trees


def _one_token_branches(g):
    prompt = torch.randint(1, VOCAB, (9,), generator=g)
    firsts = torch.randperm(VOCAB - 1, generator=g)[:7] + 1
    seqs = [torch.cat([prompt, firsts[i : i + 1]]) for i in range(6)]  # six one-token leaves
    seqs.append(torch.cat([prompt[:4], firsts[6:7]]))  # one-token branch inside the prompt
    seqs.append(torch.cat([prompt, firsts[:1], torch.randint(1, VOCAB, (3,), generator=g)]))
    return seqs


def _deep_chain(g):
    chain = torch.randint(1, VOCAB, (70,), generator=g)
    return [chain, torch.cat([chain[:41], torch.tensor([VOCAB - 1])]), chain[:23].clone()]


def _tile_boundaries(g):
    """Subtrees that end at tile boundaries: a 17-token root (only the second tile's first query
    sees the first key tile), a 15-token root ending a tile, a 47-deep chain whose one-token
    branches start and end at tile edges."""
    rand = lambda n: torch.randint(1, VOCAB, (n,), generator=g)  # noqa: E731
    a, b, c = rand(17), rand(15), rand(47)
    a[0], b[0], c[0] = 1, 2, 3  # three roots
    return [a, b, c, torch.cat([c[:16], rand(1)]), torch.cat([c[:31], rand(1)])]


def tree_of(kind: str):
    """A packed tree: ``random_odd`` (random sharing, an odd unpadded length), ``one_token``
    (one-token branches), ``deep_chain`` (a 70-deep chain with a one-token branch), ``padded``
    (branching sequences padded to a multiple of 16: padding roots), ``boundaries`` (subtrees
    ending at tile edges, see :func:`_tile_boundaries`)."""
    g = torch.Generator().manual_seed(5)
    seqs, block = {
        "random_odd": (lambda: (random_trie_sequences(4, 6, 30), 1)),
        "one_token": (lambda: (_one_token_branches(g), 1)),
        "deep_chain": (lambda: (_deep_chain(g), 1)),
        "padded": (lambda: (branching_sequences()[:6], 16)),
        "boundaries": (lambda: (_tile_boundaries(g), 2)),
    }[kind]()
    tree = pack(seqs, block_size=block, max_tokens=1024)[0]["tree"]
    if kind == "random_odd":
        assert tree.padded_length % 2 == 1, tree.padded_length
    if kind == "padded":
        assert tree.padded_length > tree.num_tree_tokens
    return tree


# ------------------------------------------------------------------------------ fp32 parity


CASES = {
    # name: (tree, heads, groups, dim, value_dim, window, sink)
    "random_odd": ("random_odd", 2, 1, 8, None, None, None),
    "one_token_branches": ("one_token", 2, 1, 8, None, None, None),
    "deep_chain": ("deep_chain", 2, 1, 8, None, None, None),
    "padding_roots": ("padded", 2, 1, 8, None, None, None),
    "tile_boundaries": ("boundaries", 2, 1, 8, None, None, None),
    "mha": ("padded", 2, 2, 16, None, None, None),
    "gqa_4_per_group_2_groups": ("random_odd", 8, 2, 8, None, None, None),
    "mla_dims_24_16": ("random_odd", 2, 1, 24, 16, None, None),
    "window_3": ("deep_chain", 2, 1, 8, None, 3, None),
    "window_0": ("padded", 2, 1, 8, None, 0, None),
    "sink_zeros": ("one_token", 2, 1, 8, None, None, "zeros"),
    "window_7_sink_learned": ("padded", 2, 1, 8, None, 7, "learned"),
    "mla_window_sink": ("random_odd", 2, 1, 24, 16, 2, "learned"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_brute_force_fp32(interpreter, case):
    """Forward and backward (q, k, v, and the sink when learned) in fp32 against fp64."""
    kind, heads, groups, dim, value_dim, window, sink_kind = CASES[case]
    tree = tree_of(kind)
    n = tree.padded_length
    q, k, v, grad_out = _inputs(n, n, heads=heads, groups=groups, dim=dim, value_dim=value_dim)
    sink = _sink(sink_kind, heads)
    learned = sink_kind == "learned"
    tensors = [q, k, v] + ([sink] if learned else [])
    visible = _visible(tree, window)
    want = _fwd_bwd(lambda q, k, v, s=sink: _brute(q, k, v, visible, s), tensors, grad_out)
    mask = tree_attention_mask(tree)
    window_size = None if window is None else (window, 0)

    def kernel(q, k, v, s=None):
        return tree_attention(
            q,
            k,
            v,
            mask,
            backend="triton",
            block_size=TILE,
            window_size=window_size,
            softmax_offset=s,
        )

    if sink is not None and not learned:
        kernel = functools.partial(kernel, s=sink.float())
    got = _fwd_bwd(kernel, [t.float() for t in tensors], grad_out)
    fwd, grad = _errors(got, want)
    _report(f"{case} (N={n})", fwd, grad, FP32_ATTN_TOL)
    assert got[0].shape == (n, 1, heads * (value_dim or dim)) and got[0].dtype == torch.float32
    assert fwd <= FP32_ATTN_TOL and grad <= FP32_ATTN_TOL, (fwd, grad)


def test_micro_batch_rows_and_mask_forms(interpreter):
    """b = 2 rows with a mask row each ([2, N] subtree_end) and with one shared mask, and the dense
    bool mask (converted to the encoding)."""
    trees = [tree_of("padded"), pack(branching_sequences(1)[:6], block_size=16)[0]["tree"]]
    n = trees[0].padded_length
    assert trees[1].padded_length == n
    q, k, v, grad_out = _inputs(n, n, b=2)
    visible = torch.stack([_visible(t, 3) for t in trees])
    want = _fwd_bwd(lambda q, k, v: _brute(q, k, v, visible), [q, k, v], grad_out)
    ends = torch.stack([t.subtree_end for t in trees])

    def run(mask):
        return functools.partial(
            tree_attention,
            attention_mask=mask,
            backend="triton",
            block_size=TILE,
            window_size=(3, 0),
        )

    fwd, grad = _errors(_fwd_bwd(run(ends), [t.float() for t in (q, k, v)], grad_out), want)
    _report("b=2 rows, [2, N] mask, window 3", fwd, grad, FP32_ATTN_TOL)
    assert fwd <= FP32_ATTN_TOL and grad <= FP32_ATTN_TOL
    shared = torch.stack([_visible(trees[0], 3)] * 2)
    want = _fwd_bwd(lambda q, k, v: _brute(q, k, v, shared), [q, k, v], grad_out)
    dense = build_attention_mask_from_trie(trees[0])  # one mask for both rows
    fwd, grad = _errors(_fwd_bwd(run(dense), [t.float() for t in (q, k, v)], grad_out), want)
    _report("b=2 rows, one dense [N, N] mask", fwd, grad, FP32_ATTN_TOL)
    assert fwd <= FP32_ATTN_TOL and grad <= FP32_ATTN_TOL


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_rows(interpreter, cp):
    """Each CP rank's rows (scattered query positions) against the whole tree's keys, with a
    window and a learned sink, forward and backward (the rank's share of dK / dV)."""
    tree = tree_of("padded")
    n = tree.padded_length
    q, k, v, grad_out = _inputs(n, n)
    sink = _sink("learned")
    visible = _visible(tree, 7)
    for rank in range(cp):
        split = context_parallel_split(tree, cp, rank, unit=4 if cp == 4 else None)
        rows = split.local_positions
        want = _fwd_bwd(
            lambda q, k, v, s, rows=rows: _brute(q, k, v, visible[rows], s),
            [q[rows], k, v, sink],
            grad_out[rows],
        )
        mask = tree_attention_mask(tree, split)
        assert mask.plan.query_positions is not None

        def kernel(q, k, v, s, mask=mask):
            return tree_attention(
                q,
                k,
                v,
                mask,
                backend="triton",
                block_size=TILE,
                window_size=(7, 0),
                softmax_offset=s,
            )

        got = _fwd_bwd(kernel, [t.float() for t in (q[rows], k, v, sink)], grad_out[rows])
        fwd, grad = _errors(got, want)
        _report(f"cp={cp} rank {rank} rows, window 7, learned sink", fwd, grad, FP32_ATTN_TOL)
        assert fwd <= FP32_ATTN_TOL and grad <= FP32_ATTN_TOL


def test_trunk_rows(interpreter):
    """A trunk-reuse part that extends stored trunk keys: its rows are some of the group tree's
    positions, its keys the stored trunk's followed by its own (key coordinates, read off the
    tree's encoding by TreeRows), with a window."""
    packed = build_packed_tree_batch(
        pad_sequences(trunk_sequences()),
        max_tokens_per_mb=64,
        block_size=16,
        pad_to_max=False,
        share_trunks=True,
    )
    parts = [mb["rows"] for mb in packed if mb["rows"].stored is not None]
    assert parts
    checked = 0
    for rows in parts[:2]:
        group = rows.tree
        visible = _visible(group, 5)[rows.positions][:, rows.key_positions]
        q, k, v, grad_out = _inputs(group.padded_length, group.padded_length, seed=checked)
        q, k, v = q[rows.positions], k[rows.key_positions], v[rows.key_positions]
        grad_out = grad_out[rows.positions]
        want = _fwd_bwd(lambda q, k, v, vis=visible: _brute(q, k, v, vis), [q, k, v], grad_out)
        mask = tree_attention_mask(rows, store=KeyValueStore(requires_grad=False))
        assert mask.plan.query_positions is not None and k.shape[0] < group.padded_length
        got = _fwd_bwd(
            lambda q, k, v, m=mask: tree_attention(
                q, k, v, m, backend="triton", block_size=TILE, window_size=(5, 0)
            ),
            [t.float() for t in (q, k, v)],
            grad_out,
        )
        fwd, grad = _errors(got, want)
        _report(
            f"trunk part rows={rows.num_rows} keys={rows.num_keys}, window 5",
            fwd,
            grad,
            FP32_ATTN_TOL,
        )
        assert fwd <= FP32_ATTN_TOL and grad <= FP32_ATTN_TOL
        checked += 1
    assert checked


# ------------------------------------------------------------------------------ fp16 / bf16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_within_twice_a_plain_run(interpreter, dtype):
    """fp16 / bf16 inputs, fp32 accumulation: the kernel's error against fp64 (output and every
    gradient) is at most 2x that of the same brute force run plainly in the low precision. (In the
    interpreter a bf16 tile is converted to fp32 before each product; on a GPU it is not.)"""
    tree = tree_of("padded")
    n = tree.padded_length
    q, k, v, grad_out = _inputs(n, n, dim=16)
    sink = _sink("learned")
    visible = _visible(tree, 7)
    brute = lambda q, k, v, s: _brute(q, k, v, visible, s)  # noqa: E731
    want = _fwd_bwd(brute, [q, k, v, sink], grad_out)
    plain = _fwd_bwd(brute, [t.to(dtype) for t in (q, k, v, sink)], grad_out)

    def kernel(q, k, v, s):
        return tree_attention(
            q,
            k,
            v,
            tree_attention_mask(tree),
            backend="triton",
            block_size=TILE,
            window_size=(7, 0),
            softmax_offset=s,
        )

    got = _fwd_bwd(kernel, [*(t.to(dtype) for t in (q, k, v)), sink.float()], grad_out)
    assert got[0].dtype == dtype and got[1][0].dtype == dtype
    names = ("out", "dq", "dk", "dv", "dsink")
    got, plain, want = ([o.detach(), *g] for o, g in (got, plain, want))
    for name, a, p, w in zip(names, got, plain, want):
        err, bar = float((a.double() - w).abs().max()), float((p.double() - w).abs().max())
        print(f"PARITY {dtype} {name}: kernel {err:.2e} plain {bar:.2e}")
        assert err <= BF16_FACTOR * bar, (name, err, bar)


# ------------------------------------------------------------------------------ tiles


def _tile_pairs(visible: torch.Tensor, shape: tuple[int, int]):
    """(any visible pair, every real pair visible): bool [query tiles, key tiles] of a [nq, nk]
    visibility padded to whole tiles."""
    nq, nk = visible.shape
    padded = torch.zeros(shape[0] * TILE, shape[1] * TILE, dtype=torch.bool)
    real = torch.zeros_like(padded)
    padded[:nq, :nk], real[:nq, :nk] = visible, True
    tiles, real = (t.view(shape[0], TILE, shape[1], TILE) for t in (padded, real))
    return tiles.any(3).any(1), (tiles | ~real).all(3).all(1)


@pytest.mark.parametrize("window", [None, 2])
def test_tile_decisions(interpreter, window):
    """The kernel's own per-tile decisions (counted by its COUNT flag) are the host rule's
    (:func:`tile_kinds`); that rule skips only tiles without a visible pair and calls full only
    tiles whose every pair is visible; on whole trees it is the FlexAttention block mask's."""
    ta = interpreter
    for kind in ("deep_chain", "padded"):
        tree = tree_of(kind)
        n = tree.padded_length
        visible = _visible(tree, window)
        plans = [("whole", tree_attention_mask(tree).plan, visible)]
        if kind == "padded":  # a CP split needs a length divisible by the CP size
            split = context_parallel_split(tree, 2, 1, unit=8)
            rows = split.local_positions
            plans.append(("cp rank 1", tree_attention_mask(tree, split).plan, visible[rows]))
        for name, plan, vis in plans:
            queries = plan.query_positions
            kinds = ta.tile_kinds(tree.subtree_end, queries, block_size=TILE, window=window)
            any_pair, all_pairs = _tile_pairs(vis, tuple(kinds.shape))
            assert not bool((any_pair & (kinds == 0)).any()), name  # skipped: no visible pair
            assert bool(all_pairs[kinds == 1].all()), name  # full: every pair visible
            nq = vis.shape[0]
            q, k, v, _ = _inputs(nq, n)
            counted = ta.count_tile_kinds(
                q.float(), k.float(), v.float(), plan, block_size=TILE, window=window
            )
            # The kernel's loop over key tiles stops at the diagonal (its tile's last query).
            positions = torch.arange(n) if queries is None else queries
            last = positions[torch.clamp(torch.arange(1, kinds.shape[0] + 1) * TILE, max=nq) - 1]
            reached = torch.arange(kinds.shape[1])[None, :] <= (last // TILE)[:, None]
            heads = q.shape[2]
            host = {
                name: int(((kinds == code) & reached).sum()) * heads
                for code, name in enumerate(("skipped", "full", "partial"))
            }
            print(f"TILES {kind} {name} window={window}: kernel {counted} host {host}")
            assert counted == host, (kind, name)
            if queries is None and n % TILE == 0:
                any_allowed, all_allowed = tree_block_layout(tree, TILE, window=window)
                assert torch.equal(any_allowed, kinds > 0)
                assert torch.equal(all_allowed, kinds == 1)


def test_errors_name_the_argument(interpreter, monkeypatch):
    tree = tree_of("one_token")
    n = tree.padded_length
    q, k, v, _ = (t.float() for t in _inputs(n, n))
    mask = tree_attention_mask(tree)
    with pytest.raises(
        ValueError, match=r"triton backend has no attention dropout \(dropout_p=0.1\)"
    ):
        tree_attention(q, k, v, mask, backend="triton", dropout_p=0.1)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32 inputs, got torch.float64"):
        tree_attention(q.double(), k.double(), v.double(), mask, backend="triton")
    with pytest.raises(ValueError, match="block_size=8: .* power of two >= 16"):
        tree_attention(q, k, v, mask, backend="triton", block_size=8)
    with pytest.raises(ValueError, match="one dtype, got torch.float32, torch.float16"):
        tree_attention(q, k.half(), v, mask, backend="triton")
    monkeypatch.setattr(interpreter, "interpreted", lambda: False)
    with pytest.raises(
        ValueError, match="runs on CUDA tensors, or on CPU tensors in Triton's interp"
    ):
        tree_attention(q, k, v, mask, backend="triton")


# ------------------------------------------------------------------------------ broken on purpose


def _load(name: str, source: str, tmp_path: Path):
    """``source`` imported as module ``name`` from a file of its own (the interpreter reads each
    kernel's source), its kernels interpreted."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return module


def _broken_module(tmp_path: Path, old: str, new: str):
    """The launch module over a copy of the kernels with ``old`` replaced by ``new`` in their
    source, both imported (interpreted) from files of their own."""
    kernels = Path(importlib.util.find_spec(KERNELS).origin).read_text()
    assert kernels.count(old) >= 1, old
    broken_kernels = _load("broken_triton_kernels", kernels.replace(old, new), tmp_path)
    source = Path(importlib.util.find_spec(MODULE).origin).read_text()
    for name in ("tree", "triton_tiles"):
        source = source.replace(f"from .{name} import", f"from megatron_tree.core.{name} import")
    source = source.replace("from .triton_kernels import", "from broken_triton_kernels import")
    sys.modules["broken_triton_kernels"] = broken_kernels
    try:
        module = _load("broken_triton_attention", source, tmp_path)
    finally:
        del sys.modules["broken_triton_kernels"]
    assert module.interpreted()
    return module


@pytest.mark.parametrize(
    "bug",
    [
        # The key-tile loop stops one tile short: the diagonal tile (each query's own key) is lost.
        ("for j in range(0, qmax // BLOCK_N + 1):", "for j in range(0, qmax // BLOCK_N):"),
        # A key tile seen only by the query tile's first query is skipped.
        (
            "visit = (kstart <= qmax) & (max_end > qmin)",
            "visit = (kstart <= qmax) & (max_end > qmin + 1)",
        ),
        # A key tile whose shortest subtree ends at the query tile's last query counts as full.
        ("(min_end > qmax)", "(min_end >= qmax)"),
        # The dK / dV kernel's walk over query tiles stops one tile short.
        (
            "range(first_row // BLOCK_M, (end_row + BLOCK_M - 1) // BLOCK_M)",
            "range(first_row // BLOCK_M, end_row // BLOCK_M)",
        ),
    ],
    ids=["loop_bound", "visit_bound", "full_bound", "dkdv_row_bound"],
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the broken kernels divide by 0
def test_a_broken_tile_bound_fails_parity(interpreter, tmp_path, bug):
    """Off-by-one tile bounds, made on purpose in a copy of the kernels, fail the parity check
    that the intact kernels pass (the ``tile_boundaries`` case above): forward or gradients."""
    broken = _broken_module(tmp_path, *bug)
    tree = tree_of("boundaries")
    n = tree.padded_length
    q, k, v, grad_out = _inputs(n, n)
    visible = _visible(tree)
    want = _fwd_bwd(lambda q, k, v: _brute(q, k, v, visible), [q, k, v], grad_out)
    plan = tree_attention_mask(tree).plan

    def kernel(q, k, v):
        return broken.triton_tree_attention(q, k, v, plan, scale=8**-0.5, block_size=TILE)

    fwd, grad = _errors(_fwd_bwd(kernel, [t.float() for t in (q, k, v)], grad_out), want)
    print(f"BROKEN {bug[1]!r}: fwd {fwd:.2e} grad {grad:.2e}")
    assert not (fwd <= FP32_ATTN_TOL and grad <= FP32_ATTN_TOL)  # NaN fails too
