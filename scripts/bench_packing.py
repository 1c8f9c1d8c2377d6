"""Packing benchmark: trees, tokens and time on realistic RL batches, and the data-parallel split.

    python scripts/bench_packing.py [--repeats 20]

Three tables:

1. Packing, per batch: tree tokens against the single-trie count (every shared prefix stored once,
   the lower bound without a capacity), trees, and the median packing time of the previous plan
   (``packing="runs"``: contiguous runs of the sorted order) and of the current one
   (``packing="trie"``: cuts at branch points), timed alternately in the same run.
2. Cost per tree under the FLOP model of an 8B-class GPT: max/min tree cost as packed for tokens,
   and with ``balance_cost=True``.
3. Data parallel, 8 ranks: the global batch split by sample index (what a trainer does by default)
   against :func:`partition_for_data_parallel`; every rank packs its share, and the table sums the
   tree tokens and trees over ranks and gives the per-rank cost spread.

It ends with the size of the O(N) mask encoding of a 32K-token tree next to the dense mask.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_tree.core.flops import GPTShape, train_flops
from megatron_tree.core.mask import build_block_mask_from_trie
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.partition import partition_for_data_parallel
from megatron_tree.testing.synthetic import agent_batch, grpo_batch, multi_turn_batch

SHAPE = GPTShape(
    hidden=4096, layers=36, heads=32, query_groups=8, ffn_hidden=12288, vocab=151936, head_dim=128
)


def _median_ms(fns: dict, repeats: int) -> dict:
    """Median milliseconds of each function, run alternately, the order reversed every other round
    (after one warm-up each)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for i in range(repeats):
        for name, fn in list(fns.items())[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _single_trie_tokens(batch: dict) -> int:
    capacity = -(-int(batch["attention_mask"].sum()) // 128) * 128
    return build_packed_tree_batch(batch, max_tokens_per_mb=capacity).num_tree_tokens


def _packing_table(cases, repeats: int) -> None:
    header = (
        f"{'batch':34} {'seqs':>5} {'tokens':>8} {'1 trie':>7} {'runs tok':>8} {'over':>6} "
        f"{'trees':>5} {'trie tok':>8} {'over':>6} {'trees':>5} {'runs ms':>8} {'trie ms':>8} "
        f"{'ratio':>5}"
    )
    print(header)
    print("-" * len(header))
    for name, batch, cap in cases:
        packed = {
            m: build_packed_tree_batch(batch, max_tokens_per_mb=cap, packing=m)
            for m in ("runs", "trie")
        }
        ms = _median_ms(
            {
                m: (
                    lambda m=m, b=batch, c=cap: build_packed_tree_batch(
                        b, max_tokens_per_mb=c, packing=m
                    )
                )
                for m in packed
            },
            repeats,
        )
        one = _single_trie_tokens(batch)
        runs, trie = packed["runs"], packed["trie"]
        print(
            f"{name:34} {trie.batch_size:5d} {trie.num_real_tokens:8d} {one:7d} "
            f"{runs.num_tree_tokens:8d} {runs.num_tree_tokens / one - 1:6.1%} {len(runs):5d} "
            f"{trie.num_tree_tokens:8d} {trie.num_tree_tokens / one - 1:6.1%} {len(trie):5d} "
            f"{ms['runs']:8.2f} {ms['trie']:8.2f} {ms['trie'] / ms['runs']:5.2f}"
        )


def _cost_table(cases) -> None:
    header = (
        f"{'batch':34} {'trees':>5} {'max/min cost':>12} {'balanced':>8} {'tokens':>8} "
        f"{'balanced':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, batch, cap in cases:
        plain, balanced = (
            build_packed_tree_batch(batch, max_tokens_per_mb=cap, cost_model=SHAPE, balance_cost=b)
            for b in (False, True)
        )
        spread = [p.max_tree_cost / p.min_tree_cost for p in (plain, balanced)]
        print(
            f"{name:34} {len(plain):5d} {spread[0]:12.3f} {spread[1]:8.3f} "
            f"{plain.num_tree_tokens:8d} {balanced.num_tree_tokens:8d}"
        )


def _dp_table(cases, dp_size: int) -> None:
    header = (
        f"{'batch':34} {'split':10} {'tree tok':>8} {'trees':>5} {'seqs/rank':>9} {'cost min':>8} "
        f"{'cost max':>8} {'max/min':>7} {'ms':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, batch, cap in cases:
        size = batch["input_ids"].shape[0]
        t0 = time.perf_counter()
        partitioned = partition_for_data_parallel(batch, dp_size, cost_model=SHAPE)
        ms = (time.perf_counter() - t0) * 1e3
        for label, ranks, took in (
            ("index", list(torch.arange(size).chunk(dp_size)), ""),
            ("partition", partitioned, f"{ms:6.1f}"),
        ):
            packs = [
                build_packed_tree_batch({k: v[r] for k, v in batch.items()}, max_tokens_per_mb=cap)
                for r in ranks
            ]
            costs = [train_flops(p.trees, SHAPE) / 1e12 for p in packs]
            counts = sorted(len(r) for r in ranks)
            print(
                f"{name:34} {label:10} {sum(p.num_tree_tokens for p in packs):8d} "
                f"{sum(len(p) for p in packs):5d} {f'{counts[0]}-{counts[-1]}':>9} "
                f"{min(costs):8.1f} {max(costs):8.1f} {max(costs) / min(costs):7.3f} {took:>6}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dp", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)

    cases = [
        ("grpo 8x8 p512 r64-128", grpo_batch(), 4096),
        ("grpo 8x8 p1024 r128-256", grpo_batch(prompt_len=1024, response_len=(128, 256)), 8192),
        (
            "grpo 32x16 p2048 r256-1024",
            grpo_batch(
                num_prompts=32, samples_per_prompt=16, prompt_len=2048, response_len=(256, 1024)
            ),
            32768,
        ),
        ("multi-turn 4 tasks x4 x4 turns", multi_turn_batch(), 8192),
        ("agent sys300 6 tasks x4 x2-5 turns", agent_batch(), 8192),
        (
            "agent sys2048 8x4 x3-8 turns",
            multi_turn_batch(
                num_tasks=8,
                rollouts_per_task=4,
                turns=(3, 8),
                system_len=2048,
                task_len=512,
                seed=0,
            ),
            16384,
        ),
    ]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, median of {args.repeats}")
    print(
        "\npacking: tree tokens (over the single-trie count) and time, previous plan (runs) vs. "
        "cuts at branch points (trie)"
    )
    _packing_table(cases, args.repeats)
    print(
        "\ncost per tree (FLOP model, 8B-class GPT): max/min over trees, packed for tokens vs. "
        "balance_cost=True"
    )
    _cost_table(cases)
    print(
        f"\ndata parallel over {args.dp} ranks: split by sample index vs. "
        "partition_for_data_parallel (each rank packs its share)"
    )
    dp_cases = [
        ("grpo 64x8 p512 r64-128", grpo_batch(num_prompts=64, samples_per_prompt=8), 4096),
        (
            "grpo 64x8 p1024 r128-256",
            grpo_batch(
                num_prompts=64, samples_per_prompt=8, prompt_len=1024, response_len=(128, 256)
            ),
            8192,
        ),
        ("agent sys300 6 tasks x4 x2-5 turns", agent_batch(), 8192),
    ]
    _dp_table(dp_cases, args.dp)

    # Mask encoding for one 32K-token tree.
    batch = grpo_batch(
        num_prompts=1, samples_per_prompt=16, prompt_len=8192, response_len=(1400, 1500)
    )
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=32768)
    tree = packed[0]["tree"]
    n = tree.padded_length
    enc_bytes = tree.subtree_end.numel() * tree.subtree_end.element_size()
    ms = _median_ms(
        {"mask": lambda: build_block_mask_from_trie(tree, block_size=128)},
        max(args.repeats // 4, 3),
    )["mask"]
    print(
        f"\nmask encoding for a {n}-token tree ({tree.num_tree_tokens} real): subtree_end "
        f"{enc_bytes / 2**20:.3f} MiB (dense bool mask would be {n * n / 2**20:.0f} MiB); "
        f"FlexAttention BlockMask built from it in {ms:.1f} ms"
    )


if __name__ == "__main__":
    main()
