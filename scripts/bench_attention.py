"""Tree attention forward + backward throughput against dense causal flash attention.

    python scripts/bench_attention.py [--lengths 8192 16384 32768] [--rows FILE]
    python scripts/bench_attention.py --small            # CPU smoke run, a few seconds

For each length N one GRPO-shaped tree of exactly N tokens: a prompt of N / 4 tokens (at most
4096) followed by 12 (8K) or 16 responses whose lengths vary by +-40% around their mean, packed by
``build_packed_tree_batch`` (``testing.synthetic.pad_sequences``), so the tree really branches.
On it, ``tree_attention(q, k, v, tree_attention_mask(tree), backend="flex")`` (bf16, head dim 128,
32 query heads in 8 key/value groups, Megatron's [N, 1, heads, dim] layout) runs forward and
backward; the baseline is dense causal attention of one N-token sequence through torch's
``scaled_dot_product_attention(is_causal=True)`` forced to the flash backend
(``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``), same shapes, same GPU.

FLOP convention (both sides): forward = 4 * P * head_dim * query_heads, where P is the number of
*visible* (query, key) pairs (two matmuls, QK^T and PV, of 2 FLOPs per multiply-add over the
allowed pairs only); backward = 2.5 x forward (the five matmuls of a flash backward, the QK^T
recomputation included), so forward + backward = 3.5 x forward. A tree's P is the sum of
(depth + 1) over its real tokens; causal attention has P = N (N + 1) / 2. Masked-out pairs that a
kernel computes anyway (partial tiles) count as no work, so TFLOP/s measures useful throughput.

Timing: one plan per tree (the mask built once, as a micro-batch does); the one-time compile of
flex and the BlockMask build are outside the timed loop (the build is timed on its own: median of
3 fresh builds, reported as "mask ms"). After ``--warmup`` iterations, the median of ``--reps``
iterations, each timed by CUDA events (``time.perf_counter`` on the CPU). An iteration is the
forward and ``torch.autograd.grad`` of the output against a fixed random output gradient.

``--rows FILE`` appends one line per length as soon as it is measured,
``check|value|bar|PASS-or-FAIL`` (the format of scripts/gpu_check.sh's summary), e.g.
``tree attention fwd+bwd 16K|312 TFLOP/s = 61% of causal SDPA flash|>= 50%|PASS``; the bar is
``--bar`` (0.5: at least half of flash attention's throughput per useful pair). The exit status is
non-zero when a length fails with an error (its row then says FAIL with the error), not when a
ratio misses the bar (the row says so).

A last row checks the kernel choice when nothing is shared: one micro-batch of unshared sequences
(``--chains`` of them, lengths +-40% around the mean, the largest length in all) timed with
``backend="auto"`` (which runs the dense causal kernel on each sequence for such a micro-batch)
against the tree kernel (``--backend``) on the same inputs; the bar is that auto is not slower.

``--small``: the same code path on the CPU in seconds: lengths 256 and 512, fp32, 4 query heads in
2 groups of dimension 32, ``backend="block_sparse"`` (torch has no FlexAttention backward on the
CPU; ``--backend triton`` is kept, for Triton's interpreter: set ``TRITON_INTERPRET=1``) with
64-token tiles, and SDPA's math backend as the baseline.

``--backend triton``: our Triton kernels (``megatron_tree.core.triton_attention``); "mask ms" is
then the build of their per-key-tile facts, and the rows are labelled with the backend.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_tree.core.attention import tree_attention
from megatron_tree.core.mask import tree_attention_mask
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import pad_sequences

BACKWARD_FACTOR = 2.5  # backward FLOPs per forward FLOP (flash attention's convention)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--lengths", type=int, nargs="+", help="default 8192 16384 32768")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--groups", type=int, default=8, help="key/value groups (GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help="tree attention tile")
    p.add_argument("--backend", default="flex", help="tree attention backend")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--bar", type=float, default=0.5, help="tree / causal TFLOP/s ratio to pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", help="append check|value|bar|result lines to this file")
    p.add_argument("--small", action="store_true", help="CPU smoke run (fp32, block_sparse)")
    p.add_argument("--chains", type=int, default=32, help="sequences of the chains-only row")
    args = p.parse_args(argv)
    if args.small:
        args.chains = min(args.chains, 4)
        args.lengths = args.lengths or [256, 512]
        args.heads, args.groups, args.head_dim = 4, 2, 32
        # flex has no CPU backward; triton runs on the CPU in Triton's interpreter
        # (TRITON_INTERPRET=1 set in the environment).
        args.backend = "block_sparse" if args.backend == "flex" else args.backend
        args.block_size, args.warmup, args.reps = 64, 1, 3
        args.device, args.dtype, args.sdpa = torch.device("cpu"), torch.float32, SDPBackend.MATH
    else:
        if not torch.cuda.is_available():
            p.error("needs CUDA (use --small for the CPU smoke run)")
        args.device, args.dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        args.sdpa = SDPBackend.FLASH_ATTENTION
    args.lengths = args.lengths or [8192, 16384, 32768]
    if args.heads % args.groups:
        p.error(f"--heads {args.heads} is not a multiple of --groups {args.groups}")
    bad = [n for n in args.lengths if n % args.block_size or (n < 1024 and not args.small)]
    if bad:
        p.error(f"lengths {bad} must be multiples of the block size {args.block_size} (>= 1024)")
    return args


def grpo_tree(length: int, seed: int, vocab: int = 32000):
    """One packed tree of exactly ``length`` tokens: a prompt and its responses (see the module
    docstring), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = min(length // 4, 4096)
    num_responses = 12 if length <= 8192 else 16
    budget = length - prompt_len
    mean = budget / num_responses
    draws = mean * (0.6 + 0.8 * torch.rand(num_responses, generator=g, dtype=torch.float64))
    lengths = (draws * budget / draws.sum()).floor().to(torch.int64).clamp(min=1)
    lengths[-1] += budget - int(lengths.sum())  # exactly `length` unique tokens in all
    # Tokens from 1 (0 is padding); distinct first response tokens, so every response branches off
    # the prompt's last token.
    prompt = torch.randint(1, vocab, (prompt_len,), generator=g)
    firsts = torch.randperm(vocab - 1, generator=g)[:num_responses] + 1
    seqs = [
        torch.cat([prompt, firsts[i : i + 1], torch.randint(1, vocab, (n - 1,), generator=g)])
        for i, n in enumerate(lengths.tolist())
    ]
    packed = build_packed_tree_batch(
        pad_sequences(seqs), max_tokens_per_mb=length, block_size=128, pad_to_max=False
    )
    if len(packed) != 1 or packed.trees[0].num_tree_tokens != length:
        raise RuntimeError(
            f"expected one tree of {length} tokens, got {[t.num_tree_tokens for t in packed.trees]}"
        )
    return packed.trees[0]


def chains_tree(length: int, num_sequences: int, seed: int, vocab: int = 32000):
    """One packed micro-batch of ``num_sequences`` sequences sharing no token (distinct first
    tokens), ``length`` tokens in all, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    draws = 0.6 + 0.8 * torch.rand(num_sequences, generator=g, dtype=torch.float64)
    lengths = (draws * length / draws.sum()).floor().to(torch.int64).clamp(min=2)
    lengths[-1] += length - int(lengths.sum())
    firsts = torch.randperm(vocab - 1, generator=g)[:num_sequences] + 1
    seqs = [
        torch.cat([firsts[i : i + 1], torch.randint(1, vocab, (n - 1,), generator=g)])
        for i, n in enumerate(lengths.tolist())
    ]
    packed = build_packed_tree_batch(
        pad_sequences(seqs), max_tokens_per_mb=length, block_size=128, pad_to_max=False
    )
    if len(packed) != 1 or packed[0]["rows"].chains is None:
        raise RuntimeError("expected one micro-batch of unshared sequences")
    return packed.trees[0]


def bench_chains(length: int, args) -> dict:
    """ms of forward + backward with backend "auto" (causal per sequence) and with the tree
    kernel, on one chains-only micro-batch."""
    tree = chains_tree(length, args.chains, args.seed + 1).to(args.device)
    mask = tree_attention_mask(tree)
    g = torch.Generator(device=args.device).manual_seed(args.seed)
    ms = {}
    for backend in ("auto", args.backend):
        run = argparse.Namespace(**{**vars(args), "backend": backend})
        ms[backend] = _time_tree(tree, mask, run, g)[1]
    return ms


def visible_pairs(tree) -> int:
    """(query, key) pairs the tree mask allows among its real tokens: sum of depth + 1."""
    depth = tree.position_ids[: tree.num_tree_tokens].to(torch.int64)
    return int((depth + 1).sum())


def fwd_bwd_flops(pairs: int, heads: int, head_dim: int) -> float:
    return 4.0 * pairs * head_dim * heads * (1.0 + BACKWARD_FACTOR)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of ``fn()`` in ms after ``warmup`` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _inputs(n: int, heads: int, args, g: torch.Generator, layout: str):
    """(q, k, v, grad_out) on the device, leaves requiring grad. ``layout``: "megatron" ([n, 1, h,
    d], tree_attention's) or "sdpa" ([1, h, n, d])."""

    def make(h):
        shape = (n, 1, h, args.head_dim) if layout == "megatron" else (1, h, n, args.head_dim)
        x = torch.randn(shape, generator=g, device=args.device, dtype=torch.float32)
        return x.to(args.dtype).requires_grad_(True)

    q, k, v = make(heads), make(args.groups), make(args.groups)
    out_shape = (n, 1, heads * args.head_dim) if layout == "megatron" else tuple(q.shape)
    grad_out = torch.randn(out_shape, generator=g, device=args.device, dtype=torch.float32)
    return q, k, v, grad_out.to(args.dtype)


def _time_tree(tree, mask, args, g: torch.Generator) -> tuple[float, float]:
    """(seconds of the first call, compile included; median ms of forward + backward)."""
    n = tree.padded_length
    q, k, v, grad_out = _inputs(n, args.heads, args, g, "megatron")

    def step():
        out = tree_attention(q, k, v, mask, backend=args.backend, block_size=args.block_size)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    t0 = time.perf_counter()
    grads = step()  # the one-time compile (flex), outside the timed loop
    _sync(args.device)
    first_s = time.perf_counter() - t0
    if not all(bool(torch.isfinite(x).all()) for x in grads):
        raise RuntimeError(f"tree attention gradients at {n} tokens are not finite")
    return first_s, median_ms(step, args.device, args.warmup, args.reps)


def _time_causal(n: int, args, g: torch.Generator) -> float:
    """Median ms of forward + backward of dense causal SDPA on ``args.sdpa``'s backend."""
    q, k, v, grad_out = _inputs(n, args.heads, args, g, "sdpa")

    def step():
        with sdpa_kernel(args.sdpa):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=args.heads != args.groups
            )
        return torch.autograd.grad(out, (q, k, v), grad_out)

    return median_ms(step, args.device, args.warmup, args.reps)


def bench_length(length: int, args) -> dict:
    tree = grpo_tree(length, args.seed + length).to(args.device)
    n = tree.padded_length
    pairs = visible_pairs(tree)
    g = torch.Generator(device=args.device).manual_seed(args.seed)

    # The block-level mask, built once per micro-batch: median of 3 fresh builds (no cache).
    builds = []
    for _ in range(3):
        mask = tree_attention_mask(tree)
        _sync(args.device)
        t0 = time.perf_counter()
        if args.backend == "flex":
            mask.plan.block_mask(args.block_size, n, n)
        elif args.backend == "block_sparse":
            mask.plan.block_sparse(0, args.block_size)
        elif args.backend == "triton":  # its per-key-tile facts (the kernels' only mask input)
            from megatron_tree.core.triton_attention import TILE, tile_facts

            tile_facts(mask.plan.subtree_end, None, min(args.block_size, TILE))
        _sync(args.device)
        builds.append(1e3 * (time.perf_counter() - t0))
    mask_ms = statistics.median(builds)  # `mask` keeps the last build for the timed loop

    first_s, tree_ms = _time_tree(tree, mask, args, g)
    causal_ms = _time_causal(n, args, g)
    causal_pairs = n * (n + 1) // 2
    tree_tflops = fwd_bwd_flops(pairs, args.heads, args.head_dim) / tree_ms / 1e9
    causal_tflops = fwd_bwd_flops(causal_pairs, args.heads, args.head_dim) / causal_ms / 1e9
    return dict(
        tokens=n,
        pairs=pairs,
        density=pairs / causal_pairs,
        mask_ms=mask_ms,
        first_s=first_s,
        tree_ms=tree_ms,
        tree_tflops=tree_tflops,
        causal_ms=causal_ms,
        causal_tflops=causal_tflops,
        ratio=tree_tflops / causal_tflops,
    )


def _label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def main(argv=None) -> int:
    args = parse_args(argv)
    sdpa_name = "math" if args.sdpa == SDPBackend.MATH else "flash"
    where = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "CPU"
    print(
        f"tree attention ({args.backend}) vs causal SDPA ({sdpa_name}) on {where}, torch "
        f"{torch.__version__}, {str(args.dtype).removeprefix('torch.')}, {args.heads} query heads "
        f"/ {args.groups} groups, head dim {args.head_dim}, tile {args.block_size}; fwd+bwd "
        f"FLOPs = 3.5 x 4 x visible pairs x head dim x heads; median of {args.reps}"
    )
    header = (
        f"{'tokens':>7} {'visible pairs':>14} {'density':>7} {'mask ms':>8} {'tree ms':>9} "
        f"{'tree TFLOP/s':>12} {'causal ms':>9} {'SDPA causal TFLOP/s':>19} {'ratio':>6}"
    )
    print(header)
    failed = False

    def add_row(row: str) -> None:
        """Append at once: a step killed by its timeout keeps the rows already measured."""
        if args.rows:
            with open(args.rows, "a") as f:
                f.write(row + "\n")

    for length in args.lengths:
        kernel = "" if args.backend == "flex" else f" ({args.backend})"
        check = f"tree attention{kernel} fwd+bwd {_label(length)}" + (
            " (CPU smoke)" if args.small else ""
        )
        try:
            r = bench_length(length, args)
        except Exception as exc:  # one length's failure (OOM, compile) must not hide the others
            failed = True
            traceback.print_exc()
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:120].replace("|", "/")
            add_row(f"{check}|error: {message}|>= {args.bar:.0%}|FAIL")
            print(f"{length:>7} ERROR {message}", flush=True)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        print(
            f"{r['tokens']:>7} {r['pairs']:>14,} {r['density']:>7.2f} {r['mask_ms']:>8.2f} "
            f"{r['tree_ms']:>9.2f} {r['tree_tflops']:>12.3g} {r['causal_ms']:>9.2f} "
            f"{r['causal_tflops']:>19.3g} {r['ratio']:>6.0%}   (first call {r['first_s']:.1f} s)",
            flush=True,
        )
        ok = r["ratio"] >= args.bar
        add_row(
            f"{check}|{r['tree_tflops']:.3g} TFLOP/s = {r['ratio']:.0%} of causal SDPA "
            f"{sdpa_name}|>= {args.bar:.0%}|{'PASS' if ok else 'FAIL'}"
        )
    length = max(args.lengths)
    check = f"chains-only {_label(length)} ({args.chains} sequences): auto vs {args.backend}"
    try:
        ms = bench_chains(length, args)
        speed = ms[args.backend] / ms["auto"]
        print(
            f"{check}: {ms['auto']:.2f} ms (causal per sequence) vs {ms[args.backend]:.2f} ms "
            f"(tree kernel), {speed:.2f}x",
            flush=True,
        )
        add_row(f"{check}|{speed:.2f}x|>= 1.00x|{'PASS' if speed >= 1.0 else 'FAIL'}")
    except Exception as exc:
        failed = True
        traceback.print_exc()
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:120].replace("|", "/")
        add_row(f"{check}|error: {message}|>= 1.00x|FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
