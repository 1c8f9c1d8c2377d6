"""Context parallelism for packed trees: a split of a micro-batch's rows that balances attention
work.

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
parallel group does). Both collectives belong to :class:`~.rows.TreeRows`, which a split returns:
the rows of a trunk-reuse part split the same way, their keys extending the trunk's.

Legend: N padded packed length, cp CP size, n = N / cp rows per rank, u unit, T sequence tokens.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .checks import check_int
from .rows import TreeRows
from .tree import PackedTree

__all__ = ["attention_work", "context_parallel_split", "sequence_split", "split_positions"]

DEFAULT_UNIT = 128


def _default_unit(rows_per_rank: int) -> int:
    return math.gcd(rows_per_rank, DEFAULT_UNIT)


def split_positions(depth: torch.Tensor, cp_size: int, *, unit: int | None = None) -> torch.Tensor:
    """int64 [cp, n]: which of ``depth``'s entries each CP rank holds, ascending within a rank.

    Args:
        depth: int [M], the depths of the rows to split (a tree's ``position_ids``, or a trunk
            part's rows' depths); M must be a multiple of ``cp_size``.
        cp_size: the CP group size.
        unit: entries per unit (consecutive entries stay together); M / cp_size must be a multiple
            of it. Default: gcd(M / cp_size, 128).
    """
    depth = depth.reshape(-1)
    cp_size = check_int("cp_size", cp_size, minimum=1)
    n_total = depth.shape[0]
    if n_total % cp_size:
        raise ValueError(
            f"the packed length {n_total} is not a multiple of the context-parallel size "
            f"{cp_size}; pack with parallel_size a multiple of {cp_size}"
        )
    rows = n_total // cp_size
    unit = _default_unit(rows) if unit is None else check_int("unit", unit, minimum=1)
    if rows % unit:
        raise ValueError(
            f"unit={unit} must divide the {rows} rows each of the {cp_size} ranks holds"
        )
    num_units = n_total // unit
    work = (depth.to(torch.int64) + 1).view(num_units, unit).sum(dim=1)  # [M / u]
    order = torch.argsort(-work, stable=True)
    turn = torch.arange(num_units, device=depth.device)
    lap, seat = turn // cp_size, turn % cp_size
    owner = torch.empty_like(order)
    owner[order] = torch.where(lap % 2 == 0, seat, cp_size - 1 - seat)
    # Units grouped by owner, ascending within each: [cp, units per rank].
    units = torch.argsort(owner * num_units + torch.arange(num_units, device=depth.device)).view(
        cp_size, -1
    )
    offsets = torch.arange(unit, device=depth.device)
    return (units[:, :, None] * unit + offsets).reshape(cp_size, rows)


def context_parallel_split(
    rows: PackedTree | TreeRows,
    cp_size: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    *,
    unit: int | None = None,
) -> TreeRows:
    """Split a micro-batch's rows across ``cp_size`` ranks with balanced attention work.

    Args:
        rows: a :class:`PackedTree` (all its positions) or a micro-batch's :class:`TreeRows`
            (a trunk-reuse part's rows split the same way; its keys still extend the trunk's).
        cp_size: the CP group size; the row count must be a multiple of it.
        rank: this process's rank in the CP group.
        group: the CP process group, kept on the rows for the collectives.
        unit: rows per unit (consecutive rows stay together); rows / cp_size must be a multiple
            of it. Default: gcd(rows / cp_size, 128).

    Returns:
        :class:`TreeRows` of this rank (positions on the device of the tree).
    """
    if isinstance(rows, PackedTree):
        rows = TreeRows.whole(rows, chains=False)  # a CP rank's rows run the tree kernel
    if rows.cp_positions is not None:
        raise ValueError("these rows are already split across context-parallel ranks")
    rank = check_int("rank", rank, minimum=0)
    if rank >= cp_size:
        raise ValueError(f"rank={rank} must be below cp_size={cp_size}")
    depth = rows.tree.position_ids[rows.positions.to(rows.tree.position_ids.device)]
    index = split_positions(depth, cp_size, unit=unit)
    return rows.with_cp(rows.positions[index.to(rows.positions.device)], rank, group)


def sequence_split(
    rows: PackedTree | TreeRows, cp_size: int, rank: int, group: dist.ProcessGroup | None = None
) -> TreeRows:
    """The rows of rank ``rank`` in a contiguous split: rank r holds rows ``r n : (r + 1) n``.

    This is the split of Ulysses-style sequence parallelism (AReaL's Archon engine), where an
    all-to-all gives each rank's attention every row, in rank order, for a share of the heads:
    attention work is balanced by the heads, so the rows need not be. The per-token outputs
    complete over the CP group as in :func:`context_parallel_split`'s split.

    Args:
        rows: a whole tree (a :class:`PackedTree` or its whole :class:`TreeRows`); its row count
            must be a multiple of ``cp_size``.
        cp_size, rank, group: the group's size, this rank in it, the group.
    """
    if isinstance(rows, PackedTree):
        rows = TreeRows.whole(rows, chains=False)
    if not rows.is_whole:
        raise ValueError("sequence_split splits a whole tree's rows (no trunk part, no CP split)")
    rank = check_int("rank", rank, minimum=0)
    if rank >= cp_size:
        raise ValueError(f"rank={rank} must be below cp_size={cp_size}")
    if rows.num_rows % cp_size:
        raise ValueError(
            f"{rows.num_rows} rows do not split into cp_size={cp_size} equal slices: pack with "
            f"the packed length a multiple of {cp_size} (build_packed_tree_batch's parallel_size)"
        )
    return rows.with_cp(rows.positions.reshape(cp_size, -1), rank, group)


def attention_work(
    depth: PackedTree | torch.Tensor, positions: TreeRows | torch.Tensor
) -> torch.Tensor:
    """int64 [cp]: attention pairs (query, visible key) of each rank's rows.

    Args:
        depth: a :class:`PackedTree`, or the depths int [M] that ``positions`` index.
        positions: a split's :class:`TreeRows`, or int64 [cp, n] (:func:`split_positions`).
    """
    depth = depth.position_ids if isinstance(depth, PackedTree) else depth.reshape(-1)
    if isinstance(positions, TreeRows):
        positions = positions.cp_positions
    return (depth.to(torch.int64) + 1)[positions.to(depth.device)].sum(dim=1)
