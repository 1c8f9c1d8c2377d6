"""``TreeGPTModel``: Megatron-Core's GPTModel with depth RoPE (rotary angles follow
``position_ids``), through the :class:`DepthRoPE` mixin that ``TreeHybridModel`` shares.

Megatron-Core's GPTModel (and HybridModel) builds the rotary table for offsets 0..S-1 and ignores
``position_ids``, which silently corrupts every branch after the first in a packed tree. The mixin
builds the rotary module as :class:`~megatron_tree.mcore.rotary.TreeRotaryEmbedding` (or the YaRN
variant) and runs the forward inside the module's ``at_depths(position_ids, reach=...)``, so the
table the model builds is indexed by the tokens' depths. Everything else in GPTModel is unchanged.
"""

from __future__ import annotations

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_model import GPTModel

from .rotary import TreeRotaryEmbedding, follow_depth


def mtp_error(detail: str) -> ValueError:
    """The refusal of multi-token prediction, ``detail`` saying where the model asks for it."""
    return ValueError(
        f"multi-token prediction ({detail}) is not supported with tree training: its input at a "
        "token is the embedding of the next token, which a branch point does not have once (one "
        "per child), and Megatron's MTP takes the next *packed* token instead. Set "
        "mtp_num_layers=None (Megatron-Bridge: provider.mtp_num_layers = None before provide(); "
        "mbridge: bridge.set_extra_args(mtp_num_layers=None) before get_model(); RL trains the "
        "main head only)"
    )


class DepthRoPE:
    """Mixin for a Megatron language model (``GPTModel``, ``HybridModel``) that builds its rotary
    module as ``self.rotary_pos_emb`` and feeds ``position_ids`` only to its embedding: the built
    module becomes a :class:`~megatron_tree.mcore.rotary.TreeRotaryEmbedding` (or the YaRN variant;
    same state dict) and the forward runs inside its ``at_depths(position_ids, reach=...)``, so
    the table the model builds is indexed by the tokens' depths. Other position embeddings already
    read ``position_ids`` and are left alone. List it before the Megatron model class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rotary = getattr(self, "rotary_pos_emb", None)
        if isinstance(rotary, RotaryEmbedding):  # rope / YaRN ("mrope" reads position_ids)
            self.rotary_pos_emb = follow_depth(rotary)

    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        """As the Megatron model's forward; with rope / YaRN the rotary table follows
        ``position_ids``, as deep as the tree mask's plan says the rows reach."""
        rotary = getattr(self, "rotary_pos_emb", None)
        if not isinstance(rotary, TreeRotaryEmbedding):
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        if position_ids is None:
            raise ValueError(
                f"{type(self).__name__} needs position_ids (token depths) for rotary embeddings; "
                "pass the micro-batch's position_ids"
            )
        # A trunk-reuse part's rows can sit deeper than they are many: its plan says how deep the
        # rotary table must reach (a host int set at packing time).
        reach = getattr(getattr(attention_mask, "plan", None), "reach", None)
        with rotary.at_depths(position_ids, reach=reach):
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)


class TreeGPTModel(DepthRoPE, GPTModel):
    """GPTModel whose rotary embedding follows ``position_ids`` (token depths in a packed tree).

    Construct it exactly like ``GPTModel``, with a layer spec from
    :func:`megatron_tree.mcore.spec.tree_attention_spec`, and call it with a packed micro-batch:
    ``model(input_ids [1, N], position_ids [1, N], attention_mask=tree_attention_mask(tree))``.
    With ``position_embedding_type="rope"`` or ``"yarn"`` its ``rotary_pos_emb`` is a
    :class:`~megatron_tree.mcore.rotary.TreeRotaryEmbedding` (same state dict as GPTModel's) and
    it requires ``position_ids`` (:class:`DepthRoPE`); other position embeddings already read them
    and are left alone. Multi-latent attention layers
    (:class:`~megatron_tree.mcore.mla.TreeMLASelfAttention`) rotate by the depths the tree mask
    gives. Under context parallelism each rank passes its rows' tokens and depths
    (``tree_forward_backward`` splits the tree); the rotary table is the whole tree's.
    Multi-token prediction is refused (ValueError).
    """

    def __init__(self, config, *args, **kwargs):
        layers = getattr(config, "mtp_num_layers", None)
        if (
            layers is not None or kwargs.get("mtp_block_spec") is not None
        ):  # 0 too: 0.16 runs MTP then
            raise mtp_error(f"mtp_num_layers={layers}")
        super().__init__(config, *args, **kwargs)
