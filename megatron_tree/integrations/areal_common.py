"""What AReaL's Megatron and FSDP tree engines share, with no Megatron import: the micro-batch
list AReaL's reordering reads, the head outputs its losses read, a micro-batch in AReaL's packed 1-D
layout and the version check."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from areal.utils.data import MicroBatchList

from ..core.batch import PackedTreeBatch

logger = logging.getLogger(__name__)

TESTED_VERSIONS = ("1.0.4",)


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
