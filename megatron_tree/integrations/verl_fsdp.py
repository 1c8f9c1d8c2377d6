"""Tree training inside verl's FSDP engine (verl 0.9.x): HF models under FSDP / FSDP2, switched on
by ``VERL_ENGINE_VENDOR=megatron_tree`` with the FSDP strategy (``fsdp`` or ``fsdp2``).

Importing this module (verl's ``verl.plugins`` entry point, :mod:`.verl_plugin`, does) registers
:class:`TreeFSDPEngineWithLMHead` (actor, reference) and :class:`TreeFSDPEngineWithValueHead`
(critic) in verl's ``EngineRegistry`` under the vendor ``megatron_tree``, for the backends and
devices verl registers its own FSDP engines for (cuda, npu) and "cpu". Each is verl's engine with
three things changed:

* the HF module runs the tree attention: :func:`~.transformers.prepare_model` before FSDP wraps it
  (the model is loaded with the tree attention, also the critic, for which verl hard-codes
  ``flash_attention_2``: no flash-attention build is needed);
* micro-batches are trees: the rank's batch is packed into prefix tries of at most the batch's token
  budget (``max_token_len_per_gpu``, also with ``use_dynamic_bsz=False``, whose sample counts it
  replaces; :func:`~megatron_tree.core.packing.build_packed_tree_batch`, whole trees, every
  data-parallel rank running as many micro-batches), in place of verl's micro-batching; verl
  restores its sample order from the trees' sequence ids as it restores its dynamic batches;
* the forward step runs :func:`~.transformers.tree_forward` and the core's gathers and hands verl's
  loss the per-sample outputs in verl's layout (nested [b, j]: entry t is log p(token t + 1), the
  last entry 0 where verl's reads the next sample's first token, which no loss uses), so verl's
  losses, metrics and output order are unchanged.

Prompt groups stay whole across data-parallel ranks through verl's trainer balancing hook, which
:mod:`.verl_balance` installs at ``import verl`` (no megatron-core needed).

Refused with the reason: Ulysses sequence parallelism, ``use_fused_kernels``, ``sum_pi_squared``
and top-k distillation outputs, per-sample temperatures that differ within a tree, TRL value-head
models. ``use_remove_padding`` and ``pad_to_length`` do not apply (a tree is never padded per
sample; its length is a multiple of the block size).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
from verl.utils import model as verl_model_utils
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp.transformer_impl import (
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
)
from verl.workers.engine.utils import detach_tree

from ..core.finite import non_finite, raise_non_finite
from ..core.heads import LogProbs, Values
from ..patches._scoped import swapped
from .common import log_packing, refuse_ulysses, tree_capacity
from .transformers import (
    ATTENTION_KEY,
    TreeAttentionOptions,
    head_forward,
    prepare_model,
    register_tree_attention,
)
from .verl_common import VENDOR, nested, sample_temperatures, tree_micro_batches

BACKENDS = ["fsdp", "fsdp2"]
DEVICES = ["cuda", "npu", "cpu"]  # verl's own FSDP engines: cuda, npu; cpu for tests
TREE_KEY = "megatron_tree_micro_batch"  # a verl micro-batch's packed tree (non-tensor data)
INDEX_KEY = "megatron_tree_micro_batch_index"  # its position in the step, for errors
_VERL_NAMES = {"logprobs": "log_probs"}  # the core heads' output names -> verl's

# verl's per-micro-batch flags whose outputs the tree step does not compute.
_UNSUPPORTED_FLAGS = {
    "use_fused_kernels": "set use_fused_kernels=False (the tree step gathers from the logits)",
    "calculate_sum_pi_squared": "the tree step computes log-probs, entropy and values only",
    "distillation_use_topk": "top-k distillation reads the teacher's tokens in verl's packed "
    "order, which a tree does not keep",
}


class _TreeFSDPEngine:
    """What the tree engines change in verl's FSDP engine (see the module docstring).

    Attributes (class level; override per instance): ``tree_backend`` (the tree attention's
    backend), ``tree_block_size`` (packing alignment and attention tile), ``tree_max_tokens`` (a
    tree's unique-token capacity; None: the batch's ``max_token_len_per_gpu`` rounded up to the
    block size), ``tree_stats`` (the last batch's packing).
    """

    tree_backend = "auto"
    tree_block_size = 128
    tree_max_tokens: int | None = None
    tree_stats: dict | None = None

    def __init__(self, model_config, engine_config, *args, **kwargs):
        # Before verl's own checks and device mesh, which would fail first on some of these.
        refuse_ulysses(
            "ulysses_sequence_parallel_size", engine_config.ulysses_sequence_parallel_size
        )
        if model_config.use_fused_kernels:
            raise ValueError(
                "use_fused_kernels=True: the verl FSDP tree engine gathers log-probs from the "
                "model's logits; set use_fused_kernels=False"
            )
        super().__init__(model_config, engine_config, *args, **kwargs)

    def _build_module(self):
        # The tree attention from the start: HF then never asks for flash-attention's package.
        register_tree_attention()
        self.model_config.hf_config._attn_implementation = ATTENTION_KEY
        with swapped(verl_model_utils, load_valuehead_model=_load_token_classifier):
            module = prepare_model(super()._build_module())
        if hasattr(module, "v_head"):
            raise ValueError(
                "a TRL value-head model (v_head): the verl FSDP tree engine runs token "
                "classification critics (AutoModelForTokenClassification, verl's default)"
            )
        return module

    def _capacity(self, data) -> int:
        tokens = self.tree_max_tokens
        if tokens is None:
            tokens = tu.get_non_tensor_data(data, key="max_token_len_per_gpu", default=None)
        return tree_capacity(
            tokens,
            block_size=self.tree_block_size,
            setting="max_token_len_per_gpu on the batch (verl's ppo_max_token_len_per_gpu) or "
            "tree_max_tokens on the engine",
        )

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        for flag, fix in _UNSUPPORTED_FLAGS.items():
            if tu.get_non_tensor_data(data, key=flag, default=False):
                raise ValueError(f"{flag}=True: not run by the verl FSDP tree engine; {fix}")
        prepare = partial(self._prepare_trees, capacity=self._capacity(data))
        tu.assign_non_tensor(data, use_dynamic_bsz=True)  # verl restores the order from our indices
        self._non_finite = None
        with swapped(transformer_impl, prepare_micro_batches=prepare):
            result = super().forward_backward_batch(data, loss_function, forward_only)
        if self._non_finite is not None:  # after every micro-batch, so no rank leaves early
            raise_non_finite("verl FSDP tree engine", *self._non_finite)
        return result

    def _prepare_trees(self, data, dp_group=None, same_micro_num_in_dp=True, *, capacity, **unused):
        """verl's ``prepare_micro_batches`` with trees: one verl micro-batch per tree (its samples
        in the tree's order, the tree attached as ``TREE_KEY``) and the batch indices of each that
        holds samples. With ``dp_group`` every rank gets as many micro-batches (all-padding trees
        appended, carrying sample 0 as their verl data: they take no loss and give no output)."""
        micro_batches, indices, packed = tree_micro_batches(
            data,
            max_tokens=capacity,
            block_size=self.tree_block_size,
            share_trunks=False,
            dp_group=dp_group if same_micro_num_in_dp else None,
        )
        self.tree_stats = log_packing(packed)
        for i, (selected, mb) in enumerate(zip(micro_batches, packed.to(get_device_id()))):
            _temperature(selected)  # one per tree, checked before any forward
            tu.assign_non_tensor(selected, **{TREE_KEY: mb, INDEX_KEY: i})
        return micro_batches, indices

    def forward_step(self, micro_batch, loss_function, forward_only):
        mb = tu.get_non_tensor_data(micro_batch, key=TREE_KEY, default=None)
        if mb is None:
            raise ValueError(
                "the verl FSDP tree engine's forward_step runs the micro-batches of its own "
                "forward_backward_batch (a packed tree each); call that"
            )
        micro_batch = micro_batch.to(get_device_id())
        # verl's autocast for the FSDP mixed precision (none in fp32)
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast = (
            nullcontext()
            if dtype == torch.float32
            else torch.autocast(device_type=get_device_name(), dtype=dtype)
        )
        options = TreeAttentionOptions(backend=self.tree_backend, block_size=self.tree_block_size)
        with autocast:
            output, per_token = head_forward(
                self.module, mb, self._tree_gather(micro_batch), options=options
            )
            if mb.tree.num_sequences == 0:  # a data-parallel fill-in: FSDP's collectives run
                return output.sum() * 0.0, {}
            lengths = mb.tree.cu_seqlens.diff().tolist()
            model_output = {
                _VERL_NAMES.get(k, k): nested(list(v.split(lengths))) for k, v in per_token.items()
            }
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=model_output,
                    data=micro_batch,
                    dp_group=self.get_data_parallel_group(),
                )
            else:
                loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
        # the loss's host read, which verl makes anyway, carries the outputs' finiteness flag
        flag = non_finite({**per_token, "loss": loss})
        loss_value, bad = torch.stack([loss.detach().float().reshape(()), flag.float()]).tolist()
        if bad and self._non_finite is None:
            index = tu.get_non_tensor_data(micro_batch, key=INDEX_KEY, default=0)
            self._non_finite = (index, mb.tree, {**per_token, "loss": loss.detach()})
        return loss, {
            "model_output": detach_tree(model_output),
            "loss": loss_value,
            "metrics": metrics,
        }


def _load_token_classifier(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's critic loader (``verl.utils.model.load_valuehead_model``, its token-classification
    branch) with the tree attention in place of the ``flash_attention_2`` it hard-codes."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation=ATTENTION_KEY,
        trust_remote_code=trust_remote_code,
    )


def _temperature(micro_batch) -> float:
    """The micro-batch's one temperature (verl gives a float or one per sample)."""
    values = sample_temperatures(micro_batch).unique()
    if values.numel() != 1:
        raise ValueError(
            f"temperature: per-sample temperatures {values.tolist()} within one tree; the verl "
            "FSDP tree engine divides a tree's logits by one temperature (give a prompt group's "
            "samples one temperature, or one per batch)"
        )
    return float(values[0])


@EngineRegistry.register(
    model_type="language_model", backend=BACKENDS, device=DEVICES, vendor=VENDOR
)
class TreeFSDPEngineWithLMHead(_TreeFSDPEngine, FSDPEngineWithLMHead):
    """verl's ``FSDPEngineWithLMHead`` with tree micro-batches and tree attention (the actor and
    the reference policy)."""

    def _tree_gather(self, micro_batch) -> LogProbs:
        """The core head of a micro-batch: log-probs [T] at its one temperature, and entropy [T]
        when verl asks for it."""
        entropy = tu.get_non_tensor_data(micro_batch, key="calculate_entropy", default=False)
        return LogProbs(temperature=_temperature(micro_batch), entropy=bool(entropy))


@EngineRegistry.register(model_type="value_model", backend=BACKENDS, device=DEVICES, vendor=VENDOR)
class TreeFSDPEngineWithValueHead(_TreeFSDPEngine, FSDPEngineWithValueHead):
    """verl's ``FSDPEngineWithValueHead`` with tree micro-batches and tree attention (the critic):
    each sample's values are the critic's output at its own tokens' rows."""

    def _tree_gather(self, micro_batch) -> Values:
        """The core head of a critic: values [T] from the value head's [n, 1]."""
        return Values()
