"""Tree training inside verl's Megatron engine (verl 0.9.x), switched on by
``VERL_ENGINE_VENDOR=megatron_tree``, without a line of verl changed.

Importing this module (verl does, through the ``verl.plugins`` entry point that installing
megatron_tree registers) adds :class:`TreeMegatronEngineWithLMHead` to verl's ``EngineRegistry``
under the vendor ``megatron_tree``. The engine is verl's ``MegatronEngineWithLMHead`` with three
things changed:

* the model is built inside :func:`~megatron_tree.bridges.mbridge.patch_bridge_for_tree_training`
  (verl's mbridge path) or the Megatron-Bridge patch (its default path), so it is a
  ``TreeGPTModel`` with tree attention;
* micro-batches are trees: every micro-batch holds whole prompt groups packed into a prefix trie by
  :func:`~megatron_tree.core.packing.build_packed_tree_batch` (verl's token-budget micro-batching
  splits groups), and verl's sample order is restored from the trees' sequence ids exactly as
  verl restores its dynamic batches;
* the forward step runs the tree once per micro-batch and hands verl, per sample of the
  micro-batch, the log-probs / entropy verl's own logits processor computes on that sample's rows
  (its labels rolled as verl rolls them): verl's losses and metrics run unchanged.

The critic's engine (:class:`TreeMegatronEngineWithValueHead`) is verl's value engine with the same
changes; each sample's values are the value head on its own rows. Data-parallel ranks run as many
trees (all-padding ones appended, which add no output or loss). Both of verl's model paths are tested (vanilla mbridge; Megatron-Bridge, its default, on a
transformers-5 stack). Not yet: pipeline and context parallelism and routing replay (refused),
trunk reuse inside verl (whole trees only), megatron_tree's data-parallel partition.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
from functools import partial

import torch
from megatron.core import parallel_state as mpu
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine import EngineRegistry
from verl.workers.engine.megatron import transformer_impl
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

from ..core.packing import build_packed_tree_batch
from ..mcore.runner import MicroBatchInputs

logger = logging.getLogger(__name__)
VENDOR = "megatron_tree"
_TREE = "megatron_tree_micro_batch"  # the non-tensor key a verl micro-batch carries its tree under


def tree_micro_batches(data, *, max_tokens: int, block_size: int, dp_group=None) -> tuple[list, list[list[int]], object]:
    """verl's micro-batch preparation with trees: (one verl micro-batch per tree, holding its
    sequences in the tree's order, with the packed tree under a non-tensor key; each micro-batch's
    batch indices, which verl's ``restore_dynamic_batch`` puts back in order; the
    :class:`~megatron_tree.core.batch.PackedTreeBatch`, for its statistics)."""
    packed = build_packed_tree_batch({"input_ids": data["input_ids"]}, max_tokens_per_mb=max_tokens,
                                     block_size=block_size, pad_to_max=False, share_trunks=False, dp_group=dp_group)
    micro_batches, indices = [], []
    for mb in packed:
        ids = [int(i) for i in mb["tree"].sequence_ids]
        # An all-padding tree (to match other data-parallel ranks' tree count) carries sample 0 as
        # its verl data (verl cannot hold an empty jagged micro-batch); it adds no output or loss.
        sub = tu.index_select_tensor_dict(data, torch.tensor(ids or [0], dtype=torch.long))
        tu.assign_non_tensor(sub, **{_TREE: mb})
        micro_batches.append(sub)
        if ids:
            indices.append(ids)
    return micro_batches, indices, packed


@contextlib.contextmanager
def _tree_bridges(backend: str):
    """Both of verl's bridge paths build tree models inside this block."""
    with contextlib.ExitStack() as stack:
        if importlib.util.find_spec("mbridge") is not None:
            from ..bridges.mbridge import patch_bridge_for_tree_training

            stack.enter_context(patch_bridge_for_tree_training(backend=backend))
        if importlib.util.find_spec("megatron.bridge") is not None:
            from ..bridges.megatron_bridge import patch_megatron_bridge_for_tree_training

            stack.enter_context(patch_megatron_bridge_for_tree_training(backend=backend))
        yield


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


class _TreeEngine:
    """What the tree engines change in verl's Megatron engine (see the module docstring).

    Attributes (class level; override per instance): ``tree_backend`` (TreeCoreAttention backend),
    ``tree_block_size`` (packing alignment), ``tree_max_tokens`` (a tree's capacity; None: the
    batch's ``max_token_len_per_gpu``, rounded up to the block size).
    """

    tree_backend = "auto"
    tree_stats: dict | None = None  # the last batch's packing: sequences, trees, tokens unpacked / computed
    tree_block_size = 128
    tree_max_tokens: int | None = None

    def _build_tf_config(self):
        with _tree_bridges(self.tree_backend):
            return super()._build_tf_config()

    def _build_megatron_module(self):
        with _tree_bridges(self.tree_backend):
            return super()._build_megatron_module()

    def _capacity(self, data) -> int:
        tokens = self.tree_max_tokens or tu.get_non_tensor_data(data, key="max_token_len_per_gpu", default=None)
        if tokens is None:
            raise ValueError("tree micro-batches need a token capacity: set max_token_len_per_gpu on the batch "
                             "or tree_max_tokens on the engine")
        return math.ceil(int(tokens) / self.tree_block_size) * self.tree_block_size

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if tu.get_non_tensor_data(data, key="enable_routing_replay", default=False) or getattr(
                self, "enable_routing_replay", False):
            raise ValueError("routing replay (router_replay) is not supported by the verl tree engine yet: the "
                             "recorded routes would not be replayed on the tree; unset VERL_ENGINE_VENDOR or "
                             "turn router replay off")
        for name, size in (("pipeline", mpu.get_pipeline_model_parallel_world_size()),
                           ("context", mpu.get_context_parallel_world_size())):
            if size > 1:
                raise ValueError(f"{name}-parallel size {size}: the verl tree engine runs without {name} "
                                 "parallelism so far; use megatron_tree.tree_forward_backward directly")
        prepare = partial(self._prepare_trees, capacity=self._capacity(data))
        tu.assign_non_tensor(data, use_dynamic_bsz=True)  # verl then restores the order from our indices
        with _swapped(transformer_impl, "prepare_micro_batches", prepare):
            return super().forward_backward_batch(data, loss_function, forward_only)

    def _prepare_trees(self, data, dp_group=None, num_batches_divided_by=None, capacity=0, **unused):
        # With dp_group every data-parallel rank gets as many trees (all-padding ones appended), as
        # Megatron's schedule and verl's same_micro_num_in_dp need.
        micro_batches, indices, packed = tree_micro_batches(data, max_tokens=capacity, block_size=self.tree_block_size,
                                                            dp_group=dp_group)
        self.tree_stats = {"sequences": packed.batch_size, "trees": len(packed), "tokens_unpacked": packed.num_real_tokens,
                           "tokens_computed": packed.num_padded_tokens, "tree_token_ratio": packed.tree_token_ratio}
        logger.info("megatron_tree: %s", " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in self.tree_stats.items()))
        return micro_batches, indices

    def _tree_forward(self, batch_iter, model):
        """The next verl micro-batch, its tree and the model's output on it [1, N, ...]."""
        batch = next(batch_iter).to(get_device_id())
        mb = tu.get_non_tensor_data(batch, key=_TREE, default=None)
        if mb is None:
            raise ValueError("a micro-batch without its tree reached the tree engine's forward step")
        input_ids, position_ids, kwargs = MicroBatchInputs([model], None)(_on(mb, batch["input_ids"].device))
        return batch, mb["tree"], model(input_ids=input_ids, position_ids=position_ids, **kwargs)

def _on(mb: dict, device) -> dict:
    """The packed micro-batch's tensors on ``device`` (its rows and tree included)."""
    if mb["input_ids"].device == device:
        return mb
    moved = dict(mb)
    for key in ("input_ids", "position_ids"):
        moved[key] = mb[key].to(device)
    moved["rows"] = mb["rows"].to(device, mb["tree"].to(device))
    return moved


def _no_loss(output: torch.Tensor):
    """An all-padding tree's loss: zero, with a graph (the schedule runs its backward), no outputs."""
    return output.sum() * 0.0, {"loss": 0.0, "metrics": {}}


def _sample_rows(tree) -> list[torch.Tensor]:
    """Every sample's packed positions, in the tree's sequence order (the verl micro-batch's rows)."""
    return [tree.sequence_token_index(i) for i in range(tree.num_sequences)]


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


@EngineRegistry.register(model_type="language_model", backend="megatron", device=["cuda", "cpu"], vendor=VENDOR)
class TreeMegatronEngineWithLMHead(_TreeEngine, MegatronEngineWithLMHead):
    """verl's ``MegatronEngineWithLMHead`` with tree micro-batches and tree attention (the actor
    and the reference policy)."""

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        batch, tree, logits = self._tree_forward(batch_iter, model)  # logits [1, N, V / tp]
        if tree.num_sequences == 0:
            return logits, _no_loss
        output = self._per_sample_outputs(logits, tree, batch, logits_processor_func)
        return output, partial(postprocess_micro_batch_func, data=batch)

    def _per_sample_outputs(self, logits, tree, batch, logits_processor_func) -> dict:
        """verl's logits processor on every sample's own rows of the tree, labels rolled by one
        within the sample as verl rolls them; [1, T, ...] back to per-sample nested tensors."""
        rows = _sample_rows(tree)
        lengths = [int(r.shape[0]) for r in rows]
        tokens = tree.input_ids.to(logits.device)
        label = torch.cat([torch.roll(tokens[r], -1) for r in rows])[None]
        temperature = batch["temperature"]
        if not isinstance(temperature, torch.Tensor):
            temperature = torch.full((len(rows),), float(temperature))
        temperature = torch.cat([temperature[i].float().expand(n) for i, n in enumerate(lengths)])[None]
        flags = {k: tu.get_non_tensor_data(batch, key=k, default=False) for k in
                 ("calculate_sum_pi_squared", "calculate_entropy", "distillation_use_topk", "distillation_only")}
        out = self._lm_head_logits_processor(
            logits[:, torch.cat(rows).to(logits.device)], label, temperature.to(logits.device),
            logits_processor_func=logits_processor_func, batch=batch, data_format="thd", **flags)
        return {k: _nested(list(v[0].split(lengths))) for k, v in out.items()}


@EngineRegistry.register(model_type="value_model", backend="megatron", device=["cuda", "cpu"], vendor=VENDOR)
class TreeMegatronEngineWithValueHead(_TreeEngine, MegatronEngineWithValueHead):
    """verl's ``MegatronEngineWithValueHead`` with tree micro-batches and tree attention (the
    critic): each sample's values are the value head's output on its own rows."""

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        batch, tree, values = self._tree_forward(batch_iter, model)  # [1, N, 1]
        if tree.num_sequences == 0:
            return values, _no_loss
        output = _nested([values[0, r.to(values.device), 0] for r in _sample_rows(tree)])
        return output, partial(postprocess_micro_batch_func, data=batch)
