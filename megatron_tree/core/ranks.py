"""Pieces of prefix tries assigned to data-parallel ranks: bins without a capacity, found
through heaps.

Ranks may be a thousand, so where the packer's bins (:mod:`~.bins`) scan every bin, these give the
scans' answers without the scans: heaps find the bin a piece goes to (:class:`Ranks`: the cheapest
bin and the cheapest holder of each of the piece's branch nodes are the only candidates), and
pieces grouped by their ancestor path (a class adds and saves the same path part anywhere) find
the best move or swap by bisection, for a large class in numpy (:func:`_exchange`). Assignment
(:func:`lpt`, :func:`balance_groups`) is O(P log dp) instead of O(P dp), a round of moves and swaps
(:func:`refine_ranks`) O(pieces of the two bins) instead of O(pieces x dp + their product).
tests/test_partition.py holds the results to the scans (:func:`~.bins.balance_pieces`,
:func:`~.bins.refine`), ties included.

Legend: P pieces, G groups, dp ranks.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left

import numpy as np

from .bins import Bin
from .trie import Piece, triangle

__all__ = ["Ranks", "balance_groups", "lpt", "refine_ranks"]


class Ranks:
    """``num_bins`` :class:`~.bins.Bin` s without a capacity (data-parallel ranks) and the heaps
    that find, without a scan over the bins, the cheapest bin, the costliest one, and the cheapest
    among the bins holding a branch node (where a piece hanging below the node repeats less of its
    path).

    A heap entry is (cost, bin, stamp) ((-cost, bin, stamp) in the max-heap) and is current while
    the bin's stamp is: every change of a bin (:meth:`refresh`) bumps its stamp and pushes current
    entries into :attr:`low` and :attr:`high`, and stale ones are dropped when they reach a top.
    A bin holding many nodes would push into many node heaps at every change, so a node's heap
    only keeps, for each bin holding the node, an entry no dearer than the bin (pushed when the
    bin comes to hold the node or gets cheaper): a stale top is pushed again with the bin's cost.
    Either way a current top is exact, ties going to the lowest bin index as in a scan.

    Attributes:
        bins: the :class:`~.bins.Bin` s, ``num_bins`` of them.
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


def lpt(pieces: list[Piece], num_bins: int, weights) -> Ranks:
    """:func:`~.bins.balance_pieces` without a capacity, the bins found through :meth:`Ranks.place`:
    pieces by decreasing cost, each to the bin whose cost after adding it is lowest (ties: the
    cheaper bin, then the first). O(P log dp) for pieces without ancestors."""
    ranks = Ranks(num_bins, weights)
    for piece in sorted(pieces, key=lambda p: (-p.full_cost(weights), p.first)):
        (_, _, i), added = ranks.place(piece)
        ranks.add(i, piece, added)
        ranks.refresh(i)
    return ranks


def refine_ranks(ranks: Ranks, *, rounds: int) -> Ranks:
    """:func:`~.bins.refine` without a capacity, in place and with the same result: while that
    lowers the costliest bin (at most ``rounds`` times), the best single move of one of its pieces
    to another bin, or swap with a piece of the cheapest bin (:func:`_exchange`)."""
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


def _exchange(ranks: Ranks):
    """:func:`~.bins._best_exchange` without a capacity, the same exchange found without trying
    every piece against every bin: (hi, piece, other bin, swapped piece or None), or None.

    The scan's choice is the first, in its order (the costliest bin's pieces in order; for each,
    moves to the other bins in index order, then swaps with the cheapest bin's pieces in order),
    of the exchanges with the least new larger cost. Pieces with one ancestor path (a class) save
    and add the same path part wherever they go, so per class of the costliest bin this needs
    one :meth:`Ranks.candidates` for its moves and, per class of the cheapest bin, three path
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


def _class_values(ranks: Ranks, hi: int, lo: int, members: _Members, terms) -> tuple:
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


def _class_terms(ranks: Ranks, hi: int, lo: int, rep: Piece, movable: bool, partners: list):
    """What a piece of ``rep``'s class (its ancestor path) saves and adds beyond its own counts,
    all (tokens, pairs): (out of bin ``hi``; per move candidate (:meth:`Ranks.candidates`,
    ``hi`` left out) its cost and what the path adds there; per partner class of bin ``lo``
    (``partners``: :meth:`Ranks.classes` values) its members, their own costs and, keyed by the
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


def _swap_cost(ranks: Ranks, hi_cost: float, lo_cost: float, piece, back, alpha, beta, gone):
    """The larger new cost of swapping ``piece`` (out of hi, leaving it at ``hi_cost``) with
    ``back`` (of lo), in :func:`~.bins._best_exchange`'s arithmetic."""
    w_tok, w_pair = ranks.weights
    new_hi = hi_cost + w_tok * (back.tokens + alpha[0]) + w_pair * (back.pairs + alpha[1])
    new_lo = (
        lo_cost
        + w_tok * ((piece.tokens + gone[0]) - (back.tokens + beta[0]))
        + w_pair * ((piece.pairs + gone[1]) - (back.pairs + beta[1]))
    )
    return max(new_hi, new_lo)


def _piece_values(ranks: Ranks, hi: int, lo: int, piece: Piece, terms) -> tuple:
    """(hi's cost without ``piece``, the least larger new cost of moving it, of swapping it; inf
    where there is none), in :func:`~.bins._best_exchange`'s arithmetic. ``terms``: its class's
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

    The bins are found through heaps (:class:`Ranks`), with a scan's answer: the cheapest bin
    with room, the cheapest with room holding each node of the path all the group's pieces hang
    below, and every bin with room holding one of the group's other ancestors (usually none). A
    bin that cannot take even the smallest group left leaves the heaps. O(G log dp) for groups
    that are one piece each (prompt groups), G groups."""
    ranks = Ranks(num_bins, weights)
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
