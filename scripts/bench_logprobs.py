"""Log-prob + entropy gathering benchmark over one packed tree (not a timed test).

    python scripts/bench_logprobs.py [--repeats 5] [--vocab 32000] [--threads N]

Packs the GRPO batch of the packing benchmark (8 prompts x 8 samples, prompt 512, responses
64-128) with ``max_tokens_per_mb=4096``, takes its largest tree (~4K real tokens) and random
logits [N, V], and prints the median time of the forward and of forward + backward for
``gather_packed_tree_logprobs_entropy`` and for plain unfused torch baselines on the same rows.

Timings with 2 threads are only meaningful on an otherwise idle machine: when another process
holds the second core, every OpenMP parallel region waits for a descheduled thread, and the
chunked method (hundreds of small regions) suffers far more than one big unfused op (compare
``--threads 1``, and the printed load average).

Peak extra memory is the growth of the process's peak RSS (``VmHWM`` in /proc/self/status, Linux;
``ru_maxrss`` would carry the parent's peak over into the child) over one forward + backward,
measured in a fresh child process per method after the logits are allocated and touched; it
includes the logits gradient (1x the logits), which any method must produce.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_tree.core.logprobs import gather_packed_tree_logprobs_entropy
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import grpo_batch


def _tree(vocab: int):
    packed = build_packed_tree_batch(grpo_batch(vocab_size=vocab), max_tokens_per_mb=4096)
    return max(packed.trees, key=lambda t: t.num_tree_tokens)


def _ours(logits, tree):
    return gather_packed_tree_logprobs_entropy(logits, tree)


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


METHODS = {
    "ours (chunked, per node)": _ours,
    "unfused log_softmax+gather": lambda x, t: _unfused(x, t, with_entropy=False),
    "unfused log_softmax+gather+entropy": _unfused,
}


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _forward_backward(method, logits, tree):
    x = logits.detach().requires_grad_()
    lp, ent = METHODS[method](x, tree)
    loss = lp.sum() if ent is None else lp.sum() + 0.01 * ent.sum()
    loss.backward()


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _memory_child(method: str, vocab: int, dtype: str) -> None:
    tree = _tree(vocab)
    logits = torch.randn(tree.padded_length, vocab, dtype=getattr(torch, dtype))
    before = _peak_rss_bytes()
    _forward_backward(method, logits, tree)
    print((_peak_rss_bytes() - before) / (logits.numel() * logits.element_size()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--memory-child", nargs=2, metavar=("METHOD", "DTYPE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        _memory_child(args.memory_child[0], args.vocab, args.memory_child[1])
        return

    torch.manual_seed(0)
    tree = _tree(args.vocab)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {load}, "
        f"median of {args.repeats}; tree: N={tree.padded_length} padded, U={tree.num_tree_tokens} "
        f"real rows, S={tree.num_sequences} sequences, T={tree.num_sequence_tokens} sequence "
        f"tokens, V={args.vocab}"
    )
    logits32 = torch.randn(tree.padded_length, args.vocab)
    cases = [(m, "float32") for m in METHODS] + [("ours (chunked, per node)", "bfloat16")]
    header = (
        f"{'method':36} {'logits':>8} {'fwd s':>7} {'fwd+bwd s':>9} {'peak extra / logits':>19}"
    )
    print(header)
    print("-" * len(header))
    rows = {}
    for method, dtype in cases:
        logits = logits32.to(getattr(torch, dtype))
        fwd = _median_s(lambda: METHODS[method](logits, tree), args.repeats)  # noqa: B023
        both = _median_s(
            lambda: _forward_backward(method, logits, tree),  # noqa: B023 (called at once)
            args.repeats,
        )
        child = [
            sys.executable,
            __file__,
            "--vocab",
            str(args.vocab),
            "--memory-child",
            method,
            dtype,
        ]
        if args.threads:
            child += ["--threads", str(args.threads)]
        run = subprocess.run(child, check=True, capture_output=True, text=True)
        mem = float(run.stdout.split()[-1])
        rows[(method, dtype)] = (fwd, both)
        name = "fp32" if dtype == "float32" else "bf16"
        print(f"{method:36} {name:>8} {fwd:7.3f} {both:9.3f} {mem:18.2f}x")
    ours = rows[("ours (chunked, per node)", "float32")]
    for method in list(METHODS)[1:]:
        base = rows[(method, "float32")]
        print(
            f"speed-up of ours over {method}: forward {base[0] / ours[0]:.1f}x, forward+backward "
            f"{base[1] / ours[1]:.1f}x"
        )


if __name__ == "__main__":
    main()
