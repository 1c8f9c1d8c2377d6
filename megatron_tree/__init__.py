"""megatron_tree: tree training (prefix-shared packed sequences) for Megatron-Core RL training.

The pure-torch core (packing, masks, log-prob gathering) imports nothing from Megatron; the
Megatron and mbridge integrations import it lazily (``TreeGPTModel`` and ``TreeCoreAttention`` are
built on first access).
"""

from .bridge import is_tree_training_bridge, patch_bridge_for_tree_training
from .attention import clear_tree_mask_cache, tree_attention
from .critic import ValueHead, attach_value_head
from .flops import GPTShape, train_flops
from .logprobs import (
    gather_packed_tree_logprobs,
    gather_packed_tree_logprobs_entropy,
    gather_packed_tree_logprobs_entropy_from_hidden,
    gather_packed_tree_values,
    gather_packed_tree_vocab_stats,
    merge_packed_tree_results,
)
from .mask import (
    build_attention_mask_from_trie,
    build_block_mask_from_trie,
    tree_block_layout,
    tree_mask_mod,
)
from .packing import PackedTreeBatch, build_packed_tree_batch
from .spec import tree_attention_spec
from .train_step import TreeStepResult, loss_weights, ppo_clipped_loss, tree_forward_backward, value_loss
from .tree import PackedTree

from .rope import depth_rotary_pos_emb

# Built on first access so that importing the package does not import Megatron.
_LAZY = {"TreeGPTModel": ".rope", "TreeCoreAttention": ".attention"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GPTShape",
    "PackedTree",
    "PackedTreeBatch",
    "TreeCoreAttention",
    "TreeGPTModel",
    "TreeStepResult",
    "ValueHead",
    "attach_value_head",
    "build_attention_mask_from_trie",
    "build_block_mask_from_trie",
    "build_packed_tree_batch",
    "clear_tree_mask_cache",
    "depth_rotary_pos_emb",
    "gather_packed_tree_logprobs",
    "gather_packed_tree_logprobs_entropy",
    "gather_packed_tree_logprobs_entropy_from_hidden",
    "gather_packed_tree_values",
    "gather_packed_tree_vocab_stats",
    "is_tree_training_bridge",
    "loss_weights",
    "merge_packed_tree_results",
    "patch_bridge_for_tree_training",
    "ppo_clipped_loss",
    "train_flops",
    "tree_attention",
    "tree_attention_spec",
    "tree_block_layout",
    "tree_forward_backward",
    "tree_mask_mod",
    "value_loss",
]
