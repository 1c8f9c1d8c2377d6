"""``TreeMLASelfAttention``: Megatron-Core's multi-latent attention (DeepSeek-V3, Kimi-K2) for
trees.

Multi-latent attention owns its rotary embedding (plain RoPE or YaRN) and applies it to the
decoupled rotary part of each query and key, at offsets 0..n-1 of the rows it is given. In a packed
tree a token's position is its depth, so this subclass builds its rotary module as
:class:`~megatron_tree.mcore.rotary.TreeRotaryEmbedding` (or the YaRN variant) and runs each forward
inside its ``at_depths`` with the rows' depths
(:meth:`megatron_tree.core.mask.TreeMaskPlan.query_depths`: the rows' depths in their tree, read off
the mask of the micro-batch, for a whole tree, a context-parallel rank's rows or a trunk-reuse part
alike). YaRN's ``mscale`` is applied as Megatron-Core applies it (to the rotary cos / sin, and
squared in the softmax scale); the low-rank query / key-value projections, their norms and the
up-projection recompute are Megatron's, unchanged. Its ``core_attention`` is
:class:`~megatron_tree.mcore.core_attention.TreeCoreAttention` (the spec rewrite puts it there).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from ..core.mask import TreeMask
from .rotary import follow_depth


class TreeMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose rotary angles follow the rows' depths in the tree.

    Same constructor, parameters and state dict as ``MLASelfAttention``; its ``rotary_pos_emb`` is a
    :class:`~megatron_tree.mcore.rotary.TreeRotaryEmbedding`. Refused (ValueError):
    ``apply_rope_fusion`` (the fused MLA RoPE kernels rotate by packed offset),
    ``cache_mla_latents`` (an inference cache) and ``qk_clip`` / ``log_max_attention_logit`` (they
    read the max logit that the stock core attention records).
    """

    def __init__(self, config, submodules, layer_number: int, *args, **kwargs):
        where = f"layer {layer_number}"
        for flag, why in (
            (
                "apply_rope_fusion",
                "the fused MLA RoPE kernels rotate by packed offset, not by depth",
            ),
            (
                "cache_mla_latents",
                "it is an inference cache; tree training runs whole micro-batches",
            ),
            ("qk_clip", "it reads the max attention logit, which tree attention does not record"),
            ("log_max_attention_logit", "tree attention does not record the max attention logit"),
        ):
            if getattr(config, flag, False):
                raise ValueError(
                    f"{where}: {flag}=True is not supported with tree attention ({why}); set "
                    f"{flag}=False"
                )
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.rotary_pos_emb = follow_depth(self.rotary_pos_emb)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        """As ``MLASelfAttention.forward``; ``attention_mask`` must be the micro-batch's tree mask
        (``tree_attention_mask(...)`` or an integer ``subtree_end``), whose rows give the depths."""
        if (
            attention_mask is None
            or attention_mask.dtype == torch.bool
            or attention_mask.dtype.is_floating_point
        ):
            raise ValueError(
                f"layer {self.layer_number}: multi-latent tree attention needs the tree mask "
                "tree_attention_mask(tree) (or an integer subtree_end) as attention_mask: its "
                "rotary positions are the rows' depths, read off the mask"
            )
        if not isinstance(attention_mask, TreeMask):
            attention_mask = TreeMask(attention_mask)
        plan = attention_mask.plan
        with self.rotary_pos_emb.at_depths(
            plan.query_depths(), reach=plan.reach or plan.subtree_end.shape[-1]
        ):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
