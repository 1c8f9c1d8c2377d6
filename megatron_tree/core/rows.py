"""The rows of a tree that one micro-batch computes on one rank, and how its keys, values and
per-token outputs are completed.

A micro-batch computes some positions of a packed tree (its *rows*) and attends to a superset of
them (its *keys*). One type, :class:`TreeRows`, describes every case:

* the whole tree: rows = keys = every position;
* a context-parallel (CP) rank's share of it (:func:`~.context_parallel.context_parallel_split`):
  the keys are every CP rank's rows, all-gathered in forward (gradients reduce-scattered in
  backward); per-token outputs are summed over the CP group;
* a part of a trunk group's tree G (:func:`~.trunk.split_group`): the keys are the keys that the
  group's earlier trunk parts *recorded* (a :class:`KeyValueStore`) followed by its own; a trunk
  part records its keys for the parts after it; per-token outputs are completed by the trunk
  parts' (the step adds them);
* a part split across CP ranks: both.

The keys a micro-batch's attention sees are [stored ; own] (own = its rows in ascending order, all
CP ranks' rows after the all-gather), put in ascending position order by one ``index_select``
(``key_order``); a trunk part records its own keys, so what later parts read is in the order of
its rows.
That *context* is ancestor-closed for every row, so the tree mask restricted to it is again an O(N)
``subtree_end`` encoding (:meth:`TreeRows.encoding`), read off the tree's by one ``searchsorted``.

Every host fact (row counts, rotary reach, the part's place in its group) is set when the rows are
built, at packing or once per micro-batch before the step, so no forward reads one off the device.

Legend: N positions of the tree (padding included), n rows of this rank, cp CP size, K keys,
T_G tokens of the group's sequences, L layers, b micro-batch size, ng key/value heads, hn head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .tree import PackedTree

__all__ = ["KeyValueStore", "TreeRows"]


@dataclass(frozen=True, eq=False)
class TreeRows:
    """A micro-batch's rows of a tree on this rank; its keys a superset of them.

    Attributes:
        tree: the tree whose positions these are (for a trunk part, the group's tree G with every
            sequence of the group).
        positions: int64 [n], this rank's rows, ascending.
        num_real: real (non-padding) rows among ``positions``.
        reach: the deepest row's depth + 1 (how far a rotary table must reach).
        cp_positions: int64 [cp, n], every CP rank's rows (row ``cp_rank`` is ``positions``);
            None without context parallelism.
        cp_rank, cp_group: this rank and the CP group (None only for single-process checks).
        stored: int64 [n_s], positions of the keys recorded by the group's earlier trunk parts,
            in the store's order; None when the micro-batch extends no stored keys.
        stored_parts: how many recorded parts ``stored`` concatenates.
        records: this micro-batch records its keys and values for the parts after it (a trunk part).
        group, index, num_parts: the trunk group's number in its batch, this part's index in it
            (trunk parts first) and the group's micro-batches; group None outside a trunk group.
        group_tokens: int64 [t], places in G's token order (``tree.token_index``) of the tokens of
            the sequences whose loss this part takes; None outside a trunk group.
        pair_offsets: n + 1 host ints, entry r the tree's predicted (non-root) nodes whose parent
            is one of the first r rows (the log-prob gather's chunk bounds without a device read);
            empty when not computed.
        chains: host ints, when the rows are a whole tree whose sequences share no token: the
            sequences' lengths in packed order (each a chain, so its attention is plain causal
            attention; the positions after them are padding). None otherwise.
    """

    tree: PackedTree
    positions: torch.Tensor
    num_real: int
    reach: int
    cp_positions: torch.Tensor | None = None
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    stored: torch.Tensor | None = None
    stored_parts: int = 0
    records: bool = False
    group: int | None = None
    index: int = 0
    num_parts: int = 1
    group_tokens: torch.Tensor | None = None
    pair_offsets: tuple[int, ...] = ()
    chains: tuple[int, ...] | None = None

    @classmethod
    def whole(cls, tree: PackedTree, *, chains: bool = True) -> TreeRows:
        """Every position of ``tree`` (host facts read once, here). ``chains=False`` skips the
        chain lengths (a read only the attention uses) for rows that never reach a model."""
        n = tree.padded_length
        reach = int(tree.position_ids.max()) + 1 if n else 1
        positions = torch.arange(n, device=tree.input_ids.device)
        return cls(
            tree,
            positions,
            tree.num_tree_tokens,
            reach,
            pair_offsets=pair_offsets(tree, positions),
            chains=chain_lengths(tree) if chains else None,
        )

    # -- shape ---------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """n, this rank's rows."""
        return int(self.positions.shape[0])

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_positions is None else int(self.cp_positions.shape[0])

    @property
    def num_keys(self) -> int:
        """K: stored keys plus every CP rank's rows."""
        stored = 0 if self.stored is None else int(self.stored.shape[0])
        return stored + self.num_rows * self.cp_size

    @property
    def is_whole(self) -> bool:
        """Rows and keys are all of the tree's positions (no CP split, no trunk part)."""
        return (
            self.cp_positions is None
            and self.stored is None
            and self.num_rows == self.tree.padded_length
        )

    @property
    def is_trunk(self) -> bool:
        """A trunk part of a group (it records its keys for the parts after it)."""
        return self.records

    @property
    def ends_group(self) -> bool:
        return self.group is not None and self.index == self.num_parts - 1

    @property
    def local_positions(self) -> torch.Tensor:
        """int64 [n]: this rank's rows (``positions``)."""
        return self.positions

    # -- index maps ----------------------------------------------------------------------------

    @functools.cached_property
    def local_index(self) -> torch.Tensor:
        """int64 [N]: this rank's row of each position of the tree, -1 where it holds none."""
        return _local_index(self.tree.padded_length, self.positions)

    def local(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's rows of a per-position tensor ([..., N, ...] along ``dim`` -> n)."""
        if self.is_whole:
            return tensor
        return tensor.index_select(dim, self.positions.to(tensor.device))

    @functools.cached_property
    def _context(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(positions of the keys, ascending [K]; the order turning every CP rank's rows, gathered
        in rank order, into ascending order [cp * n] (None without CP); the order turning
        [stored ; own ascending] into ascending order [K] (None when nothing is stored))."""
        if self.is_whole:
            return self.positions, None, None
        own, own_order = self.positions, None
        if self.cp_positions is not None:
            own_order = torch.argsort(self.cp_positions.reshape(-1))
            own = self.cp_positions.reshape(-1)[own_order]
        if self.stored is None:
            return own, own_order, None
        both = torch.cat([self.stored, own])
        order = torch.argsort(both)
        return both[order], own_order, order

    @property
    def key_positions(self) -> torch.Tensor:
        """int64 [K]: the tree positions of the keys, ascending."""
        return self._context[0]

    @property
    def key_order(self) -> torch.Tensor | None:
        """int64 [K]: row of [stored ; own] holding each key in ascending order (None: identity)."""
        return self._context[2]

    @functools.cached_property
    def _encoding(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.is_whole:
            return self.tree.subtree_end, None
        keys = self.key_positions
        if self.num_keys == self.tree.padded_length:  # all positions: the tree's own encoding
            subtree_end = self.tree.subtree_end
        else:
            # For keys k <= q of the context, k is an ancestor of q iff q < subtree_end[k], iff q's
            # place in the context is below the number of keys under subtree_end[k].
            ends = self.tree.subtree_end.to(torch.int64)[keys]
            subtree_end = torch.searchsorted(keys, ends).to(torch.int32)
        return subtree_end, torch.searchsorted(keys, self.positions)

    def encoding(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``subtree_end`` int32 [K] of the tree restricted to the keys, in key coordinates; the
        rows' places among the keys int64 [n], None when rows and keys are the same)."""
        return self._encoding

    # -- constructors of related rows ------------------------------------------------------------

    def with_cp(self, cp_positions: torch.Tensor, cp_rank: int, cp_group) -> TreeRows:
        """These rows split across CP ranks: ``cp_positions`` [cp, n / cp] (tree positions, each
        rank's ascending, together exactly ``positions``); host facts recomputed once, here."""
        mine = cp_positions[cp_rank]
        depth = self.tree.position_ids[mine.to(self.tree.position_ids.device)]
        return replace(
            self,
            positions=mine,
            cp_positions=cp_positions,
            cp_rank=cp_rank,
            cp_group=cp_group,
            num_real=int((mine < self.tree.num_tree_tokens).sum()),
            reach=int(depth.max()) + 1 if len(mine) else 1,
            pair_offsets=pair_offsets(self.tree, mine),
            chains=None,  # a CP rank's rows attend to other ranks' keys: the tree kernel
        )

    def to(self, device, tree: PackedTree | None = None) -> TreeRows:
        """A copy on ``device``; pass ``tree`` (already moved) so that a group's tree moves once."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            tree=self.tree.to(device) if tree is None else tree,
            positions=move(self.positions),
            cp_positions=move(self.cp_positions),
            stored=move(self.stored),
            group_tokens=move(self.group_tokens),
        )

    # -- keys, values and outputs ----------------------------------------------------------------

    def keys_values(
        self, key: torch.Tensor, value: torch.Tensor, layer: int, store: KeyValueStore | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's keys/values [n, b, ng, hn] -> the context's [K, b, ng, hn]: all-gather
        over the CP group, record for later parts, prepend the stored keys, put in key order. Any
        per-row pair [n, ...] works the same way (a gated delta-net passes its convolution input
        and gate logits, [n, b, d1] and [n, b, d2])."""
        if self.is_whole:
            return key, value
        both = torch.cat([key, value], dim=-1)
        if self.cp_positions is not None:  # every rank's rows, then in ascending order
            both = _GatherRows.apply(both, self.cp_group)
            both = both.index_select(0, self._context[1].to(both.device))
        if self.records or self.stored is not None:
            if store is None:
                raise ValueError(
                    "a trunk group's micro-batch needs the step's KeyValueStore: build its mask "
                    "with tree_attention_mask(rows, store=store) (tree_forward_backward does this)"
                )
            if self.records:
                both = store.record(both, self.index, layer)
            if self.stored is not None:
                both = torch.cat([*store.recorded(layer, self.stored_parts), both])
        if self.key_order is not None:
            both = both.index_select(0, self.key_order.to(both.device))
        return both.split([key.shape[-1], value.shape[-1]], dim=-1)

    def complete(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-token outputs [t] this rank computed (0 at entries of other ranks' rows) -> complete
        over the CP group (one all-reduce; backward the identity). A trunk group's parts are then
        completed by the step with the trunk parts' outputs."""
        if self.cp_positions is None:
            return outputs
        return list(_SumOwned.apply(torch.stack(outputs), self.cp_group).unbind(0))


def _local_index(num_positions: int, positions: torch.Tensor) -> torch.Tensor:
    """int64 [num_positions]: the row of each position among ``positions``, -1 where absent."""
    index = torch.full((num_positions,), -1, dtype=torch.int64, device=positions.device)
    index[positions] = torch.arange(positions.shape[0], device=positions.device)
    return index


def chain_lengths(tree: PackedTree) -> tuple[int, ...] | None:
    """The sequences' lengths in packed order when ``tree`` shares no token between them, else
    None (host ints; one device read, and only for such trees).

    A position with two children, or one that ends a sequence and continues another, lies in two
    sequences, so the tree has fewer unique tokens than sequence tokens; with as many, and every
    sequence token at its own position in order (``token_index`` the identity: not so for a view of
    some of a group's sequences), every sequence is a chain of its own, laid out contiguously.
    """
    count = tree.num_tree_tokens
    if count != tree.num_sequence_tokens:
        return None
    identity = torch.arange(count, device=tree.token_index.device)
    if not torch.equal(tree.token_index, identity):
        return None
    return tuple(length for length in tree.sequence_lengths.tolist() if length)


def pair_offsets(tree: PackedTree, positions: torch.Tensor) -> tuple[int, ...]:
    """Host prefix counts [n + 1]: entry r is the number of ``tree``'s predicted (non-root) nodes
    whose parent is one of ``positions[:r]`` (``positions`` ascending). One host read, at
    packing."""
    n = positions.shape[0]
    parent = tree.parent_index[: tree.num_tree_tokens]
    rows = _local_index(tree.padded_length, positions)[parent[parent >= 0].to(positions.device)]
    counts = torch.bincount(rows[rows >= 0], minlength=n)
    return (0, *torch.cumsum(counts, 0).tolist())


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, tensor, group=group)


def _reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, tensor, group=group)


class _GatherRows(torch.autograd.Function):
    """[n, ...] on each rank -> [cp * n, ...] in rank order; backward sums the gradients and
    returns each rank its own rows (reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.contiguous()
        out = tensor.new_empty((dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:]))
        _all_gather(out, tensor, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter(out, grad, ctx.group)
        return out, None


class _SumOwned(torch.autograd.Function):
    """Entries each computed by exactly one rank (zeros elsewhere) -> all of them on every rank.
    Backward is the identity: a rank's gradient reaches only the entries it computed."""

    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---------------------------------------------------------------------------------------------
# Trunk parts' keys and values
# ---------------------------------------------------------------------------------------------


class _AddStoredGrads(torch.autograd.Function):
    """Identity on a trunk part's keys/values; backward adds the gradients that later parts left on
    the stored copy (:class:`KeyValueStore`)."""

    @staticmethod
    def forward(ctx, both, store, key):
        ctx.store, ctx.key = store, key
        return both.view_as(both)

    @staticmethod
    def backward(ctx, grad):
        stored = ctx.store.saved[ctx.key]
        if stored.grad is not None:
            grad = grad + stored.grad
        return grad, None, None


class KeyValueStore:
    """Every layer's keys and values of a trunk group's trunk parts, for the parts after them.

    A trunk part's attention calls :meth:`record` (after any CP all-gather, so the stored copy is
    the part's whole keys); every later part of the group reads :meth:`recorded`. The stored copies
    are leaves (requiring grad in a training step), so the later parts' backward passes accumulate
    the gradients with respect to the trunk's keys and values on them, and the trunk part's own
    backward (which must run after theirs) picks them up where the keys and values were made. A
    recomputed forward (activation recompute) finds its layer stored and keeps the first copy.

    It also holds what a layer must sum over the whole group rather than one micro-batch (an MoE
    router's expert counts and token weight, so that its load-balancing loss is the group's as if
    unpacked): ``collecting`` is set during a first no-grad pass over every part, in which layers
    :meth:`add_stats`; the later passes read ``layer_stats``.

    Memory: L x [n_t, b, ng, 2 hn] per trunk part (plus as much for the gradients).

    Args:
        requires_grad: the copies collect gradients (a training step). Decided here, not from the
            keys: under activation recompute the first forward runs without grad.
    """

    def __init__(self, requires_grad: bool):
        self.requires_grad = requires_grad
        self.saved: dict[tuple[int, int], torch.Tensor] = {}
        self.collecting = False
        self.layer_stats: dict[int, torch.Tensor] = {}

    def add_stats(self, layer: int, stats: torch.Tensor) -> None:
        """Add one part's statistics of ``layer`` (summed over the group's parts)."""
        self.layer_stats[layer] = (
            stats if layer not in self.layer_stats else self.layer_stats[layer] + stats
        )

    def record(self, both: torch.Tensor, part: int, layer: int) -> torch.Tensor:
        """Part ``part``'s keys/values of ``layer`` [n_t, b, ng, 2 hn]: stored, returned
        unchanged."""
        key = (part, layer)
        if key not in self.saved:
            self.saved[key] = both.detach().requires_grad_(self.requires_grad)
        return _AddStoredGrads.apply(both, self, key)

    def recorded(self, layer: int, num_parts: int) -> list[torch.Tensor]:
        """The stored keys/values of ``layer`` of parts 0 .. num_parts - 1."""
        missing = [p for p in range(num_parts) if (p, layer) not in self.saved]
        if missing:
            raise ValueError(
                f"layer {layer}: no keys and values recorded for trunk parts {missing}; a trunk "
                "group's micro-batches must run in order, trunk parts first "
                "(tree_forward_backward does this)"
            )
        return [self.saved[(p, layer)] for p in range(num_parts)]

    def clear(self) -> None:
        self.saved.clear()
        self.layer_stats.clear()
