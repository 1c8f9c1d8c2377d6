"""``TreeGPTModel``: Megatron-Core's GPTModel with depth RoPE (rotary angles follow
``position_ids``).

Megatron-Core's GPTModel builds the rotary table for offsets 0..S-1 and ignores ``position_ids``,
which silently corrupts every branch after the first in a packed tree; this subclass re-indexes the
table by the tokens' depths (:func:`megatron_tree.core.rope.depth_rotary_pos_emb`). Everything else
in GPTModel is unchanged.
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_model import GPTModel

from ..core.rope import depth_rotary_pos_emb


class TreeGPTModel(GPTModel):
    """GPTModel whose rotary embedding follows ``position_ids`` (token depths in a packed tree).

    Construct it exactly like ``GPTModel``, with a layer spec from
    :func:`megatron_tree.mcore.spec.tree_attention_spec`, and call it with a packed micro-batch:
    ``model(input_ids [1, N], position_ids [1, N], attention_mask=tree_attention_mask(tree))``.
    With ``position_embedding_type="rope"`` or ``"yarn"`` it requires ``position_ids``; other
    position embeddings already read them and are left alone. Multi-latent attention layers
    (:class:`~megatron_tree.mcore.mla.TreeMLASelfAttention`) rotate by the depths the tree mask
    gives. Under context parallelism each rank passes its rows' tokens and depths
    (``tree_forward_backward`` splits the tree). Multi-token prediction is refused (ValueError).
    """

    def __init__(self, config, *args, **kwargs):
        layers = getattr(config, "mtp_num_layers", None)
        if (
            layers is not None or kwargs.get("mtp_block_spec") is not None
        ):  # 0 too: 0.16 runs MTP then
            raise ValueError(
                f"multi-token prediction (mtp_num_layers={layers}) is not supported with tree "
                "training: its input at a token is the embedding of the next token, which a "
                "branch point does not have once (one per child), and Megatron's MTP takes the "
                "next *packed* token instead. Set mtp_num_layers=None (Megatron-Bridge: "
                "provider.mtp_num_layers = None before provide(); mbridge: "
                "bridge.set_extra_args(mtp_num_layers=None) before get_model(); RL trains the "
                "main head only)"
            )
        super().__init__(config, *args, **kwargs)

    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        # A trunk-reuse part's rows can sit deeper than they are many: its rows say how deep the
        # rotary table must reach (a host int set at packing time).
        self._rotary_length = getattr(getattr(attention_mask, "plan", None), "reach", None)
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            self._rotary_length = None

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        rotary = getattr(self, "rotary_pos_emb", None)
        cp_group = getattr(rotary, "cp_group", None)
        if cp_group is not None:
            # Without its CP group the rotary module returns the table for every packed position
            # (not this rank's zigzag slice): the depths of this rank's rows index the whole table.
            rotary.cp_group = None
        reach = getattr(self, "_rotary_length", None)
        if reach is not None and rotary is not None:
            length_of = rotary.get_rotary_seq_len
            rotary.get_rotary_seq_len = lambda *a, **k: max(length_of(*a, **k), reach)
        try:
            output = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        finally:
            if cp_group is not None:
                rotary.cp_group = cp_group
            if reach is not None and rotary is not None:
                del rotary.get_rotary_seq_len
        rotary_pos_emb = output[1]
        if rotary_pos_emb is None or self.position_embedding_type not in ("rope", "yarn"):
            return output
        if position_ids is None:
            raise ValueError(
                "TreeGPTModel needs position_ids (token depths) for rotary embeddings; pass the "
                "micro-batch's position_ids"
            )
        if isinstance(rotary_pos_emb, tuple):  # (q_emb, k_emb) variants
            rotary_pos_emb = tuple(depth_rotary_pos_emb(t, position_ids) for t in rotary_pos_emb)
        else:
            rotary_pos_emb = depth_rotary_pos_emb(rotary_pos_emb, position_ids)
        return (output[0], rotary_pos_emb, *output[2:])
