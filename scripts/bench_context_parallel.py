"""Long-context tree training with context parallelism: one multi-turn agent tree, CP=1 vs CP=2.

    python scripts/bench_context_parallel.py            # >= 16K-token tree, CPU, gloo
    python scripts/bench_context_parallel.py --small    # a quick run

Each layout runs the same packed tree through ``tree_forward_backward`` (forward + backward) in a
spawned gloo world and reports, per rank: its rows, its attention pairs (query, visible key), the
activation memory saved for the backward (the bytes of every distinct tensor autograd keeps, logits
included, measured with saved-tensor hooks: the CPU has no allocator statistics) and the step time
(median over the timed steps). Ratios are against CP=1 in the same run. The machine is shared and
noisy: read the times as ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

# The test harness (tests/harness: tiny models, spawned worlds, engine fixtures) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a ~4K-token tree and a smaller model")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    return p.parse_args()


def agent_tree(small: bool, vocab: int) -> dict:
    """One agent task with a long shared history: a system prompt, 3 rollouts of several turns
    (each turn's sequence is the whole history so far), all in one tree."""
    from megatron_tree.testing.synthetic import multi_turn_batch

    scale = 4 if small else 1
    batch = multi_turn_batch(
        num_tasks=1,
        rollouts_per_task=3,
        turns=5,
        system_len=2048 // scale,
        task_len=512 // scale,
        observation_len=(640 // scale, 896 // scale),
        action_len=(256 // scale, 384 // scale),
        vocab_size=vocab,
        seed=7,
    )
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def nll(outputs: dict, micro_batch: dict) -> torch.Tensor:
    """Per-token negative log-likelihood (default loss mask: every entry but each sequence's
    last)."""
    return -outputs["logprobs"]


class SavedBytes:
    """Bytes of the distinct tensor storages autograd saves for the backward (peak = at the end of
    the forward, when the schedule runs one micro-batch)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def mib(self) -> float:
        return sum(self.storages.values()) / 2**20


def _worker(rank: int, args, batch: dict, cp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from harness.models import build_gpt_model, small_gpt_config
    from megatron_tree import LogProbs, build_packed_tree_batch, tree_forward_backward
    from megatron_tree.core.context_parallel import attention_work, context_parallel_split

    config = small_gpt_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=4 * args.hidden,
        context_parallel_size=cp,
    )
    model = build_gpt_model(
        config, tree=True, vocab_size=args.vocab, backend="block_sparse", block_size=128
    )
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=1 << 20, block_size=128, parallel_size=cp, pad_to_max=False
    )
    assert len(packed) == 1, "the benchmark wants one tree"
    tree = packed[0]["tree"]
    split = context_parallel_split(tree, cp, ps.get_context_parallel_rank())
    pairs = attention_work(tree, split)
    contiguous = (tree.position_ids + 1).view(cp, -1).sum(dim=1)  # a plain split into cp ranges

    def step():
        model.zero_grad(set_to_none=True)
        return tree_forward_backward(model, packed, nll, gather=LogProbs(entropy=False))

    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        step()  # warm-up, measured
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "contiguous": float(contiguous.max() / contiguous.min()),
        "rows": tree.padded_length // cp,
        "tokens": tree.num_tree_tokens,
        "pairs": int(pairs[ps.get_context_parallel_rank()]),
        "saved_mib": saved.mib,
        "seconds": statistics.median(times),
    }


def main() -> None:
    args = parse_args()
    if args.small:
        args.hidden, args.vocab = min(args.hidden, 128), min(args.vocab, 2048)
    from harness.dist import run_spawned

    batch = agent_tree(args.small, args.vocab)
    lengths = batch["attention_mask"].sum(1)
    print(
        f"agent tree: {len(lengths)} sequences, {int(lengths.sum())} tokens, longest "
        f"{int(lengths.max())}; model: {args.layers} layers, hidden {args.hidden}, vocab "
        f"{args.vocab}, fp32, block_sparse",
        flush=True,
    )
    rows = []
    for cp in (1, 2):
        print(f"running CP={cp} ...", flush=True)
        ranks = run_spawned(_worker, cp, args, batch, cp, cp=cp, tp=1)
        rows.append((cp, ranks))
    base_mem = max(r["saved_mib"] for r in rows[0][1])
    base_time = max(r["seconds"] for r in rows[0][1])
    print(f"\ntree tokens {rows[0][1][0]['tokens']} (padded {rows[0][1][0]['rows']})")
    print(
        f"{'CP':>3} {'rank':>4} {'rows':>7} {'attn pairs':>12} {'saved MiB':>10} {'vs CP=1':>8} "
        f"{'step s':>8} {'vs CP=1':>8}"
    )
    for cp, ranks in rows:
        for r, res in enumerate(ranks):
            print(
                f"{cp:>3} {r:>4} {res['rows']:>7} {res['pairs']:>12} {res['saved_mib']:>10.1f} "
                f"{res['saved_mib'] / base_mem:>8.2f} {res['seconds']:>8.2f} "
                f"{res['seconds'] / base_time:>8.2f}"
            )
    cp2 = rows[1][1]
    pairs = [r["pairs"] for r in cp2]
    print(
        "\nCP=2: peak saved activations per rank "
        f"{max(r['saved_mib'] for r in cp2) / base_mem:.2f}x of CP=1 (goal <= 0.6x); attention "
        f"pairs max/min over ranks {max(pairs) / min(pairs):.3f} (a contiguous split: "
        f"{cp2[0]['contiguous']:.3f}); step time {max(r['seconds'] for r in cp2) / base_time:.2f}x "
        "of CP=1 (2 processes on a shared CPU)"
    )


if __name__ == "__main__":
    main()
