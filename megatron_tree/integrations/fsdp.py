"""Data-parallel trees for HF models under FSDP2 (or DDP): each rank packs its share of a batch.

Every data-parallel rank holds the same global rollout batch; :func:`pack_rank_share` splits it
with :func:`~megatron_tree.core.partition.partition_for_data_parallel` (prompt groups whole, ranks'
FLOP costs balanced), packs this rank's samples into trees and gives every rank the same number of
micro-batches (all-padding fill-ins), which FSDP2 needs: each forward of a sharded layer is an
all-gather that every rank must join. The model side is
:func:`megatron_tree.integrations.transformers.packed_logprobs` on a model made by ``prepare_model``
and then ``fully_shard``.

What does not run here: trunk reuse (``share_trunks``: the HF engine runs whole trees) and
Ulysses sequence parallelism (heads all-to-all across ranks; a tree's attention is not split).
Legend: B global batch size, B_r this rank's samples, L padded length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.batch import PackedTreeBatch
from ..core.flops import GPTShape
from ..core.packing import build_packed_tree_batch
from ..core.partition import partition_for_data_parallel
from .common import refuse_ulysses


@dataclass(frozen=True)
class RankShare:
    """One data-parallel rank's part of a global batch.

    Attributes:
        indices: int64 [B_r], the global sample indices this rank holds, ascending; row i of
            ``batch``'s results is sample ``indices[i]``.
        batch: those samples packed into trees (as many micro-batches as every other rank).
        parts: every rank's indices (the partition, identical on all ranks).
    """

    indices: torch.Tensor
    batch: PackedTreeBatch
    parts: tuple[torch.Tensor, ...]


def _select(data: dict[str, Any], indices: torch.Tensor, batch_size: int) -> dict[str, Any]:
    """The samples ``indices`` of every entry of ``data`` ([B, ...] tensors or lists of B)."""
    out = {}
    for name, value in data.items():
        if isinstance(value, (list, tuple)) and len(value) == batch_size:
            out[name] = [value[i] for i in indices.tolist()]
        elif isinstance(value, torch.Tensor) and not value.is_nested and value.dim() >= 1:
            if value.shape[0] != batch_size:
                raise ValueError(
                    f"data[{name!r}] has {value.shape[0]} rows, input_ids {batch_size}: give every "
                    "entry one row per sample ([B, L] right-padded, or a list of B sequences)"
                )
            out[name] = value[indices]
        else:
            raise ValueError(
                f"data[{name!r}] must be a [B, ...] tensor or a list of B per-sample tensors; "
                "nested and THD layouts: split them per sample first"
            )
    return out


def pack_rank_share(
    data: dict[str, Any],
    *,
    max_tokens_per_mb: int,
    dp_group: dist.ProcessGroup | None = None,
    groups: Any = None,
    cost_model: GPTShape | None = None,
    share_trunks: bool = False,
    ulysses_sequence_parallel_size: int = 1,
    **packing: Any,
) -> RankShare:
    """Partition a global batch across the data-parallel ranks and pack this rank's share.

    Args:
        data: the global batch, the same on every rank: ``input_ids`` [B, L] with
            ``attention_mask`` [B, L] (right-padded) and other per-token tensors [B, L, ...], or
            ``input_ids`` a list of B 1-D sequences (extras lists of B as well).
        max_tokens_per_mb: unique-token capacity of one tree.
        dp_group: the data-parallel group (FSDP2's mesh group); None: the default world.
        groups: a label per sample (a prompt ``uid``): samples with one label go to one rank.
            None: the partitioner cuts tries where that balances the ranks better.
        cost_model: the FLOP model that balances ranks (and reports tree costs).
        share_trunks: must stay False (the HF engine runs whole trees).
        ulysses_sequence_parallel_size: must stay 1 (no Ulysses sequence parallelism).
        packing: other :func:`~megatron_tree.core.packing.build_packed_tree_batch` arguments
            (``block_size``, ``vocab_size``, ``pad_token_id``, ...).

    Returns:
        :class:`RankShare`: this rank's indices [B_r] and packed batch, every rank's indices.
    """
    if share_trunks:
        raise ValueError(
            "share_trunks=True: the HF engine (packed_logprobs) runs whole trees; trunk reuse runs "
            "on the Megatron path (tree_forward_backward) only. Pass share_trunks=False"
        )
    refuse_ulysses("ulysses_sequence_parallel_size", ulysses_sequence_parallel_size)
    rank = dist.get_rank(dp_group)
    size = dist.get_world_size(dp_group)
    ids = data["input_ids"]
    batch_size = len(ids) if isinstance(ids, (list, tuple)) else ids.shape[0]
    parts = partition_for_data_parallel(data, size, groups=groups, cost_model=cost_model)
    indices = parts[rank]
    mine = _select(data, indices, batch_size)
    batch = build_packed_tree_batch(
        mine,
        max_tokens_per_mb=max_tokens_per_mb,
        dp_group=dp_group if dp_group is not None else dist.group.WORLD,
        cost_model=cost_model,
        share_trunks=False,
        **packing,
    )
    return RankShare(indices=indices, batch=batch, parts=tuple(parts))
