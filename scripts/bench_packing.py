"""Packing benchmark: trees, tokens, tree_token_ratio and time on realistic RL batches.

    python scripts/bench_packing.py [--repeats 20]

Prints one row per batch with the median packing time over ``--repeats`` runs (after a warm-up),
and the size of the O(N) mask encoding of a 32K-token tree next to the dense mask it replaces.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_tree.core.mask import build_block_mask_from_trie
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import grpo_batch, multi_turn_batch


def _median_ms(fn, repeats: int) -> tuple[float, object]:
    result = fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)

    cases = [
        ("grpo 8x8 p512 r64-128", grpo_batch(), 4096),
        ("grpo 8x8 p1024 r128-256", grpo_batch(prompt_len=1024, response_len=(128, 256)), 8192),
        ("grpo 32x16 p2048 r256-1024", grpo_batch(num_prompts=32, samples_per_prompt=16, prompt_len=2048, response_len=(256, 1024)), 32768),
        ("multi-turn 4 tasks x4 x4 turns", multi_turn_batch(), 8192),
    ]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, median of {args.repeats}")
    header = f"{'batch':32} {'seqs':>5} {'tokens':>8} {'tree tok':>8} {'ratio':>6} {'trees':>5} {'padded':>8} {'pack ms':>8}"
    print(header)
    print("-" * len(header))
    for name, batch, cap in cases:
        ms, packed = _median_ms(lambda: build_packed_tree_batch(batch, max_tokens_per_mb=cap), args.repeats)
        print(
            f"{name:32} {packed.batch_size:5d} {packed.num_real_tokens:8d} {packed.num_tree_tokens:8d} "
            f"{packed.tree_token_ratio:6.3f} {len(packed):5d} {packed.num_padded_tokens:8d} {ms:8.2f}"
        )

    # Mask encoding for one 32K-token tree.
    batch = grpo_batch(num_prompts=1, samples_per_prompt=16, prompt_len=8192, response_len=(1400, 1500))
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=32768)
    tree = packed[0]["tree"]
    n = tree.padded_length
    enc_bytes = tree.subtree_end.numel() * tree.subtree_end.element_size()
    ms, _ = _median_ms(lambda: build_block_mask_from_trie(tree, block_size=128), max(args.repeats // 4, 3))
    print(
        f"\nmask encoding for a {n}-token tree ({tree.num_tree_tokens} real): subtree_end "
        f"{enc_bytes / 2**20:.3f} MiB (dense bool mask would be {n * n / 2**20:.0f} MiB); "
        f"FlexAttention BlockMask built from it in {ms:.1f} ms"
    )


if __name__ == "__main__":
    main()
