"""``TreeCoreAttention``: the Megatron-Core ``core_attention`` module for packed trees.

It replaces ``SelfAttentionSubmodules.core_attention`` in a layer spec (see
:func:`megatron_tree.mcore.spec.tree_attention_spec`) and calls
:func:`megatron_tree.core.attention.tree_attention`. The tree mask arrives as Megatron's
``attention_mask`` argument, best as ``tree_attention_mask(tree)`` (one plan per micro-batch).

Like Megatron's ``DotProductAttention`` it honours the config's sliding window (``window_size``,
on the layers ``window_attn_skip_freq`` selects; over depth in a tree) and ``softmax_type``
("off-by-one", or "learnable" with the same ``softmax_offset`` parameter [np], so state dicts load
either way).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)

from ..core.attention import BACKENDS, tree_attention
from ..core.mask import depth_window

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


class TreeCoreAttention(MegatronModule):
    """Megatron ``core_attention`` for packed trees.

    Built by Megatron's ``build_module``; the extra keyword arguments ``backend`` and ``block_size``
    come from the spec's ``params``. A sliding-window layer (``config.window_size``, selected by
    ``config.window_attn_skip_freq`` as in Megatron) attends ancestors at most ``window_size[0]``
    levels up; ``config.softmax_type`` "off-by-one" / "learnable" adds a sink logit per head (a
    zero, or the parameter ``softmax_offset`` [np / tp] initialized with ``config.init_method``).

    Args:
        config: the layer's TransformerConfig (attention_dropout, softmax_scale, ...).
        layer_number: 1-based layer index (used in error messages).
        attn_mask_type: must be ``AttnMaskType.arbitrary`` (the tree mask is passed explicitly).
        attention_type: "self" (cross attention is not a tree operation).
        attention_dropout: overrides ``config.attention_dropout``.
        softmax_scale: overrides 1 / sqrt(head_dim).
        k_channels, v_channels: unused (multi-latent attention passes its query-key and value head
            dims; the attention reads them off the tensors).
        cp_comm_type: unused (context parallelism gathers keys and values over the split's group).
        pg_collection: process groups: its ``tp`` group (default Megatron's parallel_state) sizes
            ``softmax_offset``. The tree mask's context-parallel split carries the CP group.
        backend: one of :data:`~megatron_tree.core.attention.BACKENDS` (``"auto"``, ``"sdpa"``,
            ``"flex"``, ``"block_sparse"``, ``"causal"``, ``"triton"``: our Triton kernels, see
            :mod:`megatron_tree.core.triton_attention`; no attention dropout).
        block_size: tile size for ``flex`` and ``block_sparse`` (``triton``: min(block_size, 64)).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
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
        self.window_size = None
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            try:
                depth_window(config.window_size)
            except ValueError as error:
                raise ValueError(f"{where}: config.{error}") from None
            self.window_size = tuple(config.window_size)
        self._build_softmax_offset(where, pg_collection)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.backend = backend
        self.block_size = block_size
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def _build_softmax_offset(self, where: str, pg_collection) -> None:
        """``softmax_offset`` as Megatron's DotProductAttention builds it: None ("vanilla"), zeros
        (a buffer, not saved: "off-by-one") or a parameter [np / tp] ("learnable")."""
        softmax_type = getattr(self.config, "softmax_type", "vanilla")
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(
                f"{where}: config.softmax_type={softmax_type!r} is not one of {SOFTMAX_TYPES}"
            )
        if softmax_type == "vanilla":
            self.softmax_offset = None
            return
        tp = getattr(pg_collection, "tp", None)
        self.tp_group = tp = parallel_state.get_tensor_model_parallel_group() if tp is None else tp
        heads = self.config.num_attention_heads // tp.size()
        device = "cpu" if self.config.use_cpu_initialization else torch.cuda.current_device()
        offset = torch.zeros(heads, device=device, dtype=self.config.params_dtype)
        if softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", offset, persistent=False)
            return
        self.register_parameter("softmax_offset", torch.nn.Parameter(offset))
        if self.config.perform_initialization:
            self.config.init_method(self.softmax_offset)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ):
        """The learnable ``softmax_offset`` is split over tensor-parallel ranks along its only axis,
        as in Megatron's DotProductAttention; nothing else is saved."""
        if not isinstance(self.softmax_offset, torch.nn.Parameter):
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )

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
        """query / key [n, b, np | ng, hn], value [n, b, ng, hv], the tree mask -> [n, b, np * hv].

        n is the micro-batch's rows on this rank. When they are not the whole tree (a
        context-parallel rank's share, ``config.context_parallel_size > 1``, or a trunk-reuse part)
        the mask is ``tree_attention_mask(rows, ...)`` and its rows say how the keys and values
        of every key are obtained: all-gathered over the CP group, recorded for the trunk
        group's later parts, prepended with the ones its earlier trunk parts recorded
        (:meth:`megatron_tree.core.rows.TreeRows.keys_values`).
        """
        cp_size = self.config.context_parallel_size
        plan = getattr(attention_mask, "plan", None)
        rows = getattr(plan, "rows", None)
        if (1 if rows is None else rows.cp_size) != cp_size:
            raise ValueError(
                f"layer {self.layer_number}: context_parallel_size={cp_size} needs the tree mask "
                f"of a {cp_size}-way context-parallel split: "
                f"tree_attention_mask(context_parallel_split(tree, {cp_size}, cp_rank, cp_group)) "
                "with each rank's rows as input (tree_forward_backward does this)"
            )
        if plan is not None:
            key, value = plan.keys_values(key, value, self.layer_number)
        if attention_bias is not None:
            raise ValueError("tree attention does not take attention_bias")
        if packed_seq_params is not None:
            raise ValueError(
                "tree attention takes the tree mask as attention_mask, not packed_seq_params"
            )
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(
            backend=self.backend,
            softmax_scale=self.softmax_scale,
            dropout_p=dropout_p,
            block_size=self.block_size,
            window_size=self.window_size,
            softmax_offset=self.softmax_offset,
        )
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Heads are split across TP ranks: draw dropout from the model-parallel RNG state,
            # as Megatron's DotProductAttention does.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return tree_attention(query, key, value, attention_mask, **kwargs)
        return tree_attention(query, key, value, attention_mask, **kwargs)
