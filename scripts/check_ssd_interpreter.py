"""Check ``tree_ssd_mamba_ssm`` (mamba_ssm's Triton SSD kernels on a packed tree) on a CPU, in
Triton's interpreter, against a token-by-token recurrence on each sequence alone; print the kernel
calls per layer of a GRPO trie and a multi-turn agent trie.

CI runs the same check as a test on the stack with mamba-ssm (``MEGATRON_TREE_BRIDGE=kernels bash
scripts/test.sh tests/test_recurrent_kernels.py``, against the pure-torch tree SSD). This script
prints more (timings, the kernel calls of large tries); it runs in that stack's venv
(``.venv-python3-kernels``) or in a scratch venv outside the repository (torch and Triton >= 3 from
the project's Python 3.12 venv):

    python3.12 -m venv /tmp/mamba-venv
    echo "$PWD/.venv-python3.12/lib/python3.12/site-packages" \\
        > /tmp/mamba-venv/lib/python3.12/site-packages/base_venv.pth
    MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE /tmp/mamba-venv/bin/pip install \\
        --no-deps --no-build-isolation mamba-ssm==2.3.2.post1
    /tmp/mamba-venv/bin/python scripts/check_ssd_interpreter.py [--no-backward] [--heads 2]
        [--groups 1] [--chunk 8]

Interpreter runs are slow (numpy per program instance): sizes are tiny (buckets <= 40 tokens,
P = N = 8, chunk 8 so that segments span several chunks). fp32 throughout (the interpreter has no
bf16 ``tl.dot``). The reference is written here, independent of megatron_tree's recurrences; the
tree's structure comes from the packer (``sequence_token_index``), the plan from ``subtree_end``.
Exit status 1 when an error exceeds ``--tol``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported: run kernels in numpy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def install_test_only_shims() -> None:
    """TEST-ONLY SHIMS, for running mamba_ssm's Triton kernels on CPU tensors in the interpreter.
    None touches the math: each replaces a CUDA-only device/launch utility around the kernels."""
    # mamba_ssm/__init__ imports its compiled selective scan, absent from a MAMBA_SKIP_CUDA_BUILD
    # install; the SSD kernels do not use it. (causal_conv1d's imports are guarded: no stub.)
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    # Every launch sits in `with torch.cuda.device(t.device.index)`: a CPU tensor has no CUDA
    # device.
    torch.cuda.device = lambda *_a, **_k: contextlib.nullcontext()
    # The backward sizes its head split by the SM count (work split only, not the result).
    torch.cuda.get_device_properties = lambda *_a, **_k: types.SimpleNamespace(
        multi_processor_count=132
    )
    # The autotuner times each config with CUDA events; the interpreter has no benchmarker. Equal
    # timings: it takes the first config (configs differ in tiling only).
    from triton.runtime.autotuner import Autotuner

    Autotuner._bench = lambda self, *a, config, **k: 1.0


# ------------------------------------------------------------------------------------ reference
def naive_ssd(x, dt, A, B, C):
    """One sequence, token by token: x [L, H, P], dt [L, H], A [H], B, C [L, G, N] -> [L, H, P]."""
    rep = x.shape[1] // B.shape[1]
    Bh, Ch = B.repeat_interleave(rep, 1), C.repeat_interleave(rep, 1)  # [L, H, N]
    state = x.new_zeros(x.shape[1], x.shape[2], B.shape[2])  # [H, P, N]
    out = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A)[:, None, None]
        state = decay * state + (dt[t][:, None] * x[t])[:, :, None] * Bh[t][:, None, :]
        out.append(state @ Ch[t][:, :, None])
    return torch.stack(out)[..., 0]


def reference_tree(tree, x, dt, A, B, C):
    """Every position's output from its root path alone: each sequence (packer's token index) run
    by :func:`naive_ssd`; a position in no sequence (padding) is a root alone."""
    y = x.new_zeros(x.shape)
    covered = torch.zeros(x.shape[0], dtype=torch.bool)
    for i in range(tree.num_sequences):
        idx = tree.sequence_token_index(i)
        y = y.index_put((idx,), naive_ssd(x[idx], dt[idx], A, B[idx], C[idx]))
        covered[idx] = True
    for q in (~covered).nonzero()[:, 0].tolist():
        s = slice(q, q + 1)
        y = y.index_put((torch.tensor([q]),), naive_ssd(x[s], dt[s], A, B[s], C[s]))
    return y


# ---------------------------------------------------------------------------------------- tries
def _pack(seqs, capacity, block):
    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.testing.synthetic import pad_sequences

    return build_packed_tree_batch(
        pad_sequences(seqs), max_tokens_per_mb=capacity, block_size=block, share_trunks=False
    )[0]["tree"]


def small_tree():
    """Two roots: a 10-token stem (over a chunk) -> a one-token branch point -> a 12-token and a
    3-token leaf, and a 20-token leaf; a one-token root with leaves of 9 and 2 tokens; a chain of
    one-token segments each with a 2-token leaf; padding positions to a block of 8."""
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
    return _pack(seqs, capacity=256, block=8)


def grpo_tree():
    """1 prompt of 256 tokens x 8 samples of 64..256 tokens."""
    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.testing.synthetic import grpo_batch

    batch = grpo_batch(
        num_prompts=1, samples_per_prompt=8, prompt_len=256, response_len=(64, 256), seed=3
    )
    return build_packed_tree_batch(
        batch, max_tokens_per_mb=4096, block_size=1, pad_to_max=False, share_trunks=False
    )[0]["tree"]


def agent_tree(turns=4, ways=3, seed=5):
    """A 256-token system+task prompt, then ``turns`` turns (observation + action, 64..224 tokens)
    branching ``ways`` ways each: ways**turns leaf sequences."""
    g = torch.Generator().manual_seed(seed)

    def grow(history, depth):
        if depth == turns:
            return [history]
        out = []
        for _ in range(ways):
            n = int(torch.randint(64, 225, (), generator=g))
            out += grow(torch.cat([history, torch.randint(1, 32000, (n,), generator=g)]), depth + 1)
        return out

    seqs = grow(torch.randint(1, 32000, (256,), generator=g), 0)
    return _pack(seqs, capacity=1 << 16, block=1)


# ----------------------------------------------------------------------------------------- main
def inputs(k, heads, groups, p=8, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, heads, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(k, heads, generator=g) - 1).clamp(1e-3, 2.0)
    A = -torch.exp(torch.rand(heads, generator=g) * 1.5 - 1)
    B = torch.randn(k, groups, n, generator=g)
    C = torch.randn(k, groups, n, generator=g)
    return x, dt, A, B, C


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--tol", type=float, default=1e-4, help="max error / max |reference|")
    args = parser.parse_args()

    install_test_only_shims()
    from megatron_tree.core.recurrent import RecurrentPlan
    from megatron_tree.mcore.ssd_kernels import kernel_calls, tree_ssd_mamba_ssm

    ok = True
    tree = small_tree()
    plan = RecurrentPlan(tree.subtree_end)
    lengths = [int((b.index < plan.num_positions).sum(1).max()) for lv in plan.buckets for b in lv]
    print(
        f"small tree: {plan.num_positions} positions, {tree.num_sequences} sequences, "
        f"{plan.num_segments} segments, {plan.num_levels} levels, {kernel_calls(plan)} kernel "
        f"calls (bucket lengths {lengths}), H={args.heads} G={args.groups} P=N=8 chunk={args.chunk}"
    )
    leaves = inputs(plan.num_positions, args.heads, args.groups)
    leaves = [t.requires_grad_(not args.no_backward) for t in leaves]
    start = time.time()
    y = tree_ssd_mamba_ssm(*leaves, plan, chunk=args.chunk)
    print(f"forward in the interpreter: {time.time() - start:.1f}s")
    ref_leaves = [t.detach().double().requires_grad_(not args.no_backward) for t in leaves]
    y_ref = reference_tree(tree, *ref_leaves)
    err = (y.double() - y_ref).abs().max().item()
    scale = y_ref.abs().max().item()
    print(f"forward: max |err| {err:.2e} (max |y| {scale:.2f}, relative {err / scale:.2e})")
    ok &= err <= args.tol * scale

    if not args.no_backward:
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
        start = time.time()
        try:
            grads = torch.autograd.grad((y * w).sum(), leaves)
        except Exception as exc:  # report what the interpreter cannot run, keep the rest
            print(f"backward FAILED in the interpreter: {type(exc).__name__}: {exc}")
            ok = False
        else:
            print(f"backward in the interpreter: {time.time() - start:.1f}s")
            want = torch.autograd.grad((y_ref * w.double()).sum(), ref_leaves)
            for name, got, ref in zip(("dx", "ddt", "dA", "dB", "dC"), grads, want):
                e, s = (got.double() - ref).abs().max().item(), ref.abs().max().item()
                print(f"  {name}: max |err| {e:.2e} (max |ref| {s:.2f}, relative {e / s:.2e})")
                ok &= e <= args.tol * s

    for name, build in (
        ("GRPO (1 prompt of 256 x 8 samples of 64..256)", grpo_tree),
        ("agent (256-token prompt, 4 turns of 64..224 tokens, 3 ways each)", agent_tree),
    ):
        t = build()
        p = RecurrentPlan(t.subtree_end)
        print(
            f"{name}: {p.num_positions} positions, {t.num_sequences} sequences, "
            f"{p.num_segments} segments, {p.num_levels} levels -> {kernel_calls(p)} "
            "mamba_chunk_scan_combined calls per layer (forward)"
        )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
