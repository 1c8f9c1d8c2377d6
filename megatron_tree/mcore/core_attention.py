"""``TreeCoreAttention``: the Megatron-Core ``core_attention`` module for packed trees.

It replaces ``SelfAttentionSubmodules.core_attention`` in a layer spec (see
:func:`megatron_tree.mcore.spec.tree_attention_spec`) and calls
:func:`megatron_tree.core.attention.tree_attention`. The tree mask arrives as Megatron's
``attention_mask`` argument, best as ``tree_attention_mask(tree)`` (one plan per micro-batch).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..core.attention import BACKENDS, tree_attention
from ..core.context_parallel import gather_keys_values


class TreeCoreAttention(MegatronModule):
    """Megatron ``core_attention`` for packed trees.

    Built by Megatron's ``build_module``; the extra keyword arguments ``backend`` and ``block_size``
    come from the spec's ``params``.

    Args:
        config: the layer's TransformerConfig (attention_dropout, softmax_scale, ...).
        layer_number: 1-based layer index (used in error messages).
        attn_mask_type: must be ``AttnMaskType.arbitrary`` (the tree mask is passed explicitly).
        attention_type: "self" (cross attention is not a tree operation).
        attention_dropout: overrides ``config.attention_dropout``.
        softmax_scale: overrides 1 / sqrt(head_dim).
        cp_comm_type: unused (context parallelism gathers keys and values over the split's group).
        pg_collection: process groups (unused: the tree mask's context-parallel split carries the
            CP group, taken from Megatron's parallel_state by ``tree_forward_backward``).
        backend: one of ``"auto"``, ``"sdpa"``, ``"flex"``, ``"block_sparse"``.
        block_size: tile size for ``flex`` and ``block_sparse``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        backend: str = "auto",
        block_size: int = 128,
    ):
        super().__init__(config=config)
        where = f"layer {layer_number}"
        if backend not in BACKENDS:
            raise ValueError(f"{where}: backend={backend!r} is not one of {BACKENDS}")
        if attn_mask_type != AttnMaskType.arbitrary:
            raise ValueError(
                f"{where}: tree attention needs attn_mask_type=AttnMaskType.arbitrary, got "
                f"{attn_mask_type}; build the layer spec with tree_attention_spec()"
            )
        if attention_type != "self":
            raise ValueError(f"{where}: tree attention is self-attention, got {attention_type!r}")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"{where}: tree attention supports softmax_type='vanilla', got {config.softmax_type!r}"
            )
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"{where}: tree attention does not support sliding windows (window_size)")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.backend = backend
        self.block_size = block_size
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        **extra_kwargs,
    ) -> torch.Tensor:
        """query [N, b, np, hn], key/value [N, b, ng, hn], the tree mask -> [N, b, np * hn].

        Under context parallelism (``config.context_parallel_size > 1``) N is this rank's n rows
        and the mask is ``tree_attention_mask(tree, split)``: the whole tree's keys and values are
        all-gathered over the split's group (their gradients reduce-scattered in backward).
        """
        cp_size = self.config.context_parallel_size
        plan = getattr(attention_mask, "plan", None)
        split = getattr(plan, "cp", None)
        if cp_size > 1 and (split is None or split.size != cp_size):
            raise ValueError(
                f"layer {self.layer_number}: context_parallel_size={cp_size} needs the tree mask of a "
                f"{cp_size}-way context-parallel split: tree_attention_mask(tree, "
                "context_parallel_split(tree, cp_size, cp_rank, cp_group)) with each rank's rows as "
                "input (tree_forward_backward does this)"
            )
        if split is not None and split.size > 1:
            key, value = gather_keys_values(key, value, split)
        if attention_bias is not None:
            raise ValueError("tree attention does not take attention_bias")
        if packed_seq_params is not None:
            raise ValueError("tree attention takes the tree mask as attention_mask, not packed_seq_params")
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(
            backend=self.backend, softmax_scale=self.softmax_scale, dropout_p=dropout_p,
            block_size=self.block_size,
        )
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Heads are split across TP ranks: draw dropout from the model-parallel RNG state,
            # as Megatron's DotProductAttention does.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return tree_attention(query, key, value, attention_mask, **kwargs)
        return tree_attention(query, key, value, attention_mask, **kwargs)
