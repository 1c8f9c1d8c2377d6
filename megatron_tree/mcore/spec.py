"""Rewrite a Megatron-Core layer/block spec so that every self-attention uses tree attention.

The rewrite swaps ``SelfAttentionSubmodules.core_attention`` for
:class:`megatron_tree.mcore.core_attention.TreeCoreAttention` and sets the attention's ``attn_mask_type`` to
``AttnMaskType.arbitrary``; an ``MoELayer`` becomes :class:`megatron_tree.mcore.moe.TreeMoELayer`
(the same module and parameters, with router losses computed as if unpacked); every other submodule
(TE or local linear layers, norms, dense MLPs, experts, routers) is kept. Attention it cannot rewrite (multi-latent attention, Mamba/hybrid layers, cross attention,
unknown attention or core-attention modules) raises ``ValueError`` naming the layer: nothing is
skipped silently.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..core.attention import BACKENDS
from ..core.checks import check_int
from .core_attention import TreeCoreAttention
from .moe import TreeMoELayer

# Core-attention modules the rewrite knows to be plain softmax(QK^T)V attention, by class name so
# that TE's classes are recognized without importing transformer-engine.
_KNOWN_CORE_ATTENTION = {"DotProductAttention", "TEDotProductAttention", "TreeCoreAttention"}


def _module_class(spec_or_class: Any) -> Any:
    module = spec_or_class.module if isinstance(spec_or_class, ModuleSpec) else spec_or_class
    if isinstance(module, tuple):
        module = import_module(module)
    if isinstance(module, functools.partial):  # megatron-core >= 0.19 builds some modules from partials
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
            "TransformerLayer specs are supported (Mamba/hybrid layers are not)"
        )
    subs = layer_spec.submodules
    cross = getattr(subs, "cross_attention", IdentityOp)
    if _module_class(cross) is not IdentityOp:
        raise ValueError(
            f"{where}: has cross attention ({_class_name(_module_class(cross))}), which tree "
            "training does not support"
        )
    _rewrite_moe(subs, where)
    attention = subs.self_attention
    attention_cls = _module_class(attention)
    if attention_cls is IdentityOp:
        return layer_spec  # no attention in this layer: nothing to rewrite
    if not (
        isinstance(attention, ModuleSpec)
        and isinstance(attention_cls, type)
        and issubclass(attention_cls, SelfAttention)
        and isinstance(attention.submodules, SelfAttentionSubmodules)
    ):
        raise ValueError(
            f"{where}: cannot rewrite self-attention {_class_name(attention_cls)} for tree attention "
            "(multi-latent attention and other attention variants are not supported); use a spec "
            "whose self_attention is SelfAttention"
        )
    core_cls = _module_class(attention.submodules.core_attention)
    if _class_name(core_cls) not in _KNOWN_CORE_ATTENTION:
        raise ValueError(
            f"{where}: unknown core attention {_class_name(core_cls)}; tree attention replaces only "
            f"{sorted(_KNOWN_CORE_ATTENTION)}"
        )
    attention.params = {**attention.params, "attn_mask_type": AttnMaskType.arbitrary}
    attention.submodules.core_attention = core_attention_spec
    return layer_spec


def _rewrite_moe(subs: Any, where: str) -> None:
    mlp = getattr(subs, "mlp", None)
    mlp_cls = _module_class(mlp) if mlp is not None else None
    if not (isinstance(mlp_cls, type) and issubclass(mlp_cls, MoELayer)) or issubclass(mlp_cls, TreeMoELayer):
        return
    if mlp_cls is not MoELayer:
        raise ValueError(
            f"{where}: custom MoE layer {_class_name(mlp_cls)}: its router losses would count a shared "
            "tree token once; derive it from megatron_tree.mcore.moe.TreeMoELayer instead of MoELayer"
        )
    if isinstance(mlp, ModuleSpec):
        mlp.module = TreeMoELayer
    elif isinstance(mlp, functools.partial):
        subs.mlp = functools.partial(TreeMoELayer, *mlp.args, **mlp.keywords)
    else:
        raise ValueError(f"{where}: cannot rewrite the MoE layer given as {type(mlp).__name__}")


def tree_attention_spec(spec: Any, *, backend: str = "auto", block_size: int = 128) -> Any:
    """A copy of ``spec`` with tree attention in every self-attention layer.

    Args:
        spec: a TransformerLayer ``ModuleSpec`` (e.g. ``get_gpt_layer_local_spec()`` or
            ``get_gpt_layer_with_transformer_engine_spec()``), a ``TransformerBlockSubmodules``
            (e.g. ``get_gpt_decoder_block_spec(config, ...)``), a TransformerBlock ``ModuleSpec``, or
            a list of layer specs. The input is not modified.
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
    core = ModuleSpec(module=TreeCoreAttention, params={"backend": backend, "block_size": block_size})
    spec = copy.deepcopy(spec)

    def rewrite_list(layer_specs, prefix):
        return [_rewrite_layer(s, f"{prefix}layer {i}", core) for i, s in enumerate(layer_specs)]

    if isinstance(spec, TransformerBlockSubmodules):
        spec.layer_specs = rewrite_list(spec.layer_specs, "block ")
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
        "TransformerBlockSubmodules, a TransformerBlock ModuleSpec or a list of layer specs"
    )
