"""What Megatron's sigmoid router (DeepSeek-V3, Kimi-K2, GLM-4.5) can reproduce of an HF router.

Shared by both bridge patches: HF ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter`` pick the best
``topk_group`` of ``n_group`` expert groups, each ranked by the sum of its top-2 scores, route
inside them, and divide the chosen sigmoid scores by their sum only with ``norm_topk_prob``.
Megatron ranks a group by its top ``topk // group_topk`` scores and always renormalizes (top-k > 1).
Checkpoints outside what Megatron computes are refused, not loaded with different routing.
"""

from __future__ import annotations

from typing import Any


def sigmoid_router_fields(hf_config: Any, *, where: str) -> dict:
    """Megatron's group-limited routing fields for ``hf_config`` (empty when routing is not
    group-limited); ValueError, naming ``where``, for HF routing Megatron cannot reproduce."""
    topk = hf_config.num_experts_per_tok
    if getattr(hf_config, "norm_topk_prob", True) is False and topk > 1:
        raise ValueError(
            f"{where}: the HF router does not renormalize its top-k sigmoid scores "
            "(norm_topk_prob=False), Megatron's sigmoid router always does; this checkpoint's "
            "routing cannot be reproduced"
        )
    n_group, topk_group = (
        getattr(hf_config, "n_group", None) or 1,
        getattr(hf_config, "topk_group", None) or 1,
    )
    if n_group <= 1 or topk_group >= n_group:
        return {}
    if topk // topk_group != 2:
        raise ValueError(
            f"{where}: num_experts_per_tok={topk} // topk_group={topk_group} is not 2: HF ranks "
            "expert groups by their top-2 scores, Megatron by their top num_experts_per_tok // "
            "topk_group; this routing cannot be reproduced"
        )
    return {"moe_router_num_groups": n_group, "moe_router_group_topk": topk_group}
