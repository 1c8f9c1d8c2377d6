"""The recurrent layers' GPU paths on a CPU: mamba_ssm's and fla's Triton kernels on a packed tree.

* Mamba-2 (:func:`~megatron_tree.mcore.ssd_kernels.tree_ssd_mamba_ssm`): mamba_ssm 2.3.2.post1's
  ``mamba_chunk_scan_combined`` run in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors,
  forward and gradients, against the pure-torch tree SSD in fp64 (the check of
  ``scripts/check_ssd_interpreter.py`` as a test).
* Gated delta-net (:func:`~megatron_tree.mcore.gdn_kernels.tree_gated_delta_rule_fla`): fla-core
  0.6.0's ``chunk_gated_delta_rule`` does not run in the interpreter: its state kernel
  ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` (``fla/ops/common/chunk_delta_h.py``) calls
  ``i_t.to(tl.int64)`` on the loop index of ``for i_t in range(NT)``, a Python int in the
  interpreter (a tensor when compiled): ``InterpreterError: AttributeError("'int' object has no
  attribute 'to'")``. :func:`test_fla_kernel_in_the_interpreter` pins exactly that failure (and
  turns into a parity test the day it runs). Everything around the kernel call (the level layout,
  ``cu_seqlens``, the per-segment initial states, the final states kept for the next level, the
  gradient routed back to each segment's parent) is tested with a pure-torch rule standing in for
  fla's call, behind fla's signature and its argument checks; these tests need neither package and
  run in every stack.

The interpreter tests need mamba-ssm and fla-core, which only the ``MEGATRON_TREE_BRIDGE=kernels``
stack installs (CI runs this file there); elsewhere they skip with the install command. Their
shims (test-only, none touching the kernels' math) are installed for this module only and put
back after: a stub for mamba_ssm's compiled ``selective_scan_cuda`` (the SSD kernels do not use
it), ``torch.cuda.device`` as a null context (every launch enters it), an SM count for the
backward's work split, and the autotuner's benchmark as a constant (one config; the interpreter
has no benchmarker). Sizes are tiny (72 positions, P = N = 8, chunk 8): about a minute of CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
import types

import pytest
import torch

from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.recurrent import (
    RecurrentPlan,
    chunk_gated_delta_rule,
    gated_delta_rule_reference,
    l2norm,
    tree_gated_delta_rule,
    tree_ssd,
)
from megatron_tree.mcore import gdn_kernels
from megatron_tree.testing.synthetic import pad_sequences

KERNELS_SETUP = (
    "MEGATRON_TREE_BRIDGE=kernels bash scripts/setup_env.sh (or, into a venv with torch and "
    "triton: MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE pip install --no-deps "
    "--no-build-isolation mamba-ssm==2.3.2.post1 einops && pip install --no-deps fla-core==0.6.0)"
)
TOL = 1e-4  # fp32 kernels vs the fp64 torch path: max |err| / max |reference| (seen: <= 3e-7)
STATE_TOL = 1e-6  # fp64 inputs, fp32 states between levels (as fla's): seen 8e-9 fwd, 2.8e-8 grads
FLA_INTERPRETER_ERROR = "'int' object has no attribute 'to'"


# ------------------------------------------------------------------------------------ trees
def small_tree():
    """Two roots: a 10-token stem (over a chunk of 8) -> a one-token branch point -> a 12-token and
    a 3-token leaf, and a 20-token leaf; a one-token root with leaves of 9 and 2 tokens; a chain of
    one-token segments each with a 2-token leaf; padding to a block of 8. 72 positions, 16
    segments, 3 levels."""
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(1, 1000, (n,), generator=g)  # noqa: E731
    stem = rand(10)
    one = torch.cat([stem, rand(1)])
    seqs = [torch.cat([one, rand(12)]), torch.cat([one, rand(3)]), torch.cat([stem, rand(20)])]
    root = rand(1)
    seqs += [torch.cat([root, rand(9)]), torch.cat([root, rand(2)])]
    ladder = rand(3)
    for _ in range(3):
        seqs.append(torch.cat([ladder, rand(2)]))
        ladder = torch.cat([ladder, rand(1)])
    return build_packed_tree_batch(
        pad_sequences(seqs), max_tokens_per_mb=256, block_size=8, share_trunks=False
    )[0]["tree"]


def paths(tree):
    """Every position's root path: each sequence's token index, and padding positions alone."""
    out = [tree.sequence_token_index(i) for i in range(tree.num_sequences)]
    covered = torch.zeros(tree.padded_length, dtype=torch.bool)
    for idx in out:
        covered[idx] = True
    return out + [torch.tensor([q]) for q in (~covered).nonzero()[:, 0].tolist()]


def max_rel(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


# ------------------------------------------------------------------- gated delta-net: the glue
def gdn_inputs(n, heads=2, dk=8, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, heads, dk, generator=g, dtype=dtype)) * dk**-0.5
    k = l2norm(torch.randn(n, heads, dk, generator=g, dtype=dtype))
    v = torch.randn(n, heads, dv, generator=g, dtype=dtype)
    gate = -torch.rand(n, heads, generator=g, dtype=dtype) * 1.5
    beta = torch.rand(n, heads, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


class TorchFla:
    """fla's ``chunk_gated_delta_rule`` signature and varlen contract, computed by the pure-torch
    chunked rule per sequence (chunk 4: segments span several chunks). Checks what fla requires
    of a varlen call and records each call's layout."""

    def __init__(self):
        self.calls = []

    def __call__(
        self,
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        cu_seqlens=None,
        **kwargs,
    ):
        assert not kwargs, kwargs
        assert q.shape[0] == 1 and cu_seqlens is not None, "varlen: batch 1 with cu_seqlens"
        assert q.shape == k.shape and v.shape[:3] == q.shape[:3] and g.shape == q.shape[:3]
        assert beta.shape == g.shape and g.dtype == torch.float32, "g: fp32 log decays"
        assert cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1
        assert int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == q.shape[1]
        lengths = torch.diff(cu_seqlens)
        assert bool((lengths > 0).all()), "no empty segment"
        n = len(lengths)
        if initial_state is not None:
            assert initial_state.shape == (n, q.shape[2], q.shape[3], v.shape[3])
            assert initial_state.dtype == torch.float32
        self.calls.append((lengths.tolist(), initial_state is not None, output_final_state))
        outs, finals = [], []
        for i, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            h0 = None if initial_state is None else initial_state[i : i + 1]
            o, ht = chunk_gated_delta_rule(
                q[:, s:e] * (q.shape[-1] ** -0.5 if scale is None else scale),
                k[:, s:e],
                v[:, s:e],
                g[:, s:e],
                beta[:, s:e],
                initial_state=h0,
                chunk=4,
                final_state=output_final_state,
            )
            outs.append(o)
            finals.append(ht)
        final = torch.cat(finals).float() if output_final_state else None
        return torch.cat(outs, 1), final


def gdn_reference(tree, q, k, v, g, beta):
    """Every position's output from its root path alone, token by token (the definition)."""
    out = torch.zeros(v.shape, dtype=v.dtype)
    for idx in paths(tree):
        want, _ = gated_delta_rule_reference(q[idx], k[idx], v[idx], g[idx], beta[idx])
        out = out.index_put((idx,), want)
    return out


@pytest.fixture(scope="module")
def gdn_case():
    tree = small_tree()
    plan = RecurrentPlan(tree.subtree_end)
    inputs = gdn_inputs(tree.padded_length)
    want = gdn_reference(tree, *inputs)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=want.dtype)
    want_grads = torch.autograd.grad((want * w).sum(), inputs)
    return tree, plan, inputs, w, want, want_grads


def test_level_layout_cuts_each_level_into_its_segments(gdn_case):
    """One call per level: its segments' positions in order, cu_seqlens from their lengths, each
    segment's state slot its parent segment's, the kept slots numbered in processing order."""
    tree, plan, *_ = gdn_case
    seen, slots = [], [None]  # slot i -> the segment (first position, last position) it holds
    for level in range(plan.num_levels):
        positions, cu, init, keep = gdn_kernels.level_layout(plan, level)
        assert cu.dtype == torch.int64 and int(cu[0]) == 0 and int(cu[-1]) == len(positions)
        segs = [positions[s:e] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
        for seg, slot in zip(segs, init.tolist()):
            assert torch.equal(seg, torch.arange(int(seg[0]), int(seg[-1]) + 1))  # contiguous
            parent = int(tree.parent_index[seg[0]])
            if slot == 0:
                assert parent == -1, "a non-root segment starts from zeros"
            else:
                assert slots[slot][1] == parent, "a segment starts from its parent's final state"
        kept = [] if keep is None else keep.tolist()
        slots += [(int(segs[i][0]), int(segs[i][-1])) for i in kept]
        seen.append(positions)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(plan.num_positions))
    assert gdn_kernels.kernel_calls(plan) == plan.num_levels == 3
    with pytest.raises(ValueError, match="level=3"):
        gdn_kernels.level_layout(plan, 3)


def test_fla_glue_matches_each_sequence_alone(gdn_case):
    """tree_gated_delta_rule_fla with the torch rule behind fla's signature: outputs and the
    gradients of q, k, v, g, beta equal the token-by-token rule on each sequence alone (fp64), and
    the pure-torch tree path; one varlen call per level. Within 1e-6: the states handed from
    level to level are fp32, as fla's are (the rest is fp64 here)."""
    tree, plan, inputs, w, want, want_grads = gdn_case
    kernel = TorchFla()
    got = gdn_kernels.tree_gated_delta_rule_fla(*inputs, plan, kernel=kernel)
    grads = torch.autograd.grad((got * w).sum(), inputs)
    assert len(kernel.calls) == plan.num_levels
    assert kernel.calls[0][1] is False and all(c[1] for c in kernel.calls[1:])  # roots from zero
    assert kernel.calls[-1][2] is False  # the leaves' final states are not asked for
    assert max_rel(got, want) < STATE_TOL
    for got_g, want_g in zip(grads, want_grads):
        assert max_rel(got_g, want_g) < STATE_TOL
    torch_path = tree_gated_delta_rule(*(t.detach() for t in inputs), plan)
    assert max_rel(got.detach(), torch_path) < STATE_TOL


def test_fla_glue_routes_a_leafs_gradient_to_its_ancestors_only(gdn_case):
    """A loss on one leaf reaches exactly its root path's positions (through the initial states
    of its segment and its ancestors' segments), nothing on other branches."""
    tree, plan, inputs, *_ = gdn_case
    got = gdn_kernels.tree_gated_delta_rule_fla(*inputs, plan, kernel=TorchFla())
    lengths = [len(tree.sequence_token_index(i)) for i in range(tree.num_sequences)]
    leaf = tree.sequence_token_index(lengths.index(23))  # stem 10 -> branch point -> leaf 12
    dv = torch.autograd.grad(got[leaf[-1]].sum(), inputs[2])[0]
    touched = dv.abs().sum((1, 2)) > 0
    on_path = torch.zeros(plan.num_positions, dtype=torch.bool)
    on_path[leaf] = True
    assert torch.equal(touched, on_path)
    assert plan.parent[leaf[1:]].tolist() == leaf[:-1].tolist()
    children = torch.bincount(plan.parent[plan.parent >= 0], minlength=plan.num_positions)
    assert children[leaf[9]] == 2 and children[leaf[10]] == 2  # 3 segments: 10, 1, 12 tokens


def test_fla_glue_broken_on_purpose_fails(gdn_case, monkeypatch):
    """The parity above sees a wrong initial state row: the segments of each level read their
    parents' states in reverse order."""
    tree, plan, inputs, _, want, _ = gdn_case
    layout = gdn_kernels.level_layout

    def swapped(plan, level):
        positions, cu, init, keep = layout(plan, level)
        return positions, cu, init.flip(0), keep

    monkeypatch.setattr(gdn_kernels, "level_layout", swapped)
    got = gdn_kernels.tree_gated_delta_rule_fla(*inputs, plan, kernel=TorchFla())
    assert max_rel(got.detach(), want) > 1e-2


def test_fla_glue_value_errors(gdn_case):
    tree, plan, inputs, *_ = gdn_case
    q, k, v, g, beta = (t.detach() for t in inputs)
    run = gdn_kernels.tree_gated_delta_rule_fla
    with pytest.raises(ValueError, match=r"q .*want q, k \[K, H, dk\]"):
        run(q[:, 0], k, v, g, beta, plan, kernel=TorchFla())
    with pytest.raises(ValueError, match=r"g .*beta .*want \[K, H\]"):
        run(q, k, v, g[..., None], beta, plan, kernel=TorchFla())
    with pytest.raises(ValueError, match="build the plan from this context's subtree_end"):
        run(q[:-8], k[:-8], v[:-8], g[:-8], beta[:-8], plan, kernel=TorchFla())


def test_gdn_layer_falls_back_with_one_log_line(monkeypatch, caplog):
    """On CUDA without fla the GDN layer runs the torch rule and says so once; on the CPU it never
    asks for fla."""
    pytest.importorskip("megatron.core")
    from megatron_tree.mcore import gated_delta_net as gdn

    cuda_like = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # import fails
    gdn._fla_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=gdn.__name__):
            assert gdn._delta_rule_backend(cuda_like) is tree_gated_delta_rule
            assert gdn._delta_rule_backend(cuda_like) is tree_gated_delta_rule
        lines = [r for r in caplog.records if "without fla's kernels" in r.getMessage()]
        assert len(lines) == 1 and "pip install fla-core" in lines[0].getMessage()
        assert gdn._delta_rule_backend(torch.zeros(1)) is tree_gated_delta_rule
    finally:
        gdn._fla_kernels.cache_clear()


# ------------------------------------------------------------------ the kernels in the interpreter
def _modules(*packages):
    """The imported modules of ``packages``, less triton's compiled extension (loaded once)."""
    return [m for m in sys.modules if m.split(".")[0] in packages and not m.startswith("triton._C")]


@pytest.fixture(scope="module")
def interpreter():
    """mamba_ssm's and fla's kernels imported under TRITON_INTERPRET=1 with the test-only shims;
    everything put back after the module (a GPU run keeps compiled kernels)."""
    missing = [m for m in ("triton", "mamba_ssm", "fla") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the interpreter tests need {', '.join(missing)}: {KERNELS_SETUP}")
    # Triton's own @jit helpers (tl.cumsum's combine function, tl.sigmoid, ...) are built when
    # triton is imported: imported earlier without TRITON_INTERPRET they stay compiled-only and
    # raise inside an interpreted kernel, so triton is imported afresh for this module.
    before = {m: sys.modules.pop(m) for m in _modules("triton", "mamba_ssm", "fla")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # read when a kernel is decorated
        from triton.runtime.autotuner import Autotuner

        # mamba_ssm/__init__ imports its compiled selective scan, absent from a
        # MAMBA_SKIP_CUDA_BUILD install; the SSD kernels do not use it.
        if importlib.util.find_spec("selective_scan_cuda") is None:
            mp.setitem(sys.modules, "selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        # Every launch enters torch.cuda.device(t.device.index): a CPU tensor has no CUDA device.
        mp.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
        # mamba_ssm's backward splits its work by the SM count (the split only, not the result).
        mp.setattr(
            torch.cuda,
            "get_device_properties",
            lambda *a, **k: types.SimpleNamespace(multi_processor_count=132),
        )
        # The autotuner times configs with CUDA events: equal timings, it takes the first.
        mp.setattr(Autotuner, "_bench", lambda self, *a, config, **k: 1.0)
        ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        fla = importlib.import_module("fla.ops.gated_delta_rule")
        yield types.SimpleNamespace(
            mamba_chunk_scan_combined=ssd.mamba_chunk_scan_combined, fla=fla
        )
    for m in _modules("triton", "mamba_ssm", "fla"):
        sys.modules.pop(m)
    sys.modules.update(before)


def ssd_inputs(k, heads=2, groups=1, p=8, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, heads, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(k, heads, generator=g) - 1).clamp(1e-3, 2.0)
    A = -torch.exp(torch.rand(heads, generator=g) * 1.5 - 1)
    B = torch.randn(k, groups, n, generator=g)
    C = torch.randn(k, groups, n, generator=g)
    return [t.requires_grad_() for t in (x, dt, A, B, C)]


@pytest.mark.slow
def test_mamba_ssm_kernels_in_the_interpreter(interpreter, monkeypatch, record_property):
    """tree_ssd_mamba_ssm through mamba_ssm's Triton kernels (interpreter, fp32, chunk 8) equals
    the pure-torch tree SSD in fp64: outputs and the gradients of x, dt, A, B, C; one kernel call
    per (level, bucket)."""
    from megatron_tree.mcore import ssd_kernels

    tree = small_tree()
    plan = RecurrentPlan(tree.subtree_end)
    calls = []
    kernel = interpreter.mamba_chunk_scan_combined
    monkeypatch.setattr(
        ssd_kernels, "_chunk_scan", lambda: lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    leaves = ssd_inputs(plan.num_positions)
    y = ssd_kernels.tree_ssd_mamba_ssm(*leaves, plan, chunk=8)
    assert len(calls) == ssd_kernels.kernel_calls(plan) == 9
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = tree_ssd(*ref_leaves, plan, chunk=8)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((y * w).sum(), leaves)
    want = torch.autograd.grad((y_ref * w.double()).sum(), ref_leaves)
    errors = {"y": max_rel(y.detach(), y_ref.detach())}
    errors.update(
        {n: max_rel(a, b) for n, a, b in zip(("dx", "ddt", "dA", "dB", "dC"), grads, want)}
    )
    for name, err in errors.items():
        record_property(f"rel_err_{name}", f"{err:.1e}")
    from megatron_tree.testing.tolerances import worst_error

    assert worst_error(errors.values()) < TOL, errors


def _known_fla_failure(exc: BaseException) -> str:
    """The interpreter's error text, asserted to be the known one, raised in fla's state kernel."""
    text = f"{type(exc).__name__}: {exc}"
    assert FLA_INTERPRETER_ERROR in text, text
    frames, err = [], exc
    while err is not None:
        tb = err.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        err = err.__cause__
    assert "chunk_gated_delta_rule_fwd_kernel_h_blockdim64" in frames, frames
    return text


@pytest.mark.slow
def test_fla_kernel_in_the_interpreter(interpreter, record_property):
    """fla's chunk_gated_delta_rule on the tree (varlen, per-segment initial states), in the
    interpreter. Today it fails inside its state kernel on the loop index (see the module
    docstring), on level 0 (no initial states) and on level 1's call as the glue makes it (one
    initial state per segment: past fla's argument checks, the same failure): pinned as that
    exact failure; if it ever runs, it must match the torch path."""
    tree = small_tree()
    plan = RecurrentPlan(tree.subtree_end)
    inputs = [t.detach().float().requires_grad_() for t in gdn_inputs(plan.num_positions, dk=16)]
    kernel = interpreter.fla.chunk_gated_delta_rule
    positions, cu, init, _ = gdn_kernels.level_layout(plan, 1)
    q, k, v, g, beta = (t.detach()[positions][None] for t in inputs)
    h0 = torch.randn(
        len(init), *k.shape[2:], v.shape[-1], generator=torch.Generator().manual_seed(2)
    )
    try:  # level 1's call as the glue makes it: it must pass fla's argument checks
        kernel(
            q, k, v, g, beta, scale=1.0, initial_state=h0, output_final_state=True, cu_seqlens=cu
        )
    except Exception as exc:
        _known_fla_failure(exc)
    try:
        got = gdn_kernels.tree_gated_delta_rule_fla(*inputs, plan, kernel=kernel)
    except Exception as exc:  # the interpreter's error, checked to the letter
        text = _known_fla_failure(exc)
        record_property("fla_interpreter_error", text)
        pytest.xfail(
            f"fla's chunk_gated_delta_rule_fwd_kernel_h_blockdim64 in Triton's interpreter: {text}"
        )
    want = tree_gated_delta_rule(*(t.detach().double() for t in inputs), plan)
    assert max_rel(got.detach(), want) < TOL


# ------------------------------------------------------------------------ fla's kernel on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_kernel_on_cuda(dtype, record_property):
    """The one thing the CPU cannot run: fla's compiled kernel on the tree (one varlen call per
    level), against the fp64 torch path, forward and gradients; the bar is twice the error of the
    same kernel on each root path alone (no tree), plus fp32's 1e-3 (tf32 products)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (fla's compiled kernels)")
    fla = pytest.importorskip("fla.ops.gated_delta_rule", reason=f"needs fla-core: {KERNELS_SETUP}")
    kernel = fla.chunk_gated_delta_rule
    dev = torch.device("cuda", 0)
    tree = small_tree()
    plan = RecurrentPlan(tree.subtree_end.to(dev))
    base = [t.detach() for t in gdn_inputs(plan.num_positions, heads=4, dk=64, dv=64, seed=3)]
    w = torch.randn(base[2].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def run(fn, work):
        leaves = [t.to(dev, work).requires_grad_() for t in base]
        out = fn(*leaves)
        grads = torch.autograd.grad((out.float() * w.to(dev).float()).sum(), leaves)
        return [t.detach().double().cpu() for t in (out, *grads)]

    def alone(q, k, v, g, beta):  # every root path as its own sequence (batch 1, no tree)
        out = torch.zeros_like(v)
        for idx in paths(tree):
            idx = idx.to(dev)
            o, _ = kernel(
                *(t[idx][None] for t in (q, k, v)), g[idx][None].float(), beta[idx][None], scale=1.0
            )
            out = out.index_put((idx,), o[0])
        return out

    want = run(lambda *a: tree_gated_delta_rule(*a, plan), torch.float64)
    got = run(lambda *a: gdn_kernels.tree_gated_delta_rule_fla(*a, plan), dtype)
    ref = run(alone, dtype)
    for name, a, b, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, want, ref):
        err, bar = max_rel(a, b), 2 * max_rel(r, b) + 1e-3
        record_property(f"{name}_rel_err", f"{err:.2e} (bar {bar:.2e})")
        assert err <= bar, (name, err, bar)


# ------------------------------------------------------------- compiled for sm_80 and sm_90
def test_third_party_kernels_compile_for_sm80_and_sm90(tmp_path):
    """mamba_ssm's SSD and fla's gated delta-rule kernels, at the shapes our tree wrappers call them
    (Nemotron-H's Mamba-2, Qwen3-Next's gated delta-net; bf16; every level's chunk length), forward
    and backward, compiled for sm_80 and sm_90 on the CPU by ``scripts/compile_kernels.py
    --recurrent`` (the first config of each autotune list; ``--all`` compiles every config, 676,
    docs/gpu.md): each compiles, and the table reports registers, spills and shared memory."""
    import os
    import subprocess
    from pathlib import Path

    missing = [m for m in ("triton", "mamba_ssm", "fla") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: {KERNELS_SETUP}")
    root = Path(__file__).resolve().parents[1]
    table = tmp_path / "recurrent.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "scripts/compile_kernels.py", "--recurrent", "--markdown", str(table)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=root,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cells = [line.split("|")[1:-1] for line in table.read_text().splitlines()]
    rows = [c for c in cells if len(c) == 9 and c[1].strip().startswith("sm_")]  # not the summary
    kernels = {(c[0].split()[1], c[1].strip()) for c in rows}
    for name in (
        "_chunk_scan_fwd_kernel",  # mamba_ssm forward
        "_chunk_scan_chunk_state_bwd_dx_kernel",  # mamba_ssm backward
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",  # fla forward
        "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",  # fla backward
    ):
        assert {(name, "sm_80"), (name, "sm_90")} <= kernels, (name, sorted(kernels)[:5])
    assert all(c[3].strip() == "ok" or c[3].strip().startswith("note:") for c in rows), rows[:3]
