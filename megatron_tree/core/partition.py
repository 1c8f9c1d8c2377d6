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
prefix sums of :class:`~.trie.TrieCounts`.

Legend: B sequences, L padded length, P pieces.
"""

from __future__ import annotations

import math
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
    lexicographic_order,
    neighbour_lcp,
    sequence_keys,
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
        of
        its path not held yet."""
        return self._path_cost(piece, without)

    def removed(self, piece: Piece) -> tuple[int, int]:
        """(tokens, pairs) taking ``piece`` (one of the bin's) out saves."""
        return self._path_cost(piece, piece)

    def add(self, piece: Piece, added: tuple[int, int] | None = None) -> None:
        tokens, pairs = self.added(piece) if added is None else added
        self.tokens += tokens
        self.pairs += pairs
        self.nodes.update(node for node, _ in piece.ancestors)
        self.pieces.append(piece)

    def remove(self, piece: Piece) -> None:
        tokens, pairs = self.removed(piece)
        self.tokens -= tokens
        self.pairs -= pairs
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
    fits ``capacity`` tokens; a new bin only when none fits."""
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


def _cut_once_more(pieces: list[Piece], counts: TrieCounts, weights) -> list[Piece]:
    """``pieces`` with the costliest one that has a branch cut there; if none has, the costliest
    chain cut into its sequences (some piece holds several while there are fewer than B)."""
    by_cost = sorted(range(len(pieces)), key=lambda i: (-pieces[i].full_cost(weights), i))
    for i in by_cost:
        children = counts.split(pieces[i])
        if len(children) > 1:
            return pieces[:i] + children + pieces[i + 1 :]
    i = next(i for i in by_cost if pieces[i].end - pieces[i].first > 1)
    return pieces[:i] + counts.split(pieces[i], keep_chains=False) + pieces[i + 1 :]


def _partition_inputs(data, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys int64 [B, W] on the host, -1 past each length; lengths int64 [B]) from a batch dict
    in any layout the packer takes (read as the packer reads it), or from an ``input_ids`` tensor
    [B, L] (a nested one too) with ``lengths``."""
    if isinstance(data, torch.Tensor) and data.is_nested:
        data = {"input_ids": data}
    if isinstance(data, dict):
        if lengths is not None:
            raise ValueError("pass lengths only with an input_ids tensor, not with a batch dict")
        wanted = ("input_ids", "attention_mask", "cu_seqlens")  # extras are not partitioned
        data, lengths, _ = read_batch({k: v for k, v in data.items() if k in wanted})
        return sequence_keys(data["input_ids"], lengths).cpu(), lengths.cpu()
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
    return sequence_keys(data.cpu(), lengths), lengths


def _group_labels(groups, num_samples: int, dp_size: int, equal_sizes: bool) -> np.ndarray:
    """int64 [B]: a group number per sample (each sample its own group when ``groups`` is None),
    checked: as many labels as samples, at least ``dp_size`` groups, B a multiple of ``dp_size``
    with ``equal_sizes``."""
    if groups is None:
        labels = np.arange(num_samples)
    else:
        groups = list(groups)
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
    holds two groups; per group (``labels``: per sorted sequence), its pieces in sorted order."""
    by_group: dict[int, list[Piece]] = {}
    stack = counts.root_groups()[::-1]
    while stack:
        piece = stack.pop()
        if (labels[piece.first : piece.end] == labels[piece.first]).all():
            by_group.setdefault(int(labels[piece.first]), []).append(piece)
            continue
        children = counts.split(piece)
        if len(children) == 1:  # a chain holding two groups: every sequence a child
            children = counts.split(piece, keep_chains=False)
        stack.extend(children[::-1])
    return list(by_group.values())


def balance_groups(
    groups: list[list[Piece]], num_bins: int, weights, max_samples: float = math.inf
) -> list[Bin]:
    """Longest-processing-time first over groups of pieces that share a bin: groups by decreasing
    cost, each to the bin whose cost after adding it is lowest (sharing-aware; ties: the cheaper
    bin, then the first) among those with room for its samples (at most ``max_samples`` per bin),
    an empty bin whenever as many groups are left as bins are empty. ValueError if a group finds
    no room."""
    bins, samples = [Bin() for _ in range(num_bins)], [0] * num_bins
    ordered = sorted(groups, key=lambda g: (-Bin(g).cost(weights), g[0].first))
    for left, group in zip(range(len(ordered), 0, -1), ordered):
        size = sum(p.end - p.first for p in group)
        empty = [i for i, b in enumerate(bins) if not b.pieces]
        candidates = empty if left <= len(empty) else range(num_bins)
        best = None
        for i in candidates:
            if samples[i] + size > max_samples:
                continue
            current = bins[i].cost(weights)
            for piece in group:
                bins[i].add(piece)
            key = (bins[i].cost(weights), current, i)
            for piece in group[::-1]:
                bins[i].remove(piece)
            best = key if best is None or key < best else best
        if best is None:
            raise ValueError(
                f"no bin has room for a group of {size} samples (at most {max_samples} per bin): "
                "groups of one size, as many per bin, always fit"
            )
        for piece in group:
            bins[best[2]].add(piece)
        samples[best[2]] += size
    return bins


def _balance_pieces(counts: TrieCounts, dp_size: int, weights) -> list[Bin]:
    """The tries cut freely at branch points, two ways (pieces of at most half a rank's share of
    the cost, and whole groups cut only while there are fewer than ``dp_size`` pieces), each
    assigned longest-cost-first and refined; the one with the cheaper costliest rank (then fewer
    tokens) wins."""
    total = weights[0] * float(counts.tokens[-1]) + weights[1] * float(counts.pairs[-1])
    # With one or two groups per rank the finer cut splits groups and repeats their prompts, and
    # keeping them whole often balances better.
    candidates = []
    for max_cost in (total / dp_size / 2, math.inf):
        pieces = cut_tries(counts, max_cost=max_cost, weights=weights)
        while len(pieces) < dp_size:
            pieces = _cut_once_more(pieces, counts, weights)
        bins = refine(balance_pieces(pieces, dp_size, weights), weights, rounds=4 * len(pieces))
        candidates.append(bins)
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
    rank. The same is done with whole groups (tries cut only as far as needed for ``dp_size``
    pieces) and the assignment with the cheaper costliest rank is kept, so the costliest rank never
    costs more than when the groups are kept whole and assigned longest-cost-first (with one or two
    groups per rank, cutting them often costs more). Ranks may get different numbers of samples;
    each gets at least one.

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
    keys, lengths = _partition_inputs(data, lengths)
    num_samples = keys.shape[0]
    if dp_size > num_samples:
        raise ValueError(f"dp_size={dp_size} is larger than the batch ({num_samples} sequences)")
    weights = cost_weights(cost_model)
    order = lexicographic_order(keys)
    sorted_lengths = lengths[order]
    counts = TrieCounts(neighbour_lcp(keys[order], sorted_lengths).numpy(), sorted_lengths.numpy())
    if groups is None and not equal_sizes:
        bins = _balance_pieces(counts, dp_size, weights)
    else:
        labels = _group_labels(groups, num_samples, dp_size, equal_sizes)[order.numpy()]
        max_samples = num_samples // dp_size if equal_sizes else math.inf
        bins = balance_groups(_pieces_by_group(counts, labels), dp_size, weights, max_samples)
    ranks = []
    for b in bins:
        members = np.concatenate([np.arange(first, end) for first, end in b.runs()])
        ranks.append(order[torch.from_numpy(members)].sort().values)
    return ranks
