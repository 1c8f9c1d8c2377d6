"""The packed tree record: one trie of token sequences laid out in depth-first pre-order, and what
its ``subtree_end`` encoding alone gives (:func:`tree_depth`).

Legend for shapes: N = padded packed length, U = real packed (unique) tokens, S = sequences in the
tree, T = sum of the lengths of those sequences (every token of every sequence, shared or not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedTree:
    """One micro-batch's trie, flattened in pre-order so that every subtree is a contiguous range.

    The whole attention structure is carried by ``subtree_end``: key position ``k`` is visible to
    the query positions ``[k, subtree_end[k])`` (its own subtree), so ``allowed(q, k) = (k <= q) &
    (q < subtree_end[k])``. Padding positions ``p >= num_tree_tokens`` have ``subtree_end[p] == p +
    1`` (each sees only itself, so no softmax row is empty).

    Attributes:
        input_ids: int64 [N]. Token of each packed position (``pad_token_id`` on padding).
        position_ids: int64 [N]. Depth of each packed position in its trie (0 for a root and for
            padding); equals the token's position in every sequence that contains it.
        subtree_end: int32 [N]. Exclusive end of each position's subtree (the O(N) mask encoding).
        parent_index: int64 [N]. Packed position of each position's parent, -1 for roots/padding.
        sequence_ids: int64 [S]. Original batch index of each sequence, in tree (pre-order) order.
        cu_seqlens: int64 [S + 1]. Offsets of each sequence's tokens in ``token_index``.
        token_index: int64 [T]. Packed position of every sequence token, sequences concatenated in
            tree order; ``input_ids[token_index[cu_seqlens[i]:cu_seqlens[i + 1]]]`` is sequence i.
        num_tree_tokens: U, the real (unique) packed tokens; positions ``>= U`` are padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    parent_index: torch.Tensor
    sequence_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    token_index: torch.Tensor
    num_tree_tokens: int

    @property
    def padded_length(self) -> int:
        """N, the packed length including padding."""
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        """S, the number of sequences in this tree (0 for a dummy tree)."""
        return int(self.sequence_ids.shape[0])

    @property
    def num_sequence_tokens(self) -> int:
        """T, the number of tokens of the sequences counted as if unpacked."""
        return int(self.token_index.shape[0])

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """int64 [S], length of each sequence in tree order."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def is_dummy(self) -> bool:
        """True for an all-padding tree added to keep data-parallel ranks in step."""
        return self.num_sequences == 0

    @classmethod
    def all_padding(cls, padded_length: int, pad_token_id: int = 0, device=None) -> PackedTree:
        """A dummy tree: ``padded_length`` padding positions and no sequence (keeps data-parallel
        ranks, or pipeline micro-batch counts, in step)."""
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(
            input_ids=torch.full((padded_length,), pad_token_id, dtype=torch.int64, device=device),
            position_ids=torch.zeros(padded_length, dtype=torch.int64, device=device),
            subtree_end=torch.arange(1, padded_length + 1, dtype=torch.int32, device=device),
            parent_index=torch.full((padded_length,), -1, dtype=torch.int64, device=device),
            sequence_ids=empty,
            cu_seqlens=torch.zeros(1, dtype=torch.int64, device=device),
            token_index=empty,
            num_tree_tokens=0,
        )

    @classmethod
    def concat(cls, trees: list[PackedTree]) -> PackedTree:
        """Unpadded trees laid out one after another, as separate roots of one tree."""
        if len(trees) == 1:
            return trees[0]
        offsets = [sum(t.padded_length for t in trees[:i]) for i in range(len(trees))]
        firsts = [sum(t.num_sequence_tokens for t in trees[:i]) for i in range(len(trees))]
        cu = [trees[0].cu_seqlens[:1]] + [t.cu_seqlens[1:] + f for t, f in zip(trees, firsts)]
        return cls(
            input_ids=torch.cat([t.input_ids for t in trees]),
            position_ids=torch.cat([t.position_ids for t in trees]),
            subtree_end=torch.cat([t.subtree_end + o for t, o in zip(trees, offsets)]),
            parent_index=torch.cat(
                [
                    torch.where(t.parent_index >= 0, t.parent_index + o, -1)
                    for t, o in zip(trees, offsets)
                ]
            ),
            sequence_ids=torch.cat([t.sequence_ids for t in trees]),
            cu_seqlens=torch.cat(cu),
            token_index=torch.cat([t.token_index + o for t, o in zip(trees, offsets)]),
            num_tree_tokens=sum(t.num_tree_tokens for t in trees),
        )

    def sequence_token_index(self, i: int) -> torch.Tensor:
        """int64 [L_i], packed positions of the tokens of the i-th sequence (tree order)."""
        return self.token_index[int(self.cu_seqlens[i]) : int(self.cu_seqlens[i + 1])]

    def to(self, device: torch.device | str) -> PackedTree:
        """A copy with every tensor moved to ``device``."""
        return PackedTree(
            **{
                name: (value.to(device) if isinstance(value, torch.Tensor) else value)
                for name, value in self.__dict__.items()
            }
        )


def subtree_end_of(tree: PackedTree | torch.Tensor) -> torch.Tensor:
    """The ``subtree_end`` [N] of a :class:`PackedTree`, or an int tensor taken as one (flattened);
    ValueError for a float or bool tensor."""
    if isinstance(tree, PackedTree):
        return tree.subtree_end
    if tree.dtype.is_floating_point or tree.dtype == torch.bool:
        raise ValueError(
            f"subtree_end must be an integer tensor, got dtype {tree.dtype}; pass "
            "PackedTree.subtree_end"
        )
    return tree.reshape(-1)


def tree_depth(tree: PackedTree | torch.Tensor) -> torch.Tensor:
    """int64 [N]: each position's depth in its tree (0 for a root and for padding), from
    ``subtree_end`` alone.

    The keys ``k <= q`` are q's ancestors (itself included) when their subtree reaches past q, and
    otherwise have ``subtree_end[k] <= q``; no key after q has (``subtree_end[k] > k``). So
    ``depth(q) = q - #{k : subtree_end[k] <= q}``: one sort and one search, O(N log N). It equals
    the packed ``position_ids`` (token depths); only differences along ancestor paths matter.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` int [N].
    """
    subtree_end = subtree_end_of(tree).to(torch.int64)
    pos = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    return pos - torch.searchsorted(torch.sort(subtree_end).values, pos, right=True)
