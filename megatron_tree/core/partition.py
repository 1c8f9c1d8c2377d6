"""Cut prefix tries at their branch points and assign the pieces to micro-batches or to ranks.

Sequences sorted lexicographically, with ``lcp[i]`` the longest common prefix of sequence i with
its predecessor (0 for the first), describe their tries without any per-token object: a root group
(a maximal run with ``lcp > 0`` inside) is one trie, and the subtree hanging below a branch node at
depth ``q`` is a maximal run whose inner LCPs all exceed ``q``. A trie too large for one bin is cut
at its top branch point into the subtrees of that node's children, recursively; each such
:class:`Piece` repeats only its ancestors' path (``base`` tokens), and a piece that joins a bin
already holding part of that path repeats only the rest. Every sequence fits a bin on its own (the
packer validates lengths), so a single chain never needs cutting inside.

The work is one Python step per piece and bin, never per token; interval sizes come from prefix
sums over the sorted order.

Legend: B sequences, L padded length, P pieces.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from .checks import check_int
from .flops import GPTShape, cost_weights

__all__ = ["Piece", "partition_for_data_parallel"]


def _neighbour_lcp(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """LCP of each row with the row before it (0 for the first).

    Args:
        rows: int64 [S, L], padded with -1 (a value no token takes) past each length.
        lengths: int64 [S].

    Returns:
        int64 [S].
    """
    lcp = torch.zeros_like(lengths)
    if rows.shape[0] > 1:
        differ = rows[1:] != rows[:-1]
        first_diff = torch.where(differ.any(dim=1), differ.int().argmax(dim=1), rows.shape[1])
        lcp[1:] = torch.minimum(first_diff, torch.minimum(lengths[1:], lengths[:-1]))
    return lcp


def _lexicographic_order(keys: torch.Tensor) -> torch.Tensor:
    """Row order of [B, L] keys, column 0 most significant (np.lexsort takes the last key first)."""
    order = np.lexsort(keys.cpu().numpy().T[::-1])
    return torch.from_numpy(order.astype(np.int64))


def _triangle(depth: int) -> int:
    """Attention pairs of a root path of ``depth`` tokens: sum of (d + 1) for d < depth."""
    return depth * (depth + 1) // 2


class Piece(NamedTuple):
    """A subtree of a trie: the sorted sequences ``[first, end)`` below an ancestor path.

    Attributes:
        first, end: the run of the sorted order it holds.
        base: length of its ancestor path (0 for a whole root group), repeated in a bin that does
        not
            hold it already.
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
        return weights[0] * self.full_tokens + weights[1] * (self.pairs + _triangle(self.base))


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
        return tokens, int(self.pairs[end] - self.pairs[first]) + _triangle(head)

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
            pairs += run_pairs - _triangle(shared)
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
                Piece(first, end, depth, tokens - depth, pairs - _triangle(depth), ancestors)
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
        return piece.full_tokens - shared, piece.pairs + _triangle(piece.base) - _triangle(shared)

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


def _right_padded_lengths(attention_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Lengths [B] of a right-padded ``attention_mask`` of ``shape``; ValueError (as the packer's)
    for a mask of another shape, with left padding or holes, or with an empty row."""
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"data['attention_mask'] has shape {tuple(attention_mask.shape)} but data['input_ids'] "
            f"has {tuple(shape)}; they must be equal"
        )
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    right_padded = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    bad = (mask != right_padded).any(dim=1).nonzero().flatten()[:8].tolist()
    if bad:
        raise ValueError(
            f"data['attention_mask'] rows {bad} are not right-padded: each row must be ones for "
            "the real tokens followed by zeros (no left padding or holes)"
        )
    empty = (lengths == 0).nonzero().flatten()[:8].tolist()
    if empty:
        raise ValueError(
            f"sequences {empty} are empty (attention_mask all zero); drop them from the batch "
            "before partitioning"
        )
    return lengths


def _partition_inputs(data, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys int64 [B, L] with -1 past each length, lengths int64 [B]) from a batch dict or ids."""
    if isinstance(data, dict):
        if "input_ids" not in data or "attention_mask" not in data:
            raise ValueError("data must hold 'input_ids' [B, L] and 'attention_mask' [B, L]")
        if lengths is not None:
            raise ValueError("pass lengths only with an input_ids tensor, not with a batch dict")
        input_ids, mask = data["input_ids"], data["attention_mask"]
    elif isinstance(data, torch.Tensor):
        input_ids, mask = data, None
        if lengths is None:
            lengths = torch.full((data.shape[0],), data.shape[-1] if data.dim() else 0)
    else:
        raise ValueError(
            f"data must be a batch dict or an input_ids tensor [B, L], got {type(data).__name__}"
        )
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(
            f"input_ids must be an integer tensor [B, L], got {input_ids.dtype} "
            f"{tuple(input_ids.shape)}"
        )
    if mask is not None:
        lengths = _right_padded_lengths(mask, input_ids.shape)
    lengths = torch.as_tensor(lengths).to(torch.int64).cpu()
    if (
        lengths.shape != (input_ids.shape[0],)
        or (lengths < 1).any()
        or (lengths > input_ids.shape[1]).any()
    ):
        raise ValueError(
            f"lengths must be [B={input_ids.shape[0]}] with every entry in [1, "
            f"L={input_ids.shape[1]}], got {lengths.tolist()[:8]}"
        )
    keys = input_ids.cpu().to(torch.int64)
    keys = keys.masked_fill(torch.arange(keys.shape[1])[None, :] >= lengths[:, None], -1)
    if (keys < -1).any() or ((keys == -1).sum(dim=1) != keys.shape[1] - lengths).any():
        raise ValueError("input_ids holds negative token ids; token ids must be >= 0")
    return keys, lengths


def partition_for_data_parallel(
    data: dict[str, torch.Tensor] | torch.Tensor,
    dp_size: int,
    *,
    lengths: torch.Tensor | None = None,
    cost_model: GPTShape | None = None,
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

    Args:
        data: the global batch, a dict with ``input_ids`` [B, L] and ``attention_mask`` [B, L]
            (right-padded: a mask with left padding or holes is refused), or an ``input_ids``
            tensor [B, L] with ``lengths``.
        dp_size: number of data-parallel ranks, at most B.
        lengths: int [B], sequence lengths, with an ``input_ids`` tensor (default: L for all).
        cost_model: the FLOP model that weighs tokens (linear layers) against attention pairs;
            None counts unique tokens only.

    Returns:
        ``dp_size`` int64 tensors [B_r]: the sample indices of each rank, ascending.
    """
    dp_size = check_int("dp_size", dp_size, minimum=1)
    keys, lengths = _partition_inputs(data, lengths)
    if dp_size > keys.shape[0]:
        raise ValueError(f"dp_size={dp_size} is larger than the batch ({keys.shape[0]} sequences)")
    weights = cost_weights(cost_model)
    order = _lexicographic_order(keys)
    sorted_lengths = lengths[order]
    counts = TrieCounts(_neighbour_lcp(keys[order], sorted_lengths).numpy(), sorted_lengths.numpy())
    total = weights[0] * float(counts.tokens[-1]) + weights[1] * float(counts.pairs[-1])
    # Two cuts: pieces of at most half a rank's share, and whole groups (tries cut only while there
    # are fewer than dp_size pieces). With one or two groups per rank the finer cut splits groups
    # and repeats their prompts, and keeping them whole often balances better: the cheaper
    # costliest rank (then fewer tokens) wins.
    candidates = []
    for max_cost in (total / dp_size / 2, math.inf):
        pieces = cut_tries(counts, max_cost=max_cost, weights=weights)
        while len(pieces) < dp_size:
            pieces = _cut_once_more(pieces, counts, weights)
        bins = refine(balance_pieces(pieces, dp_size, weights), weights, rounds=4 * len(pieces))
        candidates.append(bins)
    bins = min(
        candidates, key=lambda c: (max(b.cost(weights) for b in c), sum(b.tokens for b in c))
    )
    ranks = []
    for b in bins:
        members = np.concatenate([np.arange(first, end) for first, end in b.runs()])
        ranks.append(order[torch.from_numpy(members)].sort().values)
    return ranks
