"""The prefix trie of a batch of sequences, read off their lexicographic order.

Sorted lexicographically (a sequence sorts before its extensions), sequences describe their trie
without any per-token object: with ``lcp[i]`` the longest common prefix (LCP) of sorted sequence i
with its predecessor (0 for the first), sequence i adds its tokens at depths ``lcp[i] .. len_i - 1``
(laid out one after another, that is the trie's depth-first pre-order), a *root group* (a maximal
run with ``lcp > 0`` inside) is one trie, and the subtree hanging below a branch node at depth
``q`` is a maximal run whose inner LCPs all exceed ``q``.

This module holds those primitives, shared by the packer (:mod:`~.packing`) and the partitioner
(:mod:`~.partition`): the keys and their order, the LCPs, :class:`TrieCounts` (any run's trie size
in O(1) from prefix sums) and :func:`cut_tries`, which cuts a trie too large for one bin at its top
branch point into the subtrees of that node's children, recursively. Each such :class:`Piece`
repeats only its ancestors' path (``base`` tokens); a piece that joins a bin already holding part
of that path repeats only the rest. The work is one Python step per piece, never per token.

Legend: B sequences, L padded length, W the longest sequence.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "Piece",
    "TrieCounts",
    "cut_tries",
    "lexicographic_order",
    "neighbour_lcp",
    "sequence_keys",
    "triangle",
    "unique_tokens",
]


def sequence_keys(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The trie keys of a right-padded batch: int64 [B, W] token ids, -1 (a value no token takes)
    past each length, W the longest length; on ``input_ids``' device.

    Args:
        input_ids: int [B, L], L >= every length.
        lengths: int [B], each >= 1.

    Raises:
        ValueError: a token id inside a sequence is negative.
    """
    lengths = lengths.to(device=input_ids.device, dtype=torch.int64)
    width = int(lengths.max()) if len(lengths) else 0
    inside = torch.arange(width, device=input_ids.device)[None, :] < lengths[:, None]  # [B, W]
    keys = input_ids[:, :width].to(torch.int64)
    if bool((keys[inside] < 0).any()):
        raise ValueError("data['input_ids'] holds negative token ids; token ids must be >= 0")
    return keys.masked_fill(~inside, -1)


def lexicographic_order(keys: torch.Tensor) -> torch.Tensor:
    """int64 [B] (on the host): the order of the rows of ``keys`` [B, W], column 0 most
    significant; stable (equal rows keep their order). np.lexsort takes the last key first."""
    order = np.lexsort(keys.cpu().numpy().T[::-1])
    return torch.from_numpy(order.astype(np.int64))


def neighbour_lcp(keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """LCP of each row of ``keys`` with the row before it (0 for the first).

    Args:
        keys: int64 [B, W], padded with -1 past each length (:func:`sequence_keys`).
        lengths: int64 [B].

    Returns:
        int64 [B].
    """
    lcp = torch.zeros_like(lengths)
    if keys.shape[0] > 1:
        differ = keys[1:] != keys[:-1]
        first_diff = torch.where(differ.any(dim=1), differ.int().argmax(dim=1), keys.shape[1])
        lcp[1:] = torch.minimum(first_diff, torch.minimum(lengths[1:], lengths[:-1]))
    return lcp


def unique_tokens(sequences: list[torch.Tensor]) -> int:
    """Tokens of the prefix trie of ``sequences`` (1-D each): every shared prefix counted once."""
    if not sequences:
        return 0
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    padded = torch.nn.utils.rnn.pad_sequence(
        [torch.as_tensor(s, dtype=torch.int64) for s in sequences], batch_first=True
    )
    keys = sequence_keys(padded, lengths)
    order = lexicographic_order(keys)
    return int((lengths[order] - neighbour_lcp(keys[order], lengths[order])).sum())


def triangle(depth: int) -> int:
    """Attention pairs of a root path of ``depth`` tokens: sum of (d + 1) for d < depth."""
    return depth * (depth + 1) // 2


class Piece(NamedTuple):
    """A subtree of a trie: the sorted sequences ``[first, end)`` below an ancestor path.

    Attributes:
        first, end: the run of the sorted order it holds.
        base: length of its ancestor path (0 for a whole root group), repeated in a bin that does
            not hold it already.
        tokens: its own unique tokens, below the ancestor path.
        pairs: its own attention pairs (sum of depth + 1 over its own tokens).
        ancestors: (id, depth) of every branch node it was cut below, root first (a node's id is the
            run ``(first, end)`` of its subtree); the last depth is ``base``.
    """

    first: int
    end: int
    base: int
    tokens: int
    pairs: int
    ancestors: tuple[tuple[tuple[int, int], int], ...]

    @property
    def full_tokens(self) -> int:
        return self.tokens + self.base

    def full_cost(self, weights: tuple[float, float]) -> float:
        return weights[0] * self.full_tokens + weights[1] * (self.pairs + triangle(self.base))


class TrieCounts:
    """Prefix sums over the sorted order that give any run's trie size in O(1).

    Args:
        lcp: int [B], LCP of each sorted sequence with its predecessor.
        lengths: int [B], sequence lengths in sorted order.
    """

    def __init__(self, lcp, lengths):
        self.lcp = np.asarray(lcp, dtype=np.int64)
        self.lengths = lengths = np.asarray(lengths, dtype=np.int64)
        self.tokens = np.concatenate([[0], np.cumsum(lengths - self.lcp)])
        pairs = (lengths * (lengths + 1) - self.lcp * (self.lcp + 1)) // 2
        self.pairs = np.concatenate([[0], np.cumsum(pairs)])

    def run(self, first: int, end: int) -> tuple[int, int]:
        """(unique tokens, attention pairs) of the trie of sorted sequences ``[first, end)``."""
        head = int(self.lcp[first])  # the first sequence counts whole
        tokens = int(self.tokens[end] - self.tokens[first]) + head
        return tokens, int(self.pairs[end] - self.pairs[first]) + triangle(head)

    def union(self, runs: list[tuple[int, int]]) -> tuple[int, int]:
        """(unique tokens, attention pairs) of the trie of the sorted runs ``[first, end)``
        together, as laid out: runs sharing a prefix share it (the LCP of the last sequence of one
        run with the first of the next is the least ``lcp`` between them)."""
        tokens = pairs = 0
        last = None
        for first, end in sorted(runs):
            run_tokens, run_pairs = self.run(first, end)
            shared = 0 if last is None else int(self.lcp[last + 1 : first + 1].min())
            tokens += run_tokens - shared
            pairs += run_pairs - triangle(shared)
            last = end - 1
        return tokens, pairs

    def root_groups(self) -> list[Piece]:
        """One piece per root group (a whole trie)."""
        starts = np.flatnonzero(self.lcp == 0)
        ends = np.append(starts[1:], len(self.lcp))
        tokens = (self.tokens[ends] - self.tokens[starts]).tolist()
        pairs = (self.pairs[ends] - self.pairs[starts]).tolist()
        return [
            Piece(a, b, 0, t, p, ())
            for a, b, t, p in zip(starts.tolist(), ends.tolist(), tokens, pairs)
        ]

    def _branch(self, first: int, end: int, keep_chains: bool) -> tuple[int, list[int]]:
        """(depth, child starts) of the top branch node of the run ``[first, end)``; no starts when
        it has none. With ``keep_chains``, sequences that end at the branch node (prefixes of the
        rest) are no child of their own: they stay with the first child, and a node with one
        other child is passed through."""
        lead = first
        while lead + 1 < end:
            inner = self.lcp[lead + 1 : end]
            depth = int(inner.min())
            starts = [lead, *(lead + 1 + np.flatnonzero(inner == depth)).tolist()]
            if not keep_chains:
                return depth, starts
            real = [s for s in starts if self.lengths[s] > depth]  # prefixes sort first
            if len(real) >= 2:
                return depth, [first, *real[1:]]
            if not real:  # copies of one sequence
                break
            lead = real[0]
        return 0, []

    def split(self, piece: Piece, keep_chains: bool = True) -> list[Piece]:
        """The subtrees of the children of ``piece``'s top branch node, or ``[piece]`` if it is a
        chain (every sequence a prefix of one); the node's id is the run it heads. Without
        ``keep_chains`` a chain is cut too, every sequence a child (for more pieces than
        branches)."""
        depth, starts = self._branch(piece.first, piece.end, keep_chains)
        if not starts:
            return [piece]
        ancestors = piece.ancestors + (((piece.first, piece.end), depth),)
        children = []
        for first, end in zip(starts, starts[1:] + [piece.end]):
            tokens, pairs = self.run(first, end)
            children.append(
                Piece(first, end, depth, tokens - depth, pairs - triangle(depth), ancestors)
            )
        return children


def cut_tries(
    counts: TrieCounts,
    *,
    max_tokens: float = math.inf,
    max_cost: float = math.inf,
    weights=(1.0, 0.0),
) -> list[Piece]:
    """Cut every root group into pieces of at most ``max_tokens`` tokens and ``max_cost`` cost
    (ancestor path included), at branch points only; chains (a sequence with its prefixes) are
    never cut, and one fits ``max_tokens`` when its longest sequence does. Pieces come in sorted
    (pre-order) order."""
    pieces: list[Piece] = []
    stack = counts.root_groups()[::-1]
    while stack:
        piece = stack.pop()
        too_big = piece.full_tokens > max_tokens or piece.full_cost(weights) > max_cost
        children = counts.split(piece) if too_big else [piece]
        if len(children) > 1:
            stack.extend(children[::-1])
        else:
            pieces.append(piece)
    return pieces
