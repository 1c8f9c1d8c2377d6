"""``patch_bridge_for_tree_training``: make mbridge build tree-attention models.

mbridge (0.15.1) builds a model in ``bridge.get_model()`` through ``LLMBridge._model_provider``,
which calls ``self._get_transformer_layer_spec()`` (the TE block spec) and the module global
``GPTModel`` of ``mbridge.core.llm_bridge``. ``AutoBridge.from_pretrained`` only creates the bridge;
no model exists yet. So the patch binds to every bridge *instance* created inside the block:

* its layer spec is rewritten with :func:`megatron_tree.mcore.spec.tree_attention_spec`; without
  transformer-engine the local spec is used instead of the TE spec (TE cannot be imported on CPU),
  with ``normalization`` from the config and ``sequence_parallel`` switched off (the local spec's
  torch norms do not support it) unless the CPU patch (:mod:`megatron_tree.patches.megatron_cpu`,
  whose norms take it) is applied and TP > 1;
* its models are :class:`megatron_tree.mcore.model.TreeGPTModel` (depth RoPE);
* with the local spec, its weight-name maps also know the local spec's ``input_layernorm.weight``
  and ``pre_mlp_layernorm.weight`` (and multi-latent attention's ``q_layernorm`` /
  ``kv_layernorm``: TE fuses those norms into the linear layers), so ``load_weights`` /
  ``export_weights`` map HuggingFace checkpoints correctly;
* its router and config match what the HF model computes where mbridge 0.15.1 gets them wrong
  (softmax order, shared-expert gate and size, group-limited routing; see ``_match_hf_router``),
  and its attention backend is ``auto`` (tree attention replaces TE's core attention);
* a DeepSeek-V3 bridge is corrected before its ``Bridge.__init__`` builds the config
  (``megatron_tree.patches.mbridge_deepseek.bind``: mbridge 0.15.1 cannot build it at all on
  megatron-core 0.16 / 0.17, and gets its RoPE type, routing and MTP setting wrong).

These instance bindings outlive the block, so ``get_model`` may be called after it. Process-wide
changes: while the block is open, a hook on ``mbridge.core.bridge.Bridge.__init__`` binds new
instances (restored on exit, also on exceptions); and while a bound bridge's model provider runs
(inside ``get_model``), the module global ``mbridge.core.llm_bridge.GPTModel`` (and that of a
bridge module with its own provider: ``mbridge.models.deepseek_v3``) is swapped for
``TreeGPTModel`` and restored afterwards, so another thread building an mbridge model at that
moment would get a ``TreeGPTModel`` too. On megatron-core >= 0.17 the same holds for the
``ModelType.encoder_and_decoder`` property that mbridge 0.15.1 needs there
(``megatron_tree.patches.mbridge_compat``), put back while a bound bridge's ``get_model`` runs.

On a CPU-only machine mbridge's ``get_model`` calls ``Module.cuda()``; apply the CPU runtime patch
(``megatron_tree.patches.megatron_cpu``), which makes it a no-op there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any

from mbridge.core import bridge as bridge_module
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.enums import AttnBackend

from ..core.attention import BACKENDS
from ..mcore.model import TreeGPTModel
from ..mcore.spec import tree_attention_spec
from ..patches import mbridge_compat, mbridge_deepseek
from ..patches._scoped import swapped
from ._hook import InitHook, cpu_patch_applied
from .load_check import raise_unsourced, safetensors_keys
from .routing import sigmoid_router_fields

logger = logging.getLogger(__name__)

_BOUND_ATTR = "_megatron_tree_tree_training"


def _transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


# Multi-latent attention: the local spec's separate latent norms, and the TE names (norms fused into
# the up projections) whose HF weights they take.
_MLA_NORMS = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
_INPUT_NORM = re.compile(r"^decoder\.layers\.\d+\.input_layernorm\.weight$")


def _extend_weight_maps_for_local_spec(bridge: Any) -> None:
    """Instance copies of the maps with the local spec's separate norm weights added.

    TE fuses the input norm into the first attention projection (``linear_qkv``; multi-latent
    attention bridges map ``input_layernorm`` already), dense layers' pre-MLP norm into
    ``linear_fc1``, and MLA's q / kv latent norms into ``linear_q_up_proj`` / ``linear_kv_up_proj``;
    the local spec keeps all of them as separate norms. Some bridges route names with their own
    ``_weight_name_mapping_mcore_to_hf`` and have no route for ``input_layernorm`` (GLM-4.5's raises
    ``NotImplementedError: Unsupported parameter name: decoder.layers.0.input_layernorm.weight``),
    so the bound bridge sends that name to ``_OTHER_MAPPING`` itself.
    """
    attention = dict(type(bridge)._ATTENTION_MAPPING)
    mlp = dict(type(bridge)._MLP_MAPPING)
    other = dict(type(bridge)._OTHER_MAPPING)
    input_norm = attention.get(
        "self_attention.linear_qkv.layer_norm_weight", attention.get("input_layernorm.weight")
    )
    # Dense TE specs fuse the pre-MLP norm into linear_fc1; MoE specs keep a separate
    # pre_mlp_layernorm, which mbridge's MoE bridges already map (as the local spec names it).
    pre_mlp_norm = mlp.get("mlp.linear_fc1.layer_norm_weight", mlp.get("pre_mlp_layernorm"))
    if input_norm is None or pre_mlp_norm is None:
        raise ValueError(
            f"{type(bridge).__name__} has no fused-norm weight mapping to derive the local spec's "
            "norm names from; tree training through mbridge without transformer-engine supports "
            "GPT bridges with RMSNorm/LayerNorm layers (Qwen2, Qwen3, Llama, Qwen3-MoE, "
            "DeepSeek-V3, ...)"
        )
    for local, fused in _MLA_NORMS.items():
        if fused in attention and local not in attention:
            attention[local] = list(attention[fused])
    # mbridge routes names without ".self_attention." and without "mlp" to _OTHER_MAPPING, and
    # "pre_mlp_layernorm" (it contains "mlp") to _MLP_MAPPING.
    other["input_layernorm.weight"] = list(input_norm)
    mlp = {"pre_mlp_layernorm.weight": list(pre_mlp_norm), **mlp}
    bridge._ATTENTION_MAPPING = attention
    bridge._OTHER_MAPPING = other
    bridge._MLP_MAPPING = mlp
    route = bridge._weight_name_mapping_mcore_to_hf

    def mcore_to_hf(name: str) -> list[str]:
        return bridge._weight_name_mapping_other(name) if _INPUT_NORM.match(name) else route(name)

    bridge._weight_name_mapping_mcore_to_hf = mcore_to_hf


# The local spec's SequentialMLP experts:
# decoder.layers.{l}.mlp.experts.local_experts.{i}.linear_fc{1,2}.weight
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _match_hf_router(bridge: Any) -> None:
    """Set Megatron's router to what the HF model computes, where mbridge 0.15.1 gets it wrong.

    Softmax routers: HF Qwen2-MoE / Qwen3-MoE take a softmax over all experts, keep the top k and,
    only with ``norm_topk_prob``, renormalize them to sum to 1. Megatron's softmax router
    renormalizes when the softmax follows the top-k (``moe_router_pre_softmax=False``) and does not
    when it precedes it (``True``). mbridge hard-codes one order per architecture (Qwen3-MoE:
    renormalized, Qwen2-MoE: not), which is wrong for checkpoints with the other setting.

    HF Qwen2-MoE scales its shared expert by ``sigmoid(shared_expert_gate(x))`` (its config names
    the shared expert ``shared_expert_intermediate_size``); mbridge maps that weight to Megatron's
    ``shared_experts.gate_weight`` but never sets ``moe_shared_expert_gate``, so the gate would be
    missing (log-probs off by O(1)). GLM-4.5's bridge inherits that map entry, but GLM-4.5 (like
    DeepSeek-V3: ``n_shared_experts``) has no gate, so it must stay off there.

    Sigmoid routers (DeepSeek-V3, GLM-4.5): see :func:`_match_hf_sigmoid_router`.
    """
    if not bridge.config.num_moe_experts:
        return
    config, hf_config = bridge.config, bridge.hf_config
    extra = {}
    norm_topk_prob = getattr(hf_config, "norm_topk_prob", None)
    if (
        norm_topk_prob is not None
        and config.moe_router_score_function == "softmax"
        and config.moe_router_pre_softmax != (not norm_topk_prob)
    ):
        extra["moe_router_pre_softmax"] = not norm_topk_prob
    if (
        config.moe_shared_expert_intermediate_size
        and not config.moe_shared_expert_gate
        and "shared_experts.gate_weight" in type(bridge)._MLP_MAPPING
        and getattr(hf_config, "shared_expert_intermediate_size", None)
    ):
        extra["moe_shared_expert_gate"] = True
    if config.moe_router_score_function == "sigmoid":
        extra.update(_match_hf_sigmoid_router(bridge))
    if extra:
        bridge.set_extra_args(**extra)


def _match_hf_sigmoid_router(bridge: Any) -> dict:
    """Extra args that make a sigmoid router (HF DeepSeek-V3 / GLM-4.5 ``TopkRouter``) match HF.

    * Group-limited routing (HF ``n_group`` / ``topk_group``): mbridge's GLM-4.5 bridge never sets
      it (its DeepSeek-V3 bridge neither: ``megatron_tree.patches.mbridge_deepseek``), so with
      ``n_group > 1`` Megatron would route over all experts.
    * The shared expert's size: HF's is ``moe_intermediate_size * n_shared_experts``; mbridge's
      GLM-4.5 bridge drops the factor.
    * HF divides the chosen sigmoid scores by their sum only with ``norm_topk_prob``; Megatron
      always does (top-k > 1), so ``norm_topk_prob=False`` cannot be reproduced: ValueError.
    """
    config, hf_config = bridge.config, bridge.hf_config
    fields = sigmoid_router_fields(hf_config, where=type(bridge).__name__)
    extra = {k: v for k, v in fields.items() if getattr(config, k) != v}
    shared = getattr(hf_config, "n_shared_experts", None)
    if (
        shared
        and config.moe_shared_expert_intermediate_size != hf_config.moe_intermediate_size * shared
    ):
        extra["moe_shared_expert_intermediate_size"] = hf_config.moe_intermediate_size * shared
    return extra


def _bind_local_moe(bridge: Any) -> None:
    """MoE through the local spec: SequentialMLP experts, no CUDA-only options, weight names.

    mbridge's MoE maps know TE's grouped experts (``mlp.experts.linear_fc1.weight{e}``, ``e`` the
    global expert); the local spec without grouped GEMM names them
    ``mlp.experts.local_experts.{i}.linear_fc1.weight`` (``i`` the expert on this expert-parallel
    rank). The bound bridge maps the latter to the former (global index ``i + ep_rank *
    num_local_experts``), so mbridge's HF names, gate/up merge and TP split apply unchanged.
    """
    # Grouped GEMM needs transformer-engine or the grouped_gemm package; persist_layer_norm is
    # apex-only (the torch norms assert it off); the shared-expert overlap creates a CUDA stream.
    bridge.set_extra_args(
        moe_grouped_gemm=False, persist_layer_norm=False, moe_shared_expert_overlap=False
    )
    mpu = bridge.mpu
    if mpu.etp_size != mpu.tp_size:
        raise ValueError(
            f"expert_tensor_parallel_size={mpu.etp_size} differs from "
            f"tensor_model_parallel_size={mpu.tp_size}: without transformer-engine, tree training "
            "through mbridge loads experts as the local spec's SequentialMLP, split like the "
            "dense layers; initialize parallel_state with expert_tensor_parallel_size equal to "
            "the tensor-parallel size"
        )
    original = bridge._weight_name_mapping_mcore_local_to_global

    def local_to_global(model, consider_ep: bool = True) -> dict[str, str]:
        names = original(model, consider_ep=False)
        per_rank = bridge.config.num_moe_experts // mpu.ep_size
        offset = per_rank * mpu.ep_rank if consider_ep else 0
        for local, name in names.items():
            match = _LOCAL_EXPERT.match(name)
            if match:
                prefix, expert, fc = match.groups()
                names[local] = f"{prefix}.{fc}.weight{int(expert) + offset}"
        return names

    bridge._weight_name_mapping_mcore_local_to_global = local_to_global


def _provider_modules(bridge: Any) -> list:
    """The modules whose ``GPTModel`` global the bridge's model provider reads.

    ``LLMBridge._model_provider`` reads ``mbridge.core.llm_bridge.GPTModel``; a bridge that defines
    its own provider (DeepSeek-V3's) reads its own module's import of it.
    """
    modules = []
    for cls in type(bridge).__mro__:
        module = sys.modules.get(cls.__module__) if "_model_provider" in vars(cls) else None
        found = getattr(module, "GPTModel", None)
        if isinstance(found, type) and issubclass(found, GPTModel) and module not in modules:
            modules.append(module)
    return modules


def _unsourced(bridge: Any, models: list, file_keys: set[str]) -> dict:
    """{global parameter name: the HF keys it needs that the checkpoint lacks (None: no mapping)}
    over ``models``, by the bridge's own name mappings, as its ``load_weights`` walks them."""
    unsourced = {}
    for model in models:
        state = model.state_dict()
        for local, name in bridge._weight_name_mapping_mcore_local_to_global(model).items():
            if "_extra_state" in local:
                continue
            try:
                hf_names = bridge._weight_name_mapping_mcore_to_hf(name)
            except NotImplementedError:
                unsourced[name] = None
                continue
            missing = [k for k in hf_names if k not in file_keys]
            value_head = hf_names[0] == "lm_head.weight" and state[local].shape[0] == 1
            if missing and not value_head:  # (mbridge keeps a value model's head as built)
                unsourced[name] = missing
    return unsourced


def _bind_load_check(bridge: Any) -> None:
    """``bridge.load_weights`` first checks that every parameter has its keys in the checkpoint
    (:func:`~megatron_tree.bridges.load_check.raise_unsourced`), before any weight is read."""
    original = bridge.load_weights

    @functools.wraps(original)
    def load_weights(models, weights_path, *args, **kwargs):
        hf_dir = bridge._get_actual_hf_path(weights_path)
        keys = safetensors_keys(hf_dir)
        raise_unsourced(
            f"mbridge {type(bridge).__name__} loading {hf_dir}",
            _unsourced(bridge, models, keys),
            keys,
        )
        return original(models, weights_path, *args, **kwargs)

    bridge.load_weights = load_weights


def _bind(bridge: Any, backend: str, block_size: int) -> None:
    """Make ``bridge`` build tree-attention models from now on (idempotent)."""
    if getattr(bridge, _BOUND_ATTR, None) is not None:
        return
    use_te = _transformer_engine_available()
    _match_hf_router(bridge)
    if bridge.config.attention_backend != AttnBackend.auto:
        # Tree attention replaces the core attention, so TE's backend is moot; but Megatron's
        # LanguageModule asserts that the NVTE_* variables an earlier model set in this process
        # match its backend, and mbridge's DeepSeek-V3 bridge asks for "fused" where the others
        # (and Megatron-Bridge) use "auto": building both kinds in one process raised.
        bridge.set_extra_args(attention_backend=AttnBackend.auto)
    if not use_te:
        _extend_weight_maps_for_local_spec(bridge)
        if bridge.config.num_moe_experts:
            _bind_local_moe(bridge)
        keep = cpu_patch_applied() and bridge.config.tensor_model_parallel_size > 1
        if bridge.config.sequence_parallel and not keep:
            # (the CPU patch's torch norms take sequence_parallel: kept under it at TP > 1)
            logger.info("tree training without transformer-engine: sequence_parallel switched off")
            bridge.set_extra_args(sequence_parallel=False)

    original_spec = bridge._get_transformer_layer_spec
    original_provider = bridge._model_provider

    # megatron-core versions differ in whether the block spec takes vp_stage; ask once.
    has_vp_stage = (
        "vp_stage" in inspect.signature(gpt_layer_specs.get_gpt_decoder_block_spec).parameters
    )

    def get_transformer_layer_spec(vp_stage=None):
        if use_te:
            spec = original_spec(vp_stage)
        else:
            bridge.has_vp_stage = has_vp_stage  # read by mbridge's provider
            extra = {"vp_stage": vp_stage} if has_vp_stage else {}
            spec = gpt_layer_specs.get_gpt_decoder_block_spec(
                bridge.config,
                use_transformer_engine=False,
                normalization=bridge.config.normalization,
                **extra,
            )
        return tree_attention_spec(spec, backend=backend, block_size=block_size)

    def model_provider(*args, **kwargs):
        provider = original_provider(*args, **kwargs)

        @functools.wraps(provider)
        def tree_provider(*pargs, **pkwargs):
            with contextlib.ExitStack() as stack:
                for module in _provider_modules(bridge):
                    stack.enter_context(swapped(module, GPTModel=TreeGPTModel))
                model = provider(*pargs, **pkwargs)
            if not isinstance(model, TreeGPTModel):
                raise ValueError(
                    f"{type(bridge).__name__} built {type(model).__name__}, not a GPTModel; tree "
                    "training through mbridge supports GPT-style language models"
                )
            return model

        return tree_provider

    original_get_model = bridge.get_model

    @functools.wraps(original_get_model)
    def get_model(*args, **kwargs):
        with mbridge_compat.mbridge_compat():  # no-op unless megatron-core >= 0.17 needs it
            return original_get_model(*args, **kwargs)

    bridge._get_transformer_layer_spec = get_transformer_layer_spec
    bridge._model_provider = model_provider
    bridge.get_model = get_model
    _bind_load_check(bridge)
    setattr(bridge, _BOUND_ATTR, {"backend": backend, "block_size": block_size, "use_te": use_te})


@contextlib.contextmanager
def patch_bridge_for_tree_training(
    enable: bool = True, *, backend: str = "auto", block_size: int = 128
) -> Iterator[None]:
    """Bridges created inside this block build tree-attention models with depth RoPE.

    Usage::

        with patch_bridge_for_tree_training():
            bridge = AutoBridge.from_pretrained(hf_path, dtype=torch.float32)
        model = bridge.get_model(weight_path=hf_path, bf16=False)   # inside or after the block
        logits = model[0](input_ids, position_ids, attention_mask=tree_attention_mask(tree))

    On a CPU-only machine also apply ``megatron_tree.patches.megatron_cpu`` (Megatron and mbridge
    call CUDA while building a model).

    Args:
        enable: False makes the block a no-op (convenient for switching tree training off); a
            disabled block nested in an enabled one creates plain bridges. In nested enabled
            blocks the innermost block's ``backend`` / ``block_size`` apply.
        backend: TreeCoreAttention backend for the models these bridges build.
        block_size: tile size of the flex / block-sparse backends.

    Raises:
        ValueError: unknown backend; or, at ``get_model``, a layer that cannot use tree attention.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    with _HOOK.block(
        bridge_module.Bridge, {"backend": backend, "block_size": block_size} if enable else None
    ):
        yield


def _before_init(bridge: Any) -> None:
    if mbridge_deepseek.applies_to(bridge):
        mbridge_deepseek.bind(bridge)  # before __init__ builds the config mbridge gets wrong


_HOOK = InitHook(bind=_bind, before=_before_init)


def is_tree_training_bridge(bridge: Any) -> bool:
    """True if ``bridge`` was created inside :func:`patch_bridge_for_tree_training`."""
    return getattr(bridge, _BOUND_ATTR, None) is not None
