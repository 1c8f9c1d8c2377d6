"""Tree training inside AReaL's Megatron engine (AReaL 1.0.x), switched on in two lines of the
entry script, without a line of AReaL changed::

    import areal.engine
    from megatron_tree.integrations import areal as tree_areal

    areal.engine.MegatronPPOActor = tree_areal.TreeMegatronPPOActor
    areal.engine.MegatronPPOCritic = tree_areal.TreeMegatronPPOCritic

AReaL's trainer looks these names up when it builds its engines (and its single controller sends
the class's import path to the workers), so the rest of the user's setup stays as it is:
``actor.enable_tree_training=true``, ``mb_spec.max_tokens_per_mb``, ``pad_to_maximum``, AReaL's
losses, metrics and checkpoints. With ``enable_tree_training`` off the classes are AReaL's own.

With it on, the engine is AReaL's Megatron PPO actor / critic with its tree path replaced:

* the model is built inside :func:`~megatron_tree.bridges.mbridge.patch_bridge_for_tree_training`
  (``bridge_type="mbridge"``) or
  :func:`~megatron_tree.bridges.megatron_bridge.patch_megatron_bridge_for_tree_training`
  (``"megatron-bridge"``, which AReaL refuses for trees): tree attention with depth RoPE, in the
  dtype the config asks for (mbridge builds its config in bf16 at ``from_pretrained``; AReaL
  rebuilds it only with gradient checkpointing, so ``dtype="float32"`` otherwise trains bf16
  parameters: here the config is rebuilt);
* micro-batches are the package's trees
  (:func:`~megatron_tree.core.packing.build_packed_tree_batch`, ``max_tokens_per_mb`` as the
  capacity, every data-parallel rank with as many trees, prompt groups larger than a micro-batch
  with trunk reuse), split over the context-parallel ranks
  (:func:`~megatron_tree.mcore.step.split_for_context_parallel`), which AReaL asserts against;
* each step runs on the package's one schedule (:func:`~megatron_tree.mcore.schedule.run_phases`)
  with the package's (tensor-parallel) log-prob / entropy / vocab-statistics or value gather as
  the head and AReaL's own loss on each micro-batch's sequences, in AReaL's packed 1-D layout
  (:class:`_AReaLLoss`); forward results come back through AReaL's own reordering as ``[B, L]``;
* ``tree_token_ratio`` goes to AReaL's stats tracker, as AReaL's tree path reports it.

Refused with the reason: vision-language models, ``bridge_type`` other than mbridge /
megatron-bridge (AReaL's own registry builds stock GPT models).

Legend: B batch size, L padded length, T a micro-batch's sequence tokens, M micro-batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from areal.engine import megatron_engine
from areal.engine.megatron_engine import MegatronPPOActor, MegatronPPOCritic
from areal.utils.data import MicroBatchList
from megatron.core import parallel_state as mpu
from megatron.core.utils import get_model_config

from ..core.packing import build_packed_tree_batch
from ..mcore.schedule import StepContext, run_phases
from ..mcore.spec import check_tree_model
from ..mcore.step import PackingConfig, constant_shapes, expert_parallel, split_for_context_parallel
from ..mcore.token_loss import TreeHead
from ..patches._scoped import swapped
from .areal_common import (
    TreeEngineSwitch,
    TreeHeadOutputs,
    TreeMicroBatchList,
    check_version,
    report_packing,
    split_inputs,
    tree_micro_batch_list,
)
from .common import tree_capacity

logger = logging.getLogger(__name__)


class _AReaLLoss:
    """:class:`~megatron_tree.mcore.schedule.Loss`: AReaL's ``process_output_fn`` on a
    micro-batch's head outputs and its sequences' data (``mbs[index]``), in Megatron's
    ``(loss, logs)`` protocol.

    AReaL scales each micro-batch's loss for Megatron's division by the batch's M micro-batches
    and sums the loss weight over the data x context-parallel group (Megatron multiplies a
    ``(loss, logs)`` loss by the CP size; AReaL's CP ranks each take the whole sequence's gradient
    through an all-gather). Here a schedule call runs ``num_micro_batches`` of them and each CP
    rank's gradient flows into its own rows only (the CP ranks' gradients add up), so the loss is
    rescaled by ``cp * num_micro_batches / M``: the same gradient as AReaL's per token.

    Forward only, ``process_output_fn`` runs after the schedule, in micro-batch order (AReaL
    appends results in call order; trunk parts run before the other micro-batches).
    """

    def __init__(self, mbs: list[dict], process_output: Callable, cp_size: int, defer: bool):
        self.mbs, self.process_output, self.cp_size, self.defer = (
            mbs,
            process_output,
            cp_size,
            defer,
        )
        self.pending: dict[int, TreeHeadOutputs] = {}

    def __call__(self, index: int, mb, outputs: dict, *, num_micro_batches: int) -> tuple:
        zero = sum(v.sum() for v in outputs.values() if v.is_floating_point()) * 0.0
        if mb.tree.num_sequences == 0:
            return zero, {}
        outputs = TreeHeadOutputs(outputs)
        if self.defer:
            self.pending[index] = outputs
            return zero, {}
        loss = self.process_output(outputs, self.mbs[index])
        return loss * (self.cp_size * num_micro_batches / len(self.mbs)), {}

    def flush(self) -> None:
        for index in sorted(self.pending):
            self.process_output(self.pending.pop(index), self.mbs[index])


class _TreeEngine(TreeEngineSwitch):
    """What the tree engines change in AReaL's Megatron engine (see the module docstring).

    Besides :class:`TreeEngineSwitch`'s settings: ``tree_share_trunks`` (trunk reuse for prompt
    groups larger than a micro-batch).
    """

    tree_share_trunks = True

    # -- build --------------------------------------------------------------------------------

    def initialize(self, addr, ft_spec, *args, **kwargs):
        if not self.tree_training:
            return super().initialize(addr, ft_spec, *args, **kwargs)
        check_version()
        with ExitStack() as stack:
            stack.enter_context(self._bridge_patch())
            # AReaL refuses CP for models it runs in the padded BSHD layout (gated delta-net,
            # Mamba); trees never use that layout.
            stack.enter_context(swapped(megatron_engine, requires_padded_seq=lambda _: False))
            result = super().initialize(addr, ft_spec, *args, **kwargs)
        self._refuse_vision(self.hf_config.model_type)
        for chunk in self.model:
            check_tree_model(chunk)
        return result

    def _bridge_patch(self):
        if self.bridge_cls == "mbridge":
            from ..bridges.mbridge import patch_bridge_for_tree_training as patch
        elif self.bridge_cls == "megatron-bridge":
            from ..bridges.megatron_bridge import patch_megatron_bridge_for_tree_training as patch
        else:
            raise ValueError(
                f"megatron.bridge_type={self.bridge_cls!r}: the tree engine builds its models "
                "through a bridge; set bridge_type='mbridge' or 'megatron-bridge'"
            )
        return patch(backend=self.tree_backend, block_size=self.tree_block_size)

    def _build_hf_mcore_bridge(self):
        bridge = super()._build_hf_mcore_bridge()
        if self.bridge_cls == "mbridge" and bridge.config.params_dtype != self.dtype:
            logger.info(
                "megatron_tree: mbridge built its config in %s; rebuilt in %s (dtype=%r)",
                bridge.config.params_dtype,
                self.dtype,
                self.config.dtype,
            )
            bridge.set_extra_args()  # rebuilds bridge.config from bridge.dtype
        return bridge

    # -- micro-batches ------------------------------------------------------------------------

    def _prepare_mb_list(self, input_: dict[str, Any]) -> MicroBatchList:
        if not self.tree_training:
            return super()._prepare_mb_list(input_)
        per_token, per_sequence = split_inputs(input_)
        config = get_model_config(self.model[0])
        cp = mpu.get_context_parallel_world_size()
        align = cp * (mpu.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1)
        packing = PackingConfig(
            max_tokens_per_mb=self._capacity(align),
            block_size=self.tree_block_size,
            pad_to_max=True if self.config.pad_to_maximum else None,
            share_prefixes=self.tree_share_prefixes,
            share_trunks=self.tree_share_trunks,
        ).resolve(constant_shapes=constant_shapes(config), align=align)
        packed = build_packed_tree_batch(
            {"input_ids": input_["input_ids"], "attention_mask": input_["attention_mask"]}
            | per_token,
            dp_group=self.data_parallel_group,
            **packing,
        )
        self.tree_stats = report_packing(packed)
        rows = split_for_context_parallel(
            packed, mpu.get_context_parallel_group() if cp > 1 else None
        )
        return tree_micro_batch_list(input_, packed, per_sequence, self.config.mb_spec, rows)

    def _capacity(self, align: int) -> int:
        return tree_capacity(
            self.config.mb_spec.max_tokens_per_mb,
            block_size=self.tree_block_size,
            align=align,
            setting="mb_spec.max_tokens_per_mb",
        )

    # -- the step -----------------------------------------------------------------------------

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        if not isinstance(mb_list, TreeMicroBatchList):
            return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        self._ensure_ready()
        config = get_model_config(self.model[0])
        cp = mpu.get_context_parallel_world_size()
        tp_group = (
            mpu.get_tensor_model_parallel_group()
            if mpu.get_tensor_model_parallel_world_size() > 1
            else None
        )
        head = TreeHead(self._tree_gather(), tp_group, mb_list.packed.max_token_id)
        loss = _AReaLLoss(mb_list.mbs, process_output_fn, cp, defer=forward_only)
        ctx = StepContext(
            list(self.model),
            config,
            moe=bool(config.num_moe_experts),
            ep_group=mpu.get_data_parallel_group() if expert_parallel(config) else None,
            per_token=False,
        )
        run_phases(ctx, list(mb_list.packed), head, loss, forward_only=forward_only)
        loss.flush()


class TreeMegatronPPOActor(_TreeEngine, MegatronPPOActor):
    """AReaL's ``MegatronPPOActor`` with tree micro-batches and tree attention (the actor and the
    reference policy)."""


class TreeMegatronPPOCritic(_TreeEngine, MegatronPPOCritic):
    """AReaL's ``MegatronPPOCritic`` with tree micro-batches and tree attention: each sequence's
    values are the value head's output at its own tokens' rows."""
