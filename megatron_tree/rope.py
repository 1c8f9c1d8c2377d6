"""Depth RoPE: rotary embeddings indexed by each packed token's depth, not its packed offset.

Megatron-Core's GPTModel builds the rotary table for offsets 0..S-1 and ignores ``position_ids``
(DESIGN.md section 4). In a packed tree the token at packed offset p sits at depth
``position_ids[p] <= p`` in every sequence that contains it, so a plain GPTModel rotates every branch
after the first by the wrong angles. :class:`TreeGPTModel` (a GPTModel subclass) re-indexes the
table by ``position_ids``; everything else in GPTModel is unchanged.

Legend for shapes: N = packed length, b = micro-batch rows, d = rotary dim.
"""

from __future__ import annotations

import torch

from ._lazy import lazy_class_getattr


def depth_rotary_pos_emb(rotary_pos_emb: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Index Megatron's rotary table by per-token positions.

    Args:
        rotary_pos_emb: [S, 1, 1, d], the table for offsets 0..S-1 (as ``RotaryEmbedding`` returns).
        position_ids: int [b, N] (or [N]); every entry must be < S.

    Returns:
        [N, b, 1, d] (the [s, b, 1, d] layout ``apply_rotary_pos_emb`` broadcasts against
        [s, b, heads, hn]); [N, 1, 1, d] when b = 1.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    table = rotary_pos_emb[:, 0, 0, :]  # [S, d]
    limit = table.shape[0]
    top = int(position_ids.max()) if position_ids.numel() else 0
    if top >= limit or int(position_ids.min()) < 0:
        raise ValueError(
            f"position_ids must lie in [0, {limit}) (the rotary table covers the packed length); "
            f"got max {top}. Pass the tree depths from build_packed_tree_batch as position_ids"
        )
    return table[position_ids.t()].unsqueeze(2)  # [N, b, 1, d]


def _make_tree_gpt_model_class():
    from megatron.core.models.gpt.gpt_model import GPTModel

    class TreeGPTModel(GPTModel):
        """GPTModel whose rotary embedding follows ``position_ids`` (token depths in a packed tree).

        Construct it exactly like ``GPTModel``, with a layer spec from
        :func:`megatron_tree.spec.tree_attention_spec`, and call it with the packed micro-batch:
        ``model(input_ids [1, N], position_ids [1, N], attention_mask=tree.subtree_end)``.
        With ``position_embedding_type="rope"`` or ``"yarn"`` it requires ``position_ids``; other
        position embeddings already read them and are left alone.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.config.context_parallel_size != 1:
                raise ValueError(
                    "TreeGPTModel does not support context parallelism; set context_parallel_size=1"
                )

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

    return TreeGPTModel


# TreeGPTModel subclasses GPTModel: built on first use (see _lazy.py).
__getattr__ = lazy_class_getattr(__name__, {"TreeGPTModel": _make_tree_gpt_model_class})
