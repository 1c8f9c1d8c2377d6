"""What verl's Megatron and FSDP tree engines share, with no Megatron import: the vendor key, the
micro-batch preparation (verl's ``prepare_micro_batches`` with trees, data-parallel fill-ins
included), verl's nested layout and its temperatures.

Legend: B the rank's samples, j a sample's tokens.
"""

from __future__ import annotations

import torch
from verl.utils import tensordict_utils as tu

from ..core.packing import build_packed_tree_batch

VENDOR = "megatron_tree"  # verl's VERL_ENGINE_VENDOR / EngineRegistry vendor key
ROUTE_KEY = "routed_experts"  # verl's per-token routes [B, j, layers, topk]


def tree_micro_batches(
    data,
    *,
    max_tokens: int,
    block_size: int,
    share_trunks: bool = True,
    dp_group=None,
    parallel_size: int = 1,
    pad_to_max: bool = False,
    routes: torch.Tensor | None = None,
) -> tuple[list, list[list[int]], object]:
    """verl's micro-batch preparation with trees.

    Returns: one verl micro-batch per packed micro-batch (the samples whose loss it takes, in the
    tree's order); the batch indices of each micro-batch that takes a loss, which verl's
    ``restore_dynamic_batch`` puts back in order; the
    :class:`~megatron_tree.core.batch.PackedTreeBatch`. With ``share_trunks`` a prompt group larger
    than ``max_tokens`` runs as trunk parts (computed once) and branches. ``dp_group``: every
    data-parallel rank gets as many micro-batches (all-padding fill-ins appended).
    ``parallel_size``: a factor of every packed length (the CP size, times the TP size under
    sequence parallelism); ``pad_to_max``: every tree ``max_tokens`` long (constant shapes).
    ``routes``: per sample, the routes its tokens replay (nested [B, j, layers, topk], -1 where a
    token routes natively): two samples share a tree position only where their routes agree too
    (the packer's ``route_key``).
    """
    inputs = {"input_ids": data["input_ids"]}
    if routes is not None:
        inputs[ROUTE_KEY] = routes
    packed = build_packed_tree_batch(
        inputs,
        route_key=None if routes is None else ROUTE_KEY,
        max_tokens_per_mb=max_tokens,
        block_size=block_size,
        parallel_size=parallel_size,
        pad_to_max=pad_to_max,
        share_trunks=share_trunks,
        dp_group=dp_group,
    )
    micro_batches, indices = [], []
    for mb in packed:
        ids = [int(i) for i in mb.tree.sequence_ids]
        # A micro-batch that takes no loss (an all-padding tree matching other data-parallel ranks'
        # count, a trunk part no sample ends in) carries sample 0 as its verl data (verl cannot hold
        # an empty jagged micro-batch); it adds no output or loss.
        micro_batches.append(
            tu.index_select_tensor_dict(data, torch.tensor(ids or [0], dtype=torch.long))
        )
        if ids:
            indices.append(ids)
    return micro_batches, indices, packed


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample tensors [j, ...] -> verl's nested [b, j, ...] (jagged layout)."""
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def sample_temperatures(data) -> torch.Tensor:
    """The batch's temperature per sample, float32 [B] (verl gives a float or one per sample)."""
    temperature = data["temperature"]
    if not isinstance(temperature, torch.Tensor):
        return torch.full((len(data),), float(temperature))
    return temperature.float()
