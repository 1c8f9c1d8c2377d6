"""Context parallelism for packed trees: a split of the tree's positions that balances attention work,
and the two collectives that make it exact.

A query of a tree attends its ancestors, which may sit anywhere before it, so each context-parallel
(CP) rank computes attention for its own query rows against the keys and values of the whole tree:
the keys and values are all-gathered in forward and their gradients reduce-scattered in backward.
Everything else in a layer is per token, so a rank holds only its rows' activations.

The split: the packed positions are cut into units of ``u`` consecutive positions; each rank gets
``N / (cp * u)`` units. A query at depth d sees d + 1 keys (its ancestors and itself; a padding
position sees itself), so a unit's attention work is the sum of ``position_ids + 1`` over it, O(N)
in total. Units are dealt to ranks in decreasing work, in serpentine order (0, 1, .., cp-1,
cp-1, .., 0, ...), which for a causal chain is Megatron's 2 x CP zigzag and for a tree balances the
deep branches wherever they are. Every rank has the same number of rows, so pipeline stages exchange
fixed shapes.

Per-token outputs (log-probs, values) are computed by the rank holding the row that produces them,
then summed over the CP group so that every rank holds all of them; the backward of that sum is the
identity, so each rank's gradient flows only into its own rows, and the CP ranks' parameter
gradients add up to the full gradient (what Megatron's gradient reduction over the data x context
parallel group does).

Legend: N padded packed length, cp CP size, n = N / cp rows per rank, u unit, T sequence tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .checks import check_int
from .tree import PackedTree

DEFAULT_UNIT = 128


@dataclass(frozen=True, eq=False)
class ContextParallelSplit:
    """Which packed positions each CP rank holds.

    Attributes:
        positions: int64 [cp, n]. Global positions of each rank's rows, ascending within a rank.
        rank: this process's rank in the CP group.
        group: the CP process group (None only for single-process checks of the split itself).
    """

    positions: torch.Tensor
    rank: int
    group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return int(self.positions.shape[0])

    @property
    def local_positions(self) -> torch.Tensor:
        """int64 [n]: the global positions of this rank's rows."""
        return self.positions[self.rank]

    @property
    def num_rows(self) -> int:
        """n, the rows each rank holds."""
        return int(self.positions.shape[1])

    def share(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-token outputs of this rank's rows -> complete on every rank (:func:`share_outputs`)."""
        return share_outputs(outputs, self)

    @functools.cached_property
    def key_order(self) -> torch.Tensor:
        """int64 [N]: row of the rank-ordered all-gather that holds each global position."""
        return torch.argsort(self.positions.reshape(-1))

    @functools.cached_property
    def local_index(self) -> torch.Tensor:
        """int64 [N]: this rank's row of each global position, -1 where another rank holds it."""
        n_total = self.positions.numel()
        index = torch.full((n_total,), -1, dtype=torch.int64, device=self.positions.device)
        local = self.local_positions
        index[local] = torch.arange(local.shape[0], device=local.device)
        return index

    def to(self, device) -> "ContextParallelSplit":
        return ContextParallelSplit(self.positions.to(device), self.rank, self.group)

    def local(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's rows of a per-position tensor ([..., N] along ``dim``)."""
        return tensor.index_select(dim, self.local_positions.to(tensor.device))


def _default_unit(rows_per_rank: int) -> int:
    return math.gcd(rows_per_rank, DEFAULT_UNIT)


def context_parallel_split(
    tree: PackedTree | torch.Tensor,
    cp_size: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    *,
    unit: int | None = None,
) -> ContextParallelSplit:
    """Split a packed tree's positions across ``cp_size`` ranks with balanced attention work.

    Args:
        tree: a :class:`PackedTree`, or its ``position_ids`` (token depths) int [N].
        cp_size: the CP group size; N must be a multiple of it.
        rank: this process's rank in the CP group.
        group: the CP process group, kept on the split for the collectives.
        unit: positions per unit (consecutive positions stay together); N / cp_size must be a
            multiple of it. Default: gcd(N / cp_size, 128).

    Returns:
        A :class:`ContextParallelSplit` (positions on the device of ``tree``).
    """
    depth = tree.position_ids if isinstance(tree, PackedTree) else tree.reshape(-1)
    cp_size = check_int("cp_size", cp_size, minimum=1)
    rank = check_int("rank", rank, minimum=0)
    n_total = depth.shape[0]
    if rank >= cp_size:
        raise ValueError(f"rank={rank} must be below cp_size={cp_size}")
    if n_total % cp_size:
        raise ValueError(
            f"the packed length {n_total} is not a multiple of the context-parallel size {cp_size}; "
            f"pack with parallel_size a multiple of {cp_size}"
        )
    rows = n_total // cp_size
    unit = _default_unit(rows) if unit is None else check_int("unit", unit, minimum=1)
    if rows % unit:
        raise ValueError(f"unit={unit} must divide the {rows} rows each of the {cp_size} ranks holds")
    num_units = n_total // unit
    work = (depth.to(torch.int64) + 1).view(num_units, unit).sum(dim=1)  # [N / u]
    order = torch.argsort(-work, stable=True)
    turn = torch.arange(num_units, device=depth.device)
    lap, seat = turn // cp_size, turn % cp_size
    owner = torch.empty_like(order)
    owner[order] = torch.where(lap % 2 == 0, seat, cp_size - 1 - seat)
    # Units grouped by owner, ascending within each: [cp, units per rank].
    units = torch.argsort(owner * num_units + torch.arange(num_units, device=depth.device)).view(cp_size, -1)
    offsets = torch.arange(unit, device=depth.device)
    positions = (units[:, :, None] * unit + offsets).reshape(cp_size, rows)
    return ContextParallelSplit(positions, rank, group)


def attention_work(tree: PackedTree | torch.Tensor, split: ContextParallelSplit) -> torch.Tensor:
    """int64 [cp]: attention pairs (query, visible key) of each rank's rows under ``split``."""
    depth = tree.position_ids if isinstance(tree, PackedTree) else tree.reshape(-1)
    return (depth.to(torch.int64) + 1)[split.positions.to(depth.device)].sum(dim=1)


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


def gather_keys_values(key: torch.Tensor, value: torch.Tensor, split: ContextParallelSplit
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's keys and values [n, b, ng, hn] -> the whole tree's [N, b, ng, hn], in global
    position order (one all-gather; the backward reduce-scatters their gradients)."""
    both = torch.cat([key, value], dim=-1)
    gathered = _GatherRows.apply(both, split.group)
    gathered = gathered.index_select(0, split.key_order.to(gathered.device))
    return gathered.split([key.shape[-1], value.shape[-1]], dim=-1)


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


def share_outputs(outputs: list[torch.Tensor], split: ContextParallelSplit) -> list[torch.Tensor]:
    """Per-token outputs [T] computed for this rank's rows (0 elsewhere) -> complete on every rank,
    with one all-reduce for all of them."""
    stacked = _SumOwned.apply(torch.stack(outputs), split.group)
    return list(stacked.unbind(0))
