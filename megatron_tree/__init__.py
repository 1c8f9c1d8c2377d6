"""megatron_tree: tree training (prefix-shared packed sequences) for Megatron-Core RL training.

The pure-torch core (packing, masks, log-prob gathering) imports nothing from Megatron; the
Megatron and mbridge integrations import it lazily.
"""

from .mask import (
    build_attention_mask_from_trie,
    build_block_mask_from_trie,
    tree_block_layout,
    tree_mask_mod,
)
from .packing import PackedTreeBatch, build_packed_tree_batch
from .tree import PackedTree

__all__ = [
    "PackedTree",
    "PackedTreeBatch",
    "build_attention_mask_from_trie",
    "build_block_mask_from_trie",
    "build_packed_tree_batch",
    "tree_block_layout",
    "tree_mask_mod",
]
