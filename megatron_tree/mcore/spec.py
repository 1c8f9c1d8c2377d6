"""Rewrite a Megatron-Core layer/block spec so that every self-attention uses tree attention.

The rewrite swaps ``SelfAttentionSubmodules.core_attention`` (or ``MLASelfAttentionSubmodules``')
for :class:`megatron_tree.mcore.core_attention.TreeCoreAttention` and sets the attention's
``attn_mask_type`` to ``AttnMaskType.arbitrary``; an ``MLASelfAttention`` (DeepSeek-V3, Kimi-K2)
becomes :class:`megatron_tree.mcore.mla.TreeMLASelfAttention` (its rotary part follows depth); an
``MoELayer`` becomes :class:`megatron_tree.mcore.moe.TreeMoELayer` (the same module and parameters,
with router losses computed as if unpacked); a ``GatedDeltaNet`` (Qwen3-Next, Qwen3.5) becomes
:class:`megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet` (its convolution and recurrence
follow the tree's root paths); in a hybrid stack spec (megatron-core >= 0.19's ``HybridStack``:
Nemotron-H, Nemotron 3) a ``MambaLayer`` and its ``MambaMixer`` become
:class:`megatron_tree.mcore.mamba.TreeMambaLayer` / ``TreeMambaMixer`` and the attention, MLA, gated
delta-net and MoE layers are rewritten as above; every other submodule (TE or local linear layers,
norms, dense MLPs, experts, routers) is kept. Attention it cannot rewrite (DeepSeek sparse
attention, cross attention, unknown attention or core-attention modules) raises ``ValueError``
naming the layer: nothing is skipped silently.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..core.attention import BACKENDS
from ..core.checks import check_int
from .core_attention import TreeCoreAttention
from .gated_delta_net import GatedDeltaNet, TreeGatedDeltaNet
from .mla import TreeMLASelfAttention
from .model import DepthRoPE
from .moe import TREE_LAYERS, ExpertRowParallelLinear, TreeMoELayer
from .rotary import TreeRotaryEmbedding

try:  # megatron-core >= 0.19
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
except ImportError:  # pragma: no cover - older megatron-core: no hybrid stack to rewrite
    HybridStack = HybridStackSubmodules = None
try:
    from .mamba import MambaLayer, MambaMixer, TreeMambaLayer, TreeMambaMixer
except ImportError:  # pragma: no cover - megatron-core without Mamba layers
    MambaLayer = MambaMixer = TreeMambaLayer = TreeMambaMixer = None

# Core-attention modules the rewrite knows to be plain softmax(QK^T)V attention, by class name so
# that TE's classes are recognized without importing transformer-engine.
_KNOWN_CORE_ATTENTION = {"DotProductAttention", "TEDotProductAttention", "TreeCoreAttention"}


def _module_class(spec_or_class: Any) -> Any:
    module = spec_or_class.module if isinstance(spec_or_class, ModuleSpec) else spec_or_class
    if isinstance(module, tuple):
        module = import_module(module)
    if isinstance(
        module, functools.partial
    ):  # megatron-core >= 0.19 builds some modules from partials
        module = module.func
    return module


def _class_name(module: Any) -> str:
    return getattr(module, "__name__", type(module).__name__)


def _rewrite_layer(layer_spec: Any, where: str, core_attention_spec: Any) -> Any:
    layer_cls = _module_class(layer_spec)
    if not (
        isinstance(layer_spec, ModuleSpec)
        and isinstance(layer_cls, type)
        and issubclass(layer_cls, TransformerLayer)
    ):
        raise ValueError(
            f"{where}: cannot rewrite {_class_name(layer_cls)} for tree attention; only "
            "TransformerLayer specs are supported here (Mamba layers live in a hybrid stack spec: "
            "rewrite the HybridStack spec, e.g. local_hybrid_stack_spec(), and build a "
            "TreeHybridModel)"
        )
    subs = layer_spec.submodules
    cross = getattr(subs, "cross_attention", IdentityOp)
    if _module_class(cross) is not IdentityOp:
        raise ValueError(
            f"{where}: has cross attention ({_class_name(_module_class(cross))}), which tree "
            "training does not support"
        )
    _rewrite_moe(subs, where)
    _rewrite_moe_layer(layer_spec, where)
    attention = subs.self_attention
    attention_cls = _module_class(attention)
    if attention_cls is IdentityOp:
        return layer_spec  # no attention in this layer: nothing to rewrite
    if _is_gated_delta_net(attention_cls):
        _to_tree_module(
            attention,
            attention_cls,
            GatedDeltaNet,
            TreeGatedDeltaNet,
            where,
            "gated delta-net",
            "its recurrence would run across the tree's branches",
        )
        return layer_spec
    latent = isinstance(attention_cls, type) and issubclass(attention_cls, MLASelfAttention)
    if not (
        isinstance(attention, ModuleSpec)
        and isinstance(attention_cls, type)
        and (issubclass(attention_cls, SelfAttention) or latent)
        and isinstance(attention.submodules, (SelfAttentionSubmodules, MLASelfAttentionSubmodules))
    ):
        raise ValueError(
            f"{where}: cannot rewrite self-attention {_class_name(attention_cls)} for tree "
            "attention; use a spec whose self_attention is SelfAttention or MLASelfAttention"
        )
    if latent:
        _to_tree_module(
            attention,
            attention_cls,
            MLASelfAttention,
            TreeMLASelfAttention,
            where,
            "multi-latent attention",
            "its rotary angles would follow packed offsets",
        )
    core_cls = _module_class(attention.submodules.core_attention)
    if _class_name(core_cls) == "DSAttention":
        raise ValueError(
            f"{where}: DeepSeek sparse attention (DSAttention: DeepSeek-V3.2, GLM-5) selects its "
            "keys by content with an indexer, which tree training does not support; use a model "
            "without it"
        )
    if _class_name(core_cls) not in _KNOWN_CORE_ATTENTION:
        raise ValueError(
            f"{where}: unknown core attention {_class_name(core_cls)}; tree attention replaces "
            f"only {sorted(_KNOWN_CORE_ATTENTION)}"
        )
    attention.params = {**attention.params, "attn_mask_type": AttnMaskType.arbitrary}
    attention.submodules.core_attention = core_attention_spec
    return layer_spec


def _is_gated_delta_net(cls: Any) -> bool:
    return GatedDeltaNet is not None and isinstance(cls, type) and issubclass(cls, GatedDeltaNet)


def _to_tree_module(
    spec: Any, cls: type, stock: type, tree: type, where: str, kind: str, why: str
) -> None:
    """The spec's ``stock`` module becomes its ``tree`` subclass (same parameters); a ``tree``
    subclass is kept; any other subclass of ``stock`` is refused (ValueError naming ``why``)."""
    if issubclass(cls, tree):
        return
    if cls is not stock or not isinstance(spec, ModuleSpec):
        raise ValueError(
            f"{where}: custom {kind} {_class_name(cls)}: {why}; derive it from "
            f"{tree.__module__}.{tree.__name__}"
        )
    spec.module = tree


def _rewrite_moe(subs: Any, where: str) -> None:
    mlp = getattr(subs, "mlp", None)
    mlp_cls = _module_class(mlp) if mlp is not None else None
    if not (isinstance(mlp_cls, type) and issubclass(mlp_cls, MoELayer)) or issubclass(
        mlp_cls, TreeMoELayer
    ):
        return
    if mlp_cls is not MoELayer:
        raise ValueError(
            f"{where}: custom MoE layer {_class_name(mlp_cls)}: its router losses would count a "
            "shared tree token once; derive it from megatron_tree.mcore.moe.TreeMoELayer instead "
            "of MoELayer"
        )
    if isinstance(mlp, ModuleSpec):
        mlp.module = TreeMoELayer
    elif isinstance(mlp, functools.partial):
        subs.mlp = functools.partial(TreeMoELayer, *mlp.args, **mlp.keywords)
    else:
        raise ValueError(f"{where}: cannot rewrite the MoE layer given as {type(mlp).__name__}")
    moe_subs = (
        subs.mlp.submodules
        if isinstance(subs.mlp, ModuleSpec)
        else subs.mlp.keywords.get("submodules")
    )
    experts = getattr(moe_subs, "experts", None)
    expert_subs = (
        experts.keywords.get("submodules")
        if isinstance(experts, functools.partial)
        else getattr(experts, "submodules", None)
    )
    if (
        _module_class(experts) is SequentialMLP
        and getattr(expert_subs, "linear_fc2", None) is RowParallelLinear
    ):
        expert_subs.linear_fc2 = ExpertRowParallelLinear


def _rewrite_moe_layer(layer_spec: Any, where: str) -> None:
    """A layer with a tree MoE layer becomes its tree layer (which hands the MoE layer the
    micro-batch's mask plan; :class:`~megatron_tree.mcore.moe.TreeTransformerLayer`)."""
    if not (
        isinstance(_module_class(layer_spec.submodules.mlp), type)
        and issubclass(_module_class(layer_spec.submodules.mlp), TreeMoELayer)
    ):
        return
    layer_cls = _module_class(layer_spec)
    if layer_cls in TREE_LAYERS.values():
        return
    if layer_cls not in TREE_LAYERS:
        raise ValueError(
            f"{where}: an MoE layer inside {_class_name(layer_cls)}: tree MoE layers need "
            f"{sorted(_class_name(c) for c in TREE_LAYERS)} (their tree versions hand the router "
            "its micro-batch's token weights)"
        )
    module = layer_spec.module
    layer_spec.module = (
        functools.partial(TREE_LAYERS[layer_cls], *module.args, **module.keywords)
        if isinstance(module, functools.partial)
        else TREE_LAYERS[layer_cls]
    )


def _rewrite_mamba_layer(layer_spec: Any, where: str) -> None:
    """A ``MambaLayer`` spec becomes a ``TreeMambaLayer`` (it hands its mixer the tree mask) and its
    ``MambaMixer`` a ``TreeMambaMixer`` (same parameters)."""
    layer_cls = _module_class(layer_spec)
    if layer_cls is IdentityOp or TreeMambaLayer is None:
        return  # no Mamba layers (without tree ones, check_tree_model refuses a built stock mixer)
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, MambaLayer)):
        raise ValueError(
            f"{where}: cannot rewrite {_class_name(layer_cls)} for tree training; expected a "
            "MambaLayer"
        )
    _to_tree_module(
        layer_spec,
        layer_cls,
        MambaLayer,
        TreeMambaLayer,
        where,
        "Mamba layer",
        "Megatron's MambaLayer drops the attention mask, which carries the tree to the mixer",
    )
    mixer = layer_spec.submodules.mixer
    _to_tree_module(
        mixer,
        _module_class(mixer),
        MambaMixer,
        TreeMambaMixer,
        f"{where} mixer",
        "Mamba mixer",
        "its convolution and scan would run across the tree's branches",
    )


# The HybridStack layers rewritten like GPT layers (the pattern symbols they build); mlp_layer (-)
# mixes no tokens, dsa_layer (D) is refused by TreeHybridModel, mtp_block_spec (/) too.
_HYBRID_TRANSFORMER_LAYERS = ("attention_layer", "mla_layer", "gdn_layer", "moe_layer")


def _rewrite_hybrid(subs: Any, core_attention_spec: Any) -> None:
    for name in _HYBRID_TRANSFORMER_LAYERS:
        layer = getattr(subs, name)
        if _module_class(layer) is not IdentityOp:
            setattr(subs, name, _rewrite_layer(layer, f"hybrid {name}", core_attention_spec))
    _rewrite_mamba_layer(subs.mamba_layer, "hybrid mamba_layer")


def _is_hybrid_stack(spec: Any) -> bool:
    cls = _module_class(spec)
    return HybridStack is not None and isinstance(cls, type) and issubclass(cls, HybridStack)


def tree_attention_spec(spec: Any, *, backend: str = "auto", block_size: int = 128) -> Any:
    """A copy of ``spec`` with tree attention in every self-attention layer.

    Args:
        spec: a TransformerLayer ``ModuleSpec`` (e.g. ``get_gpt_layer_local_spec()`` or
            ``get_gpt_layer_with_transformer_engine_spec()``), a ``TransformerBlockSubmodules``
            (e.g. ``get_gpt_decoder_block_spec(config, ...)``), a TransformerBlock ``ModuleSpec``,
            a list of layer specs, or a HybridStack ``ModuleSpec`` / ``HybridStackSubmodules``
            (megatron-core >= 0.19: ``hybrid_stack_spec``,
            :func:`~megatron_tree.mcore.hybrid.local_hybrid_stack_spec`). The input is not
            modified.
        backend: TreeCoreAttention backend (``"auto"``, ``"sdpa"``, ``"flex"``, ``"block_sparse"``).
        block_size: tile size of the flex / block-sparse backends.

    Returns:
        The rewritten spec, of the same kind as ``spec``.

    Raises:
        ValueError: a layer whose attention cannot be rewritten (the message names the layer).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    check_int("block_size", block_size, minimum=1)
    core = ModuleSpec(
        module=TreeCoreAttention, params={"backend": backend, "block_size": block_size}
    )
    spec = copy.deepcopy(spec)

    def rewrite_list(layer_specs, prefix):
        return [_rewrite_layer(s, f"{prefix}layer {i}", core) for i, s in enumerate(layer_specs)]

    if isinstance(spec, TransformerBlockSubmodules):
        spec.layer_specs = rewrite_list(spec.layer_specs, "block ")
        return spec
    if HybridStackSubmodules is not None and isinstance(spec, HybridStackSubmodules):
        _rewrite_hybrid(spec, core)
        return spec
    if isinstance(spec, ModuleSpec) and _is_hybrid_stack(spec):
        if not isinstance(spec.submodules, HybridStackSubmodules):
            raise ValueError("HybridStack spec without HybridStackSubmodules cannot be rewritten")
        _rewrite_hybrid(spec.submodules, core)
        return spec
    if isinstance(spec, list):
        return rewrite_list(spec, "")
    if isinstance(spec, ModuleSpec):
        cls = _module_class(spec)
        if isinstance(cls, type) and issubclass(cls, TransformerBlock):
            if not isinstance(spec.submodules, TransformerBlockSubmodules):
                raise ValueError(
                    "TransformerBlock spec without TransformerBlockSubmodules cannot be rewritten"
                )
            spec.submodules.layer_specs = rewrite_list(spec.submodules.layer_specs, "block ")
            return spec
        return _rewrite_layer(spec, "layer spec", core)
    raise ValueError(
        f"cannot rewrite a spec of type {type(spec).__name__}; pass a layer ModuleSpec, a "
        "TransformerBlockSubmodules, a TransformerBlock ModuleSpec, a list of layer specs or a "
        "HybridStack spec"
    )


def _swap_norms(spec: Any, norm: Any) -> Any:
    """Every torch-norm builder (``WrappedTorchNorm``, the local spec's norm) in ``spec`` ->
    ``norm``."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def is_norm(value):
        return value is WrappedTorchNorm or (
            isinstance(value, type) and value.__name__ in ("FusedLayerNorm",)
        )

    subs = getattr(spec, "submodules", None)
    if subs is None:
        return spec
    for name, value in vars(subs).items():
        if is_norm(value):
            setattr(subs, name, norm)
        elif isinstance(value, ModuleSpec):
            _swap_norms(value, norm)
    return spec


def local_hybrid_block_spec(
    config: Any, vp_stage: int | None = None, pp_rank: int | None = None
) -> Any:
    """The block spec of a gated delta-net hybrid (Qwen3-Next, Qwen3.5) from Megatron-Core's local
    modules, for machines without transformer-engine.

    Megatron-Core 0.19's ``get_transformer_block_with_experimental_attention_variant_spec`` builds
    these models from transformer-engine modules only. This is the same layer pattern
    (``config.linear_attention_freq``: gated delta-net or softmax attention;
    ``config.moe_layer_freq``: MoE or dense MLP) with ``ColumnParallelLinear`` /
    ``RowParallelLinear`` / separate norms (:class:`~megatron_tree.mcore.norm.LocalNorm`, which has
    zero-centered gamma), sliced to the pipeline stage. Pass the result to
    :func:`tree_attention_spec` (the Megatron-Bridge patch does).

    Returns:
        TransformerBlockSubmodules.
    """
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from .norm import LocalNorm

    if config.experimental_attention_variant not in (None, "gated_delta_net"):
        raise ValueError(
            f"experimental_attention_variant={config.experimental_attention_variant!r}: tree "
            "training supports gated_delta_net (DeepSeek sparse attention selects keys by "
            "content, not by tree)"
        )
    linear = (
        variants.get_linear_attention_pattern(config)
        if config.experimental_attention_variant
        else [0] * config.num_layers
    )
    moe = (
        variants.get_moe_layer_pattern(config)
        if config.num_moe_experts
        else [0] * config.num_layers
    )
    kinds = {}
    for sparse in set(moe):
        base = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if sparse else None,
            moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        )
        kinds[sparse] = _swap_norms(base, LocalNorm)
    gdn = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=LocalNorm, out_proj=RowParallelLinear
        ),
    )
    layers = []
    for is_linear, sparse in zip(linear, moe):
        layer = copy.deepcopy(kinds[sparse])
        if is_linear:
            layer.submodules.self_attention = copy.deepcopy(gdn)
        layers.append(layer)
    if config.pipeline_model_parallel_layout is not None:
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        ids = range(
            offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        )
    return TransformerBlockSubmodules(layer_specs=[layers[i] for i in ids], layer_norm=LocalNorm)


# Modules that mix tokens along the sequence and know nothing of trees (by class name, so that
# transformer-engine's and Mamba's classes are recognized without importing them).
_STOCK_MIXERS = {
    "DotProductAttention",
    "TEDotProductAttention",
    "GatedDeltaNet",
    "MambaMixer",
    "MLASelfAttention",
    "DSAttention",
    "FlashAttention",
}


def check_tree_model(model: Any) -> None:
    """Raise ValueError unless every module of ``model`` that mixes or rotates tokens is a tree
    module.

    Every ``TransformerLayer``'s self-attention must be a tree one (``TreeCoreAttention`` as its
    core attention, or ``TreeGatedDeltaNet``, or none), and no stock mixer (core attention, gated
    delta-net, Mamba mixer, MLA) may sit anywhere else: it would run causally over the packed
    positions and silently mix branches. Every rope / YaRN rotary module must follow token depth
    (:class:`~megatron_tree.mcore.rotary.TreeRotaryEmbedding`, owned by a ``TreeGPTModel``, a
    ``TreeHybridModel`` or a ``TreeMLASelfAttention``): a stock ``GPTModel`` or ``HybridModel``
    built with :func:`tree_attention_spec` rotates every later branch by its packed offset. Mamba
    mixers must be ``TreeMambaMixer``s. The error names the first such module and the fix.
    Checked once per model object (the result is remembered on it).
    """
    if getattr(model, "_megatron_tree_checked", False):
        return
    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer):
            attention = module.self_attention
            core = getattr(attention, "core_attention", None)
            if not (
                isinstance(attention, IdentityOp)
                or isinstance(core, TreeCoreAttention)
                or (TreeGatedDeltaNet is not None and isinstance(attention, TreeGatedDeltaNet))
            ):
                _refuse_mixer(model, f"{name}.self_attention", attention if core is None else core)
        elif type(module).__name__ in _STOCK_MIXERS or _is_stock_mamba(module):
            _refuse_mixer(model, name, module)
    for name, module in model.named_modules():  # mixers first: a stock model names its attention
        _check_rotary(name, module)
    object.__setattr__(model, "_megatron_tree_checked", True)


def _is_stock_mamba(module: Any) -> bool:
    """A Mamba mixer (a MambaMixer subclass too) that is not a tree one."""
    return (
        MambaMixer is not None
        and isinstance(module, MambaMixer)
        and not isinstance(module, TreeMambaMixer)
    )


def _check_rotary(name: str, module: Any) -> None:
    """Refuse a module whose rotary table would follow packed offsets, not token depths: a stock
    rotary module (GPTModel's or HybridModel's rope / YaRN, a stock MLA's), or one of ours owned by
    a module that does not hand it the depths (a ``DepthRoPE`` model or a tree MLA does)."""
    rotary = getattr(module, "rotary_pos_emb", None)
    if not isinstance(rotary, RotaryEmbedding):
        return  # no rotary, or one that reads position_ids itself (mrope)
    if isinstance(module, MLASelfAttention):
        owner, fix = TreeMLASelfAttention, "Build the model with a spec from tree_attention_spec()"
    else:
        owner = DepthRoPE  # TreeGPTModel, TreeHybridModel
        tree = (
            "TreeHybridModel (megatron_tree.mcore.hybrid)"
            if _is_hybrid_model(module)
            else "TreeGPTModel (megatron_tree.mcore.model)"
        )
        fix = (
            f"Build a {tree} instead of {type(module).__name__}, with the same arguments, or "
            "build the model through patch_bridge_for_tree_training / "
            "patch_megatron_bridge_for_tree_training"
        )
    if isinstance(module, owner) and isinstance(rotary, TreeRotaryEmbedding):
        return
    raise ValueError(
        f"{name or 'model'} ({type(module).__name__}) rotates by packed offset, not by token depth "
        f"(its rotary_pos_emb is a {type(rotary).__name__}): every branch after the first in a "
        f"packed tree would get the wrong rotary angles. {fix}: its rotary follows depth."
    )


def _is_hybrid_model(module: Any) -> bool:
    return any(cls.__name__ == "HybridModel" for cls in type(module).__mro__)


def _refuse_mixer(model: Any, name: str, module: Any) -> None:
    kind = type(module).__name__
    hint = {
        "MambaMixer": " tree_attention_spec() makes a hybrid stack's MambaLayer / MambaMixer a "
        "TreeMambaLayer / TreeMambaMixer (megatron_tree.mcore.mamba)."
    }.get(kind, "")
    if _is_hybrid_model(model) and not isinstance(model, DepthRoPE):
        hint += (
            " For a HybridModel, build a TreeHybridModel (megatron_tree.mcore.hybrid) with the "
            "same arguments and its stack spec rewritten by tree_attention_spec()."
        )
    raise ValueError(
        f"{name or 'model'} is a stock {kind}, which would attend across the tree's branches; "
        "build the model with a spec from tree_attention_spec() (or through "
        f"patch_bridge_for_tree_training / patch_megatron_bridge_for_tree_training).{hint}"
    )
