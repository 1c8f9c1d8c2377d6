"""Depth RoPE as a Megatron-Core rotary module: ``TreeRotaryEmbedding`` (and its YaRN variant),
whose table follows token depth.

Megatron-Core's ``RotaryEmbedding.forward(max_seq_len)`` returns the angles of offsets 0..S-1
(sliced to this rank's zigzag chunks under context parallelism), and its callers
(``GPTModel._preprocess``, ``MLASelfAttention.get_query_key_value_tensors``) pass no positions. In
a packed tree a token's position is its depth, so every branch after the first would be rotated by
its packed offset. The tree modules (:class:`~megatron_tree.mcore.model.TreeGPTModel`,
:class:`~megatron_tree.mcore.mla.TreeMLASelfAttention`) build Megatron's module as usual, make it
one of these at construction (:func:`follow_depth`: same object, same state, nothing in the state
dict) and run their forward inside :meth:`TreeRotaryEmbedding.at_depths`, which hands it the rows'
depths and how deep the table must reach. Inside, Megatron's own call returns the table of the
whole tree (never a context-parallel slice: a rank's rows are indexed by their depths) gathered
at those depths; outside, the module is Megatron's, unchanged.

Legend: n rows, b micro-batch rows, S table length, d rotary dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

from ..core.rope import depth_rotary_pos_emb

__all__ = ["TreeRotaryEmbedding", "TreeYarnRotaryEmbedding", "follow_depth"]


class TreeRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose table follows token depth inside :meth:`at_depths`.

    Same constructor and state as ``RotaryEmbedding`` (``inv_freq`` is not in the state dict).
    Megatron calls it as ``rotary(max_seq_len, offset=0, packed_seq=False, cp_group=None)``.
    """

    _depths: torch.Tensor | None = None
    _reach: int = 0

    @contextlib.contextmanager
    def at_depths(
        self, depths: torch.Tensor, *, reach: int | None = None
    ) -> Iterator[TreeRotaryEmbedding]:
        """Within the block, a call returns the table of the whole tree at ``depths``.

        Args:
            depths: int [b, n] (or [n]): the rows' depths in their tree (a micro-batch's
                ``position_ids``, or :meth:`~megatron_tree.core.mask.TreeMaskPlan.query_depths`).
            reach: how deep the table must reach (a host int: the rows' deepest depth + 1, which
                exceeds the rows' count for a trunk-reuse part); None: as deep as the length the
                caller asks for.
        """
        saved = self._depths, self._reach
        self._depths, self._reach = depths, reach or 0
        try:
            yield self
        finally:
            self._depths, self._reach = saved

    def depth_table(self, depths: torch.Tensor, length: int, offset: int = 0):
        """Megatron's table of ``length`` positions from ``offset`` (no context-parallel slice),
        gathered at ``depths``: [n, b, 1, d] (YaRN: ``(table, mscale)``). ``length`` must exceed
        every depth."""
        table = super().forward(length, offset, packed_seq=True)  # cached by Megatron
        if isinstance(table, tuple):  # YaRN: (table, mscale)
            return (depth_rotary_pos_emb(table[0], depths), *table[1:])
        return depth_rotary_pos_emb(table, depths)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        """Megatron's call: outside :meth:`at_depths` Megatron's table; inside, the
        :meth:`depth_table` at the given depths, ``max(max_seq_len, reach)`` long."""
        if self._depths is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        return self.depth_table(self._depths, max(max_seq_len, self._reach), offset)


class TreeYarnRotaryEmbedding(TreeRotaryEmbedding, YarnRotaryEmbedding):
    """``YarnRotaryEmbedding`` whose table follows token depth (see :class:`TreeRotaryEmbedding`);
    a call returns ``(table, mscale)`` as Megatron's does."""


_TREE_CLASSES = {
    RotaryEmbedding: TreeRotaryEmbedding,
    YarnRotaryEmbedding: TreeYarnRotaryEmbedding,
}


def follow_depth(rotary: RotaryEmbedding) -> TreeRotaryEmbedding:
    """Megatron's rotary module ``rotary``, just built, as its depth-following variant: the same
    object and state, its class set to :class:`TreeRotaryEmbedding` or
    :class:`TreeYarnRotaryEmbedding` (so that the variant follows whatever the installed Megatron's
    constructor computed). A module that already follows depth is returned as it is.

    Raises:
        ValueError: a rotary class other than Megatron's two (its table could not follow depth).
    """
    if isinstance(rotary, TreeRotaryEmbedding):
        return rotary
    tree = _TREE_CLASSES.get(type(rotary))
    if tree is None:
        raise ValueError(
            f"cannot make {type(rotary).__name__} follow token depth; tree training supports "
            "Megatron-Core's RotaryEmbedding and YarnRotaryEmbedding"
        )
    rotary.__class__ = tree
    return rotary
