"""Assign the pieces of prefix tries to bins: micro-batches (the packer) or data-parallel ranks.

A bin holds :class:`~.trie.Piece` s (subtrees of the batch's tries, cut at branch points by
:func:`~.trie.cut_tries`) and knows the size of their union trie: a piece that joins a bin already
holding part of its ancestors' path repeats only the rest. The packer fills bins of a token
capacity (:func:`pack_pieces`, first-fit-decreasing and sharing-aware) and may even out their
costs (:func:`balance_by_cost`); :func:`partition_for_data_parallel` balances the ranks' costs,
either over pieces it cuts itself or over given groups (:func:`balance_groups`: a prompt group
stays on one rank). :func:`first_fit_decreasing` is the plain bin packer of sizes (runs of the
sorted order, trunk-reuse pieces, trunk groups).

The work is one Python step per piece and bin, never per token; interval sizes come from the
prefix sums of :class:`~.trie.TrieCounts`. The packer's bins are few (micro-batches) and scanned.
Ranks have no capacity and may be a thousand, so the partitioner gives the scans' answers without
the scans: heaps find the bin a piece goes to (:class:`_Ranks`: the cheapest bin and the cheapest
holder of each of the piece's branch nodes are the only candidates), and pieces grouped by their
ancestor path (a class adds and saves the same path part anywhere) find the best move or swap by
bisection, for a large class in numpy (:func:`_exchange`). Assignment is O(P log dp) instead of
O(P dp), a round of moves and swaps O(pieces of the two bins) instead of O(pieces x dp + their
product), and the batch is sorted as bytes, not over W columns (:func:`_trie_order`).
tests/test_partition.py holds the results to the scans, ties included.

Legend: B sequences, L padded length, W the longest sequence, P pieces, dp ranks.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter

import numpy as np
import torch

from .checks import check_bool, check_int
from .flops import GPTShape, cost_weights
from .ragged import read_batch
from .trie import (
    Piece,
    TrieCounts,
    cut_tries,
    triangle,
)

__all__ = [
    "Bin",
    "balance_by_cost",
    "balance_groups",
    "first_fit_decreasing",
    "pack_pieces",
    "partition_for_data_parallel",
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
    fits ``capacity`` tokens; a new bin only when none fits. Without a capacity (ranks) the bins
    come from heaps (:func:`_lpt`), with the same result as the scan over all bins."""
    if capacity == math.inf:
        return _lpt(pieces, num_bins, weights).bins
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


# ---------------------------------------------------------------------------------------------
# Ranks: bins without a capacity, found through heaps
# ---------------------------------------------------------------------------------------------


class _Ranks:
    """``num_bins`` :class:`Bin` s without a capacity (data-parallel ranks) and the heaps that find,
    without a scan over the bins, the cheapest bin, the costliest one, and the cheapest among the
    bins holding a branch node (where a piece hanging below the node repeats less of its path).

    A heap entry is (cost, bin, stamp) ((-cost, bin, stamp) in the max-heap) and is current while
    the bin's stamp is: every change of a bin (:meth:`refresh`) bumps its stamp and pushes current
    entries into :attr:`low` and :attr:`high`, and stale ones are dropped when they reach a top.
    A bin holding many nodes would push into many node heaps at every change, so a node's heap
    only keeps, for each bin holding the node, an entry no dearer than the bin (pushed when the
    bin comes to hold the node or gets cheaper): a stale top is pushed again with the bin's cost.
    Either way a current top is exact, ties going to the lowest bin index as in a scan.

    Attributes:
        bins: the :class:`Bin` s, ``num_bins`` of them.
        costs: float [num_bins], each bin's cost under ``weights``.
        cost_array: the same as a numpy float64 array [num_bins].
        holders: per branch node id, the set of bins holding it (a piece below it).
        low, high: heaps of every bin by cost, ascending and descending.
        holding: per branch node id, the heap of its holders by cost.
    """

    def __init__(self, num_bins: int, weights: tuple[float, float]):
        self.weights = weights
        self.bins = [Bin() for _ in range(num_bins)]
        self.costs = [0.0] * num_bins
        self.cost_array = np.zeros(num_bins)
        self.stamps = [0] * num_bins
        self.retired = [False] * num_bins
        self.low = [(0.0, i, 0) for i in range(num_bins)]  # sorted, so a heap
        self.high = [(-0.0, i, 0) for i in range(num_bins)]
        self.holding: dict = {}
        self.holders: dict = {}
        self._gained: dict = {}  # bin -> nodes it came to hold since its last refresh
        self._pushed: dict = {}  # (node, bin) -> stamp of its newest entry in holding[node]
        self._classes: dict = {}  # bin -> its pieces by ancestor path (:meth:`classes`)

    def add(self, i: int, piece: Piece, added: tuple[int, int] | None = None) -> None:
        """Put ``piece`` into bin ``i`` (call :meth:`refresh` after the bin's last change)."""
        nodes = self.bins[i].nodes
        self.bins[i].add(piece, added)
        for node, _ in piece.ancestors:
            if nodes[node] == 1:
                self.holders.setdefault(node, set()).add(i)
                self._gained.setdefault(i, []).append(node)
        if i in self._classes:
            self._file(self._classes[i], piece)

    def remove(self, i: int, piece: Piece) -> None:
        """Take ``piece`` out of bin ``i`` (call :meth:`refresh` after the bin's last change)."""
        nodes = self.bins[i].nodes
        self.bins[i].remove(piece)
        for node, _ in piece.ancestors:
            if nodes[node] == 0:
                self.holders[node].discard(i)
        if i in self._classes:
            self._unfile(self._classes[i], piece)

    def refresh(self, i: int) -> None:
        """Bin ``i`` changed: its cost again, current heap entries."""
        b = self.bins[i]
        cheaper = b.cost(self.weights) < self.costs[i]
        cost = self.costs[i] = b.cost(self.weights)
        self.cost_array[i] = cost
        stamp = self.stamps[i] = self.stamps[i] + 1
        heapq.heappush(self.low, (cost, i, stamp))
        heapq.heappush(self.high, (-cost, i, stamp))
        gained = self._gained.pop(i, ())
        for node in (node for node, count in b.nodes.items() if count > 0) if cheaper else gained:
            if b.nodes[node] > 0:
                heapq.heappush(self.holding.setdefault(node, []), (cost, i, stamp))
                self._pushed[(node, i)] = stamp

    def retire(self, i: int) -> None:
        """Take bin ``i`` out of every heap for good (it can take no more pieces)."""
        self.stamps[i] += 1
        self.retired[i] = True

    def cheapest(self, heap: list | None, skip: int = -1, fits=None, node=None) -> int | None:
        """The bin of ``heap`` (:attr:`low`, or the heap of ``node`` in :attr:`holding`) with the
        least (cost, index), other than ``skip`` and one for which ``fits(bin)`` is false; None
        if there is none."""
        stash, found = [], None
        while heap:
            entry = heap[0]
            i = entry[1]
            if entry[2] != self.stamps[i]:
                heapq.heappop(heap)
                if (
                    node is not None
                    and not self.retired[i]
                    and self.bins[i].nodes[node] > 0
                    and self._pushed[(node, i)] != self.stamps[i]
                ):  # still a holder: its entry again, at its cost
                    heapq.heappush(heap, (self.costs[i], i, self.stamps[i]))
                    self._pushed[(node, i)] = self.stamps[i]
            elif i == skip or (fits is not None and not fits(i)):
                stash.append(heapq.heappop(heap))
            else:
                found = i
                break
        for entry in stash:
            if entry[2] == self.stamps[entry[1]]:  # ``fits`` may have retired it
                heapq.heappush(heap, entry)
        return found

    def costliest(self) -> int:
        """The bin with the highest cost (ties: the first)."""
        while self.high[0][2] != self.stamps[self.high[0][1]]:
            heapq.heappop(self.high)
        return self.high[0][1]

    def candidates(self, pieces: list[Piece], skip: int = -1, fits=None) -> set[int]:
        """Bins (other than ``skip``, and those for which ``fits(bin)`` is false) among which the
        least (cost after adding ``pieces`` one after another, cost before, index) is the least
        over all such bins.

        A bin holding none of the pieces' ancestors adds them whole, so the cheapest bin (which
        adds at most that) is at least as good as any of those. What a bin adds falls as it holds
        deeper nodes of the path all the pieces hang below (depths grow along a path cut at
        branch points), so for each node of that path its cheapest holder is at least as good as
        any bin whose deepest held node of the path it is. Bins holding other ancestors (a group
        hanging below several paths; paths cut between the sequences of a chain, whose depths
        need not grow) are all taken. So a piece below a path of k nodes needs k + 1 heap tops,
        not a scan."""
        path = pieces[0].ancestors
        for piece in pieces[1:]:
            common = 0
            while (
                common < min(len(path), len(piece.ancestors))
                and path[common] == piece.ancestors[common]
            ):
                common += 1
            path = path[:common]
        if any(a[1] >= b[1] for p in pieces for a, b in zip(p.ancestors, p.ancestors[1:])):
            path = ()  # a path cut in a chain: holding more of it may share less (Bin's rule)
        found = {self.cheapest(self.low, skip, fits)}
        found.update(self.cheapest(self.holding.get(node), skip, fits, node) for node, _ in path)
        if len(pieces) > 1 or len(path) < len(pieces[0].ancestors):
            others = {node for piece in pieces for node, _ in piece.ancestors}
            for node in others.difference(node for node, _ in path):
                found.update(
                    i for i in self.holders.get(node, ()) if i != skip and (fits is None or fits(i))
                )
        found.discard(None)
        return found

    def place(self, piece: Piece, skip: int = -1):
        """Where ``piece`` costs least after joining, other than bin ``skip``: ((cost after, cost
        before, bin), (tokens, pairs) it adds there), the least such key, as a scan over the bins
        would find it (:meth:`candidates`); None if no bin is left."""
        w_tok, w_pair = self.weights
        if not piece.ancestors:  # a whole trie: the same everywhere, so the cheapest bin
            i = self.cheapest(self.low, skip)
            if i is None:
                return None
            current = self.costs[i]
            key = (current + w_tok * piece.tokens + w_pair * piece.pairs, current, i)
            return key, (piece.tokens, piece.pairs)
        best = None
        for i in self.candidates([piece], skip):
            added = self.bins[i].added(piece)
            current = self.costs[i]
            key = (current + w_tok * added[0] + w_pair * added[1], current, i)
            if best is None or key < best[0]:
                best = (key, added)
        return best

    def classes(self, i: int) -> dict:
        """Bin ``i``'s pieces by ancestor path (pieces with one path add and save the same path
        part anywhere): {ancestors: :class:`_Members`}. Built on first use, then kept up to date
        by :meth:`add` and :meth:`remove`."""
        classes = self._classes.get(i)
        if classes is None:
            classes = self._classes[i] = {}
            for piece in sorted(self.bins[i].pieces, key=lambda p: p.first):
                self._file(classes, piece)
        return classes

    def _file(self, classes: dict, piece: Piece) -> None:
        if piece.ancestors not in classes:
            classes[piece.ancestors] = _Members()
        classes[piece.ancestors].insert(piece, self.weights)

    def _unfile(self, classes: dict, piece: Piece) -> None:
        members = classes[piece.ancestors]
        members.delete(piece, self.weights)
        if not members.pieces:
            del classes[piece.ancestors]


class _Members:
    """The pieces of one bin below one ancestor path, sorted by (own cost, first).

    Attributes:
        keys: (own cost, first) per piece; pieces; owns: float own costs (weighted tokens and
            pairs below the path).
    """

    def __init__(self):
        self.keys: list = []
        self.pieces: list[Piece] = []
        self.owns: list[float] = []
        self._arrays = None

    def insert(self, piece: Piece, weights) -> None:
        own = weights[0] * piece.tokens + weights[1] * piece.pairs
        j = bisect_left(self.keys, (own, piece.first))
        self.keys.insert(j, (own, piece.first))
        self.pieces.insert(j, piece)
        self.owns.insert(j, own)
        self._arrays = None

    def delete(self, piece: Piece, weights) -> None:
        own = weights[0] * piece.tokens + weights[1] * piece.pairs
        j = bisect_left(self.keys, (own, piece.first))
        del self.keys[j], self.pieces[j], self.owns[j]
        self._arrays = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int64 [n], pairs int64 [n], own costs float64 [n]) of the pieces, in order."""
        if self._arrays is None:
            self._arrays = (
                np.array([p.tokens for p in self.pieces], dtype=np.int64),
                np.array([p.pairs for p in self.pieces], dtype=np.int64),
                np.array(self.owns, dtype=np.float64),
            )
        return self._arrays


def _lpt(pieces: list[Piece], num_bins: int, weights) -> _Ranks:
    """:func:`balance_pieces` without a capacity, the bins found through :meth:`_Ranks.place`:
    pieces by decreasing cost, each to the bin whose cost after adding it is lowest (ties: the
    cheaper bin, then the first). O(P log dp) for pieces without ancestors."""
    ranks = _Ranks(num_bins, weights)
    for piece in sorted(pieces, key=lambda p: (-p.full_cost(weights), p.first)):
        (_, _, i), added = ranks.place(piece)
        ranks.add(i, piece, added)
        ranks.refresh(i)
    return ranks


def _refine_ranks(ranks: _Ranks, *, rounds: int) -> _Ranks:
    """:func:`refine` without a capacity, in place and with the same result: while that lowers the
    costliest bin (at most ``rounds`` times), the best single move of one of its pieces to another
    bin, or swap with a piece of the cheapest bin (:func:`_exchange`)."""
    for _ in range(rounds):
        exchange = _exchange(ranks)
        if exchange is None:
            break
        hi, piece, other, back = exchange
        ranks.remove(hi, piece)
        if back is not None:
            ranks.remove(other, back)
            ranks.add(hi, back)
        ranks.add(other, piece)
        ranks.refresh(hi)
        ranks.refresh(other)
    return ranks


_VECTOR = 32  # classes at least this large are evaluated with numpy (:func:`_class_values`)


def _exchange(ranks: _Ranks):
    """:func:`_best_exchange` without a capacity, the same exchange found without trying every
    piece against every bin: (hi, piece, other bin, swapped piece or None), or None.

    The scan's choice is the first, in its order (the costliest bin's pieces in order; for each,
    moves to the other bins in index order, then swaps with the cheapest bin's pieces in order),
    of the exchanges with the least new larger cost. Pieces with one ancestor path (a class) save
    and add the same path part wherever they go, so per class of the costliest bin this needs
    one :meth:`_Ranks.candidates` for its moves and, per class of the cheapest bin, three path
    parts for its swaps (:func:`_class_terms`); the best move and swap of every piece of the
    class then come out of a few numpy passes (:func:`_class_values`). Only for the winning piece
    are the bins (numpy, one pass) or the cheapest bin's pieces scanned in order for the first
    exchange with that cost."""
    w_tok, w_pair = ranks.weights
    hi, lo = ranks.costliest(), ranks.cheapest(ranks.low)
    top, low = ranks.bins[hi], ranks.bins[lo]
    movable = len(top.pieces) > 1
    partners = list(ranks.classes(lo).values()) if lo != hi else []
    position = {piece.first: k for k, piece in enumerate(top.pieces)}
    best, at, terms = math.inf, len(top.pieces), {}
    for path, members in ranks.classes(hi).items():
        terms[path] = _class_terms(ranks, hi, lo, members.pieces[0], movable, partners)
        if len(members.pieces) >= _VECTOR:
            value = np.minimum(*_class_values(ranks, hi, lo, members, terms[path])[1:])
            least = value.min()
            if least > best:
                continue
            first = min(position[members.pieces[k].first] for k in np.flatnonzero(value == least))
            if least < best or first < at:
                best, at = least, first
            continue
        known: dict = {}  # (tokens, pairs) -> its best exchange
        for piece in members.pieces:
            least = known.get((piece.tokens, piece.pairs))
            if least is None:
                least = min(_piece_values(ranks, hi, lo, piece, terms[path])[1:])
                known[piece.tokens, piece.pairs] = least
            if least < best or (least == best and position[piece.first] < at):
                best, at = least, position[piece.first]
    if not best < ranks.costs[hi] * (1 - 1e-9):
        return None
    piece = top.pieces[at]
    hi_cost, move, _ = _piece_values(ranks, hi, lo, piece, terms[piece.ancestors])
    if move == best:  # the first bin (by index) the move reaches this with
        shared = np.zeros(len(ranks.bins), dtype=np.int64)
        for node, depth in piece.ancestors:  # Bin's rule: the last held node of the path
            holders = ranks.holders.get(node)
            if holders:
                shared[np.fromiter(holders, np.int64, len(holders))] = depth
        after = (
            ranks.cost_array
            + w_tok * (piece.full_tokens - shared)
            + w_pair * (piece.pairs + triangle(piece.base) - shared * (shared + 1) // 2)
        )
        new_max = np.maximum(hi_cost, after)
        new_max[hi] = math.inf
        return hi, piece, int(np.flatnonzero(new_max == best)[0]), None
    swaps = terms[piece.ancestors][3]
    classes = ranks.classes(lo)
    for back in low.pieces:  # the first partner (in the bin's order) that reaches it
        alpha, beta, gone = swaps[id(classes[back.ancestors])]
        if _swap_cost(ranks, hi_cost, ranks.costs[lo], piece, back, alpha, beta, gone) == best:
            return hi, piece, lo, back
    raise AssertionError("the best swap was not found again")  # pragma: no cover


def _class_values(ranks: _Ranks, hi: int, lo: int, members: _Members, terms) -> tuple:
    """:func:`_piece_values` for every piece of ``members`` (a class of bin ``hi``) at once:
    float64 [n] each, the same numbers (the same IEEE operations, on arrays). A swap partner is
    sought by bisection over each partner class's own costs, its two neighbours evaluated exactly;
    a piece whose partners tie more widely than that (equal own costs) goes through
    :func:`_piece_values`."""
    w_tok, w_pair = ranks.weights
    out, moves, partners, swaps = terms
    tokens, pairs, _ = members.arrays()
    hi_cost = ranks.costs[hi] - w_tok * (tokens + out[0]) - w_pair * (pairs + out[1])
    move = np.full(len(tokens), math.inf)
    if moves:
        after = np.min(
            [cost + w_tok * (tokens + t) + w_pair * (pairs + p) for cost, t, p in moves], axis=0
        )
        move = np.maximum(hi_cost, after)
    swap, lo_cost = np.full(len(tokens), math.inf), ranks.costs[lo]
    wide: dict = {}  # (tokens, pairs) -> the best swap, for pieces whose partners tie widely
    for partner in partners:
        q_tokens, q_pairs, q_owns = partner.arrays()
        alpha, beta, gone = swaps[id(partner)]
        x = hi_cost + w_tok * alpha[0] + w_pair * alpha[1]
        y = lo_cost + w_tok * (tokens + gone[0] - beta[0]) + w_pair * (pairs + gone[1] - beta[1])
        j = np.searchsorted(q_owns, (y - x) / 2, side="left")
        n = len(q_owns)

        def near(k, x=x, y=y, q_owns=q_owns, n=n):
            kk = np.clip(k, 0, n - 1)
            return np.where((k >= 0) & (k < n), np.maximum(x + q_owns[kk], y - q_owns[kk]), np.inf)

        def exact(k, alpha=alpha, beta=beta, gone=gone, q_tokens=q_tokens, q_pairs=q_pairs, n=n):
            kk = np.clip(k, 0, n - 1)
            new_hi = hi_cost + w_tok * (q_tokens[kk] + alpha[0]) + w_pair * (q_pairs[kk] + alpha[1])
            new_lo = (
                lo_cost
                + w_tok * ((tokens + gone[0]) - (q_tokens[kk] + beta[0]))
                + w_pair * ((pairs + gone[1]) - (q_pairs[kk] + beta[1]))
            )
            return np.where((k >= 0) & (k < n), np.maximum(new_hi, new_lo), np.inf)

        least = np.minimum(near(j - 1), near(j))
        limit = least + 1e-9 * np.abs(least)
        swap = np.minimum(swap, np.minimum(exact(j - 1), exact(j)))
        for k in np.flatnonzero((near(j - 2) <= limit) | (near(j + 1) <= limit)):
            piece = members.pieces[k]
            if (piece.tokens, piece.pairs) not in wide:  # every partner class, once
                wide[piece.tokens, piece.pairs] = _piece_values(ranks, hi, lo, piece, terms)[2]
            swap[k] = min(swap[k], wide[piece.tokens, piece.pairs])
    return hi_cost, move, swap


def _class_terms(ranks: _Ranks, hi: int, lo: int, rep: Piece, movable: bool, partners: list):
    """What a piece of ``rep``'s class (its ancestor path) saves and adds beyond its own counts,
    all (tokens, pairs): (out of bin ``hi``; per move candidate (:meth:`_Ranks.candidates`,
    ``hi`` left out) its cost and what the path adds there; per partner class of bin ``lo``
    (``partners``: :meth:`_Ranks.classes` values) its members, their own costs and, keyed by the
    class's id, (alpha: a partner into ``hi`` without the piece, beta: the partner out of ``lo``,
    gone: the piece into ``lo`` without the partner))."""
    top, low = ranks.bins[hi], ranks.bins[lo]
    out = top.removed(rep)
    out = (out[0] - rep.tokens, out[1] - rep.pairs)
    moves = []
    if movable:
        for i in ranks.candidates([rep], skip=hi):
            added = ranks.bins[i].added(rep)
            moves.append((ranks.costs[i], added[0] - rep.tokens, added[1] - rep.pairs))
    swaps = {}
    for partner in partners:
        q = partner.pieces[0]
        back_in, back_out, gone = top.added(q, rep), low.removed(q), low.added(rep, q)
        swaps[id(partner)] = (
            (back_in[0] - q.tokens, back_in[1] - q.pairs),
            (back_out[0] - q.tokens, back_out[1] - q.pairs),
            (gone[0] - rep.tokens, gone[1] - rep.pairs),
        )
    return out, moves, partners, swaps


def _swap_cost(ranks: _Ranks, hi_cost: float, lo_cost: float, piece, back, alpha, beta, gone):
    """The larger new cost of swapping ``piece`` (out of hi, leaving it at ``hi_cost``) with
    ``back`` (of lo), in :func:`_best_exchange`'s arithmetic."""
    w_tok, w_pair = ranks.weights
    new_hi = hi_cost + w_tok * (back.tokens + alpha[0]) + w_pair * (back.pairs + alpha[1])
    new_lo = (
        lo_cost
        + w_tok * ((piece.tokens + gone[0]) - (back.tokens + beta[0]))
        + w_pair * ((piece.pairs + gone[1]) - (back.pairs + beta[1]))
    )
    return max(new_hi, new_lo)


def _piece_values(ranks: _Ranks, hi: int, lo: int, piece: Piece, terms) -> tuple:
    """(hi's cost without ``piece``, the least larger new cost of moving it, of swapping it; inf
    where there is none), in :func:`_best_exchange`'s arithmetic. ``terms``: its class's
    :func:`_class_terms`."""
    w_tok, w_pair = ranks.weights
    out, moves, partners, swaps = terms
    hi_cost = ranks.costs[hi] - w_tok * (piece.tokens + out[0]) - w_pair * (piece.pairs + out[1])
    move = math.inf
    if moves:
        after = min(
            cost + w_tok * (piece.tokens + tokens) + w_pair * (piece.pairs + pairs)
            for cost, tokens, pairs in moves
        )
        move = max(hi_cost, after)
    swap, lo_cost = math.inf, ranks.costs[lo]
    for partner in partners:
        members, owns = partner.pieces, partner.owns
        alpha, beta, gone = swaps[id(partner)]
        # The larger new cost is about max(x + own(q), y - own(q)): least near own(q) = (y - x) / 2.
        x = hi_cost + w_tok * alpha[0] + w_pair * alpha[1]
        y = (
            lo_cost
            + w_tok * (piece.tokens + gone[0] - beta[0])
            + w_pair * (piece.pairs + gone[1] - beta[1])
        )
        j = bisect_left(owns, (y - x) / 2)
        k = min(
            (k for k in (j - 1, j) if 0 <= k < len(owns)),
            key=lambda k: max(x + owns[k], y - owns[k]),
        )
        limit = max(x + owns[k], y - owns[k])
        limit += 1e-9 * abs(limit)  # rounding: take every partner this close, exactly
        first, last = k, k
        while first > 0 and max(x + owns[first - 1], y - owns[first - 1]) <= limit:
            first -= 1
        while last + 1 < len(owns) and max(x + owns[last + 1], y - owns[last + 1]) <= limit:
            last += 1
        seen = set()
        for back in members[first : last + 1]:
            if (back.tokens, back.pairs) not in seen:
                seen.add((back.tokens, back.pairs))
                swap = min(
                    swap, _swap_cost(ranks, hi_cost, lo_cost, piece, back, alpha, beta, gone)
                )
    return hi_cost, move, swap


def _cut_to(pieces: list[Piece], counts: TrieCounts, num: int, weights) -> list[Piece]:
    """``pieces`` cut until there are at least ``num`` (a valid ``num`` <= B): each time the
    costliest piece that has a branch (ties: the first) is cut there; when none has one, the
    costliest chain (a sequence with its prefixes, or copies) is cut into its sequences. Pre-order,
    like ``pieces``; a heap keeps this O(P log P)."""
    if len(pieces) >= num:
        return pieces
    branchy = [(-p.full_cost(weights), p.first, p) for p in pieces]
    heapq.heapify(branchy)
    chains: list = []  # cut only when no piece has a branch left
    done: list[Piece] = []
    count = len(pieces)
    while count < num:
        if branchy:
            entry = heapq.heappop(branchy)
            children = counts.split(entry[2])
            if len(children) == 1:  # no branch: a chain, or one sequence
                if entry[2].end - entry[2].first > 1:
                    heapq.heappush(chains, entry)
                else:
                    done.append(entry[2])
                continue
        else:
            children = counts.split(heapq.heappop(chains)[2], keep_chains=False)
        count += len(children) - 1
        for child in children:
            heapq.heappush(branchy, (-child.full_cost(weights), child.first, child))
    rest = [entry[2] for entry in branchy + chains] + done
    return sorted(rest, key=lambda p: p.first)


# ---------------------------------------------------------------------------------------------
# The data-parallel partition
# ---------------------------------------------------------------------------------------------


_CHUNK = 512  # rows per numpy pass in _trie_order


def _trie_order(input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """The batch's lexicographic order and its neighbours' LCPs, as
    :func:`~.trie.lexicographic_order` and :func:`~.trie.neighbour_lcp` give them on
    :func:`~.trie.sequence_keys`, without the int64 keys [B, W] and a sort over W columns: each
    sequence becomes a bytes object of its big-endian tokens (byte order is token order, and a
    prefix sorts before its extensions) and Python's stable sort orders them.

    Args:
        input_ids: int [B, L] (any device), right-padded, L >= every length.
        lengths: int [B], each in [1, L].

    Returns:
        (order int64 [B] on the host, stable; lcp int64 [B] numpy: LCP of each sorted sequence
        with the one before it, 0 for the first).

    Raises:
        ValueError: a token id inside a sequence is negative.
    """
    lengths = lengths.detach().cpu().numpy().astype(np.int64)
    width = int(lengths.max())
    ids = input_ids.detach().cpu().numpy()[:, :width]
    if ids.min() < 0:  # padding may be negative; tokens may not
        inside = np.arange(width)[None, :] < lengths[:, None]
        if ((ids < 0) & inside).any():
            raise ValueError("data['input_ids'] holds negative token ids; token ids must be >= 0")
    # Big-endian tokens (uint32 while they fit), a chunk of rows at a time (no [B, W] copy); the
    # padding wraps but is never compared.
    code = ">u4" if ids.max() < 2**32 else ">u8"
    nbytes, row, keys = (lengths * int(code[-1])).tolist(), width * int(code[-1]), []
    for start in range(0, len(nbytes), _CHUNK):
        raw = ids[start : start + _CHUNK].astype(code).tobytes()
        keys += [raw[i * row : i * row + n] for i, n in enumerate(nbytes[start : start + _CHUNK])]
    order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    del keys
    # The first difference of each sorted row with the one before (W if none), a chunk at a time.
    first_diff = np.zeros(len(order), dtype=np.int64)
    for start in range(1, len(order), _CHUNK):
        rows = ids[order[start - 1 : start + _CHUNK]]
        differ = rows[1:] != rows[:-1]
        first_diff[start : start + _CHUNK] = np.where(
            differ.any(axis=1), differ.argmax(axis=1), width
        )
    sorted_lengths = lengths[order]
    lcp = first_diff
    lcp[1:] = np.minimum(first_diff[1:], np.minimum(sorted_lengths[1:], sorted_lengths[:-1]))
    return torch.from_numpy(order), lcp


def _partition_inputs(data, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids int [B, L], lengths int64 [B] (each in [1, L]), both on the host) from a batch
    dict in any layout the packer takes (read as the packer reads it), or from an ``input_ids``
    tensor [B, L] (a nested one too) with ``lengths``."""
    if isinstance(data, torch.Tensor) and data.is_nested:
        data = {"input_ids": data}
    if isinstance(data, dict):
        if lengths is not None:
            raise ValueError("pass lengths only with an input_ids tensor, not with a batch dict")
        wanted = ("input_ids", "attention_mask", "cu_seqlens")  # extras are not partitioned
        data, lengths, _ = read_batch({k: v for k, v in data.items() if k in wanted})
        return data["input_ids"].cpu(), lengths.cpu()
    if not isinstance(data, torch.Tensor):
        raise ValueError(
            f"data must be a batch dict or an input_ids tensor [B, L], got {type(data).__name__}"
        )
    if data.dim() != 2 or data.dtype.is_floating_point or data.dtype == torch.bool:
        raise ValueError(
            f"input_ids must be an integer tensor [B, L], got {data.dtype} {tuple(data.shape)}"
        )
    if lengths is None:
        lengths = torch.full((data.shape[0],), data.shape[1])
    lengths = torch.as_tensor(lengths).to(torch.int64).cpu()
    if lengths.shape != (data.shape[0],) or (lengths < 1).any() or (lengths > data.shape[1]).any():
        raise ValueError(
            f"lengths must be [B={data.shape[0]}] with every entry in [1, L={data.shape[1]}], got "
            f"{lengths.tolist()[:8]}"
        )
    return data.cpu(), lengths


def _group_labels(groups, num_samples: int, dp_size: int, equal_sizes: bool) -> np.ndarray:
    """int64 [B]: a group number per sample (each sample its own group when ``groups`` is None),
    checked: as many labels as samples, at least ``dp_size`` groups, B a multiple of ``dp_size``
    with ``equal_sizes``."""
    if groups is None:
        labels = np.arange(num_samples)
    else:
        # Tensor elements hash by identity, numpy scalars are slow: plain Python values.
        groups = groups.tolist() if isinstance(groups, (torch.Tensor, np.ndarray)) else list(groups)
        if len(groups) != num_samples:
            raise ValueError(
                f"groups must give one label per sample ({num_samples}), got {len(groups)}"
            )
        number: dict = {}
        labels = np.array([number.setdefault(g, len(number)) for g in groups], dtype=np.int64)
        if len(number) < dp_size:
            raise ValueError(
                f"{len(number)} groups cannot fill dp_size={dp_size} ranks with every group whole"
            )
    if equal_sizes and num_samples % dp_size:
        raise ValueError(
            f"equal_sizes: {num_samples} samples do not split into {dp_size} equal shares"
        )
    return labels


def _pieces_by_group(counts: TrieCounts, labels: np.ndarray) -> list[list[Piece]]:
    """The tries cut (at branch points, then between the sequences of a chain) until no piece
    holds two groups; per group (``labels``: int [B], per sorted sequence), its pieces in sorted
    order."""
    # changes[i]: label changes among sorted sequences 0..i, so a run [a, b) is one group's when
    # changes[b - 1] == changes[a]: O(1) per piece.
    changes = np.concatenate([[0], np.cumsum(labels[1:] != labels[:-1])]).tolist()
    label = labels.tolist()
    by_group: dict[int, list[Piece]] = {}
    stack = counts.root_groups()[::-1]
    while stack:
        piece = stack.pop()
        if changes[piece.end - 1] == changes[piece.first]:
            by_group.setdefault(label[piece.first], []).append(piece)
            continue
        children = counts.split(piece)
        if len(children) == 1:  # a chain holding two groups: every sequence a child
            children = counts.split(piece, keep_chains=False)
        stack.extend(children[::-1])
    return list(by_group.values())


def _group_added(b: Bin, group: list[Piece]) -> tuple[int, int]:
    """(tokens, pairs) that ``group``'s pieces add to ``b`` one after another (each repeats only
    the part of its path neither the bin nor the pieces before it hold); ``b`` is unchanged."""
    if len(group) == 1:
        return b.added(group[0])
    brought: set = set()
    tokens = pairs = 0
    for piece in group:
        shared = 0
        for node, depth in reversed(piece.ancestors):
            if b.nodes[node] > 0 or node in brought:
                shared = depth
                break
        tokens += piece.full_tokens - shared
        pairs += piece.pairs + triangle(piece.base) - triangle(shared)
        brought.update(node for node, _ in piece.ancestors)
    return tokens, pairs


def balance_groups(
    groups: list[list[Piece]], num_bins: int, weights, max_samples: float = math.inf
) -> list[Bin]:
    """Longest-processing-time first over groups of pieces that share a bin: groups by decreasing
    cost, each to the bin whose cost after adding it is lowest (sharing-aware; ties: the cheaper
    bin, then the first) among those with room for its samples (at most ``max_samples`` per bin),
    an empty bin whenever as many groups are left as bins are empty. ValueError if a group finds
    no room.

    The bins are found through heaps (:class:`_Ranks`), with a scan's answer: the cheapest bin
    with room, the cheapest with room holding each node of the path all the group's pieces hang
    below, and every bin with room holding one of the group's other ancestors (usually none). A
    bin that cannot take even the smallest group left leaves the heaps. O(G log dp) for groups
    that are one piece each (prompt groups), G groups."""
    ranks = _Ranks(num_bins, weights)
    bins, samples = ranks.bins, [0] * num_bins
    ordered = sorted(groups, key=lambda g: (-Bin(g).cost(weights), g[0].first))
    sizes = [sum(p.end - p.first for p in g) for g in ordered]
    smallest_left = np.minimum.accumulate(np.array(sizes[::-1] or [0]))[::-1].tolist()
    empty = list(range(num_bins))  # a heap of the empty bins (a bin never empties again)
    num_empty = num_bins
    w_tok, w_pair = weights
    for k, (group, size) in enumerate(zip(ordered, sizes)):

        def fits(i: int, size=size, least=smallest_left[k]) -> bool:
            if samples[i] + least > max_samples:  # no group left fits: out of the heaps
                ranks.retire(i)
                return False
            return samples[i] + size <= max_samples

        if len(ordered) - k <= num_empty:  # every empty bin adds the same: the first
            while bins[empty[0]].pieces:
                heapq.heappop(empty)
            candidates = [empty[0]] if size <= max_samples else []
        else:
            candidates = ranks.candidates(group, fits=None if max_samples == math.inf else fits)
        best = None
        for i in candidates:
            added = _group_added(bins[i], group)
            after = w_tok * (bins[i].tokens + added[0]) + w_pair * (bins[i].pairs + added[1])
            key = (after, ranks.costs[i], i)
            best = key if best is None or key < best else best
        if best is None:
            raise ValueError(
                f"no bin has room for a group of {size} samples (at most {max_samples} per bin): "
                "groups of one size, as many per bin, always fit"
            )
        i = best[2]
        num_empty -= not bins[i].pieces
        for piece in group:
            ranks.add(i, piece)
        samples[i] += size
        ranks.refresh(i)
    return bins


_SHALLOW = 32  # a cut is shallow when the path it repeats is at most 1/_SHALLOW of what lies below


def _cut_shallow(pieces: list[Piece], counts: TrieCounts, num_bins: int) -> list[Piece]:
    """``pieces`` cut at their top branch points, recursively, while such a cut is shallow: its
    children, spread over up to ``num_bins`` bins, would repeat (min(children, ``num_bins``) - 1)
    x (branch depth - base) path tokens, at most 1/32 of the piece's own tokens. Prompt groups
    that merely start alike (a token or two in common), or a short system prompt over many
    groups, are cut apart; a prompt over its samples is not (it repeats more than that). Pre-order.
    """
    lcp = counts.lcp
    done: list[Piece] = []
    stack = pieces[::-1]
    while stack:
        piece = stack.pop()
        # The top branch point is no shallower than the least LCP inside: a quick no.
        if piece.end - piece.first < 2 or (
            (int(lcp[piece.first + 1 : piece.end].min()) - piece.base) * _SHALLOW > piece.tokens
        ):
            done.append(piece)
            continue
        children = counts.split(piece)
        repeat = (min(len(children), num_bins) - 1) * (children[0].base - piece.base)
        if len(children) > 1 and repeat * _SHALLOW <= piece.tokens:
            stack.extend(children[::-1])
        else:
            done.append(piece)
    return done


def _balance_pieces(counts: TrieCounts, dp_size: int, weights) -> list[Bin]:
    """The tries cut at branch points three ways, each cut assigned longest-cost-first
    (:func:`_lpt`); the one with the cheapest costliest rank (then fewer tokens; then the first)
    wins:

    1. pieces of at most half a rank's share of the cost (:func:`~.trie.cut_tries`), refined
       (:func:`_refine_ranks`);
    2. whole tries, cut only while there are fewer than ``dp_size`` pieces (:func:`_cut_to`),
       refined;
    3. whole prompt groups: 2 with shallow cuts before and after (:func:`_cut_shallow`), so that
       groups which merely start alike, or share a short system prompt, are not one piece. Not
       refined: its many small cuts can leave many ancestor paths in a rank, where a round of
       refining costs O(paths of one rank x paths of the other).

    With one or two groups per rank the finer cut splits groups and repeats their prompts, and
    keeping them whole often balances better; 3 makes the result never worse than the prompt
    groups kept whole and assigned longest-cost-first (what ``groups=`` with prompt labels
    gives). A cut equal to an earlier one is not redone."""
    total = weights[0] * float(counts.tokens[-1]) + weights[1] * float(counts.pairs[-1])
    tries = cut_tries(counts, weights=weights)
    cuts = [
        _cut_to(
            cut_tries(counts, max_cost=total / dp_size / 2, weights=weights),
            counts,
            dp_size,
            weights,
        ),
        _cut_to(tries, counts, dp_size, weights),
        _cut_shallow(
            _cut_to(_cut_shallow(tries, counts, dp_size), counts, dp_size, weights),
            counts,
            dp_size,
        ),
    ]
    candidates = []
    for k, pieces in enumerate(cuts):
        if pieces not in cuts[:k]:
            ranks = _lpt(pieces, dp_size, weights)
            if k < 2:  # 3's shallow cuts may leave many ancestor paths per rank: no refining
                _refine_ranks(ranks, rounds=4 * len(pieces))
            candidates.append(ranks.bins)
    return min(
        candidates, key=lambda c: (max(b.cost(weights) for b in c), sum(b.tokens for b in c))
    )


def partition_for_data_parallel(
    data: dict[str, torch.Tensor] | torch.Tensor,
    dp_size: int,
    *,
    lengths: torch.Tensor | None = None,
    cost_model: GPTShape | None = None,
    groups=None,
    equal_sizes: bool = False,
) -> list[torch.Tensor]:
    """Split a global batch across data-parallel ranks without scattering shared prefixes.

    The batch's tries are cut at branch points into pieces of at most half a rank's share of the
    cost (a whole prompt group usually stays one piece), the pieces are assigned
    longest-processing-time first to the rank where they cost least (a piece joining the rank
    that holds its prefix repeats nothing), and single moves and swaps then lower the costliest
    rank. The same is done with whole tries (cut only as far as needed for ``dp_size`` pieces),
    and whole prompt groups (tries also cut where that repeats little: groups that merely start
    alike, a short system prompt) are assigned longest-cost-first; the assignment with the
    cheapest costliest rank is kept, so the costliest rank never costs more than when the prompt
    groups are kept whole and assigned longest-cost-first (with one or two groups per rank,
    cutting them often costs more). Ranks may get different numbers of samples; each gets at
    least one. Deterministic; a 65,536-sequence batch over 1,024 ranks takes about half a second
    on one core (``scripts/bench_packing.py``).

    With ``groups`` (or ``equal_sizes``) the units are given instead: each group's samples go to
    one rank, groups are assigned longest-cost-first to the rank where they cost least (sharing
    prefixes with what it holds already) and are not moved afterwards.

    Args:
        data: the global batch in any layout the packer takes (a dict with ``input_ids`` [B, L]
            and ``attention_mask`` [B, L], right-padded; or ``input_ids`` a list of sequences, a
            jagged nested tensor, or [T] with ``cu_seqlens``: :mod:`~megatron_tree.core.ragged`;
            other entries are ignored), or an ``input_ids`` tensor [B, L] with ``lengths`` (or a
            jagged nested one).
        dp_size: number of data-parallel ranks, at most B.
        lengths: int [B], sequence lengths, with an ``input_ids`` tensor (default: L for all).
        cost_model: the FLOP model that weighs tokens (linear layers) against attention pairs;
            None counts unique tokens only.
        groups: a label per sample (e.g. verl's prompt ``uid``): samples with one label stay on one
            rank. At least ``dp_size`` groups.
        equal_sizes: every rank gets B / ``dp_size`` samples (a dispatch that splits the batch into
            equal chunks); without ``groups`` every sample is a group of its own. Always possible
            when the groups have one size and their number is a multiple of ``dp_size``.

    Returns:
        ``dp_size`` int64 tensors [B_r]: the sample indices of each rank, ascending.
    """
    dp_size = check_int("dp_size", dp_size, minimum=1)
    equal_sizes = check_bool("equal_sizes", equal_sizes)
    input_ids, lengths = _partition_inputs(data, lengths)
    num_samples = input_ids.shape[0]
    if dp_size > num_samples:
        raise ValueError(f"dp_size={dp_size} is larger than the batch ({num_samples} sequences)")
    weights = cost_weights(cost_model)
    order, lcp = _trie_order(input_ids, lengths)
    counts = TrieCounts(lcp, lengths[order].numpy())
    if groups is None and not equal_sizes:
        bins = _balance_pieces(counts, dp_size, weights)
    else:
        labels = _group_labels(groups, num_samples, dp_size, equal_sizes)[order.numpy()]
        max_samples = num_samples // dp_size if equal_sizes else math.inf
        bins = balance_groups(_pieces_by_group(counts, labels), dp_size, weights, max_samples)
    rank_of = np.empty(num_samples, dtype=np.int64)  # per sorted sequence
    for r, b in enumerate(bins):
        for piece in b.pieces:
            rank_of[piece.first : piece.end] = r
    by_rank = np.lexsort((order.numpy(), rank_of))  # rank, then sample index
    sizes = np.bincount(rank_of, minlength=dp_size)
    return list(torch.from_numpy(order.numpy()[by_rank]).split(sizes.tolist()))
