"""Depth RoPE: rotary embeddings indexed by each packed token's depth, not its packed offset.

In a packed tree the token at packed offset p sits at depth ``position_ids[p] <= p`` in every
sequence that contains it. A rotary table built for offsets 0..S-1 (as Megatron-Core's GPTModel
builds it, ignoring ``position_ids``) rotates every branch after the first by the wrong angles;
re-indexing the table by depth gives each token the angle it has in its own sequence.

Legend for shapes: N = packed length, b = micro-batch rows, S = table length, d = rotary dim.
"""

from __future__ import annotations

import torch

from .checks import debug_checks


def depth_rotary_pos_emb(rotary_pos_emb: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Index a rotary table by per-token positions.

    Packing guarantees ``0 <= position_ids < N <= S``; the range is checked here only with debug
    checks on (it costs a host sync), see :mod:`megatron_tree.core.checks`.

    Args:
        rotary_pos_emb: [S, 1, 1, d], the table for offsets 0..S-1 (as ``RotaryEmbedding`` returns).
        position_ids: int [b, N] (or [N]).

    Returns:
        [N, b, 1, d] (the [s, b, 1, d] layout ``apply_rotary_pos_emb`` broadcasts against
        [s, b, heads, hn]).
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    table = rotary_pos_emb[:, 0, 0, :]  # [S, d]
    if debug_checks() and position_ids.numel():
        low, high = int(position_ids.min()), int(position_ids.max())
        if low < 0 or high >= table.shape[0]:
            raise ValueError(
                f"position_ids must lie in [0, {table.shape[0]}) (the rotary table's length); got "
                f"values in [{low}, {high}]. Pass the tree depths from build_packed_tree_batch"
            )
    return table[position_ids.t()].unsqueeze(2)  # [N, b, 1, d]
