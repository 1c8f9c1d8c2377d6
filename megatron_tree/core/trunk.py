"""Trunk reuse: a shared upper part of a large trie computed once, its keys and values reused by
every micro-batch that extends it.

A trie too large for one micro-batch is cut today at its branch points, and each piece repeats its
ancestors' path. With trunk reuse the trie's *trunk* (every node whose subtree holds more than the
capacity, an ancestor-closed set, so it is the upper part of the trie) runs as one micro-batch, and
the subtrees hanging below it (each at most the capacity) are bin-packed into *branch*
micro-batches. Nothing is computed twice.

All micro-batches of a *trunk group* (one or more such tries, laid out together in pre-order as one
tree G) are parts of G, the way context-parallel ranks are parts of one tree:

* A part's rows are some of G's positions (ascending); its keys are its *context*: the trunk's
  positions and its own. The context of a branch is ancestor-closed, so the mask restricted to it
  is again an O(N) ``subtree_end`` encoding, read off G's by one ``searchsorted``.
* The trunk runs first and keeps every layer's keys and values (:class:`TrunkKeyValues`); a branch
  attends to [trunk keys/values ; its own], merged into context order, and the gradients of the
  trunk's keys and values accumulate over the branches. The trunk's backward then runs once, adding
  those gradients where its keys and values were made (this works under activation recompute too).
* Per-token outputs of a sequence are produced by the rows of the parts it runs through: the trunk
  produces the entries its rows predict (for every sequence of G), a branch those of its own rows,
  and the two add up. A sequence's loss is taken in the part holding its last token, so a
  sequence ending inside the trunk is the trunk's.

Legend: N_G positions of G (padding included), U_G its real nodes, n rows of a part, K its context
(keys), T tokens of a part's sequences, L layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .mask import TreeMask, TreeMaskPlan, padding_subtree_end
from .tree import PackedTree

__all__ = ["TreePart", "TrunkKeyValues", "first_fit", "part_attention_mask", "plan_trunk", "split_group"]


@dataclass(frozen=True, eq=False)
class TreePart:
    """The rows of a trunk group's tree that one micro-batch computes.

    It speaks the interface of a context-parallel split where the gather functions take one
    (``local_positions``, ``local_index``, ``num_rows``, ``share``), so per-token outputs of the
    part's rows are read with the same code; they are not shared over a group but completed by the
    trunk's (see the module docstring).

    Attributes:
        tree: G, the group's tree with every sequence of the group (the trunk gathers on it).
        positions: int64 [n], G positions of this part's rows, ascending (real rows, then padding).
        trunk: int64 [n_t], the trunk part's positions (the keys a branch adds); None for the trunk.
        group_tokens: int64 [T], the positions in G's token order (``tree.token_index``) of the
            tokens of this part's sequences (those whose last token it holds).
        group: the group's number in its batch; index: 0 for the trunk, 1.. for the branches;
        num_parts: the group's micro-batches (trunk included).
        num_real: real (non-padding) rows; max_depth: the deepest row's depth.
    """

    tree: PackedTree
    positions: torch.Tensor
    trunk: torch.Tensor | None
    group_tokens: torch.Tensor
    group: int
    index: int
    num_parts: int
    num_real: int
    max_depth: int

    @property
    def is_trunk(self) -> bool:
        return self.trunk is None

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def local_positions(self) -> torch.Tensor:
        return self.positions

    @functools.cached_property
    def local_index(self) -> torch.Tensor:
        """int64 [N_G]: this part's row of each G position, -1 where another part holds it."""
        index = torch.full((self.tree.padded_length,), -1, dtype=torch.int64, device=self.positions.device)
        index[self.positions] = torch.arange(self.num_rows, device=self.positions.device)
        return index

    def share(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Outputs of this part's rows stay as they are (the step adds the trunk's)."""
        return outputs

    @functools.cached_property
    def context(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(G positions of the keys, ascending [K]; the order that turns [trunk keys ; own keys]
        into that order [K], None for the trunk, whose keys are its rows)."""
        if self.trunk is None:
            return self.positions, None
        both = torch.cat([self.trunk, self.positions])
        order = torch.argsort(both)
        return both[order], order

    def mask_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``subtree_end`` int32 [K] of G restricted to the context, in context coordinates; the
        rows' places among the keys int64 [n], None when they are all of them).

        For positions k <= q of the context, k is an ancestor of q in G iff q < G.subtree_end[k],
        iff q's context index is below the number of context positions under G.subtree_end[k].
        """
        keys, order = self.context
        ends = self.tree.subtree_end.to(torch.int64)[keys]
        subtree_end = torch.searchsorted(keys, ends).to(torch.int32)
        queries = None if order is None else torch.searchsorted(keys, self.positions)
        return subtree_end, queries

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part's rows of a per-position tensor of G ([N_G] -> [n])."""
        return tensor[self.positions.to(tensor.device)]

    def to(self, device) -> "TreePart":
        return TreePart(
            self.tree.to(device), self.positions.to(device),
            None if self.trunk is None else self.trunk.to(device), self.group_tokens.to(device),
            self.group, self.index, self.num_parts, self.num_real, self.max_depth,
        )


class _AddTrunkGrads(torch.autograd.Function):
    """Identity on a trunk layer's keys and values; backward adds the gradients the branches left
    on their copies (:class:`TrunkKeyValues`)."""

    @staticmethod
    def forward(ctx, key, value, store, layer):
        ctx.store, ctx.layer = store, layer
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        key, value = ctx.store.saved[ctx.layer]
        if key.grad is not None:
            grad_key = grad_key + key.grad
        if value.grad is not None:
            grad_value = grad_value + value.grad
        return grad_key, grad_value, None, None


class TrunkKeyValues:
    """Every layer's keys and values of one trunk forward, for its branches.

    The trunk's attention calls :meth:`record`; each branch's calls :meth:`extend`. The stored
    copies are leaves (requiring grad when grad is on), so the branches' backward passes accumulate
    the gradients with respect to the trunk's keys and values on them, and the trunk's backward
    picks them up where the keys and values were made. A recomputed trunk forward (activation
    recompute) finds its layer stored and keeps the first copy.

    Memory: 2 x L x [n_t, b, ng, hn] (plus as much for the gradients).

    Args:
        requires_grad: the copies collect gradients (a training step). Decided here, not from the
            keys: under activation recompute the trunk's first forward runs without grad.
    """

    def __init__(self, requires_grad: bool):
        self.requires_grad = requires_grad
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk's keys/values [n_t, b, ng, hn] of ``layer``: stored, returned unchanged."""
        if layer not in self.saved:
            self.saved[layer] = tuple(t.detach().requires_grad_(self.requires_grad) for t in (key, value))
        return _AddTrunkGrads.apply(key, value, self, layer)

    def extend(self, key: torch.Tensor, value: torch.Tensor, layer: int, order: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A branch's keys/values [n, b, ng, hn] -> [trunk ; own] in context order [K, b, ng, hn]."""
        if layer not in self.saved:
            raise ValueError(
                f"layer {layer}: no trunk keys and values recorded; a trunk group's micro-batches must run "
                "in order, trunk first (tree_forward_backward does this)"
            )
        trunk_key, trunk_value = self.saved[layer]
        order = order.to(key.device)
        return (torch.cat([trunk_key, key]).index_select(0, order),
                torch.cat([trunk_value, value]).index_select(0, order))

    def clear(self) -> None:
        self.saved.clear()


def part_attention_mask(part: TreePart, store: TrunkKeyValues) -> TreeMask:
    """The ``attention_mask`` for one part's forward: its context's encoding, its rows as queries,
    and the hook that records (trunk) or prepends (branch) the trunk's keys and values.
    The plan's ``rotary_length`` tells the model how deep the rotary table must reach."""
    subtree_end, queries = part.mask_inputs()
    _, order = part.context
    if part.is_trunk:
        hook = store.record
    else:
        hook = functools.partial(store.extend, order=order)
    plan = TreeMaskPlan(subtree_end[None], query_positions=queries, keys_values=hook)
    plan.rotary_length = part.max_depth + 1
    return TreeMask(subtree_end, plan)


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def plan_trunk(subtree_end: torch.Tensor, parent_index: torch.Tensor, num_nodes: int, capacity: int
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


def first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, first-fit-decreasing."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for b, left in enumerate(room):
            if sizes[i] <= left:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


def _pad_tree(tree: PackedTree, padded_length: int, pad_token_id: int) -> PackedTree:
    n = tree.padded_length
    extra = padded_length - n
    device = tree.input_ids.device
    return PackedTree(
        input_ids=torch.cat([tree.input_ids, torch.full((extra,), pad_token_id, dtype=torch.int64, device=device)]),
        position_ids=torch.cat([tree.position_ids, torch.zeros(extra, dtype=torch.int64, device=device)]),
        subtree_end=torch.cat([tree.subtree_end, padding_subtree_end(n, padded_length, device).to(torch.int32)]),
        parent_index=torch.cat([tree.parent_index, torch.full((extra,), -1, dtype=torch.int64, device=device)]),
        sequence_ids=tree.sequence_ids, cu_seqlens=tree.cu_seqlens, token_index=tree.token_index,
        num_tree_tokens=tree.num_tree_tokens,
    )


def _view(tree: PackedTree, sequences: torch.Tensor) -> tuple[PackedTree, torch.Tensor]:
    """G with only ``sequences`` (indices in G's order) and their tokens' places in G's token order."""
    starts, ends = tree.cu_seqlens[sequences], tree.cu_seqlens[sequences + 1]
    lengths = ends - starts
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=cu[1:])
    tokens = torch.arange(int(cu[-1]), device=lengths.device) - cu[:-1].repeat_interleave(lengths) \
        + starts.repeat_interleave(lengths)
    view = PackedTree(tree.input_ids, tree.position_ids, tree.subtree_end, tree.parent_index,
                      tree.sequence_ids[sequences], cu, tree.token_index[tokens], tree.num_tree_tokens)
    return view, tokens


def split_group(tree: PackedTree, capacity: int, group: int, *, pad_to: callable, pad_token_id: int = 0
                ) -> list[tuple[PackedTree, TreePart]]:
    """Cut a laid-out group (unpadded, every root's trie larger than ``capacity`` with a trunk of at
    most ``capacity`` nodes in all) into its trunk and branch parts.

    Args:
        tree: G without padding (``padded_length == num_tree_tokens``).
        capacity: real rows per micro-batch.
        group: the group's number (kept on its parts).
        pad_to: real rows -> a part's padded rows.

    Returns:
        Per part, trunk first: (the part's view of G with the sequences whose loss it takes, the part).
    """
    num_nodes = tree.num_tree_tokens
    device = tree.input_ids.device
    trunk, pieces = plan_trunk(tree.subtree_end, tree.parent_index, num_nodes, capacity)
    bins = first_fit([end - start for start, end in pieces], capacity)
    bins.sort(key=lambda b: min(b))  # branches in pre-order of their first piece
    rows = [torch.nonzero(trunk).flatten()]
    for b in bins:
        rows.append(torch.cat([torch.arange(*pieces[i], device=device) for i in sorted(b)]))
    padded = [pad_to(len(r)) for r in rows]
    tree = _pad_tree(tree, num_nodes + sum(p - len(r) for p, r in zip(padded, rows)), pad_token_id)
    owner = torch.empty(num_nodes, dtype=torch.int64, device=device)
    positions, next_pad = [], num_nodes
    for i, (r, p) in enumerate(zip(rows, padded)):
        owner[r] = i
        positions.append(torch.cat([r, torch.arange(next_pad, next_pad + p - len(r), device=device)]))
        next_pad += p - len(r)
    last = tree.token_index[tree.cu_seqlens[1:] - 1]
    site = owner[last]  # the part holding each sequence's last token takes its loss
    parts = []
    for i, (pos, r) in enumerate(zip(positions, rows)):
        view, tokens = _view(tree, torch.nonzero(site == i).flatten())
        depth = int(tree.position_ids[r].max()) if len(r) else 0
        part = TreePart(tree, pos, None if i == 0 else positions[0], tokens, group, i, len(rows), len(r), depth)
        parts.append((view, part))
    return parts
