"""A FLOP model of a GPT forward+backward over packed trees, for ideal speed-ups.

Linear layers cost ``2 * params`` per packed token (for a mixture of experts, the parameters a token
uses: its top-k routed experts, the shared experts and the router; see :class:`GPTShape`); attention
costs ``2 * heads * (query-key dim + value dim)`` per allowed (query, key) pair per attention layer
(QK^T and PV: ``4 * heads * head_dim`` for standard attention; multi-latent attention's query-key
dim is its no-rope plus rope dims, its value dim its own); a gated delta-net layer (hybrids) costs
per token only: its projections, its convolution and ``6 * dk * dv`` per value head for the state
(read, update, output: three matrix-vector products), no pairs; so does a Mamba-2 layer: its
projections, its convolution and ``6 * headdim * d_state`` per head (decay, update, read). The
allowed pairs are read off ``subtree_end`` in O(N) (equivalently, the sum over tokens of depth + 1:
a token sees its ancestors and itself); a backward is twice a forward. Padding is not counted: the
model gives the ideal of the layout.

The cost is linear in (tokens, pairs), so packing can weigh any part of a trie by
:func:`cost_weights` without laying it out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .tree import PackedTree


@dataclass(frozen=True)
class GPTShape:
    """The sizes that set a GPT's FLOPs.

    Mixture of experts: with ``num_experts > 0``, ``moe_layers`` of the ``layers`` (default: all)
    replace the dense MLP (``ffn_hidden``) by a router (``hidden x num_experts``), the ``topk``
    experts a token is routed to (each an MLP of width ``moe_ffn_hidden``) and an always-active
    shared expert of width ``shared_ffn_hidden`` (0: none; ``shared_expert_gate`` adds its
    ``hidden x 1`` sigmoid gate). Token-choice routing without a capacity factor computes every
    token in exactly ``topk`` experts, so the active-parameter count per token is exact; the
    dispatch itself (permutation, all-to-all) does no FLOPs.
    """

    hidden: int
    layers: int
    heads: int
    query_groups: int
    ffn_hidden: int
    vocab: int
    gated_mlp: bool = True
    head_dim: int | None = None  # default hidden // heads
    num_experts: int = 0
    topk: int = 0
    moe_ffn_hidden: int | None = None  # default ffn_hidden
    shared_ffn_hidden: int = 0
    shared_expert_gate: bool = False
    moe_layers: int | None = None  # default: every layer when num_experts > 0
    # Gated delta-net hybrids (Qwen3-Next, Qwen3.5): ``linear_layers`` of the ``layers`` are gated
    # delta-nets with these heads and head dims; the rest are attention.
    linear_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_width: int = 4
    attention_output_gate: bool = False
    # Multi-latent attention (DeepSeek-V3, Kimi-K2), with ``kv_lora_rank > 0``: queries through a
    # rank-``q_lora_rank`` down / up projection (None: one projection), keys and values through a
    # rank-``kv_lora_rank`` latent plus a shared ``qk_rope_head_dim`` rope key; per head
    # ``qk_head_dim + qk_rope_head_dim`` query-key dims and ``v_head_dim`` value dims.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mamba-2 hybrids (Nemotron-H, HybridModel patterns): ``mamba_layers`` of the ``layers`` are
    # Mamba-2 mixers; in a hybrid pattern the MLPs are layers of their own, so ``mlp_layers`` sets
    # the dense MLP count (default: every layer that is not MoE, the GPT block).
    mamba_layers: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mlp_layers: int | None = None

    def __post_init__(self):
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.topk <= self.num_experts):
            raise ValueError(
                f"topk={self.topk} must be in [1, num_experts={self.num_experts}] for a mixture of "
                "experts (num_experts=0 is a dense model)"
            )
        if self.moe_layers is not None and not 0 <= self.moe_layers <= self.layers:
            raise ValueError(f"moe_layers={self.moe_layers} must be in [0, layers={self.layers}]")
        if not 0 <= self.linear_layers + self.mamba_layers <= self.layers:
            raise ValueError(
                f"linear_layers={self.linear_layers} + mamba_layers={self.mamba_layers} must be in "
                f"[0, layers={self.layers}]"
            )
        if self.mamba_layers and not (
            self.mamba_heads and self.mamba_head_dim and self.mamba_groups and self.mamba_state
        ):
            raise ValueError(
                "a Mamba hybrid (mamba_layers > 0) needs mamba_heads, mamba_head_dim, "
                "mamba_groups and mamba_state"
            )
        if self.linear_layers and not (
            self.linear_key_heads
            and self.linear_value_heads
            and self.linear_key_dim
            and self.linear_value_dim
        ):
            raise ValueError(
                "a gated delta-net hybrid (linear_layers > 0) needs linear_key_heads, "
                "linear_value_heads, linear_key_dim and linear_value_dim"
            )
        if self.kv_lora_rank and not (self.qk_head_dim and self.v_head_dim):
            raise ValueError(
                "multi-latent attention (kv_lora_rank > 0) needs qk_head_dim and v_head_dim"
            )

    @classmethod
    def from_config(cls, config, vocab: int, hybrid_layer_pattern: str | None = None) -> GPTShape:
        """From a Megatron ``TransformerConfig`` (dense or MoE) and the vocabulary size.

        A HybridModel's layers come from its ``hybrid_layer_pattern`` (the argument, else
        ``config.hybrid_layer_pattern`` as Megatron-Bridge's provider has it): ``*`` attention,
        ``+`` MLA, ``G`` gated delta-net, ``M`` Mamba-2 (``mamba_num_heads``, ``mamba_head_dim``,
        ``mamba_num_groups``, ``mamba_state_dim``), ``-`` MLP, ``E`` MoE; ``|`` and the MTP part
        after ``/`` are not counted.

        MoE fields read: ``num_moe_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``,
        ``moe_shared_expert_intermediate_size``, ``moe_shared_expert_gate`` and ``moe_layer_freq``
        (an int N: every N-th layer from layer 0 is MoE; or a list of 0/1 per layer); with
        ``multi_latent_attention``: ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``,
        ``qk_pos_emb_head_dim``, ``v_head_dim``.
        """
        num_experts = getattr(config, "num_moe_experts", None) or 0
        moe = {}
        if num_experts:
            moe = dict(
                num_experts=num_experts,
                topk=config.moe_router_topk,
                moe_ffn_hidden=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                shared_ffn_hidden=getattr(config, "moe_shared_expert_intermediate_size", None) or 0,
                shared_expert_gate=bool(getattr(config, "moe_shared_expert_gate", False)),
                moe_layers=_moe_layer_count(
                    getattr(config, "moe_layer_freq", 1), config.num_layers
                ),
            )
        if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
            from_freq = _linear_layer_count(config.linear_attention_freq, config.num_layers)
            moe.update(
                linear_layers=from_freq,
                linear_key_heads=config.linear_num_key_heads,
                linear_value_heads=config.linear_num_value_heads,
                linear_key_dim=config.linear_key_head_dim,
                linear_value_dim=config.linear_value_head_dim,
                conv_width=config.linear_conv_kernel_dim,
            )
        if getattr(config, "multi_latent_attention", False):
            moe.update(
                kv_lora_rank=config.kv_lora_rank,
                q_lora_rank=config.q_lora_rank,
                qk_head_dim=config.qk_head_dim,
                qk_rope_head_dim=config.qk_pos_emb_head_dim,
                v_head_dim=config.v_head_dim,
            )
        pattern = hybrid_layer_pattern or getattr(config, "hybrid_layer_pattern", None)
        layers = config.num_layers
        if pattern:
            moe.update(_hybrid_counts(pattern, config))
            layers = moe.pop("layers")
        return cls(
            hidden=config.hidden_size,
            attention_output_gate=bool(getattr(config, "attention_output_gate", False)),
            layers=layers,
            heads=config.num_attention_heads,
            query_groups=config.num_query_groups or config.num_attention_heads,
            ffn_hidden=config.ffn_hidden_size,
            vocab=vocab,
            gated_mlp=bool(config.gated_linear_unit),
            head_dim=config.kv_channels,
            **moe,
        )

    @property
    def pair_flops(self) -> int:
        """Forward FLOPs per allowed (query, key) pair per attention layer: QK^T over the query-key
        dims and PV over the value dims of every head."""
        if self.kv_lora_rank:
            return 2 * self.heads * (self.qk_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return 4 * self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def attention_params(self) -> int:
        """Projection weights of one attention layer (query / key / value / output)."""
        heads = self.heads
        if self.kv_lora_rank:
            qk = self.qk_head_dim + self.qk_rope_head_dim
            rank = self.q_lora_rank
            query = (
                self.hidden * heads * qk if rank is None else self.hidden * rank + rank * heads * qk
            )
            key_value = self.hidden * (
                self.kv_lora_rank + self.qk_rope_head_dim
            ) + self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim)
            return query + key_value + heads * self.v_head_dim * self.hidden
        head_dim = self.head_dim or self.hidden // heads
        qkv = (
            self.hidden
            * (heads * (2 if self.attention_output_gate else 1) + 2 * self.query_groups)
            * head_dim
        )
        return qkv + heads * head_dim * self.hidden

    def _mlp_params(self, width: int) -> int:
        return self.hidden * width * (3 if self.gated_mlp else 2)

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        if not self.num_experts:
            return 0
        return self.layers if self.moe_layers is None else self.moe_layers

    @property
    def moe_params_per_token(self) -> int:
        """Weights one token uses in one MoE layer's MLP: router, top-k experts, shared expert."""
        routed = self.topk * self._mlp_params(self.moe_ffn_hidden or self.ffn_hidden)
        shared = self._mlp_params(self.shared_ffn_hidden) + (
            self.hidden if self.shared_expert_gate else 0
        )
        return self.hidden * self.num_experts + routed + (shared if self.shared_ffn_hidden else 0)

    @property
    def attention_layers(self) -> int:
        """Softmax-attention layers (the ones that cost per pair)."""
        return self.layers - self.linear_layers - self.mamba_layers

    @property
    def _mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def linear_params_per_token(self) -> int:
        """Weights one token multiplies by (active parameters for MoE), embedding lookup
        excluded."""
        moe_layers = self.num_moe_layers
        dense_layers = self.layers - moe_layers if self.mlp_layers is None else self.mlp_layers
        mlp = (
            dense_layers * self._mlp_params(self.ffn_hidden)
            + moe_layers * self.moe_params_per_token
        )
        qk, v = (
            self.linear_key_heads * self.linear_key_dim,
            self.linear_value_heads * self.linear_value_dim,
        )
        gdn = self.hidden * (2 * qk + 2 * v + 2 * self.linear_value_heads) + v * self.hidden
        inner, bc = self._mamba_inner, 2 * self.mamba_groups * self.mamba_state
        mamba = self.hidden * (2 * inner + bc + self.mamba_heads) + inner * self.hidden
        return (
            self.attention_layers * self.attention_params
            + self.linear_layers * gdn
            + self.mamba_layers * mamba
            + mlp
            + self.hidden * self.vocab
        )

    @property
    def recurrent_flops_per_token(self) -> int:
        """Forward FLOPs per token of the gated delta-net and Mamba-2 layers beyond their
        projections: the depthwise convolution and the state's three products per (value) head."""
        mamba = 0
        if self.mamba_layers:
            conv = (
                2 * self.conv_width * (self._mamba_inner + 2 * self.mamba_groups * self.mamba_state)
            )
            state = 6 * self.mamba_heads * self.mamba_head_dim * self.mamba_state
            mamba = self.mamba_layers * (conv + state)
        if not self.linear_layers:
            return mamba
        conv = (
            2
            * self.conv_width
            * (
                2 * self.linear_key_heads * self.linear_key_dim
                + self.linear_value_heads * self.linear_value_dim
            )
        )
        state = 6 * self.linear_value_heads * self.linear_key_dim * self.linear_value_dim
        return mamba + self.linear_layers * (conv + state)


def _moe_layer_count(freq, num_layers: int) -> int:
    """MoE layers of Megatron's ``moe_layer_freq`` (int N: layers 0, N, 2N, ...; or a 0/1 list)."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq} must be >= 1")
        return sum(1 for i in range(num_layers) if i % freq == 0)
    pattern = list(freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(
            f"moe_layer_freq={freq!r} must be an int or a list of num_layers={num_layers} zeros "
            "and ones"
        )
    return sum(pattern)


def _hybrid_counts(pattern: str, config) -> dict:
    """GPTShape fields of a HybridModel layer pattern (the part before ``/``, ``|`` dropped)."""
    main = pattern.split("/")[0].replace("|", "")
    unknown = set(main) - set("M*+G-ED")
    if unknown:
        raise ValueError(f"hybrid_layer_pattern={pattern!r}: unknown symbols {sorted(unknown)}")
    counts = {c: main.count(c) for c in "M*+G-ED"}
    fields = {
        "layers": counts["M"] + counts["*"] + counts["+"] + counts["G"] + counts["D"],
        "mlp_layers": counts["-"],
        "moe_layers": counts["E"],
        "linear_layers": counts["G"],
        "mamba_layers": counts["M"],
    }
    if not counts["E"]:  # the config's expert fields describe no layer of this pattern
        fields.update(num_experts=0, topk=0)
    if counts["M"]:
        heads = config.mamba_num_heads or (
            2 * config.hidden_size // config.mamba_head_dim
        )  # Megatron's default: expand 2
        fields.update(
            mamba_heads=heads,
            mamba_head_dim=config.mamba_head_dim,
            mamba_groups=config.mamba_num_groups,
            mamba_state=config.mamba_state_dim,
        )
    return fields


def _linear_layer_count(freq, num_layers: int) -> int:
    """Gated delta-net layers of Megatron's ``linear_attention_freq`` (int N: every N-th layer is
    attention, the others linear; or a 1 (linear) / 0 list)."""
    if isinstance(freq, int):
        return sum(1 for i in range(num_layers) if (i + 1) % freq != 0)
    return sum(list(freq))


def attention_pairs(tree: PackedTree) -> int:
    """Allowed (query, key) pairs among the tree's real tokens: sum of subtree sizes."""
    u = tree.num_tree_tokens
    ends = tree.subtree_end[:u].to(torch.int64)
    return int((ends - torch.arange(u, device=ends.device)).sum())


def cost_weights(shape: GPTShape | None) -> tuple[float, float]:
    """Forward+backward FLOPs per (unique token, attention pair) of ``shape``; ``(1.0, 0.0)`` (count
    tokens only) for None."""
    if shape is None:
        return 1.0, 0.0
    if not isinstance(shape, GPTShape):
        raise ValueError(f"cost_model must be a GPTShape or None, got {type(shape).__name__}")
    per_token = 3.0 * (2.0 * shape.linear_params_per_token + shape.recurrent_flops_per_token)
    return per_token, 3.0 * shape.pair_flops * shape.attention_layers


def tree_cost(tree: PackedTree, shape: GPTShape) -> float:
    """Forward+backward FLOPs of ``shape`` over one tree's real tokens (0 for a dummy tree)."""
    per_token, per_pair = cost_weights(shape)
    return per_token * tree.num_tree_tokens + per_pair * attention_pairs(tree)


def train_flops(trees: Iterable[PackedTree], shape: GPTShape) -> float:
    """Forward+backward FLOPs of ``shape`` over the real tokens of ``trees``."""
    return sum((tree_cost(tree, shape) for tree in trees), 0.0)
