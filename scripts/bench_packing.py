"""Packing benchmark: trees, tokens and time on realistic RL batches, and the data-parallel split.

    python scripts/bench_packing.py [--repeats 20]
    taskset -c 0 python scripts/bench_packing.py --only-partition   # the partition table alone

Four tables:

1. Packing, per batch: tree tokens against the single-trie count (every shared prefix stored once,
   the lower bound without a capacity), trees, and the median packing time of the previous plan
   (``packing="runs"``: contiguous runs of the sorted order) and of the current one
   (``packing="trie"``: cuts at branch points), timed alternately in the same run.
2. Cost per tree under the FLOP model of an 8B-class GPT: max/min tree cost as packed for tokens,
   and with ``balance_cost=True``.
3. Data parallel, 8 ranks: the global batch split by sample index (what a trainer does by default)
   against :func:`partition_for_data_parallel`; every rank packs its share, and the table sums the
   tree tokens and trees over ranks and gives the per-rank cost spread.

4. :func:`partition_for_data_parallel` at verl's scale: GRPO batches of 1K-64K sequences (prompts
   of 256 tokens, 8 samples each, responses of 64-128) and one multi-turn agent batch (16K
   sequences: a 256-token system prompt, 1,024 tasks of 128 tokens, 4 rollouts of 4 turns), over 8
   to 1,024 ranks: the median seconds of ``--partition-repeats`` calls (wall clock and this
   process's CPU time; run it pinned to one core, ``taskset -c 0``, as the numbers in
   docs/benchmarks.md were), and the balance in the same run: the costliest rank's cost (FLOP
   model below: its trie's unique tokens and attention pairs) over the mean, for the partition
   and for the whole-groups baseline (each prompt group, or each task, whole on one rank,
   longest-cost-first: ``groups=``), and how many prompt groups the partition spreads over two
   ranks. ``--partition-sizes`` and ``--ranks`` pick the grid.

It ends with the size of the O(N) mask encoding of a 32K-token tree next to the dense mask.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from megatron_tree.core.flops import GPTShape, cost_weights, train_flops
from megatron_tree.core.mask import build_block_mask_from_trie
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.partition import partition_for_data_parallel
from megatron_tree.core.trie import TrieCounts, lexicographic_order, neighbour_lcp, sequence_keys
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


def _rank_loads(counts: TrieCounts, position: np.ndarray, ranks) -> np.ndarray:
    """float64 [dp]: each rank's cost under the FLOP model (its trie's unique tokens and attention
    pairs), from the batch's sorted order: a rank's sequences are runs of it (``position``: int64
    [B], each sample's place in that order), and :meth:`TrieCounts.union` counts their trie."""
    w_tok, w_pair = cost_weights(SHAPE)
    loads = []
    for rank in ranks:
        places = np.sort(position[rank.numpy()])
        breaks = np.flatnonzero(np.diff(places) != 1) + 1
        firsts = places[np.concatenate([[0], breaks])].tolist()
        ends = (places[np.concatenate([breaks - 1, [len(places) - 1]])] + 1).tolist()
        tokens, pairs = counts.union(list(zip(firsts, ends)))
        loads.append(w_tok * tokens + w_pair * pairs)
    return np.array(loads)


def _prompt_groups(batch: dict, width: int) -> list[int]:
    """A group label per sample: its first ``width`` tokens (the prompt, or system + task)."""
    return np.unique(batch["input_ids"][:, :width].numpy(), axis=0, return_inverse=True)[1].tolist()


def _partition_table(cases, ranks: list[int], repeats: int) -> None:
    """Seconds (median wall and CPU) and balance of :func:`partition_for_data_parallel` per batch
    and rank count, next to the whole-groups baseline."""
    header = (
        f"{'batch':34} {'seqs':>6} {'ranks':>5} {'s':>6} {'cpu s':>6} {'max/mean':>8} "
        f"{'whole':>8} {'split':>5}"
    )
    print(header)
    print("-" * len(header))
    for name, batch, width in cases:
        mask = batch["attention_mask"].bool()
        lengths = mask.sum(1)
        keys = sequence_keys(batch["input_ids"], lengths)
        order = lexicographic_order(keys)
        counts = TrieCounts(
            neighbour_lcp(keys[order], lengths[order]).numpy(), lengths[order].numpy()
        )
        position = np.empty(len(order), dtype=np.int64)
        position[order.numpy()] = np.arange(len(order))
        groups = _prompt_groups(batch, width)
        group_of = np.array(groups)
        data = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        for dp in ranks:
            if dp > len(order):
                continue
            wall, cpu = [], []
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                parts = partition_for_data_parallel(data, dp, cost_model=SHAPE)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            loads = _rank_loads(counts, position, parts)
            whole = "-"  # fewer groups than ranks: no whole-groups split exists
            if len(set(groups)) >= dp:
                parts_whole = partition_for_data_parallel(data, dp, cost_model=SHAPE, groups=groups)
                baseline = _rank_loads(counts, position, parts_whole)
                whole = f"{baseline.max() / baseline.mean():.4f}"
            rank_of = np.empty(len(order), dtype=np.int64)
            for r, part in enumerate(parts):
                rank_of[part.numpy()] = r
            placed = np.unique(np.stack([group_of, rank_of]), axis=1)[0]  # (group, rank) pairs
            split = int((np.bincount(placed) > 1).sum())  # groups on more than one rank
            print(
                f"{name:34} {len(order):6d} {dp:5d} {statistics.median(wall):6.3f} "
                f"{statistics.median(cpu):6.3f} {loads.max() / loads.mean():8.4f} "
                f"{whole:>8} {split:5d}",
                flush=True,
            )


def _partition_cases(sizes: list[int]):
    """(name, batch, prompt width for the group labels) for the partition table, one at a time."""
    for n in sizes:
        batch = grpo_batch(num_prompts=n // 8, samples_per_prompt=8, prompt_len=256, seed=1)
        yield f"grpo {n // 8}x8 p256 r64-128", batch, 256
    multi_turn = multi_turn_batch(
        num_tasks=1024,
        rollouts_per_task=4,
        turns=4,
        system_len=256,
        task_len=128,
        observation_len=(16, 48),
        action_len=(16, 64),
        seed=1,
    )
    yield "multi-turn 1024 tasks x4 x4 turns", multi_turn, 256 + 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument(
        "--only-partition", action="store_true", help="only the partition-at-scale table"
    )
    parser.add_argument("--partition-sizes", default="1024,4096,16384,65536")
    parser.add_argument("--ranks", default="8,32,128,512,1024")
    parser.add_argument("--partition-repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    sizes = [int(s) for s in args.partition_sizes.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.only_partition:
        _print_partition(sizes, ranks, args.partition_repeats)
        return

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
    _print_partition(sizes, ranks, args.partition_repeats)


def _print_partition(sizes: list[int], ranks: list[int], repeats: int) -> None:
    print(
        f"\npartition_for_data_parallel at scale (torch threads {torch.get_num_threads()}; median "
        f"of {repeats}; s: wall, cpu s: this process): max/mean is the costliest rank over the "
        "mean (FLOP model) for the partition, whole: the same for whole prompt groups "
        "longest-cost-first (groups=), split: prompt groups the partition spreads over two ranks"
    )
    _partition_table(_partition_cases(sizes), ranks, repeats)


if __name__ == "__main__":
    main()
