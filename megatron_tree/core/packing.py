"""Pack an RL batch into prefix tries, one flattened pre-order trie per micro-batch.

How it works, with no Python object or loop per token:

1. Sort the sequences lexicographically (a sequence sorts before its extensions). In sorted order
   the trie of a set of sequences is read off the longest common prefix (LCP) of each sequence with
   its predecessor: sequence i contributes its tokens at depths ``lcp_i .. len_i - 1``, and laying
   the contributions out one after another is the depth-first pre-order of the trie
   (``core/trie.py``).
2. Split the sorted order into root groups (LCP 0); cut a group too large for one micro-batch at
   its branch points into subtrees that repeat only their ancestors' path (``core/trie.py``), and
   bin-pack the pieces first-fit-decreasing, each into the bin holding most of its path (a loop
   over pieces, not tokens; ``core/bins.py``). The previous plan (contiguous runs of the
   sorted order, bin-packed first-fit-decreasing; ``packing="runs"``) is computed too and kept when
   it needs fewer trees, or as many trees and fewer tokens, so no batch packs worse than with it.
   Optionally the pieces are then rebalanced by FLOP cost over the same number of trees.
3. Lay out each bin with a few [S, L] tensor operations: packed position of every (sequence, depth)
   by a forward fill of the owning sequence down each depth column, and the end of every node's
   subtree (the start of the first later contribution with ``lcp <= depth``) by a reverse fill.

Legend: B batch size, L padded length, S sequences in a tree, N packed (padded) tree length,
T sequence tokens of a tree (every token of every sequence).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .batch import RESERVED_KEYS, PackedTreeBatch, micro_batch
from .bins import balance_by_cost, first_fit_decreasing, pack_pieces
from .checks import check_bool, check_int
from .flops import GPTShape, cost_weights
from .mask import padding_subtree_end
from .ragged import read_batch
from .tree import PackedTree
from .trie import TrieCounts, cut_tries, lexicographic_order, neighbour_lcp, sequence_keys
from .trunk import TrunkPlan, split_group

logger = logging.getLogger(__name__)

__all__ = ["PackedTreeBatch", "build_packed_tree_batch", "layout_tree"]


def layout_tree(
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    *,
    padded_length: int | None = None,
    align: int = 1,
    pad_token_id: int = 0,
    share_prefixes: bool = True,
    keys: torch.Tensor | None = None,
):
    """Flatten the trie of lexicographically sorted sequences in pre-order.

    Args:
        sequences: int64 [S, L] token ids, sorted lexicographically, -1 past each length.
        lengths: int64 [S], all >= 1.
        padded_length: N, at least the number of unique tokens; by default the unique token count
            rounded up to a multiple of ``align``.
        align: alignment of the default ``padded_length``.
        pad_token_id: token id written on padding positions.
        share_prefixes: False lays every sequence out as its own root chain (the unshared
            baseline with the same layout and kernels).
        keys: int64 [S, L], what two sequences must agree on to share a position (default
            ``sequences``; with routing replay, token and route), sorted like ``sequences``.

    Returns:
        (input_ids [N], position_ids [N], subtree_end int32 [N], parent_index [N], token_index [T],
        num_tree_tokens).
    """
    sequences, lengths = sequences.to(torch.int64), lengths.to(torch.int64)
    num_seq, width = sequences.shape
    device = sequences.device
    lcp = (
        neighbour_lcp(sequences if keys is None else keys, lengths)
        if share_prefixes
        else torch.zeros_like(lengths)
    )
    contrib = lengths - lcp  # [S] tokens each sequence adds to the trie
    start = torch.zeros(num_seq + 1, dtype=torch.int64, device=device)
    torch.cumsum(contrib, dim=0, out=start[1:])
    num_tree_tokens = int(start[-1])
    if padded_length is None:
        padded_length = max(-(-num_tree_tokens // align), 1) * align
    if num_tree_tokens > padded_length:
        raise ValueError(
            f"padded_length={padded_length} is smaller than the tree's {num_tree_tokens} unique "
            "tokens; pass at least that many (or leave padded_length=None)"
        )

    depth = torch.arange(width, device=device)[None, :]  # [1, L]
    seq = torch.arange(num_seq, device=device)[:, None]  # [S, 1]
    in_seq = depth < lengths[:, None]  # [S, L]
    owned = in_seq & (depth >= lcp[:, None])  # tokens this sequence contributes
    own_pos = start[:-1, None] + depth - lcp[:, None]  # packed position where owned

    # Packed position of every (sequence, depth): the last sequence at or above that contributed
    # this depth owns the node (everything in between shares a longer prefix).
    owner = torch.where(owned, seq, -1).cummax(dim=0).values
    path = torch.gather(own_pos, 0, owner.clamp(min=0))  # [S, L], valid where in_seq

    # The subtree of a node at depth d contributed by sequence i ends where the first later
    # sequence j with lcp_j <= d starts its contribution (or at the end of the tree).
    leaves_here = torch.where(lcp[:, None] <= depth, seq, num_seq)  # [S, L]
    first_leaving = leaves_here.flip(0).cummin(dim=0).values.flip(0)
    next_leaving = torch.cat(
        [first_leaving[1:], torch.full((1, width), num_seq, device=device)], dim=0
    )
    node_end = start[next_leaving]  # [S, L]

    parent_path = torch.cat([torch.full((num_seq, 1), -1, device=device), path[:, :-1]], dim=1)

    dest = own_pos[owned]
    input_ids = torch.full((padded_length,), pad_token_id, dtype=torch.int64, device=device)
    position_ids = torch.zeros(padded_length, dtype=torch.int64, device=device)
    subtree_end = padding_subtree_end(0, padded_length, device)
    parent_index = torch.full((padded_length,), -1, dtype=torch.int64, device=device)
    input_ids[dest] = sequences[owned]
    position_ids[dest] = depth.expand(num_seq, width)[owned]
    subtree_end[dest] = node_end[owned]
    parent_index[dest] = parent_path[owned]
    token_index = path[in_seq]
    return (
        input_ids,
        position_ids,
        subtree_end.to(torch.int32),
        parent_index,
        token_index,
        num_tree_tokens,
    )


def _check_sizes(
    data: dict, max_tokens_per_mb, block_size, parallel_size, pad_token_id, vocab_size
) -> tuple[int, int]:
    """Check the size arguments (and that ``data`` uses no reserved name); returns (the alignment
    ``lcm(block_size, parallel_size)``, ``max_tokens_per_mb`` as an int)."""
    for reserved in RESERVED_KEYS[1:3]:
        if reserved in data:
            raise ValueError(
                f"data[{reserved!r}] is reserved: each micro-batch gets its own (position ids are "
                "the token depths in the tree); drop it from data"
            )
    block_size = check_int("block_size", block_size, minimum=1)
    parallel_size = check_int("parallel_size", parallel_size, minimum=1)
    pad_token_id = check_int("pad_token_id", pad_token_id, minimum=0)
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, minimum=1)
        if pad_token_id >= vocab_size:
            raise ValueError(f"pad_token_id={pad_token_id} must be < vocab_size={vocab_size}")
    align = math.lcm(block_size, parallel_size)
    if max_tokens_per_mb is None:
        raise ValueError(
            "max_tokens_per_mb is required: the token capacity of one micro-batch (a multiple of "
            f"lcm(block_size, parallel_size) = {align})"
        )
    max_tokens_per_mb = check_int("max_tokens_per_mb", max_tokens_per_mb)
    if max_tokens_per_mb <= 0 or max_tokens_per_mb % align:
        raise ValueError(
            f"max_tokens_per_mb={max_tokens_per_mb} must be a positive multiple of "
            f"lcm(block_size={block_size}, parallel_size={parallel_size}) = {align}; e.g. "
            f"{max(align, -(-max_tokens_per_mb // align) * align)}"
        )
    return align, max_tokens_per_mb


def _check_lengths(
    lengths: torch.Tensor, capacity: int, align: int, *, share_prefixes: bool, share_trunks: bool
) -> None:
    """A sequence longer than ``capacity`` runs only as a chain of trunk parts, which needs trunk
    reuse and shared prefixes: otherwise ValueError naming what to change."""
    too_long = lengths > capacity
    if not too_long.any() or (share_trunks and share_prefixes):
        return
    i = int(too_long.nonzero()[0])
    if share_prefixes:
        chain = "pack with share_trunks=True (a longer sequence then runs as a chain of parts)"
    else:
        chain = (
            "a longer sequence runs as a chain of parts only with trunk reuse, which needs "
            "share_prefixes=True (this batch has share_prefixes=False"
            + (")" if share_trunks else " and share_trunks=False)")
        )
    raise ValueError(
        f"sequence {i} has {int(lengths[i])} tokens, more than max_tokens_per_mb={capacity}; "
        f"{chain}; or raise max_tokens_per_mb (a multiple of {align}) or truncate it"
    )


def _max_token_id(keys: torch.Tensor, pad_token_id: int, vocab_size: int | None) -> int:
    """The largest token id the batch holds (``pad_token_id`` included), checked against
    ``vocab_size``."""
    max_token_id = max(int(keys.max()), pad_token_id)
    if vocab_size is not None and max_token_id >= vocab_size:
        raise ValueError(
            f"data['input_ids'] holds token id {max_token_id}, outside the vocabulary [0, "
            f"{vocab_size})"
        )
    return max_token_id


def _split_into_runs(
    lcp: torch.Tensor, lengths: torch.Tensor, capacity: int
) -> list[tuple[int, int, int]]:
    """Cut the sorted order into runs [a, b) that each fit ``capacity`` unique tokens.

    A run starts at every root group (lcp 0) and wherever the current run is full; greedy filling is
    optimal for contiguous runs because a run's trie only shrinks when a sequence is removed.

    Returns:
        list of (first, end, unique_tokens).
    """
    runs = []
    first, used = 0, 0
    for i, (shared, n) in enumerate(zip(lcp.tolist(), lengths.tolist())):
        add = n - shared
        if i > 0 and (shared == 0 or used + add > capacity):
            runs.append((first, i, used))
            first, used, add = i, 0, n
        used += add
    runs.append((first, len(lengths), used))
    return runs


PACKINGS = ("trie", "runs")


def _plan_trees(
    lcp: torch.Tensor, lengths: torch.Tensor, capacity: int, *, packing: str, weights, balance: bool
) -> list[list[tuple[int, int]]]:
    """Which runs of the sorted order each tree holds.

    Args:
        lcp: int64 [B], LCP of each sorted sequence with its predecessor.
        lengths: int64 [B], in sorted order.
        capacity: unique tokens per tree.
        packing: "trie" (cuts at branch points, never worse than "runs") or "runs" (the previous
            plan: contiguous runs, first-fit-decreasing).
        weights: cost per (token, attention pair), for ``balance``.
        balance: rebalance the pieces by cost over the same number of trees (see
            :func:`~.bins.balance_by_cost`).

    Returns:
        per tree, its runs ``(first, end)`` in sorted order.
    """
    runs = _split_into_runs(lcp, lengths, capacity)
    plan = [
        sorted(runs[r][:2] for r in b) for b in first_fit_decreasing([r[2] for r in runs], capacity)
    ]
    if packing == "runs" and not balance:
        return plan
    counts = TrieCounts(lcp.cpu().numpy(), lengths.cpu().numpy())
    pieces = cut_tries(counts, max_tokens=capacity)
    bins = pack_pieces(pieces, capacity)
    # Compare the trees as laid out: runs of one root group in the same tree share their prefix,
    # so the previous plan can hold fewer tokens than its runs add up to.
    runs_tokens = sum(counts.union(tree)[0] for tree in plan)
    bins_tokens = sum(b.tokens for b in bins)
    use_bins = packing == "trie" and (len(bins), bins_tokens) <= (len(plan), runs_tokens)
    if use_bins:
        plan = [b.runs() for b in bins]
    if balance:
        balanced = balance_by_cost(pieces, bins if use_bins else None, len(plan), weights, capacity)
        plan = plan if balanced is None else [b.runs() for b in balanced]
    return plan


def _sync_num_micro_batches(num: int, dp_group) -> int:
    import torch.distributed as dist

    device = "cuda" if dist.get_backend(dp_group) == "nccl" else "cpu"
    count = torch.tensor([num], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    return int(count.item())


def _route_keys(data: dict, route_key: str, keys: torch.Tensor) -> torch.Tensor:
    """Trie keys [B, W] that differ where tokens or routes differ: token * R + route id, where the
    route id numbers the distinct values of ``data[route_key]`` per token (-1 past each length)."""
    if route_key in RESERVED_KEYS or route_key not in data:
        raise ValueError(
            f"route_key={route_key!r} must name a per-token input of the batch (e.g. "
            "'routed_experts' [B, L, layers, topk]); the batch has "
            f"{sorted(k for k in data if k not in RESERVED_KEYS)}"
        )
    routes = data[route_key]  # [B, L, ...], shape checked with the other per-token inputs
    batch, width = keys.shape
    if routes.dtype.is_floating_point:
        raise ValueError(
            f"data[{route_key!r}] must hold integer routes (expert ids), got {routes.dtype}"
        )
    flat = routes[:, :width].reshape(batch * width, -1).to(keys.device)
    _, route_id = torch.unique(flat, dim=0, return_inverse=True)
    num_routes = int(route_id.max()) + 1
    return torch.where(keys >= 0, keys * num_routes + route_id.view(batch, width), -1)


def _cut_rows(lcp: torch.Tensor, lengths: torch.Tensor, capacity: int, pad_to, plan_trees) -> int:
    """Rows computed when one trie (sorted, ``lcp[0] == 0``) is packed alone without trunk reuse:
    the plan ``plan_trees(lcp, lengths)`` picks (cut at branch points, or contiguous runs), each
    micro-batch padded by ``pad_to``."""
    counts = TrieCounts(lcp.cpu().numpy(), lengths.cpu().numpy())
    return sum(pad_to(counts.union(runs)[0]) for runs in plan_trees(lcp, lengths))


def _trunk_groups(
    lcp: torch.Tensor, lengths: torch.Tensor, capacity: int, pad_to, layout, plan_trees
) -> tuple[list[tuple[PackedTree, TrunkPlan]], torch.Tensor]:
    """Which tries run with trunk reuse, grouped, each group with its laid-out tree and the plan
    that decided; and the sorted indices of the other tries.

    A trie larger than ``capacity`` runs with trunk reuse when its plan computes fewer rows than
    the plan that would pack it otherwise (``plan_trees``; both with every micro-batch padded by
    ``pad_to``); one holding a sequence longer
    than ``capacity`` cannot be cut and always does. Tries are grouped first-fit-decreasing by trunk
    size, so that small trunks share trunk parts.

    Args:
        lcp, lengths: int64 [B] in sorted order.
        pad_to: real rows -> a micro-batch's padded rows.
        layout: ``layout(first, end) -> PackedTree`` of sorted sequences ``first..end-1``.
        plan_trees: ``plan_trees(lcp, lengths) -> per tree, its runs`` without trunk reuse.
    """
    starts = torch.nonzero(lcp == 0).flatten().tolist() + [len(lengths)]
    unique = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum((lengths - lcp).cpu(), dim=0, out=unique[1:])
    tries, plain = [], []
    for first, end in zip(starts[:-1], starts[1:]):
        if int(unique[end] - unique[first]) > capacity:
            tree = _unpadded(layout(first, end))
            plan = TrunkPlan.of(tree, capacity)
            if int(lengths[first:end].max()) > capacity:
                tries.append((tree, plan))
                continue
            trunk_rows, cut = (
                plan.padded_rows(pad_to),
                _cut_rows(lcp[first:end], lengths[first:end], capacity, pad_to, plan_trees),
            )
            if trunk_rows < cut:
                tries.append((tree, plan))
                continue
            logger.info(
                "trie of sorted sequences %d..%d: cut (%d rows) rather than trunk reuse (%d rows)",
                first,
                end - 1,
                cut,
                trunk_rows,
            )
        plain.append(torch.arange(first, end))
    groups = []
    for b in sorted(first_fit_decreasing([len(plan.trunk_nodes) for _, plan in tries], capacity)):
        members = [tries[i] for i in sorted(b)]
        trees = [t for t, _ in members]
        groups.append(
            (
                PackedTree.concat(trees),
                TrunkPlan.merged([p for _, p in members], [t.num_tree_tokens for t in trees]),
            )
        )
    rest = torch.cat(plain) if plain else torch.zeros(0, dtype=torch.int64)
    return groups, rest


@dataclass(frozen=True)
class _SortedBatch:
    """A batch's sequences in trie (lexicographic) order, what every tree is laid out from.

    Attributes:
        order: int64 [B], the batch index of each sorted sequence.
        keys: int64 [B, W] token ids, -1 past each length, sorted.
        trie_keys: int64 [B, W], what two sequences must agree on to share a position (token and
            route, with routing replay), sorted; None when that is ``keys``.
        lengths: int64 [B], sorted.
        lcp: int64 [B], each sorted sequence's LCP with its predecessor (all 0 without sharing).
        align, pad_token_id, share_prefixes: how trees are laid out (:func:`layout_tree`).
    """

    order: torch.Tensor
    keys: torch.Tensor
    trie_keys: torch.Tensor | None
    lengths: torch.Tensor
    lcp: torch.Tensor
    align: int
    pad_token_id: int
    share_prefixes: bool

    @classmethod
    def of(cls, keys, lengths, trie_keys, *, align, pad_token_id, share_prefixes) -> _SortedBatch:
        """Sort ``keys`` and ``lengths`` [B] (and ``trie_keys``, which then decide the order)."""
        order = lexicographic_order(keys if trie_keys is None else trie_keys).to(keys.device)
        sorted_lengths = lengths[order]
        sorted_trie_keys = None if trie_keys is None else trie_keys[order]
        lcp = neighbour_lcp(keys[order] if trie_keys is None else sorted_trie_keys, sorted_lengths)
        if not share_prefixes:
            lcp = torch.zeros_like(lcp)
        return cls(
            order,
            keys[order],
            sorted_trie_keys,
            sorted_lengths,
            lcp,
            align,
            pad_token_id,
            share_prefixes,
        )

    def layout(self, members: torch.Tensor, padded_length: int | None) -> PackedTree:
        """The tree of the sorted sequences ``members`` (ascending), padded to ``padded_length``
        (None: to the alignment)."""
        lengths = self.lengths[members]
        width = int(lengths.max())
        ids, pos, end, parent, token_index, unique = layout_tree(
            self.keys[members, :width],
            lengths,
            padded_length=padded_length,
            align=self.align,
            pad_token_id=self.pad_token_id,
            share_prefixes=self.share_prefixes,
            keys=None if self.trie_keys is None else self.trie_keys[members, :width],
        )
        cu_seqlens = torch.zeros(len(members) + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, dim=0, out=cu_seqlens[1:])
        return PackedTree(
            ids, pos, end, parent, self.order[members], cu_seqlens, token_index, unique
        )


def _micro_batches(
    batch: _SortedBatch, capacity: int, pad_to, plan_trees, *, share_trunks: bool, pad_to_max: bool
) -> list:
    """Every micro-batch of ``batch``: the trees of ``plan_trees`` over the tries without trunk
    reuse, then the parts of each trunk group (:func:`_trunk_groups`, with ``share_trunks``)."""
    device = batch.keys.device
    groups, members = [], torch.arange(len(batch.lcp), device=device)
    if share_trunks:
        groups, members = _trunk_groups(
            batch.lcp,
            batch.lengths,
            capacity,
            pad_to,
            lambda a, b: batch.layout(torch.arange(a, b, device=device), None),
            plan_trees,
        )
        members = members.to(device)
    micro_batches = []
    if len(members):
        for tree_runs in plan_trees(batch.lcp[members], batch.lengths[members]):
            picked = members[
                torch.cat([torch.arange(first, end) for first, end in tree_runs]).to(device)
            ]
            micro_batches.append(
                micro_batch(batch.layout(picked, capacity if pad_to_max else None))
            )
    for g, (tree, plan) in enumerate(groups):
        micro_batches += [
            micro_batch(view, part)
            for view, part in split_group(
                tree, plan, g, pad_to=pad_to, pad_token_id=batch.pad_token_id
            )
        ]
    return micro_batches


def _unpadded(tree: PackedTree) -> PackedTree:
    """``tree`` cut to its real positions."""
    u = tree.num_tree_tokens
    return PackedTree(
        tree.input_ids[:u],
        tree.position_ids[:u],
        tree.subtree_end[:u],
        tree.parent_index[:u],
        tree.sequence_ids,
        tree.cu_seqlens,
        tree.token_index,
        u,
    )


def _check_options(
    pad_to_max, share_prefixes, share_trunks, balance_cost, packing, cost_model
) -> bool:
    """Type-check the packing options; returns ``share_trunks`` with its default resolved."""
    for name, value in dict(
        pad_to_max=pad_to_max, share_prefixes=share_prefixes, balance_cost=balance_cost
    ).items():
        check_bool(name, value)
    share_trunks = check_bool("share_trunks", share_trunks, optional=True)
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r} must be one of {PACKINGS}")
    if balance_cost and cost_model is None:
        raise ValueError(
            "balance_cost=True needs cost_model (a GPTShape) to weigh tokens against attention"
        )
    return True if share_trunks is None else share_trunks


def build_packed_tree_batch(
    data: dict[str, torch.Tensor],
    *,
    max_tokens_per_mb: int | None = None,
    block_size: int = 128,
    parallel_size: int = 1,
    pad_to_max: bool = False,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
    dp_group=None,
    share_prefixes: bool = True,
    packing: str = "trie",
    cost_model: GPTShape | None = None,
    balance_cost: bool = False,
    route_key: str | None = None,
    share_trunks: bool | None = None,
    min_micro_batches: int = 1,
    micro_batch_multiple: int = 1,
) -> PackedTreeBatch:
    """Pack a right-padded batch into prefix tries, one per micro-batch.

    Two sequences in the same tree share their whole common prefix, whatever their input order.
    Sequences sharing a prefix are kept in one tree when it fits; a larger group is cut at its
    branch points into subtrees, each repeating only its ancestors' path (and nothing when it joins
    a tree holding that path), and groups and subtrees share trees (as separate roots)
    first-fit-decreasing.

    Args:
        data: ``input_ids`` [B, L] int, ``attention_mask`` [B, L] (1 for real tokens, right-padded),
            and any other per-token tensors [B, L, ...] (loss mask, old log-probs, advantages...),
            which the micro-batches carry in tree layout [T, ...]. numpy arrays are accepted
            (``torch.as_tensor``, keeping their dtype), and so are rectangular nested lists. Or a
            ragged batch without ``attention_mask``: ``input_ids`` a list of 1-D sequences, a jagged
            nested tensor, or THD ``[T]`` with ``cu_seqlens`` [B + 1], extras in the same layout
            (:mod:`megatron_tree.core.ragged`); the batch's ``input_layout`` then says how to give
            results back in it (``TreeStepResult.merged_outputs`` does).
        max_tokens_per_mb: unique-token capacity of one tree (an int); a multiple of
            ``lcm(block_size, parallel_size)``.
        block_size: attention tile size the packed length is aligned to.
        parallel_size: another factor the packed length must be divisible by (e.g. TP x CP x 2).
        pad_to_max: pad every tree to ``max_tokens_per_mb`` (constant shapes: pipeline
            parallelism and the allgather expert dispatcher need them; the step then asks for
            them, see ``PackingConfig``); False (default): each tree only to the next multiple
            of the alignment.
        pad_token_id: token id written on padding positions (>= 0).
        vocab_size: if given, every token id and ``pad_token_id`` must be below it.
        dp_group: optional data-parallel process group; all its ranks then return the same number
            of micro-batches (all-padding dummy trees appended where needed).
        share_prefixes: False switches sharing off: every sequence becomes its own root chain, in
            the same layout, for a baseline that runs the same kernels.
        packing: ``"trie"`` (cut large groups at branch points; never more trees, or more tokens in
            as many trees, than ``"runs"``) or ``"runs"`` (the previous plan: contiguous runs of the
            sorted order, bin-packed first-fit-decreasing).
        cost_model: a :class:`GPTShape`; the batch then reports FLOP costs per tree
            (``tree_costs``, min/max in its repr), and ``balance_cost`` uses it.
        balance_cost: assign the pieces to the same number of trees longest-cost-first, each to
            the tree where its cost lands lowest, evening out the trees' FLOPs (may repeat a few
            more prefix tokens); needs ``cost_model``.
        route_key: the name of a per-token input that two sequences must also agree on to share a
            token, e.g. ``"routed_experts"`` [B, L, layers, topk] recorded by the rollout engine for
            MoE routing replay: a tree position has one route, so sharing stops at the first token
            whose routes differ (the trie key is token + route). Its tree-layout values are then
            equal on every sequence through a position (``values_per_position`` reads them).
        share_trunks: trunk reuse (:mod:`megatron_tree.core.trunk`): a trie larger than
            ``max_tokens_per_mb`` is not cut; its trunk (the nodes whose subtree is larger) runs
            once, as a chain of trunk parts of at most ``max_tokens_per_mb`` rows, and the
            subtrees below it are bin-packed into branch micro-batches that attend to the trunk's
            keys and values, so no prefix is computed twice. Chosen per trie from the two real
            plans: trunk reuse where it computes fewer rows than cutting (each micro-batch padded
            as ``pad_to_max`` says), and always for a trie holding a sequence longer than
            ``max_tokens_per_mb`` (which runs as a chain of parts). Every micro-batch carries its
            ``"rows"`` (:class:`~megatron_tree.core.rows.TreeRows`); parts are padded like trees
            (``pad_to_max``), and ``tree_forward_backward`` runs them under every parallelism and
            for MoE models (router losses as if each group ran unpacked; routing replay too). The
            statistics count a trunk once. None (default): on (as in ``tree_forward_backward``).
        min_micro_batches: at least this many micro-batches, all-padding fill-ins appended where
            the batch packs into fewer (torch's pipeline schedules need as many micro-batches as
            pipeline stages).
        micro_batch_multiple: the micro-batch count a multiple of this, fill-ins appended (torch's
            interleaved pipeline schedules need a multiple of the pipeline size).

    Returns:
        :class:`PackedTreeBatch`.
    """
    min_micro_batches = check_int("min_micro_batches", min_micro_batches, minimum=1)
    micro_batch_multiple = check_int("micro_batch_multiple", micro_batch_multiple, minimum=1)
    share_trunks = _check_options(
        pad_to_max, share_prefixes, share_trunks, balance_cost, packing, cost_model
    )
    data, lengths, input_layout = read_batch(data)
    align, max_tokens_per_mb = _check_sizes(
        data, max_tokens_per_mb, block_size, parallel_size, pad_token_id, vocab_size
    )
    _check_lengths(
        lengths, max_tokens_per_mb, align, share_prefixes=share_prefixes, share_trunks=share_trunks
    )
    keys = sequence_keys(data["input_ids"], lengths)
    max_token_id = _max_token_id(keys, pad_token_id, vocab_size)
    batch = _SortedBatch.of(
        keys,
        lengths,
        None if route_key is None else _route_keys(data, route_key, keys),
        align=align,
        pad_token_id=pad_token_id,
        share_prefixes=share_prefixes,
    )
    # Every micro-batch's padded rows, decided once: the capacity (constant shapes) or the
    # alignment.
    pad_to = (
        (lambda n: max_tokens_per_mb) if pad_to_max else (lambda n: max(-(-n // align), 1) * align)
    )
    weights = cost_weights(cost_model)

    def plan_trees(lcp, lengths):
        return _plan_trees(
            lcp, lengths, max_tokens_per_mb, packing=packing, weights=weights, balance=balance_cost
        )

    micro_batches = _micro_batches(
        batch,
        max_tokens_per_mb,
        pad_to,
        plan_trees,
        share_trunks=share_trunks and share_prefixes,
        pad_to_max=pad_to_max,
    )
    target = len(micro_batches)
    if dp_group is not None:  # as many micro-batches on every rank
        target = _sync_num_micro_batches(target, dp_group)
    target = max(target, min_micro_batches)
    target = -(-target // micro_batch_multiple) * micro_batch_multiple
    if target > len(micro_batches):  # all-padding fill-ins
        filler = PackedTree.all_padding(pad_to(1), pad_token_id, keys.device)
        micro_batches += [micro_batch(filler) for _ in range(target - len(micro_batches))]
    result = PackedTreeBatch(
        micro_batches, len(lengths), int(lengths.sum()), max_token_id, cost_model=cost_model
    )
    result.attach_padded(
        {k: v for k, v in data.items() if k not in ("input_ids", "attention_mask")}
    )
    result.input_layout = input_layout
    logger.debug("packed %s", result)
    return result
