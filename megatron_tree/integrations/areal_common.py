"""What AReaL's Megatron and FSDP tree engines share, with no Megatron import: the settings and the
switch, the refusals, the head (its outputs what AReaL's losses read), AReaL's loss and forward
result on them, the micro-batch list AReaL's reordering reads, a micro-batch in AReaL's packed 1-D
layout, the packing report and the version check."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from areal.utils import stats_tracker
from areal.utils.data import MicroBatchList

from ..core.batch import PackedTreeBatch
from ..core.finite import FiniteCheck
from ..core.heads import LogProbs, Values
from ..core.results import gather_packed_tree_vocab_stats
from ..core.rows import TreeRows
from .common import log_packing

logger = logging.getLogger(__name__)

TESTED_VERSIONS = ("1.0.4",)


class TreeEngineSwitch:
    """What both AReaL tree engines (Megatron, FSDP) hold: the settings, class level, overridable
    per instance (``tree_backend``: the attention backend; ``tree_block_size``: attention tile and
    packing alignment; ``tree_share_prefixes``: False packs every sequence as its own chain, the
    unshared baseline on the same kernels; ``tree_stats``: the last batch's packing), and the
    switch: AReaL's own tree path (its attention patch, packing, gathers and refusals) stays off,
    ours runs where the config asks for trees (``tree_training``). Also the engines' one head
    (:meth:`_tree_gather`), AReaL's loss and forward result on its outputs
    (``_compute_logprobs_and_loss``, ``_compute_forward_result``; an engine names its loss
    argument's data in ``_loss_inputs``) and the refusal of vision-language models."""

    tree_backend = "auto"
    tree_block_size = 128
    tree_share_prefixes = True
    tree_stats: dict | None = None

    def __init__(self, config):
        super().__init__(config)
        self.tree_training = bool(self.enable_tree_training)
        self.enable_tree_training = False
        self._head_outputs: tuple[str, ...] | None = None

    def _refuse_vision(self, model_type: str) -> None:
        if self.is_vision_model:
            raise ValueError(
                f"model_type={model_type!r} is a vision-language model, which the tree engine "
                "does not support (its inputs are not token trees): set enable_tree_training=False"
            )

    def _tree_gather(self) -> AReaLGather:
        """The step's head: values (critic) or log-probs at AReaL's temperature with the entropy
        and vocabulary statistics AReaL's loss reads (forward results: log-probs only)."""
        if self.config.is_critic:
            return AReaLGather(Values(), vocab_stats=False)
        outputs = self._head_outputs or ("logprobs", "entropy", "vocab_min", "vocab_max")
        gather = LogProbs(temperature=self.config.temperature, entropy="entropy" in outputs)
        return AReaLGather(gather, vocab_stats="vocab_min" in outputs)

    @contextmanager
    def _outputs(self, names: tuple[str, ...]):
        self._head_outputs = names
        try:
            yield
        finally:
            self._head_outputs = None

    def forward_batch(self, *args, **kwargs):
        # AReaL's forward results are log-probs (or values): no entropy or vocab statistics.
        with self._outputs(("logprobs",)):
            return super().forward_batch(*args, **kwargs)

    @staticmethod
    def _loss_inputs(inputs) -> dict[str, Any]:
        """A micro-batch's data from the engine's loss argument (Megatron's: the data itself)."""
        return inputs

    def _compute_logprobs_and_loss(
        self,
        output,
        inputs,
        loss_fn: Callable[..., torch.Tensor],
        loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor],
        total_loss_weight: torch.Tensor,
        loss_multiplier: float = 1.0,
    ) -> torch.Tensor:
        if not isinstance(output, TreeHeadOutputs):
            return super()._compute_logprobs_and_loss(
                output, inputs, loss_fn, loss_weight_fn, total_loss_weight, loss_multiplier
            )
        inputs = self._loss_inputs(inputs)
        local_weight = loss_weight_fn(inputs)
        if local_weight == 0:  # as AReaL: a zero loss that keeps the outputs in the graph
            return sum(v.sum() for v in output.values() if v.requires_grad) * 0.0
        if self.config.is_critic:
            loss = loss_fn(output["values"], inputs)
        else:
            loss = loss_fn(
                output["logprobs"],
                output["entropy"],
                inputs,
                vocab_min_logits=output["vocab_min"],
                vocab_max_logits=output["vocab_max"],
            )
        return loss * (local_weight / total_loss_weight * loss_multiplier)

    def _compute_forward_result(self, output, inputs):
        if not isinstance(output, TreeHeadOutputs):
            return super()._compute_forward_result(output, inputs)
        return output["values" if self.config.is_critic else "logprobs"]


@dataclass(frozen=True)
class AReaLGather:
    """A core head (``gather``: :class:`~megatron_tree.core.heads.LogProbs` or ``Values``) with the
    vocabulary's min / max logit (no grad) that AReaL's loss reads, when ``vocab_stats``; the
    core heads' protocol (``check_output``, ``gather``)."""

    base: LogProbs | Values
    vocab_stats: bool

    def check_output(self, output: torch.Tensor, tp_group, max_token_id: int) -> None:
        self.base.check_output(output, tp_group, max_token_id)

    def gather(self, output: torch.Tensor, tree, tp_group, rows=None) -> dict:
        outputs = self.base.gather(output, tree, tp_group, rows)
        if self.vocab_stats:
            outputs["vocab_min"], outputs["vocab_max"] = gather_packed_tree_vocab_stats(
                output, tree, tp_group=tp_group, rows=rows
            )
        return outputs


@dataclass
class TreeMicroBatchList(MicroBatchList):
    """AReaL's ``MicroBatchList`` of a packed batch: ``mbs[i]`` is micro-batch i's sequences in
    AReaL's packed 1-D layout (what its loss functions read), ``packed`` this rank's rows of the
    trees. ``forward_indices`` lists the sequences in micro-batch order, so AReaL's own
    ``reorder_and_pad_outputs`` gives results back as ``[B, L]``. ``head_rows``, where set, are
    this rank's rows of each micro-batch when its attention takes every row of ``packed``
    (Ulysses: a contiguous slice, :func:`~megatron_tree.core.context_parallel.sequence_split`)."""

    packed: PackedTreeBatch | None = None
    head_rows: list[TreeRows] | None = None

    def to(self, *args, **kwargs) -> TreeMicroBatchList:
        moved = super().to(*args, **kwargs)
        fields = {
            f: getattr(moved, f)
            for f in moved.__dataclass_fields__
            if f not in ("packed", "head_rows")
        }
        packed = self.packed.to(*args, **kwargs)
        head_rows = None
        if self.head_rows is not None:
            device = packed[0].tree.input_ids.device if len(packed) else None
            head_rows = [r.to(device, tree=mb.tree) for r, mb in zip(self.head_rows, packed)]
        return TreeMicroBatchList(**fields, packed=packed, head_rows=head_rows)


def run_micro_batches(
    engine: str,
    mb_list: TreeMicroBatchList,
    forward: Callable[[int, Any], tuple[torch.Tensor, dict]],
    context: Callable[[dict], dict],
    process_output_fn: Callable,
    *,
    forward_only: bool,
    grad_scale: float = 1.0,
) -> list[torch.Tensor]:
    """The step of AReaL's single-stage engines (FSDP, Archon) on a packed batch: each micro-batch
    through ``forward(i, mb)`` -> (model output, head outputs {name: [T]}), AReaL's
    ``process_output_fn`` on the head outputs and ``context(mbs[i])`` (the engine's train-context
    dict), backward unless ``forward_only``; one finiteness check (``engine`` names the engine in
    its error) before AReaL reads a result or steps. Returns what ``process_output_fn`` returned,
    detached, forward only (Archon's forward results), else []. ``grad_scale`` multiplies each
    loss for its backward only (Ulysses: see the Archon engine).

    A data-parallel fill-in (an all-padding tree, so that every rank runs as many forwards) takes
    a zero loss and gives no result; its attention still gives the query / key projections (zero)
    gradients, so FSDP2 reduce-scatters the same gradients on every rank.
    """
    finite = FiniteCheck(engine)
    results = []
    for i, (mb, data) in enumerate(zip(mb_list.packed, mb_list.mbs)):
        output, outputs = forward(i, mb)
        finite.add(i, mb.tree, outputs)
        if mb.tree.num_sequences == 0:
            if not forward_only:
                (output.sum() * 0.0).backward()
            continue
        loss = process_output_fn(TreeHeadOutputs(outputs), context(data))
        if loss is None:
            continue
        finite.add_loss(i, loss.detach())
        if forward_only:
            results.append(loss.detach())
        else:
            (loss * grad_scale if grad_scale != 1.0 else loss).backward()
    finite.raise_if_any()
    return results if forward_only else []


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
    input_: dict[str, Any],
    packed: PackedTreeBatch,
    per_sequence: dict,
    mb_spec,
    rows=None,
    head_rows: list[TreeRows] | None = None,
) -> TreeMicroBatchList:
    """The :class:`TreeMicroBatchList` of a packed batch: AReaL's layout of each micro-batch, its
    sequences' order (``forward_indices``) and the rows this rank computes (``rows``: the batch
    split for context parallelism; default ``packed``; ``head_rows``: see
    :class:`TreeMicroBatchList`)."""
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
        head_rows=head_rows,
    )


def report_packing(packed: PackedTreeBatch) -> dict:
    """A packed batch's statistics (logged, and the tree-token ratio to AReaL's stats tracker)."""
    stats_tracker.scalar(tree_token_ratio=packed.tree_token_ratio)
    return log_packing(packed)
