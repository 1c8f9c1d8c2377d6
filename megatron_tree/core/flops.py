"""A FLOP model of a GPT forward+backward over packed trees, for ideal speed-ups.

Linear layers cost ``2 * params`` per packed token; attention costs ``4 * heads * head_dim`` per allowed
(query, key) pair per layer (QK^T and PV), with the allowed pairs read off ``subtree_end`` in O(N)
(equivalently, the sum over tokens of depth + 1: a token sees its ancestors and itself); a backward
is twice a forward. Padding is not counted: the model gives the ideal of the layout.

The cost is linear in (tokens, pairs), so packing can weigh any part of a trie by
:func:`cost_weights` without laying it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .tree import PackedTree


@dataclass(frozen=True)
class GPTShape:
    """The sizes that set a GPT's FLOPs."""

    hidden: int
    layers: int
    heads: int
    query_groups: int
    ffn_hidden: int
    vocab: int
    gated_mlp: bool = True
    head_dim: int | None = None  # default hidden // heads

    @classmethod
    def from_config(cls, config, vocab: int) -> "GPTShape":
        """From a Megatron ``TransformerConfig`` and the vocabulary size (dense models only)."""
        if getattr(config, "num_moe_experts", None):
            raise ValueError(
                "GPTShape models dense MLPs only; this config has num_moe_experts="
                f"{config.num_moe_experts} (count active expert FLOPs yourself)"
            )
        return cls(
            hidden=config.hidden_size,
            layers=config.num_layers,
            heads=config.num_attention_heads,
            query_groups=config.num_query_groups or config.num_attention_heads,
            ffn_hidden=config.ffn_hidden_size,
            vocab=vocab,
            gated_mlp=bool(config.gated_linear_unit),
            head_dim=config.kv_channels,
        )

    @property
    def attention_width(self) -> int:
        """heads x head_dim: the width of QK^T and PV per layer."""
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def linear_params_per_token(self) -> int:
        head_dim = self.head_dim or self.hidden // self.heads
        qkv = self.hidden * (self.heads + 2 * self.query_groups) * head_dim
        proj = self.heads * head_dim * self.hidden
        mlp = self.hidden * self.ffn_hidden * (3 if self.gated_mlp else 2)
        return self.layers * (qkv + proj + mlp) + self.hidden * self.vocab


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
    return 3.0 * 2.0 * shape.linear_params_per_token, 3.0 * 4.0 * shape.attention_width * shape.layers


def tree_cost(tree: PackedTree, shape: GPTShape) -> float:
    """Forward+backward FLOPs of ``shape`` over one tree's real tokens (0 for a dummy tree)."""
    per_token, per_pair = cost_weights(shape)
    return per_token * tree.num_tree_tokens + per_pair * attention_pairs(tree)


def train_flops(trees: Iterable[PackedTree], shape: GPTShape) -> float:
    """Forward+backward FLOPs of ``shape`` over the real tokens of ``trees``."""
    return sum((tree_cost(tree, shape) for tree in trees), 0.0)
