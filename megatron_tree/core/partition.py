"""The data-parallel partition: a global batch's samples split across ranks without scattering
shared prefixes (:func:`partition_for_data_parallel`).

The batch is sorted as bytes, not over W columns (:func:`_trie_order`), into the prefix counts of
:class:`~.trie.TrieCounts`; its tries are cut at branch points into pieces (several cuts, each
assigned longest-cost-first to the ranks and refined, the cheapest costliest rank kept:
:func:`_balance_pieces`), or, with ``groups``, cut until no piece holds two groups and assigned
group by group (:func:`~.ranks.balance_groups`). The ranks' bins and their heaps are
:mod:`~.ranks`; the micro-batch packer's bins of a token capacity are :mod:`~.bins`.

Legend: B sequences, L padded length, W the longest sequence, P pieces, dp ranks.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch

from .bins import Bin
from .checks import check_bool, check_int
from .flops import GPTShape, cost_weights
from .ragged import read_batch
from .ranks import balance_groups, lpt, refine_ranks
from .trie import Piece, TrieCounts, cut_tries

__all__ = ["partition_for_data_parallel"]


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
    (:func:`~.ranks.lpt`); the one with the cheapest costliest rank (then fewer tokens; then the
    first) wins:

    1. pieces of at most half a rank's share of the cost (:func:`~.trie.cut_tries`), refined
       (:func:`~.ranks.refine_ranks`);
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
            ranks = lpt(pieces, dp_size, weights)
            if k < 2:  # 3's shallow cuts may leave many ancestor paths per rank: no refining
                refine_ranks(ranks, rounds=4 * len(pieces))
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
