"""Log-prob + entropy gathering benchmark over one packed tree (not a timed test).

    python scripts/bench_logprobs.py [--device cpu|cuda] [--small] [--rows FILE] [--threads N]
                                     [--repeats 7] [--vocab V] [--dtype float32|bfloat16]
                                     [--memory]

Packs the GRPO batch of the packing benchmark (8 prompts x 8 samples, prompt 512, responses
64-128) with ``max_tokens_per_mb=4096``, takes its largest tree (~4K real tokens) and random
logits [N, V] (V = 32000 on CPU, 151936 on CUDA), and times, in the same run and round-robin (so
that a busy machine slows every method alike), the median of:

- ``plain read``: ``logits.sum()``, one read of the logits: the floor of any gather;
- ``chunked``: ``gather_packed_tree_logprobs_entropy(fused=False)``, the eager chunked path;
- ``fused``: the same with ``fused=True``, the compiled one-pass kernels (fused_logprobs.py);
- ``log_softmax+gather``: torch's ``log_softmax`` over the real rows, then a gather (with and
  without the entropy), the plain unfused baseline;

forward, and forward + backward, each with its ratio to the plain read. The first fused forward
and backward (compile, or a load from inductor's on-disk cache) are timed apart. The fused and
chunked outputs and gradients are compared (a mismatch is an error: exit status 1).

``--rows FILE`` appends ``check|value|bar|PASS-or-FAIL`` lines: on CPU the fused forward's ratio
to the plain read (bar: <= 3x); on CUDA the fused kernel's bandwidth (logits read once + its
outputs, over the kernel's median time) against the GPU's copy bandwidth measured in the same run
(``y.copy_(x)`` of a same-size tensor: 2 x bytes / time; bar: >= 50%); and the fused vs chunked
agreement. A missed performance bar is a FAIL row, not an error (the exit status stays 0).
``--small`` is a quick CPU smoke configuration (a small tree, V = 2048; seconds, most of it the
compile). ``--memory`` adds the peak extra memory of one forward + backward per method (Linux,
CPU: growth of the peak RSS, ``VmHWM``, in a fresh child process per method after the logits are
allocated; includes the logits gradient, 1x the logits, which any method must produce).

Timings with 2 threads are only meaningful on an otherwise idle machine: when another process
holds the second core, every OpenMP parallel region waits for a descheduled thread, and the
chunked method (hundreds of small regions) suffers far more than one big op (compare
``--threads 1``, and the printed load average).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_tree.core.fused_logprobs import select_kernels
from megatron_tree.core.logprobs import gather_packed_tree_logprobs_entropy
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import grpo_batch

# Fused vs chunked: both fp32 with another summation order, ~1e-6 on log-probs of |x| < 10.
AGREEMENT_TOL = 1e-4


def _tree(vocab: int, small: bool):
    if small:
        batch = grpo_batch(
            num_prompts=2,
            samples_per_prompt=4,
            prompt_len=64,
            response_len=(16, 32),
            vocab_size=vocab,
        )
        packed = build_packed_tree_batch(batch, max_tokens_per_mb=1024)
    else:
        packed = build_packed_tree_batch(grpo_batch(vocab_size=vocab), max_tokens_per_mb=4096)
    return max(packed.trees, key=lambda t: t.num_tree_tokens)


def _unfused(logits, tree, with_entropy=True):
    """log_softmax over the U real rows in fp32, gather every node's label at its parent row."""
    num_nodes = tree.num_tree_tokens
    logp = torch.log_softmax(logits[:num_nodes].float(), dim=-1)  # [U, V]
    parent = tree.parent_index[:num_nodes]
    child = torch.nonzero(parent >= 0).squeeze(1)
    node_logprob = logp.new_zeros(num_nodes)
    node_logprob[child] = logp[parent[child], tree.input_ids[child]]
    logprobs = node_logprob[torch.roll(tree.token_index, -1)]
    if not with_entropy:
        return logprobs, None
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy[tree.token_index]


def _plain_read(logits, tree):
    return logits.sum(), None


METHODS = {
    "plain read (logits.sum())": _plain_read,
    "chunked (fused=False)": lambda x, t: gather_packed_tree_logprobs_entropy(x, t, fused=False),
    "fused (fused=True)": lambda x, t: gather_packed_tree_logprobs_entropy(x, t, fused=True),
    "log_softmax+gather": lambda x, t: _unfused(x, t, with_entropy=False),
    "log_softmax+gather+entropy": _unfused,
}
PLAIN, CHUNKED, FUSED = list(METHODS)[:3]
NO_BACKWARD = {PLAIN}


def _forward_backward(method, logits, tree):
    x = logits.detach().requires_grad_()
    lp, ent = METHODS[method](x, tree)
    loss = lp.sum() if ent is None else lp.sum() + 0.01 * ent.sum()
    loss.backward()
    return x.grad


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _medians(fns: dict, repeats: int, sync) -> dict:
    """Median seconds of each callable, timed round-robin after one warm-up call each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn, sync))
    return {name: statistics.median(t) for name, t in times.items()}


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _memory_child(method: str, vocab: int, dtype: str, small: bool) -> None:
    tree = _tree(vocab, small)
    logits = torch.randn(tree.padded_length, vocab, dtype=getattr(torch, dtype))
    if method == FUSED:  # compile first: the compiler's own memory is not the method's
        _forward_backward(method, logits, tree)
    before = _peak_rss_bytes()
    _forward_backward(method, logits, tree)
    print((_peak_rss_bytes() - before) / (logits.numel() * logits.element_size()))


def _row(path: str | None, check: str, value: str, bar: str, ok: bool) -> None:
    line = f"{check}|{value}|{bar}|{'PASS' if ok else 'FAIL'}"
    print("row:", line)
    if path:
        with open(path, "a") as out:
            out.write(line + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--small", action="store_true", help="tiny quick CPU smoke configuration")
    parser.add_argument("--rows", default=None, help="append check|value|bar|verdict lines here")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--memory", action="store_true", help="peak extra memory (CPU, Linux)")
    parser.add_argument(
        "--memory-child", nargs=2, metavar=("METHOD", "DTYPE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = args.vocab or (2048 if args.small else 151936 if args.device == "cuda" else 32000)
    repeats = args.repeats or (3 if args.small else 7)
    if args.memory_child:
        _memory_child(args.memory_child[0], vocab, args.memory_child[1], args.small)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    torch.manual_seed(0)
    tree = _tree(vocab, args.small).to(device)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__} on {name}, threads {torch.get_num_threads()}, load average "
        f"{load}, median of {repeats}; tree: N={tree.padded_length} padded, "
        f"U={tree.num_tree_tokens} real rows, T={tree.num_sequence_tokens} sequence tokens, "
        f"V={vocab}, {args.dtype} logits"
    )
    logits = torch.randn(tree.padded_length, vocab, device=device).to(getattr(torch, args.dtype))
    logits_bytes = logits.numel() * logits.element_size()

    # The first fused calls compile (or load inductor's cache); timed apart from the medians.
    t_fwd = _timed(lambda: METHODS[FUSED](logits, tree), sync)
    t_both = _timed(lambda: _forward_backward(FUSED, logits, tree), sync)
    print(f"first fused forward (compile) {t_fwd:.2f} s, first forward + backward {t_both:.2f} s")

    # Agreement of the fused and chunked paths: outputs and gradients.
    agreement = 0.0
    for method in (CHUNKED, FUSED):
        x = logits.detach().requires_grad_()
        lp, ent = METHODS[method](x, tree)
        (lp.sum() + 0.01 * ent.sum()).backward()
        if method == CHUNKED:
            want = (lp, ent, x.grad)
        else:
            for g, w in zip((lp, ent, x.grad), want):
                agreement = max(agreement, (g.float() - w.float()).abs().max().item())

    fwd = _medians({m: (lambda m=m: METHODS[m](logits, tree)) for m in METHODS}, repeats, sync)
    both = _medians(
        {
            m: (lambda m=m: _forward_backward(m, logits, tree))
            for m in METHODS
            if m not in NO_BACKWARD
        },
        repeats,
        sync,
    )
    header = f"{'method':30} {'fwd ms':>9} {'/ read':>7} {'fwd+bwd ms':>11} {'/ read':>7}"
    if args.memory:
        header += f" {'peak extra / logits':>19}"
    print(header)
    print("-" * len(header))
    read = fwd[PLAIN]
    for method in METHODS:
        line = f"{method:30} {fwd[method] * 1e3:9.2f} {fwd[method] / read:6.2f}x"
        if method in both:
            line += f" {both[method] * 1e3:11.2f} {both[method] / read:6.2f}x"
        else:
            line += f" {'':11} {'':7}"
        if args.memory and method not in NO_BACKWARD and device.type == "cpu":
            child = [sys.executable, __file__, "--vocab", str(vocab), "--memory-child", method]
            child += [args.dtype] + (["--small"] if args.small else [])
            if args.threads:
                child += ["--threads", str(args.threads)]
            run = subprocess.run(child, check=True, capture_output=True, text=True)
            line += f" {float(run.stdout.split()[-1]):18.2f}x"
        print(line)
    print(
        f"fused vs chunked: forward {fwd[CHUNKED] / fwd[FUSED]:.1f}x faster, forward + backward "
        f"{both[CHUNKED] / both[FUSED]:.1f}x; fused vs log_softmax+gather+entropy: forward "
        f"{fwd['log_softmax+gather+entropy'] / fwd[FUSED]:.1f}x faster"
    )

    where = f"{device.type}, {args.dtype}" + (", small" if args.small else "")
    if device.type == "cuda":
        # The kernel alone: every real row of the logits through the compiled row reduction.
        kernels = select_kernels(True, device, logits.dtype, logits.numel())
        rows = logits[: tree.num_tree_tokens]
        c = torch.full((), 1.4426950408889634, dtype=torch.float32, device=device)
        copy_src = torch.empty_like(logits)
        copy_dst = torch.empty_like(logits)
        timed = _medians(
            {
                "kernel": lambda: kernels.row_stats(rows, c),
                "copy": lambda: copy_dst.copy_(copy_src),
            },
            repeats,
            sync,
        )
        moved = rows.numel() * rows.element_size() + 3 * rows.shape[0] * 4
        kernel_bw = moved / timed["kernel"]
        copy_bw = 2 * logits_bytes / timed["copy"]
        whole_bw = (logits_bytes + 2 * tree.num_sequence_tokens * 4) / fwd[FUSED]
        print(
            f"fused kernel {kernel_bw / 1e9:.0f} GB/s ({timed['kernel'] * 1e3:.3f} ms), whole "
            f"fused forward {whole_bw / 1e9:.0f} GB/s, copy {copy_bw / 1e9:.0f} GB/s"
        )
        _row(
            args.rows,
            f"log-prob gather fused ({where})",
            f"{kernel_bw / 1e9:.0f} GB/s = {100 * kernel_bw / copy_bw:.1f}% of copy "
            f"({copy_bw / 1e9:.0f} GB/s); whole forward {100 * whole_bw / copy_bw:.1f}%",
            ">= 50% of copy bandwidth",
            kernel_bw >= 0.5 * copy_bw,
        )
    else:
        ratio = fwd[FUSED] / read
        _row(
            args.rows,
            f"log-prob gather fused ({where}, {torch.get_num_threads()} threads)",
            f"{ratio:.2f}x plain read ({fwd[FUSED] * 1e3:.1f} ms vs {read * 1e3:.1f} ms; chunked "
            f"{fwd[CHUNKED] / read:.2f}x)",
            "<= 3x plain read",
            ratio <= 3.0,
        )
    ok = agreement <= AGREEMENT_TOL
    _row(
        args.rows,
        f"log-prob gather fused vs chunked ({where})",
        f"max abs diff {agreement:.1e} (log-probs, entropy, gradient)",
        f"<= {AGREEMENT_TOL:.0e}",
        ok,
    )
    if not ok:
        print(f"error: the fused and chunked paths disagree by {agreement:.2e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
