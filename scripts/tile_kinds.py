"""Count the tiles backend="triton" skips, computes whole and masks, against FlexAttention's block
mask, on a GRPO tree and an agent tree of 16K tokens.

    python scripts/tile_kinds.py [--tokens 16384] [--block-size 128 64] [--window 127]

Trees (``testing.synthetic``, packed by ``build_packed_tree_batch`` into one micro-batch padded to
``--tokens``): GRPO 8 x 8 (8 prompts of 1024 tokens, 8 responses of 64-176 tokens each) and a
multi-turn agent batch (one 300-token system prompt, 6 tasks x 4 rollouts of 2-5 turns). For each
tile size B, the (query tile, key tile) pairs by kind:

* ``skip`` (``diag``: above the diagonal, never reached by the kernels' loops; ``tree``: below it,
  rejected by the per-tile test from the key tile's facts);
* ``full``: computed without a mask; ``partial``: masked per element.

The kernel's kinds come from :func:`~megatron_tree.core.triton_attention.tile_kinds` (the rule its
kernels apply); flex's from the ``BlockMask`` that ``backend="flex"`` builds
(:func:`~megatron_tree.core.mask.build_block_mask_from_trie`: ``kv_num_blocks`` partial,
``full_kv_num_blocks`` full). ``pairs`` is the fraction of (query, key) pairs the tree mask allows;
``work`` the fraction of tiles computed (full + partial). ``meta`` is the mask metadata each
needs: the kernel's per-key-tile facts (6 int32 per key tile) against the block mask's index
tensors (forward and backward lists); ``build ms`` the time to build it on this machine's CPU
(best of 5).

With ``--window W`` the same under a depth window (Megatron's ``window_size=(W, 0)``; gpt-oss's
128-token windows are W = 127). Needs triton (the kernel module imports it); runs on the CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_tree.core.mask import build_block_mask_from_trie
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.triton_attention import FACTS, tile_facts, tile_kinds
from megatron_tree.testing.synthetic import agent_batch, grpo_batch


def trees(tokens: int) -> dict:
    """{name: subtree_end [tokens]} of one micro-batch each."""
    batches = {
        "GRPO 8x8": grpo_batch(
            num_prompts=8, samples_per_prompt=8, prompt_len=1024, response_len=(64, 176)
        ),
        "agent": agent_batch(),
    }
    out = {}
    for name, batch in batches.items():
        packed = build_packed_tree_batch(
            batch, max_tokens_per_mb=tokens, block_size=128, pad_to_max=True
        )
        if len(packed) != 1:
            raise RuntimeError(f"{name}: expected one micro-batch of {tokens} tokens")
        tree = packed.trees[0]
        out[f"{name} ({tree.num_tree_tokens} real)"] = tree.subtree_end
    return out


def best_ms(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return min(times)


def row(name: str, ends: torch.Tensor, block: int, window: int | None) -> list[str]:
    n = ends.shape[0]
    kinds = tile_kinds(ends, block_size=block, window=window)
    tiles = kinds.numel()
    above = int(torch.triu(torch.ones_like(kinds, dtype=torch.bool), diagonal=1).sum())
    skip, full, partial = (int((kinds == c).sum()) for c in range(3))
    mask = build_block_mask_from_trie(ends.to(torch.int32), block, window=window)
    flex_partial, flex_full = int(mask.kv_num_blocks.sum()), int(mask.full_kv_num_blocks.sum())
    flex_skip = tiles - flex_partial - flex_full
    index_bytes = sum(
        t.numel() * t.element_size()
        for t in (
            mask.kv_num_blocks,
            mask.kv_indices,
            mask.full_kv_num_blocks,
            mask.full_kv_indices,
            mask.q_num_blocks,
            mask.q_indices,
            mask.full_q_num_blocks,
            mask.full_q_indices,
        )
        if t is not None
    )
    ours_bytes = FACTS * kinds.shape[1] * 4
    ours_ms = best_ms(lambda: tile_facts(ends[None], None, block, window))
    flex_ms = best_ms(
        lambda: build_block_mask_from_trie(ends.to(torch.int32), block, window=window)
    )
    depth = torch.arange(n) - torch.searchsorted(
        torch.sort(ends.to(torch.int64)).values, torch.arange(n), right=True
    )
    if window is None:
        pairs = int((depth + 1).sum())
    else:
        pairs = int((depth.clamp(max=window) + 1).sum())
    return [
        name,
        str(block),
        "-" if window is None else str(window),
        str(tiles),
        f"{skip} ({above} diag + {skip - above} tree)",
        str(full),
        str(partial),
        f"{flex_skip} / {flex_full} / {flex_partial}",
        f"{pairs / (n * n):.1%}",
        f"{(full + partial) / tiles:.1%}",
        f"{ours_bytes / 1024:.1f} KiB / {index_bytes / 1024:.0f} KiB",
        f"{ours_ms:.1f} / {flex_ms:.1f}",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, nargs="+", default=[128, 64])
    p.add_argument("--window", type=int, nargs="*", default=[127], help="depth windows to add")
    args = p.parse_args(argv)
    header = [
        "tree",
        "B",
        "window",
        "tiles",
        "skip",
        "full",
        "partial",
        "flex skip / full / partial",
        "pairs",
        "work",
        "meta (ours / flex)",
        "build ms (ours / flex)",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, ends in trees(args.tokens).items():
        for block in args.block_size:
            for window in [None, *args.window]:
                print("| " + " | ".join(row(name, ends, block, window)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
