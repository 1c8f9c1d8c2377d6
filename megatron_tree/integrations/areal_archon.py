"""Tree training inside AReaL's Archon engine (AReaL 1.0.x), switched on in two lines of the entry
script, without a line of AReaL changed::

    from areal.experimental.engine import archon_engine
    from megatron_tree.integrations import areal_archon

    archon_engine.ArchonPPOActor = areal_archon.TreeArchonPPOActor
    archon_engine.ArchonPPOCritic = areal_archon.TreeArchonPPOCritic

AReaL's trainer imports the classes from ``archon_engine`` when it builds an engine whose
allocation names ``archon`` (``PPOTrainer._create_train_engine``, ``_create_critic``), so the rest
of the set-up stays as it is: ``actor.enable_tree_training=true``, ``mb_spec.max_tokens_per_mb``,
AReaL's losses, metrics and checkpoints, Archon's own models (``qwen2``, ``qwen3``, ``qwen3_moe``)
and parallelism. With ``enable_tree_training`` off the classes are AReaL's own.

With it on, AReaL's own tree path (its attention wrapper, trie packing and gathers, and its
refusals of critics and of context parallelism) stays off. Each attention module's packed-attention
slot (``Attention.packed_attn``) is a :class:`TreeArchonAttention` over
:func:`~megatron_tree.core.attention.tree_attention`. Micro-batches are the package's tries
(:func:`~megatron_tree.core.packing.build_packed_tree_batch`, ``max_tokens_per_mb`` as the
capacity, every data-parallel rank with as many micro-batches, whole trees). Each one runs through
Archon's model with depth positions, and the package's gathers give AReaL's loss its packed 1-D
layout. Under Ulysses context parallelism (``cp > 1``) each rank runs a contiguous slice of a
micro-batch's rows: Archon's all-to-all hands the attention every row for a share of the heads,
and the gathers sum the per-token outputs over the group. Forward results come back through
AReaL's own reordering as ``[B, L]``.

Pipeline parallelism (``pp > 1``) runs forward only (``compute_logp``, ``compute_values``):
Archon's pipeline runner does not train on this torch (see ``_pipelined``). Refused, each with its
reason: training under pipeline parallelism, pipeline with context parallelism, and models with
recurrent mixers (Qwen3.5's gated delta-net; use the FSDP engine, :mod:`.areal_fsdp`, whose HF
model runs the package's tree modules).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from areal.experimental.engine.archon_engine import (
    ArchonPPOActor,
    ArchonPPOCritic,
    ArchonTrainContext,
)

from ..core.attention import tree_attention
from ..core.context_parallel import sequence_split
from ..core.finite import FiniteCheck
from ..core.mask import TreeMask, tree_attention_mask
from ..core.packing import build_packed_tree_batch
from ..core.tree import subtree_end_of
from .areal_common import (
    TreeEngineSwitch,
    TreeHeadOutputs,
    TreeMicroBatchList,
    check_version,
    report_packing,
    run_micro_batches,
    split_inputs,
    tree_micro_batch_list,
)
from .common import tree_capacity
from .transformers import TreeAttentionOptions

logger = logging.getLogger(__name__)

# Archon module class names whose state runs along the sequence (no packed-attention slot).
_RECURRENT_MARKERS = ("GatedDeltaNet", "Mamba", "LinearAttention")


class TreeArchonAttention(torch.nn.Module):
    """Archon's packed-attention slot (``VarlenAttentionWrapper``'s interface) over the package's
    tree attention (``options``: backend and tile size). It has no parameters, so checkpoints and
    FSDP2 see the same model.

    Archon's model hands every layer its ``tree_attn_meta``: here the micro-batch's
    :class:`~megatron_tree.core.mask.TreeMask` (of every row, also under Ulysses, where attention
    sees them all), or under pipeline parallelism its ``subtree_end`` int [1, n] (a tensor, so
    that torch's pipeline schedule splits it by micro-batch like the other inputs).
    """

    def __init__(self, options: TreeAttentionOptions):
        super().__init__()
        self.options = options

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        tree_attn_meta: TreeMask | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [1, np, n, hn], k [1, ng, n, hn], v [1, ng, n, hv] (rotary applied, Ulysses'
        all-to-all done: every row of the micro-batch) -> [1, np, n, hv]. ``cu_seqlens`` and
        ``max_seqlen`` are the varlen interface's, unused."""
        mask = tree_attn_meta
        if torch.is_tensor(mask) and not isinstance(mask, TreeMask):
            mask = mask.reshape(-1)  # a pipeline stage's subtree_end [1, n]
        elif not isinstance(mask, TreeMask):
            raise ValueError(
                "TreeArchonAttention needs the micro-batch's tree mask as tree_attn_meta: run the "
                "model through TreeArchonPPOActor / TreeArchonPPOCritic (enable_tree_training="
                f"True), got {type(mask).__name__}"
            )
        if q.shape[0] != 1:
            raise ValueError(f"expected one packed row (batch 1), got q of shape {tuple(q.shape)}")
        q, k, v = (t.permute(2, 0, 1, 3) for t in (q, k, v))  # Megatron's [n, 1, h, d]
        out = tree_attention(
            q,
            k,
            v,
            mask,
            backend=self.options.backend,
            softmax_scale=scale,
            block_size=self.options.block_size,
        )
        n, heads = q.shape[0], q.shape[2]
        return out.view(n, 1, heads, v.shape[-1]).permute(1, 2, 0, 3)


def install_tree_attention(model: torch.nn.Module, options: TreeAttentionOptions) -> int:
    """Put a :class:`TreeArchonAttention` in every ``packed_attn`` slot of an Archon model (on the
    meta device, before parallelism); returns how many.

    Raises:
        ValueError: a model with recurrent mixers (named) or without a packed-attention slot.
    """
    recurrent = sorted(
        {type(m).__name__ for m in model.modules() if type(m).__name__.endswith(_RECURRENT_MARKERS)}
    )
    if recurrent:
        raise ValueError(
            f"{type(model).__name__} has recurrent mixers {recurrent}: a packed tree would run "
            "them across branches, and Archon has no tree module for them. Train this model with "
            "tree training on AReaL's FSDP engine (megatron_tree.integrations.areal_fsdp), whose "
            "HF model runs the package's tree gated delta-net"
        )
    slots = [m for m in model.modules() if hasattr(m, "packed_attn")]
    if not slots:
        raise ValueError(f"{type(model).__name__} has no packed_attn slot to run tree attention")
    for module in slots:
        module.packed_attn = TreeArchonAttention(options)
    return len(slots)


def checkpoint_has_value_head(path: str) -> bool:
    """Whether the HF checkpoint at ``path`` holds a value head (a ``score.weight``)."""
    import glob
    import os

    from safetensors import safe_open

    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, framework="pt") as f:
            if any(key.endswith("score.weight") for key in f.keys()):  # noqa: SIM118 (safe_open is not iterable)
                return True
    return False


def init_value_head(model: torch.nn.Module, *, seed: int = 0) -> None:
    """Draw an Archon critic's value head (``model.score``) as Archon's ``init_weights`` does
    (truncated normal, std ``dim ** -0.5``, cut at 3 std), from ``seed``, the same on every rank
    (drawn whole, then each rank keeps its FSDP2 shard)."""
    weight = model.score.weight
    std = weight.shape[-1] ** -0.5
    full = torch.empty(weight.shape, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    torch.nn.init.trunc_normal_(full, std=std, a=-3 * std, b=3 * std, generator=generator)
    with torch.no_grad():
        if hasattr(weight, "device_mesh"):  # a DTensor
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(full, weight.device_mesh, weight.placements).to_local()
            weight.to_local().copy_(local)
        else:
            weight.copy_(full)


class _TreeArchonEngine(TreeEngineSwitch):
    """What the tree engines change in AReaL's Archon engine (see the module docstring).

    The settings are :class:`TreeEngineSwitch`'s.
    """

    # -- build --------------------------------------------------------------------------------

    def initialize(self, addr, ft_spec, *args, **kwargs):
        if self.tree_training:
            check_version()
            dims = self.parallel_dims
            if dims.pp_enabled and dims.cp_enabled:
                raise ValueError(
                    f"pipeline_parallel_size={dims.pp} with context_parallel_size={dims.cp}: the "
                    "Archon tree engine runs one or the other (its pipeline stages take whole "
                    "micro-batches); the Megatron tree engine (megatron_tree.integrations.areal) "
                    "runs both"
                )
        return super().initialize(addr, ft_spec, *args, **kwargs)

    def _materialize_and_load_weights(self):
        super()._materialize_and_load_weights()
        # Archon loads a critic from a causal LM's checkpoint leaving its value head as allocated
        # (``to_empty``: whatever the memory held; values of 1e38 seen): drawn here instead.
        config = self.config
        if (
            self.tree_training
            and config.is_critic
            and not config.init_from_scratch
            and not checkpoint_has_value_head(config.path)
        ):
            logger.info("megatron_tree: the checkpoint has no value head; drawn (seed 0)")
            for part in self.model_parts:  # under PP only the last stage holds the head
                if getattr(part, "score", None) is not None:
                    init_value_head(part)

    def _create_model_structure(self):
        model = super()._create_model_structure()
        if self.tree_training:
            install_tree_attention(model, self._attention_options())
        return model

    # -- micro-batches ------------------------------------------------------------------------

    @property
    def _cp_size(self) -> int:
        return self.parallel_dims.cp if self.parallel_dims.cp_enabled else 1

    def _prepare_mb_list(self, input_: dict[str, Any]):
        if not self.tree_training:
            return super()._prepare_mb_list(input_)
        per_token, per_sequence = split_inputs(input_)
        dims = self.parallel_dims
        packed = build_packed_tree_batch(
            {"input_ids": input_["input_ids"], "attention_mask": input_["attention_mask"]}
            | per_token,
            max_tokens_per_mb=tree_capacity(
                self.config.mb_spec.max_tokens_per_mb,
                block_size=self.tree_block_size,
                align=dims.seq_len_divisor,
                setting="mb_spec.max_tokens_per_mb",
            ),
            block_size=self.tree_block_size,
            parallel_size=dims.seq_len_divisor,  # Archon's TP (sequence-sharded) x CP x 2
            # A pipeline's stages exchange fixed shapes (and Archon's compile forces
            # pad_to_maximum); torch's schedules want a micro-batch for every stage, a multiple of
            # the pipeline size for the interleaved ones.
            pad_to_max=dims.pp_enabled or bool(self.config.pad_to_maximum),
            min_micro_batches=len(self.pp_stages) * dims.pp if dims.pp_enabled else 1,
            micro_batch_multiple=dims.pp if dims.pp_enabled else 1,
            dp_group=self.data_parallel_group,
            share_prefixes=self.tree_share_prefixes,
            share_trunks=False,
        )
        self.tree_stats = report_packing(packed)
        head_rows = None
        if self._cp_size > 1:  # the model takes every row; this rank's slice reaches the head
            cp_rank = self.parallel_dims.get_mesh("cp").get_local_rank()
            head_rows = [
                sequence_split(mb.rows, self._cp_size, cp_rank, self._cp_group) for mb in packed
            ]
        return tree_micro_batch_list(
            input_, packed, per_sequence, self.config.mb_spec, head_rows=head_rows
        )

    # -- the step -----------------------------------------------------------------------------

    def _attention_options(self) -> TreeAttentionOptions:
        return TreeAttentionOptions(backend=self.tree_backend, block_size=self.tree_block_size)

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        if not isinstance(mb_list, TreeMicroBatchList):
            return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        if self.parallel_dims.pp_enabled:
            if not forward_only:
                raise NotImplementedError(
                    f"pipeline_parallel_size={self.parallel_dims.pp}: the Archon tree engine runs "
                    "forward only under pipeline parallelism. Archon's pipeline runner does not "
                    "train here: torch's schedule calls the last stage's loss function once more "
                    "than there are micro-batches and the runner stops with StopIteration "
                    "(archon_runner.pp_loss_fn; Archon's stock engine alike). Train with data, "
                    "tensor or Ulysses context parallelism, or on the Megatron tree engine "
                    "(megatron_tree.integrations.areal), which pipelines trees"
                )
            return self._pipelined(mb_list, process_output_fn, forward_only)
        gather = self._tree_gather()
        (model,) = self.model_parts

        def forward(i: int, mb):
            # The mask of every row (after Ulysses' all-to-all attention sees them all); the rest
            # of the model runs this rank's rows: all of them, or its slice under Ulysses.
            mask = tree_attention_mask(mb.rows)
            rows = mb.rows if mb_list.head_rows is None else mb_list.head_rows[i]
            n = rows.num_rows
            logits = model(
                rows.local(mb.tree.input_ids)[None],
                rows.local(mb.tree.position_ids)[None],
                cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=mb.tree.input_ids.device),
                max_seqlen=n,
                tree_attn_meta=mask,
            ).reshape(n, -1)
            return logits, gather.gather(logits, mb.tree, self._tp_group, rows)

        return run_micro_batches(
            "AReaL Archon tree engine",
            mb_list,
            forward,
            lambda data: ArchonTrainContext(mb_input=data).to_dict(),
            process_output_fn,
            forward_only=forward_only,
            # Under Ulysses every CP rank takes the whole loss and its gradient flows into the
            # rank's own rows only (the gathers' sum has an identity backward), while FSDP2
            # averages gradients over data x CP ranks: scaled by CP for the backward, as Archon's
            # stock all-gather of per-token outputs (its backward sums the ranks') does.
            grad_scale=float(self._cp_size),
        )

    def _pipelined(self, mb_list: TreeMicroBatchList, process_output_fn, forward_only: bool):
        """Archon's own pipeline runner (torch's schedule) on the trees: the micro-batches'
        inputs stacked [M, n] (every tree padded to the capacity), their ``subtree_end`` passed
        as ``tree_attn_meta`` so that the schedule splits it with them; the last stage's loss
        function gathers each micro-batch's outputs (the schedule calls it in micro-batch order,
        as Archon's stock runner assumes) and hands them to AReaL's ``process_output_fn``. A
        non-finite output raises on the last stage after the schedule, before the optimizer step
        (the launcher then stops the other stages' processes)."""
        gather = self._tree_gather()
        finite = FiniteCheck("AReaL Archon tree engine")
        order = iter(range(len(mb_list.packed)))

        def process(pred: torch.Tensor, ctx: dict):
            i = next(order)
            mb = mb_list.packed[i]
            logits = pred.reshape(mb.rows.num_rows, -1)
            outputs = gather.gather(logits, mb.tree, self._tp_group, mb.rows)
            finite.add(i, mb.tree, outputs)
            if mb.tree.num_sequences == 0:
                return None  # a fill-in: the runner takes a zero loss, gives no result
            loss = process_output_fn(TreeHeadOutputs(outputs), ctx)
            if loss is not None and not forward_only:
                finite.add_loss(i, loss.detach())
            return loss

        results = self.runner.run(mb_list, process, forward_only)
        finite.raise_if_any()
        return results

    def _prepare_pipelined_mb_inputs(self, mb_list):
        if not isinstance(mb_list, TreeMicroBatchList):
            return super()._prepare_pipelined_mb_inputs(mb_list)
        packed = mb_list.packed
        ids = torch.cat([mb.input_ids for mb in packed])  # [M, n]
        m, n = ids.shape
        kwargs = {
            "positions": torch.cat([mb.position_ids for mb in packed]),
            "cu_seqlens": torch.tensor([[0, n]] * m, dtype=torch.int32, device=ids.device),
            "max_seqlen": torch.full((m,), n),
            "tree_attn_meta": torch.stack([subtree_end_of(mb.tree) for mb in packed]),
        }
        contexts = [ArchonTrainContext(mb_input=data) for data in mb_list.mbs]
        # torch's schedule wants a target on the last stage to call the loss function with; the
        # loss reads the micro-batch's tree instead (one placeholder entry per micro-batch).
        target = torch.zeros(m, 1, device=ids.device) if self.pp_has_last_stage else None
        return ((ids,) if self.pp_has_first_stage else ()), kwargs, target, contexts

    @staticmethod
    def _loss_inputs(ctx: ArchonTrainContext) -> dict[str, Any]:
        return ctx.mb_input


class TreeArchonPPOActor(_TreeArchonEngine, ArchonPPOActor):
    """AReaL's ``ArchonPPOActor`` with tree micro-batches and tree attention (the actor and the
    reference policy)."""


class TreeArchonPPOCritic(_TreeArchonEngine, ArchonPPOCritic):
    """AReaL's ``ArchonPPOCritic`` with tree micro-batches and tree attention: each sequence's
    values are the value head's output at its own tokens' rows."""
