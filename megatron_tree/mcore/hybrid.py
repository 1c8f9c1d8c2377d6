"""``TreeHybridModel``: Megatron-Core's HybridModel (Mamba-2 / gated delta-net / attention / MLP /
MoE layers by pattern: Nemotron-H, Nemotron 3) with depth RoPE, and a local hybrid stack spec.

HybridModel (megatron-core >= 0.19, where it replaces GPTModel) feeds ``position_ids`` only to its
embedding; with rope / YaRN its rotary table follows packed offsets. :class:`TreeHybridModel`
makes it follow token depth as :class:`~megatron_tree.mcore.model.TreeGPTModel` does (the shared
:class:`~megatron_tree.mcore.model.DepthRoPE` mixin), and refuses what tree training cannot do
(multi-token prediction, DeepSeek sparse attention) by name before anything is built. Its stack
spec comes from :func:`~megatron_tree.mcore.spec.tree_attention_spec` (every token mixer a tree
one).

Megatron-Core's hybrid stack specs are transformer-engine only (fused norm + linear layers, and the
stack's final norm is always ``TENorm``). :func:`local_hybrid_stack_spec` is the same stack from
Megatron-Core's local modules for machines without transformer-engine: separate
:class:`~megatron_tree.mcore.norm.LocalNorm` norms, ``ColumnParallelLinear`` /
``RowParallelLinear``, local core attention, ``SequentialMLP`` experts, and
:class:`LocalHybridStack`, whose final norm is a ``LocalNorm``.
"""

from __future__ import annotations

import inspect
from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from .model import DepthRoPE, mtp_error
from .norm import LocalNorm

__all__ = ["LocalHybridStack", "TreeHybridModel", "local_hybrid_stack_spec"]


def _pattern(config: Any, args: tuple, kwargs: dict) -> str:
    """The layer pattern HybridModel will read from its arguments (its deprecated name too), ''
    when none is given."""
    given = inspect.signature(HybridModel.__init__).bind_partial(None, config, *args, **kwargs)
    names = given.arguments
    return names.get("hybrid_layer_pattern") or names.get("hybrid_override_pattern") or ""


class TreeHybridModel(DepthRoPE, HybridModel):
    """HybridModel whose rotary embedding follows ``position_ids`` (token depths in a packed tree).

    Construct it exactly like ``HybridModel``, with a stack spec from
    :func:`megatron_tree.mcore.spec.tree_attention_spec` (Mamba mixers, gated delta-nets,
    attention, MLA and MoE layers become tree modules), and call it with a packed micro-batch:
    ``model(input_ids [1, N], position_ids [1, N], attention_mask=tree_attention_mask(tree))``.
    With ``position_embedding_type="rope"`` or ``"yarn"`` its ``rotary_pos_emb`` is a
    :class:`~megatron_tree.mcore.rotary.TreeRotaryEmbedding` and it requires ``position_ids``
    (Nemotron-H has no position embedding: its attention layers see order only through the Mamba
    layers).

    Raises:
        ValueError: multi-token prediction (an MTP part ``/...`` in the pattern, or
            ``config.mtp_num_layers``), or DeepSeek sparse attention layers (``D`` in the pattern).
    """

    def __init__(self, config, *args, **kwargs):
        pattern = _pattern(config, args, kwargs)
        if Symbols.DS_ATTENTION in pattern:
            raise ValueError(
                f"hybrid_layer_pattern={pattern!r} has DeepSeek sparse attention layers "
                f"({Symbols.DS_ATTENTION!r}): DSAttention selects its keys by content with an "
                "indexer, which tree training does not support"
            )
        parsed = parse_hybrid_pattern(pattern) if pattern else None
        if (parsed is not None and parsed.mtp_num_depths) or getattr(config, "mtp_num_layers", 0):
            raise mtp_error(
                f"hybrid_layer_pattern={pattern!r}, mtp_num_layers={config.mtp_num_layers}"
            )
        super().__init__(config, *args, **kwargs)


class LocalHybridStack(HybridStack):
    """HybridStack whose final norm is built from ``final_norm`` (a norm builder, default
    :class:`~megatron_tree.mcore.norm.LocalNorm`) instead of transformer-engine's ``TENorm``, which
    Megatron's HybridStack builds unconditionally. Same arguments (``final_norm`` as a spec param),
    same state dict (``final_norm.weight``)."""

    def __init__(
        self, config, submodules, *, post_layer_norm: bool = True, final_norm=LocalNorm, **kwargs
    ):
        super().__init__(config, submodules, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = final_norm(
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )


def local_hybrid_stack_spec(config: Any = None) -> ModuleSpec:
    """The hybrid stack spec of Megatron-Core's ``hybrid_stack_spec`` from local modules.

    Layers: Mamba (``M``: separate norm, ``MambaMixer`` with column / row parallel projections),
    gated delta-net (``G``), attention (``*``: local ``DotProductAttention``, q / k norms when
    ``config.qk_layernorm``), multi-latent attention (``+``), dense MLP (``-``, an ``MLPLayer``)
    and MoE (``E``: ``SequentialMLP`` experts, shared experts and router as the config says); every
    norm a :class:`~megatron_tree.mcore.norm.LocalNorm`, the stack a :class:`LocalHybridStack`.
    DeepSeek sparse attention (``D``) and multi-token prediction are not in it (tree training
    refuses both). Checkpoint keys of the norms are mapped to transformer-engine's fused names as
    Megatron-Core's ModelOpt local spec does, so distributed checkpoints interoperate.

    Args:
        config: the model's TransformerConfig (read: ``qk_layernorm``); None: no q / k norms.
            Megatron-Bridge's ``HybridModelProvider`` calls ``hybrid_stack_spec(provider)``.

    Returns:
        A HybridStack ModuleSpec; pass it to
        :func:`~megatron_tree.mcore.spec.tree_attention_spec` for tree training.
    """
    qk_norm = bool(getattr(config, "qk_layernorm", False))

    def attention(multi_latent: bool) -> Any:
        """Megatron's local self-attention spec, its torch norms (q / k, MLA's latent norms)
        made LocalNorm."""
        spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, multi_latent_attention=multi_latent)
        attention = spec.submodules.self_attention
        for name, value in vars(attention.submodules).items():
            if value is WrappedTorchNorm:
                setattr(attention.submodules, name, LocalNorm)
        return attention

    bda = get_bias_dropout_add
    mamba = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=LocalNorm,
            mixer=ModuleSpec(
                module=MambaMixer,
                submodules=MambaMixerSubmodules(
                    in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                ),
            ),
            mamba_bda=bda,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
        ),
    )
    gdn = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=LocalNorm,
            self_attention=ModuleSpec(
                module=GatedDeltaNet,
                submodules=GatedDeltaNetSubmodules(
                    in_proj=ColumnParallelLinear, out_norm=LocalNorm, out_proj=RowParallelLinear
                ),
            ),
            self_attn_bda=bda,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.in_proj.layer_norm_"},
        ),
    )
    softmax_attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=LocalNorm,
            self_attention=attention(multi_latent=False),
            self_attn_bda=bda,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_"
            },
        ),
    )
    latent_attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=LocalNorm,
            self_attention=attention(multi_latent=True),
            self_attn_bda=bda,
        ),
    )
    dense = get_gpt_layer_local_spec().submodules.mlp  # MLP.as_mlp_submodule, local linears
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=LocalNorm,
            mlp=dense,
            mlp_bda=bda,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
        ),
    )
    moe = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=LocalNorm,
            # num_experts: any number builds the local MoE spec; the config sets the count
            mlp=get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False),
            mlp_bda=bda,
        ),
    )
    return ModuleSpec(
        module=LocalHybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=mamba,
            gdn_layer=gdn,
            attention_layer=softmax_attention,
            mla_layer=latent_attention,
            mlp_layer=mlp,
            moe_layer=moe,
        ),
    )
