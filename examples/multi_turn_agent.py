"""A multi-turn agent batch: every turn's sequence extends the turns before it.

    python examples/multi_turn_agent.py

Packs a batch of agent trajectories (a shared system prompt, per-task prompts, rollouts whose turns
extend one another), prints what the trie shares, writes a picture of the first tree's mask, and
reads one trajectory back from its tree to show that nothing is lost.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_tree import build_packed_tree_batch
from megatron_tree.demo.visualize import save_tree_mask_png
from megatron_tree.testing.synthetic import multi_turn_batch


def main(out_dir: str = "outputs") -> dict:
    batch = multi_turn_batch(num_tasks=4, rollouts_per_task=4, turns=4, vocab_size=32000, seed=0)
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=8192, block_size=128)
    print(
        f"{packed.batch_size} sequences ({packed.num_real_tokens} tokens) -> {len(packed)} trees, "
        f"{packed.num_tree_tokens} unique tokens: tree_token_ratio {packed.tree_token_ratio:.3f}"
    )
    for i, mb in enumerate(packed):
        tree = mb.tree
        if mb.rows.group is not None:  # trunk reuse: a prompt group larger than a micro-batch
            role = "trunk part" if mb.rows.is_trunk else "branches"
            print(
                f"  micro-batch {i}: {role} {mb.rows.index} of trunk group {mb.rows.group}, "
                f"{mb.rows.num_real} rows computed, losses of {tree.num_sequences} sequences"
            )
            continue
        depth = int(tree.position_ids.max()) + 1
        roots = int((tree.parent_index[: tree.num_tree_tokens] < 0).sum())
        branch_points = int(torch.bincount(tree.parent_index[tree.parent_index >= 0]).gt(1).sum())
        print(
            f"  tree {i}: {tree.num_sequences} sequences, "
            f"{tree.num_tree_tokens}/{tree.padded_length} tokens, {roots} root(s), {branch_points} "
            f"branch points, depth {depth}"
        )

    # Read the deepest sequence of the first micro-batch with losses back, compare with the input.
    first = next(i for i, mb in enumerate(packed) if mb.tree.num_sequences)
    tree = packed[first].tree
    longest = int(tree.sequence_lengths.argmax())
    row = int(tree.sequence_ids[longest])
    n = int(batch["attention_mask"][row].sum())
    same = torch.equal(
        tree.input_ids[tree.sequence_token_index(longest)], batch["input_ids"][row, :n]
    )
    print(
        f"  batch row {row} ({n} tokens) read back from tree {first}: "
        f"{'identical' if same else 'DIFFERENT'}"
    )

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    picture = save_tree_mask_png(tree, Path(out_dir) / "multi_turn_mask.png", max_pixels=512)
    print(f"  mask picture: {picture}")
    return {"tree_token_ratio": packed.tree_token_ratio, "read_back": same}


if __name__ == "__main__":
    main()
