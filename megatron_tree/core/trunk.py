"""Trunk reuse: a shared upper part of a large trie computed once, its keys and values reused by
every micro-batch that extends it.

Without trunk reuse, a trie too large for one micro-batch is cut at its branch points, and each
piece repeats its ancestors' path. With it, the trie's *trunk* (every node whose subtree holds more
than the capacity: an ancestor-closed set, so the upper part of the trie) runs once, and the
subtrees hanging below it (each at most the capacity) are bin-packed into *branch* micro-batches.
Nothing is computed twice.

A trunk longer than the capacity (a long shared history, or one sequence longer than a
micro-batch) runs as a chain of *trunk parts*: consecutive pre-order slices of the trunk's nodes,
each at most the capacity. A node's ancestors precede it in pre-order, so every part's rows are
ancestor-closed together with the parts before it.

All micro-batches of a *trunk group* (one or more such tries, laid out together in pre-order as one
tree G) are :class:`~.rows.TreeRows` of G, the way context-parallel ranks are rows of one tree:

* A part's keys are the keys the trunk parts before it recorded, then its own (each trunk part
  records its keys and values in a :class:`~.rows.KeyValueStore`); a branch's are the whole
  trunk's and its own. Gradients with respect to the stored keys and values accumulate over the
  later parts; each trunk part's backward runs after theirs, in reverse order, and adds them where
  its keys and values were made (this works under activation recompute too).
* Per-token outputs of a sequence are produced by the rows of the parts it runs through: a trunk
  part produces the entries its rows predict (for every sequence of G), a branch those of its own
  rows, and they add up. A sequence's loss is taken in the part holding its last token.

Legend: N_G positions of G (padding included), U_G its real nodes, n rows of a part, T tokens of a
part's sequences, c the capacity (real rows per micro-batch).
"""

from __future__ import annotations

import torch

from .bins import first_fit_decreasing
from .mask import padding_subtree_end
from .rows import TreeRows, pair_offsets
from .tree import PackedTree

__all__ = ["TrunkPlan", "plan_trunk", "split_group"]


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


class TrunkPlan:
    """How one laid-out trie (or a forest of them) runs with trunk reuse: trunk parts, then
    branches.

    Attributes:
        trunk_nodes: int64 [n_t], the trunk's nodes (those whose subtree holds more than the
            capacity) in pre-order.
        pieces: the subtrees hanging below the trunk, ``(start, end)`` in pre-order.
        trunk_parts: int64 [<= c] per trunk part: the trunk's nodes, c at a time.
        branches: int64 [<= c] per branch micro-batch: its pieces' nodes (pieces bin-packed
            first-fit-decreasing), in pre-order of their first piece.
    """

    def __init__(self, trunk_nodes: torch.Tensor, pieces: list[tuple[int, int]], capacity: int):
        self.trunk_nodes, self.pieces, self.capacity = trunk_nodes, pieces, capacity
        self.trunk_parts = list(trunk_nodes.split(capacity)) if len(trunk_nodes) else []
        bins = first_fit_decreasing([end - start for start, end in pieces], capacity)
        bins.sort(key=lambda b: min(b))
        device = trunk_nodes.device
        self.branches = [
            torch.cat([torch.arange(*pieces[i], device=device) for i in sorted(b)]) for b in bins
        ]

    @classmethod
    def of(cls, tree: PackedTree, capacity: int) -> TrunkPlan:
        trunk, pieces = plan_trunk(
            tree.subtree_end, tree.parent_index, tree.num_tree_tokens, capacity
        )
        return cls(torch.nonzero(trunk).flatten(), pieces, capacity)

    @property
    def parts(self) -> list[torch.Tensor]:
        """Every part's real positions (the rows it computes, padding aside), trunk parts
        first."""
        return self.trunk_parts + self.branches

    def padded_rows(self, pad_to) -> int:
        """Rows computed, every part padded by ``pad_to`` (real rows -> padded rows)."""
        return sum(pad_to(len(positions)) for positions in self.parts)

    @classmethod
    def merged(cls, plans: list[TrunkPlan], sizes: list[int]) -> TrunkPlan:
        """The plan of tries laid out one after another (``sizes``: their real nodes): their trunks
        share trunk parts, their pieces share branch micro-batches."""
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        nodes = torch.cat([p.trunk_nodes + o for p, o in zip(plans, offsets)])
        pieces = [(a + o, b + o) for p, o in zip(plans, offsets) for a, b in p.pieces]
        return cls(nodes, pieces, plans[0].capacity)


def plan_trunk(
    subtree_end: torch.Tensor, parent_index: torch.Tensor, num_nodes: int, capacity: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The trunk of a laid-out trie (or forest) and the subtrees below it.

    Args:
        subtree_end, parent_index: of the tree (pre-order), [>= num_nodes].
        num_nodes: U, its real nodes.
        capacity: real rows one micro-batch may hold.

    Returns:
        (bool [U], True on trunk nodes: those whose subtree holds more than ``capacity`` nodes;
        the branch pieces ``(start, end)``: subtrees of at most ``capacity`` nodes whose parent is a
        trunk node or that are roots, in pre-order).
    """
    ends = subtree_end[:num_nodes].to(torch.int64)
    size = ends - torch.arange(num_nodes, device=ends.device)
    trunk = size > capacity
    parent = parent_index[:num_nodes]
    top = ~trunk & ((parent < 0) | trunk[parent.clamp(min=0)])
    starts = torch.nonzero(top).flatten()
    return trunk, list(zip(starts.tolist(), ends[starts].tolist()))


def _pad_tree(tree: PackedTree, padded_length: int, pad_token_id: int) -> PackedTree:
    n = tree.padded_length
    extra = padded_length - n
    device = tree.input_ids.device
    return PackedTree(
        input_ids=torch.cat(
            [tree.input_ids, torch.full((extra,), pad_token_id, dtype=torch.int64, device=device)]
        ),
        position_ids=torch.cat(
            [tree.position_ids, torch.zeros(extra, dtype=torch.int64, device=device)]
        ),
        subtree_end=torch.cat(
            [tree.subtree_end, padding_subtree_end(n, padded_length, device).to(torch.int32)]
        ),
        parent_index=torch.cat(
            [tree.parent_index, torch.full((extra,), -1, dtype=torch.int64, device=device)]
        ),
        sequence_ids=tree.sequence_ids,
        cu_seqlens=tree.cu_seqlens,
        token_index=tree.token_index,
        num_tree_tokens=tree.num_tree_tokens,
    )


def _view(tree: PackedTree, sequences: torch.Tensor) -> tuple[PackedTree, torch.Tensor]:
    """G with only ``sequences`` (indices in G's order) and their tokens' places in G's token
    order."""
    starts, ends = tree.cu_seqlens[sequences], tree.cu_seqlens[sequences + 1]
    lengths = ends - starts
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=cu[1:])
    tokens = (
        torch.arange(int(cu[-1]), device=lengths.device)
        - cu[:-1].repeat_interleave(lengths)
        + starts.repeat_interleave(lengths)
    )
    view = PackedTree(
        tree.input_ids,
        tree.position_ids,
        tree.subtree_end,
        tree.parent_index,
        tree.sequence_ids[sequences],
        cu,
        tree.token_index[tokens],
        tree.num_tree_tokens,
    )
    return view, tokens


def split_group(
    tree: PackedTree, plan: TrunkPlan, group: int, *, pad_to: callable, pad_token_id: int = 0
) -> list[tuple[PackedTree, TreeRows]]:
    """Lay out a trunk group's parts.

    Args:
        tree: G without padding (``padded_length == num_tree_tokens``).
        plan: G's :class:`TrunkPlan` (the plan that decided the group is the one laid out).
        group: the group's number (kept on its parts).
        pad_to: real rows -> a part's padded rows.

    Returns:
        Per part, trunk parts first: (G with the sequences whose loss the part takes, its rows).
    """
    num_nodes = tree.num_tree_tokens
    device = tree.input_ids.device
    real = plan.parts  # each part's real positions
    padded = [pad_to(len(r)) for r in real]
    tree = _pad_tree(tree, num_nodes + sum(p - len(r) for p, r in zip(padded, real)), pad_token_id)
    owner = torch.empty(num_nodes, dtype=torch.int64, device=device)
    positions, next_pad = [], num_nodes
    for i, (r, p) in enumerate(zip(real, padded)):
        owner[r] = i
        positions.append(
            torch.cat([r, torch.arange(next_pad, next_pad + p - len(r), device=device)])
        )
        next_pad += p - len(r)
    last = tree.token_index[tree.cu_seqlens[1:] - 1]
    site = owner[last]  # the part holding each sequence's last token takes its loss
    num_trunk = len(plan.trunk_parts)
    parts = []
    for i, (pos, r) in enumerate(zip(positions, real)):
        view, tokens = _view(tree, torch.nonzero(site == i).flatten())
        before = min(i, num_trunk)  # the trunk parts whose keys this part extends
        part = TreeRows(
            tree,
            pos,
            num_real=len(r),
            reach=int(tree.position_ids[r].max()) + 1 if len(r) else 1,
            stored=torch.cat(positions[:before]) if before else None,
            stored_parts=before,
            records=i < num_trunk,
            group=group,
            index=i,
            num_parts=len(real),
            group_tokens=tokens,
            pair_offsets=pair_offsets(tree, pos),
        )
        parts.append((view, part))
    return parts
