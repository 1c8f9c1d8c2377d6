"""Tree training inside AReaL's FSDP engine (AReaL 1.0.x), switched on in two lines of the entry
script, without a line of AReaL changed::

    import areal.engine
    from megatron_tree.integrations import areal_fsdp as tree_areal_fsdp

    areal.engine.FSDPPPOActor = tree_areal_fsdp.TreeFSDPPPOActor
    areal.engine.FSDPPPOCritic = tree_areal_fsdp.TreeFSDPPPOCritic

AReaL's trainer looks the classes up when it builds its actor, reference and critic engines
(``PPOTrainer._create_train_engine``, ``_create_critic``), so the rest of the setup stays as it is:
``actor.enable_tree_training=true``, ``mb_spec.max_tokens_per_mb``, AReaL's losses, metrics and
checkpoints. With ``enable_tree_training`` off the classes are AReaL's own.

With it on, AReaL's own tree path (its flash-attention patch, trie packing and gathers) stays off
and the HF model runs the package's: :func:`~megatron_tree.integrations.transformers.prepare_model`
selects the tree attention before FSDP2 shards the model; micro-batches are the package's tries
(:func:`~megatron_tree.core.packing.build_packed_tree_batch`, ``max_tokens_per_mb`` as the
capacity, every data-parallel rank with as many micro-batches, whole trees); each runs through
:func:`~megatron_tree.integrations.transformers.tree_forward` (depth position ids, the O(N) tree
mask), the package's log-prob / entropy / vocab-statistics gather (the critic: its value head's
output at each sequence's own rows) gives AReaL's loss its packed 1-D layout, and forward results
come back through AReaL's own reordering as ``[B, L]``. AReaL's own FSDP tree path refuses the
critic (``NotImplementedError``).

Refused with the reason: vision-language models, Ulysses sequence parallelism (``sp_size > 1``).
"""

from __future__ import annotations

from typing import Any

from areal.engine.fsdp_engine import FSDPPPOActor, FSDPPPOCritic, FSDPTrainContext

from ..core.packing import build_packed_tree_batch
from .areal_common import (
    TreeEngineSwitch,
    TreeMicroBatchList,
    check_version,
    report_packing,
    run_micro_batches,
    split_inputs,
    tree_micro_batch_list,
)
from .common import refuse_ulysses, tree_capacity
from .transformers import TreeAttentionOptions, head_forward, prepare_model


class _TreeFSDPEngine(TreeEngineSwitch):
    """What the tree engines change in AReaL's FSDP engine (see the module docstring).

    The settings are :class:`TreeEngineSwitch`'s.
    """

    # -- build --------------------------------------------------------------------------------

    def initialize(self, addr, ft_spec, *args, **kwargs):
        if not self.tree_training:
            return super().initialize(addr, ft_spec, *args, **kwargs)
        check_version()
        self._refuse_vision(self.model_config.model_type)
        refuse_ulysses("sp_size (the allocation's Ulysses size)", self.parallel_helper.sp_size)
        return super().initialize(addr, ft_spec, *args, **kwargs)

    def _create_device_model(self):
        super()._create_device_model()
        if self.tree_training:  # before FSDP2 shards it (initialize's parallelize_model)
            prepare_model(self.model)

    # -- micro-batches ------------------------------------------------------------------------

    def _prepare_mb_list(self, input_: dict[str, Any]):
        if not self.tree_training:
            return super()._prepare_mb_list(input_)
        per_token, per_sequence = split_inputs(input_)
        packed = build_packed_tree_batch(
            {"input_ids": input_["input_ids"], "attention_mask": input_["attention_mask"]}
            | per_token,
            max_tokens_per_mb=tree_capacity(
                self.config.mb_spec.max_tokens_per_mb,
                block_size=self.tree_block_size,
                setting="mb_spec.max_tokens_per_mb",
            ),
            block_size=self.tree_block_size,
            dp_group=self.data_parallel_group,
            share_prefixes=self.tree_share_prefixes,
            share_trunks=False,
        )
        self.tree_stats = report_packing(packed)
        return tree_micro_batch_list(input_, packed, per_sequence, self.config.mb_spec)

    # -- the step -----------------------------------------------------------------------------

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        if not isinstance(mb_list, TreeMicroBatchList):
            return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        options = TreeAttentionOptions(backend=self.tree_backend, block_size=self.tree_block_size)
        gather = self._tree_gather()
        run_micro_batches(
            "AReaL FSDP tree engine",
            mb_list,
            lambda i, mb: head_forward(self.model, mb, gather, options=options),
            lambda data: FSDPTrainContext(
                model_inputs=data, mb_input=data, pad_length=0, ulysses_pad_size=0
            ).to_dict(),
            process_output_fn,
            forward_only=forward_only,
        )

    @staticmethod
    def _loss_inputs(ctx: FSDPTrainContext) -> dict[str, Any]:
        return ctx.mb_input


class TreeFSDPPPOActor(_TreeFSDPEngine, FSDPPPOActor):
    """AReaL's ``FSDPPPOActor`` with tree micro-batches and tree attention (the actor and the
    reference policy)."""


class TreeFSDPPPOCritic(_TreeFSDPEngine, FSDPPPOCritic):
    """AReaL's ``FSDPPPOCritic`` with tree micro-batches and tree attention: each sequence's values
    are the value head's output at its own tokens' rows."""
