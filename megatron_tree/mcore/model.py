"""``TreeGPTModel``: Megatron-Core's GPTModel with depth RoPE (rotary angles follow ``position_ids``).

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
    position embeddings already read them and are left alone.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.context_parallel_size != 1:
            raise ValueError("TreeGPTModel does not support context parallelism; set context_parallel_size=1")

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        output = super()._preprocess(input_ids, position_ids, *args, **kwargs)
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
