"""Mixture-of-experts with trees: the router's load-balancing and z losses as if the batch were
unpacked.

A prefix token stored once in a tree occurs once per sequence through it in the unpacked batch, and
Megatron's auxiliary load-balancing loss and z-loss are means over tokens: on a tree they silently
weigh a shared token once and count padding. :class:`TreeMoELayer` (put in place of ``MoELayer`` by
:func:`megatron_tree.mcore.spec.tree_attention_spec`) takes each packed position's multiplicity
(the number of sequences that contain it, 0 for padding) and weighs every token by it inside the
routing statistics, so that per micro-batch the aux loss, z-loss and their gradients equal those of
the tree's sequences run unpacked as one batch:

* aux loss = E * coeff / (k * W^2) * sum_e (sum_x w_x p_xe) (sum_x w_x r_xe), with p the router
  scores, r the top-k map, W = sum_x w_x (over the tensor x context parallel group, like
  Megatron's);
* z-loss = coeff * sum_x w_x logsumexp(l_x)^2 / W.

The multiplicities travel in the micro-batch's one context, its tree mask's plan
(``attention_mask.plan.tokens``, a :class:`RouterInputs`), which Megatron hands to every layer
in the forward and in an activation recomputation; :class:`TreeTransformerLayer` gives its MoE
layer the plan of the call it runs. A model called without a tree mask keeps Megatron's
``padding_mask``. The sequence-level aux loss (per sequence statistics), the global aux loss and
token dropping (a capacity factor: which tokens an expert drops depends on every token of the
micro-batch, so a tree cannot reproduce it) are refused with a clear error; see
:func:`check_tree_moe_config`.

The expert-bias token counts of aux-loss-free balancing (DeepSeek-V3, GLM-4.5:
``moe_router_enable_expert_bias``) weigh each token by its multiplicity too, so the bias update
after the step is the unpacked one.

Routing is unchanged: with token-choice top-k routing and no capacity, a token's experts depend on
that token alone, so the tree's routing equals the unpacked one.

A trunk-reuse group spans several micro-batches; its router losses are the group's sequences'
run unpacked as one batch: the expert counts and W of every layer are summed over the group's
parts in a first no-grad pass (into the group's
:class:`~megatron_tree.core.rows.KeyValueStore`, on the mask plan of its micro-batch), and each
part then attaches its share (the aux loss is linear in each part's
scores once the counts are the group's; the z-loss is a sum over tokens).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    save_to_aux_losses_tracker,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

_SUPPORTED_AUX = ("aux_loss", "none")


@dataclass(frozen=True)
class RouterInputs:
    """What a micro-batch's MoE routers read besides the hidden states (on its mask plan,
    ``attention_mask.plan.tokens``; built once per micro-batch by the step).

    Attributes:
        weights: float32 [n]: each row's multiplicity in the unpacked batch (0 for padding), the
            weight of its token in the router losses (:func:`token_multiplicity`).
        loss_scale: the factor the step gives each loss token (1 when Megatron divides by the
            global token count itself): a micro-batch's router losses, means over its W weighted
            tokens, are then added with weight W x ``loss_scale``, as the step's own loss tokens
            are (Megatron's per-token semantics). None: added as they are, as Megatron's mean
            per micro-batch (verl's protocol, a direct model call). Megatron's own channel
            (``MoEAuxLossAutoScaler.set_loss_scale``, set by its schedule from
            ``grad_scale_func``) scales them further in backward.
        routes: int [n, num_layers, topk]: the routes each row replays (global layer order),
            or None without routing replay. A row of -1 routes as the model chooses, where the
            router's replay takes a mask (verl's ``RouterReplay``: its R3 replay of rollout routes
            leaves each sample's last token to the model).
    """

    weights: torch.Tensor
    loss_scale: float | None = None
    routes: torch.Tensor | None = None


def check_tree_moe_config(config) -> None:
    """Raise ValueError for MoE settings a tree cannot reproduce as if unpacked."""
    types = config.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    coeffs = (
        config.moe_aux_loss_coeff
        if isinstance(config.moe_aux_loss_coeff, list)
        else [config.moe_aux_loss_coeff] * len(types)
    )
    active = [t for t, c in zip(types, coeffs) if c and t not in _SUPPORTED_AUX]
    if active:
        raise ValueError(
            f"moe_router_load_balancing_type {active} is not supported with trees: the "
            "sequence-level aux loss needs per-sequence statistics and the global one accumulates "
            "across steps; use 'aux_loss' (computed as if unpacked) or set its coefficient to 0 "
            "(Megatron-Bridge's DeepSeek-V3 / Kimi-K2 / GLM-4.5 providers set 'seq_aux_loss': set "
            "provider.moe_router_load_balancing_type = 'aux_loss' or provider.moe_aux_loss_coeff "
            "= 0.0 before provide())"
        )
    if config.moe_expert_capacity_factor is not None:
        raise ValueError(
            "moe_expert_capacity_factor drops tokens by their rank among all tokens of a "
            "micro-batch, which a tree (shared tokens once, padding present) cannot reproduce; set "
            "it to None (dropless routing)"
        )
    if getattr(config, "moe_input_jitter_eps", None):
        raise ValueError("moe_input_jitter_eps is not supported with trees; set it to None")


@contextlib.contextmanager
def _router_losses_off(config):
    """Megatron's own aux and z losses off (this module adds the weighted ones)."""
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    aux = saved[0]
    config.moe_aux_loss_coeff = [0.0] * len(aux) if isinstance(aux, list) else 0.0
    config.moe_z_loss_coeff = None
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved


def router_losses_on(config) -> bool:
    """Whether ``config``'s routers add a load-balancing loss or a z-loss."""
    return bool(config.num_moe_experts) and bool(_aux_coeff(config) or config.moe_z_loss_coeff)


def _aux_coeff(config) -> float:
    types, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if isinstance(types, list):
        return sum(c for t, c in zip(types, coeff) if t == "aux_loss")
    return float(coeff) if types == "aux_loss" else 0.0


class ExpertRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` as a ``SequentialMLP`` expert's second projection (the local spec's
    experts, used without transformer-engine), with the same parameters.

    Megatron-Core's MLP (0.16.1, 0.17.0, 0.19.2) adds a biased expert's bias to this layer's output
    *in place*; that output is the tensor-parallel reduction's, a view of its input at TP=1, so any
    backward through biased experts (gpt-oss) fails: "Output 0 of _ReduceFromModelParallelRegion is
    a view and is being modified inplace". This returns a copy when there is a bias to add.
    """

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return (output if bias is None else output.clone()), bias


class TreeMoELayer(MoELayer):
    """``MoELayer`` whose router losses weigh each token by its multiplicity in the unpacked batch.

    Inside a tree model its :class:`TreeTransformerLayer` hands it the micro-batch's mask plan
    (:meth:`reading`): the plan's :class:`RouterInputs` give the weights, replayed routes and loss
    scale, its store a trunk group's routing statistics. Without a plan (or without router inputs
    on it) it behaves exactly like ``MoELayer``.
    """

    _plan = None

    @contextlib.contextmanager
    def reading(self, plan):
        """Route with ``plan`` (a micro-batch's :class:`~megatron_tree.core.mask.TreeMaskPlan`)
        for the duration of one layer call."""
        self._plan = plan
        try:
            yield
        finally:
            self._plan = None

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        inputs = getattr(self._plan, "tokens", None)
        if inputs is not None and getattr(self, "moe_layer_recompute", False):
            raise ValueError(
                "MoE-only recompute (recompute_modules=['moe']) re-routes outside the layer's "
                "forward, where the micro-batch's tree plan is gone; use full or core_attn "
                "recompute with trees"
            )
        return super().forward(hidden_states, intermediate_tensors, padding_mask)

    def route(self, hidden_states, padding_mask=None):
        plan = self._plan
        inputs = getattr(plan, "tokens", None)
        if inputs is None:
            return super().route(hidden_states, padding_mask)
        weights = inputs.weights
        store = plan.store  # a trunk group's, or None
        if inputs.routes is not None:
            self._replay(inputs.routes)
        if store is not None and store.collecting and router_losses_on(self.config):
            store.add_stats(
                self.router.layer_number, _routing_stats(self.router, hidden_states, weights)
            )
        if not (self.training and torch.is_grad_enabled()):
            return super().route(hidden_states, None)
        check_tree_moe_config(self.config)
        counts = self.router.local_tokens_per_expert if self.router.enable_expert_bias else None
        before = None if counts is None else counts.clone()
        with _router_losses_off(self.config):
            probs, routing_map = super().route(hidden_states, None)
        if counts is not None:
            _count_tokens_as_unpacked(counts, before, routing_map, weights)
        group_stats = None
        if store is not None and router_losses_on(self.config):
            group_stats = store.layer_stats.get(self.router.layer_number)
            if group_stats is None:
                raise ValueError(
                    f"layer {self.router.layer_number}: a trunk group's router losses need the "
                    "group's routing statistics, collected by a first pass over its parts "
                    "(tree_forward_backward does this)"
                )
        probs = _attach_weighted_losses(
            self.router, hidden_states, probs, weights, inputs.loss_scale, group_stats
        )
        return probs, routing_map

    def _replay(self, routes: torch.Tensor) -> None:
        """Make the router replay its layer's column of ``routes`` [n, layers, topk] (cut to the
        sequence-parallel shard it sees) in this call, a recomputation included."""
        replay = getattr(self.router, "router_replay", None)
        if replay is None:
            raise ValueError(
                "the micro-batch carries routes to replay, but this router does not replay: build "
                "the model with moe_enable_routing_replay=True"
            )
        if self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1:
            shard = routes.shape[0] // self.config.tensor_model_parallel_size
            rank = parallel_state.get_tensor_model_parallel_rank()
            routes = routes[rank * shard : (rank + 1) * shard]
        column = routes[:, self.router.layer_number - 1].to(torch.int64)  # [n, topk]
        if "replay_mask" in inspect.signature(replay.set_target_indices).parameters:
            # verl's RouterReplay: rows marked -1 route as the model chooses (its R3 replay mask)
            replay.set_target_indices(column.clamp(min=0), replay_mask=column[:, 0] >= 0)
            replay.replay_backward_mask_list.pop()
        else:
            replay.set_target_indices(column)
        replay.replay_backward_list.pop()  # a recomputation replays forward again
        replay.set_router_replay_action(_replay_actions(replay).REPLAY_FORWARD)


def _replay_actions(replay):
    """The action enum of ``replay``'s class: Megatron's ``RouterReplayAction``, or verl's where
    verl's router replay patch (verl 0.9.1 on a Megatron-Core without hash routing) gives every
    router its own ``RouterReplay``, which compares actions with its own enum."""
    return importlib.import_module(type(replay).__module__).RouterReplayAction


class _TreeLayer:
    """A transformer layer that gives its tree MoE layer the mask plan of the call it runs (the
    plan travels as ``attention_mask``, which Megatron passes to every layer, recomputation
    included)."""

    def forward(self, *args, **kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        plan = getattr(mask, "plan", None)
        if plan is None or not isinstance(self.mlp, TreeMoELayer):
            return super().forward(*args, **kwargs)
        with self.mlp.reading(plan):
            return super().forward(*args, **kwargs)


class TreeTransformerLayer(_TreeLayer, TransformerLayer):
    """``TransformerLayer`` for tree MoE layers (same parameters); see :class:`_TreeLayer`."""


class TreeMoETransformerLayer(_TreeLayer, MoETransformerLayer):
    """``MoETransformerLayer`` for tree MoE layers (same parameters); see :class:`_TreeLayer`."""


TREE_LAYERS = {TransformerLayer: TreeTransformerLayer, MoETransformerLayer: TreeMoETransformerLayer}


def _count_tokens_as_unpacked(counts, before, routing_map, weights) -> None:
    """The expert-bias token counts (``local_tokens_per_expert`` [E], which ``finalize_model_grads``
    turns into the aux-loss-free bias update) as the unpacked batch counts them: each routed token
    weighed by its multiplicity, padding by 0. Megatron's router counted each packed token once
    whenever it counts at all (grad enabled: under full recompute that is the backward's
    recomputation, the checkpointed forward runs without grad); which calls count is kept as
    Megatron decides it, without a host read."""
    with torch.no_grad():
        counted = (counts - before).sum() > 0
        weighted = (routing_map.to(counts.dtype) * weights.to(counts.dtype)[:, None]).sum(0)
        counts.copy_(before + torch.where(counted, weighted, torch.zeros_like(weighted)))


def _routing_stats(router, hidden_states, weights, routing_map=None) -> torch.Tensor:
    """[E + 1]: the weighted token count of every expert, then W (the total weight), over the
    TP x CP shards (no gradient)."""
    with torch.no_grad():
        if routing_map is None:
            logits = router.gating(hidden_states).reshape(-1, router.config.num_moe_experts)
            routing_map, _ = compute_routing_scores_for_aux_loss(
                logits, router.topk, router.score_function
            )
        w = weights.to(routing_map.device, torch.float32)
        stats = torch.cat([(routing_map.float() * w[:, None]).sum(0), w.sum()[None]])
        group = router.tp_cp_group
        if group is not None and group.size() > 1:
            dist.all_reduce(stats, group=group)
    return stats


def _attach_weighted_losses(router, hidden_states, probs, weights, loss_scale, group_stats=None):
    """probs with the weighted aux loss and z-loss attached (their gradients flow in backward).

    ``group_stats`` ([E + 1], :func:`_routing_stats` summed over a trunk group's parts): the counts
    and W the losses are normalized by, in place of this micro-batch's own."""
    config = router.config
    num_experts = config.num_moe_experts
    aux_coeff, z_coeff = _aux_coeff(config), config.moe_z_loss_coeff
    if not aux_coeff and not z_coeff:
        return probs
    logits = router.gating(hidden_states).reshape(-1, num_experts)  # [tokens, E]
    w = weights.to(logits.dtype)
    group = router.tp_cp_group
    routing_map, scores = compute_routing_scores_for_aux_loss(
        logits, router.topk, router.score_function
    )
    stats = (
        _routing_stats(router, hidden_states, weights, routing_map=routing_map)
        if group_stats is None
        else group_stats.to(logits.dtype)
    )
    total = stats[-1].clamp(
        min=1.0
    )  # W counts tokens (>= 1 with any real one); an all-padding fill-in: 0 losses
    factor = 1.0 if loss_scale is None else total * loss_scale
    num_layers = config.num_layers + (config.mtp_num_layers or 0)
    if z_coeff:
        z_loss = z_coeff * (torch.logsumexp(logits, dim=-1).square() * w).sum() / total
        probs = MoEAuxLossAutoScaler.apply(probs, z_loss * factor)
        save_to_aux_losses_tracker(
            "z_loss", z_loss.detach() / z_coeff, router.layer_number, num_layers
        )
    if aux_coeff:
        aux = switch_load_balancing_loss_func(
            scores * w[:, None], stats[:-1], total, router.topk, num_experts, aux_coeff
        )
        probs = MoEAuxLossAutoScaler.apply(probs, aux * factor)
        save_to_aux_losses_tracker(
            "load_balancing_loss",
            aux.detach() / aux_coeff,
            router.layer_number,
            num_layers,
            reduce_group=group,
        )
    return probs


def token_multiplicity(tree, positions: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [1, N] (or [1, n] at ``positions``): how many of the tree's sequences contain each
    packed position (0 for padding), the weight of that token in the unpacked batch."""
    index = tree.token_index
    # index_add_ rather than bincount, which reads the largest index back to the host on CUDA.
    counts = torch.zeros(tree.padded_length, dtype=torch.float32, device=index.device)
    counts.index_add_(0, index, torch.ones(index.shape, dtype=torch.float32, device=index.device))
    return (counts if positions is None else counts[positions.to(counts.device)])[None]


def _replaying_routers(chunk) -> list:
    """The routers of a model chunk that replay recorded routes (``moe_enable_routing_replay``)."""
    return [
        m.router
        for m in chunk.modules()
        if isinstance(m, MoELayer) and getattr(m.router, "router_replay", None) is not None
    ]


def replay_routes(micro_batches, route_key: str) -> list[torch.Tensor]:
    """Per micro-batch, the routes its rows replay: int [n, num_layers, topk].

    The routes are a per-token input packed with ``build_packed_tree_batch(route_key=...)``
    ([T, num_layers, topk], equal on every sequence through a position). They are laid out per
    packed position (for a trunk group, per position of the group's tree, filled from all its
    parts), then cut to each micro-batch's rows (a CP split or trunk part). Padding positions
    replay experts 0..k-1 (distinct, as top-k indices are).
    """
    from ..core.results import values_per_position

    def routes_of(mb) -> torch.Tensor:
        if route_key not in mb.inputs:
            raise ValueError(
                f"the micro-batch has no {route_key!r} routes to replay (pack them with the batch)"
            )
        return mb.inputs[route_key]

    def padding(table: torch.Tensor) -> torch.Tensor:
        return torch.arange(table.shape[-1], dtype=table.dtype, device=table.device)

    groups: dict[int, torch.Tensor] = {}
    for mb in micro_batches:
        rows = mb.rows
        if rows.group is None:
            continue
        routes = routes_of(mb)
        if rows.group not in groups:
            table = routes.new_empty((rows.tree.padded_length, *routes.shape[1:]))
            table[:] = padding(table)
            groups[rows.group] = table
        groups[rows.group][mb.tree.token_index.to(routes.device)] = routes
    result = []
    for mb in micro_batches:
        rows = mb.rows
        if rows.group is not None:
            table = groups[rows.group]
        else:
            table = values_per_position(routes_of(mb), mb.tree)  # [N, layers, topk]
            table[mb.tree.num_tree_tokens :] = padding(table)
        result.append(rows.local(table, dim=0))
    return result


def check_replaying(chunks, route_key: str) -> None:
    """Refuse routing replay on a model whose routers do not replay."""
    if not any(
        isinstance(m, MoELayer) and getattr(m.router, "router_replay", None) is not None
        for chunk in chunks
        for m in chunk.modules()
    ):
        raise ValueError(
            f"route_key={route_key!r} needs routers that replay: build the model with "
            "moe_enable_routing_replay=True"
        )


@contextlib.contextmanager
def replaying(chunks):
    """Routers' replay state cleared when the step ends (each call sets its own targets)."""
    try:
        yield
    finally:
        for chunk in chunks:
            for m in chunk.modules():
                replay = getattr(getattr(m, "router", None), "router_replay", None)
                if isinstance(m, MoELayer) and replay is not None:
                    replay.clear_indices()
                    replay.clear_router_replay_action()
