"""Pieces of prefix tries packed into bins of a token capacity: the micro-batch packer's bins.

A bin holds :class:`~.trie.Piece` s (subtrees of the batch's tries, cut at branch points by
:func:`~.trie.cut_tries`) and knows the size of their union trie: a piece that joins a bin already
holding part of its ancestors' path repeats only the rest. The packer fills bins of a token
capacity (:func:`pack_pieces`, first-fit-decreasing and sharing-aware) and may even out their
costs (:func:`balance_by_cost`: longest-cost-first (:func:`balance_pieces`) and single moves and
swaps (:func:`refine`)). :func:`first_fit_decreasing` is the plain bin packer of sizes (runs of
the sorted order, trunk-reuse pieces, trunk groups).

The bins are few (micro-batches), so every choice is a scan over them, one Python step per piece
and bin, never per token. Data-parallel ranks (no capacity, up to thousands) get the same answers
without the scans in :mod:`~.ranks`; tests/test_partition.py holds those to these scans.
"""

from __future__ import annotations

import math
from collections import Counter

from .trie import Piece, triangle

__all__ = [
    "Bin",
    "balance_by_cost",
    "balance_pieces",
    "first_fit_decreasing",
    "pack_pieces",
    "refine",
]


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, first-fit-decreasing: items by decreasing size (then index), each to
    the first bin with room within ``capacity`` (an item larger than it gets a bin of its own);
    each bin lists its items in the order they went in."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b, left in enumerate(room):
            if sizes[i] <= left:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


class Bin:
    """The pieces of one micro-batch (or rank), with the size of their union trie.

    Attributes:
        tokens, pairs: unique tokens and attention pairs of the union trie.
        nodes: per branch node id, how many of the bin's pieces hang below it.
        pieces: its pieces, in insertion order.
    """

    def __init__(self, pieces=()):
        self.tokens, self.pairs, self.nodes, self.pieces = 0, 0, Counter(), []
        for piece in pieces:
            self.add(piece)

    def _path_cost(self, piece: Piece, without: Piece | None) -> tuple[int, int]:
        """(tokens, pairs) of ``piece`` with the part of its path held here (by pieces other than
        ``without``) left out."""
        skip = {node for node, _ in without.ancestors} if without is not None else ()
        shared = 0
        for node, depth in reversed(piece.ancestors):
            if self.nodes[node] - (node in skip) > 0:
                shared = depth
                break
        return piece.full_tokens - shared, piece.pairs + triangle(piece.base) - triangle(shared)

    def added(self, piece: Piece, without: Piece | None = None) -> tuple[int, int]:
        """(tokens, pairs) ``piece`` adds here (to the bin less ``without``): its own plus the part
        of its path not held yet."""
        return self._path_cost(piece, without)

    def removed(self, piece: Piece) -> tuple[int, int]:
        """(tokens, pairs) taking ``piece`` (one of the bin's) out saves."""
        return self._path_cost(piece, piece)

    def add(self, piece: Piece, added: tuple[int, int] | None = None) -> None:
        tokens, pairs = self.added(piece) if added is None else added
        self.tokens += tokens
        self.pairs += pairs
        if piece.ancestors:
            self.nodes.update(node for node, _ in piece.ancestors)
        self.pieces.append(piece)

    def remove(self, piece: Piece) -> None:
        tokens, pairs = self.removed(piece)
        self.tokens -= tokens
        self.pairs -= pairs
        if piece.ancestors:
            self.nodes.subtract(node for node, _ in piece.ancestors)
        self.pieces.remove(piece)

    def cost(self, weights: tuple[float, float]) -> float:
        return weights[0] * self.tokens + weights[1] * self.pairs

    def runs(self) -> list[tuple[int, int]]:
        """The bin's runs of the sorted order, in order (their concatenation is sorted)."""
        return sorted((p.first, p.end) for p in self.pieces)


def pack_pieces(pieces: list[Piece], capacity: int) -> list[Bin]:
    """First-fit-decreasing by full size, sharing-aware: each piece goes to the bin where it adds
    the fewest tokens (the one holding most of its path; the first such bin on ties), within
    ``capacity``."""
    bins: list[Bin] = []
    for piece in sorted(pieces, key=lambda p: (-p.full_tokens, p.first)):
        best, best_added = None, None
        for candidate in bins:
            added = candidate.added(piece)
            if added[0] <= capacity - candidate.tokens and (
                best is None or added[0] < best_added[0]
            ):
                best, best_added = candidate, added
                if added[0] == piece.tokens:  # its whole path is there: nothing adds less
                    break
        if best is None:
            best = Bin()
            bins.append(best)
        best.add(piece, best_added)
    return bins


def balance_pieces(
    pieces: list[Piece], num_bins: int, weights: tuple[float, float], capacity: float = math.inf
) -> list[Bin]:
    """Longest-processing-time first: pieces by decreasing cost, each to the bin whose cost after
    adding it is lowest (sharing-aware; ties: the cheaper bin, then the first) among those where it
    fits ``capacity`` tokens; a new bin only when none fits. A scan over the bins: for many bins
    without a capacity (ranks), :func:`~.ranks.lpt` gives the same result through heaps."""
    bins = [Bin() for _ in range(num_bins)]
    for piece in sorted(pieces, key=lambda p: (-p.full_cost(weights), p.first)):
        best, best_key, best_added = None, None, None
        for i, candidate in enumerate(bins):
            added = candidate.added(piece)
            if added[0] > capacity - candidate.tokens:
                continue
            current = candidate.cost(weights)
            key = (current + weights[0] * added[0] + weights[1] * added[1], current, i)
            if best is None or key < best_key:
                best, best_key, best_added = candidate, key, added
        if best is None:
            best = Bin()
            bins.append(best)
        best.add(piece, best_added)
    return bins


def _best_exchange(bins: list[Bin], weights, capacity: float):
    """The move (a piece of the costliest bin to another bin) or swap (with the cheapest bin) that
    lowers the larger of the two bins' costs most, within ``capacity`` tokens and never emptying a
    bin: (new larger cost, hi, piece, other, swapped piece or None), or None if nothing helps."""
    costs = [b.cost(weights) for b in bins]
    hi = max(range(len(bins)), key=lambda i: (costs[i], -i))
    lo = min(range(len(bins)), key=lambda i: (costs[i], i))
    w_tok, w_pair = weights
    best = None
    for piece in bins[hi].pieces:
        out = bins[hi].removed(piece)
        hi_tokens, hi_cost = bins[hi].tokens - out[0], costs[hi] - w_tok * out[0] - w_pair * out[1]
        options = []
        for other in range(len(bins)) if len(bins[hi].pieces) > 1 else ():
            add = bins[other].added(piece)
            if other != hi and bins[other].tokens + add[0] <= capacity:
                options.append(
                    (max(hi_cost, costs[other] + w_tok * add[0] + w_pair * add[1]), other, None)
                )
        for back in bins[lo].pieces if lo != hi else ():
            back_in, back_out, gone = (
                bins[hi].added(back, piece),
                bins[lo].removed(back),
                bins[lo].added(piece, back),
            )
            if max(hi_tokens + back_in[0], bins[lo].tokens - back_out[0] + gone[0]) <= capacity:
                new_hi = hi_cost + w_tok * back_in[0] + w_pair * back_in[1]
                new_lo = (
                    costs[lo] + w_tok * (gone[0] - back_out[0]) + w_pair * (gone[1] - back_out[1])
                )
                options.append((max(new_hi, new_lo), lo, back))
        for new_max, other, back in options:
            if new_max < costs[hi] * (1 - 1e-9) and (best is None or new_max < best[0]):
                best = (new_max, hi, piece, other, back)
    return best


def refine(
    bins: list[Bin], weights: tuple[float, float], *, rounds: int, capacity: float = math.inf
) -> list[Bin]:
    """Lower the costliest bin by single moves and swaps while that helps (at most ``rounds``),
    keeping every bin within ``capacity`` tokens and non-empty; in place, returns ``bins``."""
    for _ in range(rounds):
        best = _best_exchange(bins, weights, capacity)
        if best is None:
            break
        _, hi, piece, other, back = best
        bins[hi].remove(piece)
        if back is not None:
            bins[other].remove(back)
            bins[hi].add(back)
        bins[other].add(piece)
    return bins


def balance_by_cost(
    pieces: list[Piece], packed: list[Bin] | None, num_bins: int, weights, capacity: int
) -> list[Bin] | None:
    """The costliest bin made as cheap as possible over ``num_bins`` bins of ``capacity`` tokens:
    :func:`refine` applied to the token-packed bins ``packed`` (if given) and to the
    longest-cost-first assignment (if it fits ``num_bins``); the one with the cheaper costliest bin
    (then fewer tokens) wins. None if neither exists."""
    candidates = [] if packed is None else [packed]
    lpt = balance_pieces(pieces, num_bins, weights, capacity)
    if len(lpt) <= num_bins:
        candidates.append(lpt)
    refined = [
        refine(bins, weights, rounds=4 * len(pieces), capacity=capacity) for bins in candidates
    ]
    return min(
        refined,
        key=lambda bins: (max(b.cost(weights) for b in bins), sum(b.tokens for b in bins)),
        default=None,
    )
