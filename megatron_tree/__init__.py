"""megatron_tree: tree training (prefix-shared packed sequences) for Megatron-Core RL training.

Layout, by dependency:

* ``megatron_tree.core``: pure torch (the trie record, packing, the mask and its plans, tree
  attention, log-probs, losses). Imports no Megatron, mbridge or transformers.
* ``megatron_tree.mcore``: Megatron-Core glue (core attention module, ``TreeGPTModel`` and
  ``TreeHybridModel``, the recurrent mixers, spec rewrite, value head, the training step). Imports
  Megatron at the top.
* ``megatron_tree.bridges``: HuggingFace bridges (mbridge).
* ``megatron_tree.testing``: the unpacked reference, the tolerances and synthetic batches; for
  checks, demos and benchmarks (the suite's harness, with the verl / AReaL CPU shims, is the
  repository's ``tests/harness``, not installed).
* ``megatron_tree.patches``: explicit runtime patches of code we do not own.

``import megatron_tree`` imports the core only; the Megatron and bridge names below are imported on
first access (this module's ``__getattr__``).
"""

from .core.attention import tree_attention
from .core.batch import MicroBatch, PackedTreeBatch, TreeOutputs
from .core.checks import set_debug_checks
from .core.context_parallel import context_parallel_split
from .core.flops import GPTShape, train_flops
from .core.heads import LogProbs, Values
from .core.logprobs import (
    gather_packed_tree_logprobs,
    gather_packed_tree_logprobs_entropy,
    gather_packed_tree_logprobs_entropy_from_hidden,
)
from .core.losses import loss_weights, ppo_clipped_loss, value_loss
from .core.mask import (
    TreeMask,
    build_attention_mask_from_trie,
    build_block_mask_from_trie,
    depth_window,
    tree_attention_mask,
    tree_block_layout,
    tree_mask_mod,
)
from .core.packing import build_packed_tree_batch
from .core.partition import partition_for_data_parallel
from .core.results import (
    gather_packed_tree_values,
    gather_packed_tree_vocab_stats,
    merge_packed_tree_results,
    values_per_position,
)
from .core.rope import depth_rotary_pos_emb
from .core.rows import KeyValueStore, TreeRows
from .core.tree import PackedTree, tree_depth

# Names that import Megatron (or mbridge), resolved on first access.
_LAZY = {
    "TreeCoreAttention": ".mcore.core_attention",
    "TreeGPTModel": ".mcore.model",
    "tree_attention_spec": ".mcore.spec",
    "local_hybrid_block_spec": ".mcore.spec",
    "LocalNorm": ".mcore.norm",
    "ValueHead": ".mcore.value_head",
    "attach_value_head": ".mcore.value_head",
    "TreeStepResult": ".mcore.step",
    "tree_forward_backward": ".mcore.step",
    "PackingConfig": ".mcore.step",
    "ProcessGroups": ".mcore.step",
    "run_phases": ".mcore.schedule",
    "ExpertTokenCounter": ".mcore.moe_stats",
    "TreeMoELayer": ".mcore.moe",
    "TreeMLASelfAttention": ".mcore.mla",
    "token_multiplicity": ".mcore.moe",
    "patch_bridge_for_tree_training": ".bridges.mbridge",
    "patch_megatron_bridge_for_tree_training": ".bridges.megatron_bridge",
    "is_tree_training_bridge": ".bridges.mbridge",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GPTShape",
    "KeyValueStore",
    "LogProbs",
    "MicroBatch",
    "PackedTree",
    "PackedTreeBatch",
    "TreeMask",
    "TreeOutputs",
    "TreeRows",
    "Values",
    "build_attention_mask_from_trie",
    "build_block_mask_from_trie",
    "build_packed_tree_batch",
    "context_parallel_split",
    "depth_rotary_pos_emb",
    "depth_window",
    "gather_packed_tree_logprobs",
    "gather_packed_tree_logprobs_entropy",
    "gather_packed_tree_logprobs_entropy_from_hidden",
    "gather_packed_tree_values",
    "gather_packed_tree_vocab_stats",
    "loss_weights",
    "merge_packed_tree_results",
    "partition_for_data_parallel",
    "ppo_clipped_loss",
    "set_debug_checks",
    "train_flops",
    "tree_attention",
    "tree_attention_mask",
    "tree_block_layout",
    "tree_depth",
    "tree_mask_mod",
    "value_loss",
    "values_per_position",
]
__all__ += sorted(_LAZY)
