"""A work model of tree attention on realistic trees: what each GPU backend must compute, and the
attention time to expect from published throughputs, before any GPU has run our kernels.

    python scripts/work_model.py                 # the three batches at 16K and 32K capacity
    python scripts/work_model.py --markdown F    # also written as markdown (docs/gpu.md)

Batches, packed by our packer (``build_packed_tree_batch``, whole trees per micro-batch):
GRPO (8 prompts x 8 samples, prompts of 1,024 tokens, responses of 256-1,024), a multi-turn agent
batch (``testing.synthetic.agent_batch``), and a low-sharing batch (64 sequences of 512-2,048
tokens, a prompt and its one response, sharing only a 64-token system prompt).

Counted per micro-batch and summed (pairs are (query, key) pairs; a tile is B x B):
  visible pairs     the pairs the tree mask allows (sum of depth + 1): the least any backend does
  causal            dense causal attention on the same packed tokens in 128-token tiles (FA-2/3)
  unshared          each sequence alone, causal (the run tree packing replaces), pairs
  ours (B=64, 32)   our kernel's tiles (full / partial) and the pairs in them: tile_kinds, the
                    kernels' own rule; 64 is launch_config's tile at head dim 128, 32 at 256
  flex (B=128)      FlexAttention's block mask at its default 128-token blocks (tree_block_layout:
                    full / partial blocks, exact for these contiguous rows)

Expected attention time (forward + backward), with the unshared run under FlashAttention-2 as 1
(each sequence alone, its causal 128-token tiles: what a user runs without trees), assumes time
proportional to the pairs in touched tiles over a backend's throughput per pair (partial tiles
cost as much as full ones; the mask's own cost is not modelled). Dense causal attention over the
packed tokens, the same unit, shows what a tree mask saves over a plain causal mask there:
  FlashAttention-3 runs 1.5-2.0x FlashAttention-2 on H100 (Shah et al., "FlashAttention-3", 2024,
  arXiv:2407.08608: FP16 up to 740 TFLOPs/s, 75% of the H100's peak, FlashAttention-2 35%);
  FlexAttention reaches 90% of FlashAttention-2 forward and 85% backward (PyTorch blog,
  "FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention", 2024), 0.86
  over a step whose backward is 2.5x its forward (its five matmuls against two);
  our kernel's throughput r (of FlashAttention-2's, per touched pair) is what the first GPU run
  measures: shown at r = 1 and r = 0.5, and the break-even r* = 0.86 x ours / flex above which our
  kernel beats flex. ``backend="auto"`` should try the triton kernel first on a GPU where r > r*.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megatron_tree.core.mask import tree_block_layout
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.triton_attention import tile_kinds
from megatron_tree.testing.synthetic import agent_batch, grpo_batch, pad_sequences

FLEX_BLOCK = 128  # FlexAttention's default BlockMask block (and FlashAttention's 128-row tiles)
OUR_TILES = (64, 32)
FA3_OVER_FA2 = (1.5, 2.0)
BACKWARD_FACTOR = 2.5  # backward FLOPs / forward FLOPs of attention (5 matmuls against 2)
FLEX_OVER_FA2 = (1 + BACKWARD_FACTOR) / (1 / 0.90 + BACKWARD_FACTOR / 0.85)
CAPACITIES = (16384, 32768)


def low_sharing_batch(seed: int = 7) -> dict:
    """64 sequences of 512-2,048 tokens (a prompt and its one response) after one 64-token system
    prompt, the only tokens they share."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, 32000, (64,), generator=g)
    seqs = []
    for _ in range(64):
        n = int(torch.randint(512, 2049, (), generator=g))
        seqs.append(torch.cat([system, torch.randint(1, 32000, (n,), generator=g)]))
    return pad_sequences(seqs)


def batches() -> dict[str, dict]:
    return {
        "GRPO 8x8 (prompt 1,024, responses 256-1,024)": grpo_batch(
            prompt_len=1024, response_len=(256, 1024), seed=3
        ),
        "multi-turn agent (agent_batch)": agent_batch(),
        "low sharing (64 prompts, 1 sample each)": low_sharing_batch(),
    }


def _tiles(kinds: torch.Tensor) -> tuple[int, int]:
    return int((kinds == 1).sum()), int((kinds == 2).sum())


def count(batch: dict, capacity: int) -> dict:
    """The counts of the module docstring, summed over the micro-batches at ``capacity``."""
    packed = build_packed_tree_batch(
        batch,
        max_tokens_per_mb=capacity,
        block_size=FLEX_BLOCK,
        pad_to_max=False,
        share_trunks=False,  # whole trees: a micro-batch attends within itself
    )
    lengths = batch["attention_mask"].sum(1).to(torch.int64)
    tiles = -(-lengths // FLEX_BLOCK)  # each sequence alone: FlashAttention's causal tiles
    out = {
        "micro_batches": len(packed),
        "real": int(lengths.sum()),
        "tree": 0,
        "visible": 0,
        "causal": 0,
        "unshared": int((lengths * (lengths + 1) // 2).sum()),
        "unshared_tiles": int((FLEX_BLOCK**2 * tiles * (tiles + 1) // 2).sum()),
    }
    for tile in OUR_TILES:
        out[f"ours{tile}"] = [0, 0, 0]  # full tiles, partial tiles, pairs in touched tiles
    out["flex"] = [0, 0, 0]
    for tree in packed.trees:
        n = tree.num_tree_tokens
        ends = tree.subtree_end[:n].to(torch.int64)  # real tokens only (padding costs no pairs)
        depth = tree.position_ids[:n].to(torch.int64)
        out["tree"] += n
        out["visible"] += int((depth + 1).sum())
        q_tiles = -(-n // FLEX_BLOCK)
        out["causal"] += FLEX_BLOCK**2 * q_tiles * (q_tiles + 1) // 2  # FlashAttention's tiles
        for tile in OUR_TILES:
            full, partial = _tiles(tile_kinds(ends, block_size=tile))
            acc = out[f"ours{tile}"]
            acc[0], acc[1], acc[2] = (
                acc[0] + full,
                acc[1] + partial,
                acc[2] + (full + partial) * tile**2,
            )
        padded = -(-n // FLEX_BLOCK) * FLEX_BLOCK
        flex_ends = torch.cat([ends, torch.arange(n + 1, padded + 1)])  # padding: itself only
        any_allowed, all_allowed = tree_block_layout(flex_ends, FLEX_BLOCK)
        full, partial = int(all_allowed.sum()), int((any_allowed & ~all_allowed).sum())
        acc = out["flex"]
        acc[0], acc[1], acc[2] = (
            acc[0] + full,
            acc[1] + partial,
            acc[2] + (full + partial) * FLEX_BLOCK**2,
        )
    return out


def rows(name: str, capacity: int, c: dict) -> list[str]:
    """Two table rows: the counts, then the expected attention times (forward + backward), the
    unshared run under FlashAttention-2 (each sequence alone, 128-token tiles) as 1."""
    base = c["unshared_tiles"]
    ours, ours32, flex = c["ours64"][2], c["ours32"][2], c["flex"][2]
    time = lambda pairs, throughput=1.0: f"{pairs / base / throughput:.2f}"  # noqa: E731
    tiles = lambda t: f"{t[0]:,} / {t[1]:,}, {t[2]:,}"  # noqa: E731
    return [
        f"| {name} | {capacity // 1024}K | {c['micro_batches']} | {c['tree']:,} / {c['real']:,} | "
        f"{c['visible']:,} | {c['unshared']:,} ({base:,}) | {c['causal']:,} | "
        f"{tiles(c['ours64'])} | {tiles(c['ours32'])} | {tiles(c['flex'])} |",
        f"| {name} | {capacity // 1024}K | time, unshared FA2 = 1 | "
        f"FA3 unshared {1 / FA3_OVER_FA2[1]:.2f}-{1 / FA3_OVER_FA2[0]:.2f} | "
        f"visible-pair limit {time(c['visible'])} | dense causal FA2 {time(c['causal'])} | "
        f"ours B=64 {time(ours)} (r=1), {time(ours, 0.5)} (r=0.5) | "
        f"ours B=32 {time(ours32)} (r=1) | "
        f"flex {time(flex, FLEX_OVER_FA2)} | r* = {FLEX_OVER_FA2 * ours / flex:.2f} |",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    lines = [
        "| batch | capacity | micro-batches | tree / real tokens | visible pairs | unshared pairs "
        "(in 128-tiles) | dense causal on the packed tokens (128-tiles) | ours B=64: full / "
        "partial tiles, pairs in them | ours B=32 | flex B=128 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, batch in batches().items():
        for capacity in CAPACITIES:
            print(f"[work model] {name} at {capacity} tokens a micro-batch", file=sys.stderr)
            lines += rows(name, capacity, count(batch, capacity))
    table = "\n".join(lines) + "\n"
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
