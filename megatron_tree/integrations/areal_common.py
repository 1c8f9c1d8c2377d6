"""What AReaL's Megatron and FSDP tree engines share, with no Megatron import: the micro-batch
list AReaL's reordering reads, the head outputs its losses read, a micro-batch in AReaL's packed 1-D
layout and the version check."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from areal.utils import stats_tracker
from areal.utils.data import MicroBatchList

from ..core.batch import PackedTreeBatch

logger = logging.getLogger(__name__)

TESTED_VERSIONS = ("1.0.4",)


class TreeEngineSwitch:
    """What both AReaL tree engines (Megatron, FSDP) hold: the settings, class level, overridable
    per instance (``tree_backend``: the attention backend; ``tree_block_size``: attention tile and
    packing alignment; ``tree_share_prefixes``: False packs every sequence as its own chain, the
    unshared baseline on the same kernels; ``tree_stats``: the last batch's packing), and the
    switch: AReaL's own tree path (its attention patch, packing, gathers and refusals) stays off,
    ours runs where the config asks for trees (``tree_training``)."""

    tree_backend = "auto"
    tree_block_size = 128
    tree_share_prefixes = True
    tree_stats: dict | None = None

    def __init__(self, config):
        super().__init__(config)
        self.tree_training = bool(self.enable_tree_training)
        self.enable_tree_training = False
        self._head_outputs: tuple[str, ...] | None = None


@dataclass
class TreeMicroBatchList(MicroBatchList):
    """AReaL's ``MicroBatchList`` of a packed batch: ``mbs[i]`` is micro-batch i's sequences in
    AReaL's packed 1-D layout (what its loss functions read), ``packed`` this rank's rows of the
    trees. ``forward_indices`` lists the sequences in micro-batch order, so AReaL's own
    ``reorder_and_pad_outputs`` gives results back as ``[B, L]``."""

    packed: PackedTreeBatch | None = None

    def to(self, *args, **kwargs) -> TreeMicroBatchList:
        moved = super().to(*args, **kwargs)
        fields = {f: getattr(moved, f) for f in moved.__dataclass_fields__ if f != "packed"}
        return TreeMicroBatchList(**fields, packed=self.packed.to(*args, **kwargs))


class TreeHeadOutputs(dict):
    """A micro-batch's per-token head outputs {name: [T]} (``logprobs``, ``entropy``,
    ``vocab_min``, ``vocab_max`` or ``values``): what AReaL's loss and result functions read in
    place of the model output when the engine trains with trees."""


def areal_micro_batch(mb, per_sequence: dict, batch_size: int) -> dict:
    """Micro-batch ``mb``'s sequences in AReaL's packed 1-D layout: ``input_ids`` [T],
    ``cu_seqlens`` int32 [S + 1], ``max_seqlen``, the per-token inputs [T, ...] (from the packer,
    in the tree's sequence order), per-sequence tensors [B, ...] at its sequences, the rest as
    is."""
    tree = mb.tree
    lengths = tree.cu_seqlens.diff()
    result = {
        "input_ids": tree.input_ids[tree.token_index],
        "cu_seqlens": tree.cu_seqlens.to(torch.int32),
        "max_seqlen": int(lengths.max()) if tree.num_sequences else 0,
        **mb.inputs,
    }
    ids = tree.sequence_ids.to(torch.long)
    for k, v in per_sequence.items():
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch_size:
            result[k] = v[ids.to(v.device)]
        else:
            result[k] = v
    return result


def check_version() -> None:
    import areal

    version = getattr(areal, "__version__", None)
    if version is None:
        from areal.version import __version__ as version
    if version not in TESTED_VERSIONS:
        logger.warning(
            "megatron_tree: AReaL %s; the tree engine is tested with AReaL %s (it replaces "
            "MegatronEngine's _prepare_mb_list, forward_backward_batch, _compute_logprobs_and_loss "
            "and _compute_forward_result: check that they have the same signatures)",
            version,
            ", ".join(TESTED_VERSIONS),
        )


def split_inputs(input_: dict[str, Any]) -> tuple[dict, dict]:
    """AReaL's padded batch -> (per-token inputs [B, L, ...] the packer carries in tree layout,
    everything else but ``input_ids`` / ``attention_mask``, handed on per sequence)."""
    shape = tuple(input_["input_ids"].shape)
    per_token = {
        k: v
        for k, v in input_.items()
        if k not in ("input_ids", "attention_mask")
        and isinstance(v, torch.Tensor)
        and tuple(v.shape[:2]) == shape
    }
    per_sequence = {
        k: v
        for k, v in input_.items()
        if k not in per_token and k not in ("input_ids", "attention_mask")
    }
    return per_token, per_sequence


def tree_micro_batch_list(
    input_: dict[str, Any], packed: PackedTreeBatch, per_sequence: dict, mb_spec, rows=None
) -> TreeMicroBatchList:
    """The :class:`TreeMicroBatchList` of a packed batch: AReaL's layout of each micro-batch, its
    sequences' order (``forward_indices``) and the rows this rank computes (``rows``: the batch
    split for context parallelism; default ``packed``)."""
    batch_size = input_["input_ids"].shape[0]
    mbs = [areal_micro_batch(mb, per_sequence, batch_size) for mb in packed]
    order = [int(i) for mb in packed for i in mb.tree.sequence_ids]
    backward = [0] * len(order)
    for position, sequence in enumerate(order):
        backward[sequence] = position
    lengths = [mb.rows.num_rows * mb.rows.cp_size for mb in packed]
    return TreeMicroBatchList(
        data=input_,
        mb_spec=mb_spec,
        mbs=mbs,
        group_lens=[mb.tree.num_tree_tokens for mb in packed],
        forward_indices=order,
        backward_indices=backward,
        padded_mbs=mbs,
        padding_lengths=[n - mb.tree.num_tree_tokens for n, mb in zip(lengths, packed)],
        padded_to_lengths=lengths,
        packed=packed if rows is None else rows,
    )


def tree_capacity(tokens: int | None, unit: int, why: str) -> int:
    """``mb_spec.max_tokens_per_mb`` (a tree's unique tokens) rounded up to a multiple of ``unit``
    (logged, with ``why`` the unit is what it is)."""
    if tokens is None:
        raise ValueError(
            "tree micro-batches need a token capacity: set mb_spec.max_tokens_per_mb (the "
            "unique tokens of one tree)"
        )
    capacity = -(-int(tokens) // unit) * unit
    if capacity != tokens:
        logger.info(
            "megatron_tree: max_tokens_per_mb=%d rounded up to %d (%s)", tokens, capacity, why
        )
    return capacity


def report_packing(packed: PackedTreeBatch) -> dict:
    """A packed batch's statistics (logged, and the tree-token ratio to AReaL's stats tracker)."""
    stats_tracker.scalar(tree_token_ratio=packed.tree_token_ratio)
    logger.info("megatron_tree: %s", packed.summary_line())
    return packed.summary()
