"""Routing replay with trees: recorded routes are a per-token input, and two sequences share a token
only if they share its route too (the trie key is token + route). Checked against a brute-force
trie built from (token, route) pairs."""

from __future__ import annotations

import pytest
import torch

from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.results import values_per_position
from megatron_tree.testing.synthetic import pad_sequences
from megatron_tree.testing.tolerances import GRAD_RTOL, LOSS_RTOL

LAYERS, TOPK, EXPERTS = 2, 2, 4


def _routes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack(
        [torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n * LAYERS)]
    ).view(n, LAYERS, TOPK)


def _batch(seqs, routes) -> dict:
    batch = pad_sequences(seqs)
    width = batch["input_ids"].shape[1]
    padded = torch.zeros(len(seqs), width, LAYERS, TOPK, dtype=torch.int64)
    for i, r in enumerate(routes):
        padded[i, : len(r)] = r
    batch["routed_experts"] = padded
    return batch


def _brute_force_unique(seqs, routes) -> int:
    """Nodes of the trie whose keys are (token, route) pairs."""
    nodes = set()
    for s, r in zip(seqs, routes):
        for t in range(len(s)):
            nodes.add(tuple((int(s[u]), tuple(r[u].flatten().tolist())) for u in range(t + 1)))
    return len(nodes)


def test_sharing_stops_where_routes_differ():
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 100, (12,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(1, 100, (n,), generator=g)]) for n in (6, 4, 7)]
    base = _routes(12, seed=1)
    disagree = base.clone()
    disagree[5, 1] = (
        disagree[5, 1] + 1
    ) % EXPERTS  # the engine routed token 5 differently in layer 1
    routes = [
        torch.cat([base, _routes(6, 2)]),
        torch.cat([disagree, _routes(4, 3)]),
        torch.cat([base, _routes(7, 4)]),
    ]
    batch = _batch(seqs, routes)
    shared = build_packed_tree_batch(batch, max_tokens_per_mb=128, block_size=16, pad_to_max=False)
    keyed = build_packed_tree_batch(
        batch, max_tokens_per_mb=128, block_size=16, pad_to_max=False, route_key="routed_experts"
    )
    # Tokens only: the 12-token prompt is shared by all three. Token + route: sequence 1 leaves at
    # token 5.
    assert shared.num_tree_tokens == 12 + 6 + 4 + 7
    assert keyed.num_tree_tokens == 12 + 6 + (12 - 5) + 4 + 7 == _brute_force_unique(seqs, routes)
    # Every position holds one route: each sequence's tokens read back their own routes.
    for mb in keyed:
        tree = mb["tree"]
        per_position = values_per_position(mb["routed_experts"], tree, fill=-1)
        for i in range(tree.num_sequences):
            b = int(tree.sequence_ids[i])
            idx = tree.sequence_token_index(i)
            assert torch.equal(per_position[idx], routes[b])
            assert torch.equal(tree.input_ids[idx], seqs[b])


@pytest.mark.parametrize("seed", range(5))
def test_route_keyed_tries_match_brute_force(seed):
    """Random batches where routes of shared prefixes disagree at random tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs, routes = [], []
    prompts = [
        torch.randint(1, 50, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
        for _ in range(3)
    ]
    prompt_routes = [_routes(len(p), seed * 10 + k) for k, p in enumerate(prompts)]
    for k in range(9):
        p, r = prompts[k % 3], prompt_routes[k % 3].clone()
        if torch.rand((), generator=g) < 0.5:  # a disagreeing route somewhere in the prompt
            t = int(torch.randint(0, len(p), (), generator=g))
            r[t, 0, 0] = (
                r[t, 0, 0] + 1 + int(torch.randint(0, EXPERTS - 1, (), generator=g))
            ) % EXPERTS
        tail = int(torch.randint(1, 6, (), generator=g))
        seqs.append(torch.cat([p, torch.randint(1, 50, (tail,), generator=g)]))
        routes.append(torch.cat([r, _routes(tail, 1000 + seed * 10 + k)]))
    packed = build_packed_tree_batch(
        _batch(seqs, routes),
        max_tokens_per_mb=256,
        block_size=16,
        pad_to_max=False,
        route_key="routed_experts",
    )
    assert packed.num_tree_tokens == _brute_force_unique(seqs, routes)


def test_route_key_errors():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([1, 2])]
    batch = _batch(seqs, [_routes(3, 0), _routes(2, 1)])
    with pytest.raises(ValueError, match="route_key='routes' must name a per-token input"):
        build_packed_tree_batch(batch, max_tokens_per_mb=16, block_size=16, route_key="routes")
    with pytest.raises(ValueError, match=r"must hold integer routes \(expert ids\)"):
        build_packed_tree_batch(
            {**batch, "routed_experts": batch["routed_experts"].float()},
            max_tokens_per_mb=16,
            block_size=16,
            route_key="routed_experts",
        )
    with pytest.raises(
        ValueError, match=r"data\['routed_experts'\] must be a tensor shaped \[B, L, ...\]"
    ):
        build_packed_tree_batch(
            {**batch, "routed_experts": batch["routed_experts"][:1]},
            max_tokens_per_mb=16,
            block_size=16,
            route_key="routed_experts",
        )


# ----------------------------------------------------------------------------- replay in the model

# A route not replayed (the model's own top-k, not the recorded one) moves the loss by >= 1e-2.


class _ReplayPerSequence(torch.nn.Module):
    """The reference: the stock model, each call (one sequence) replaying that sequence's routes."""

    def __init__(self, model, routes):
        super().__init__()
        self.model, self.routes, self.calls = model, routes, 0

    def forward(self, ids, positions, attention_mask=None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routes = self.routes[self.calls]
        self.calls += 1
        routers = [
            m.router
            for m in self.model.modules()
            if hasattr(m, "router") and hasattr(m.router, "router_replay")
        ]
        for router in routers:
            router.router_replay.clear_indices()
            router.router_replay.set_target_indices(routes[:, router.layer_number - 1])
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return self.model(ids, positions, attention_mask=attention_mask)


def _recorded_routes(seqs, seed: int) -> list[torch.Tensor]:
    """Routes that depend on the token prefix (so shared prefixes agree), except that sequence 1
    disagrees at its token 5, as a rollout engine may."""
    routes = []
    for s in seqs:
        r = torch.empty(len(s), LAYERS, TOPK, dtype=torch.int64)
        for t in range(len(s)):
            g = torch.Generator().manual_seed(seed + hash(tuple(s[: t + 1].tolist())) % 100003)
            r[t] = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(LAYERS)])
        routes.append(r)
    routes[1][5, 0] = (
        routes[1][5, 0].flip(0) if routes[1][5, 0, 0] != routes[1][5, 0, 1] else routes[1][5, 0]
    )
    routes[1][5, 1, 0] = (routes[1][5, 1, 1] + 1) % EXPERTS
    return routes


@pytest.mark.parametrize(
    "seqs,share_trunks,recompute",
    [
        ("branching", False, False),
        ("branching", True, True),
        ("long_context", True, False),
        ("long_context", True, True),
    ],
    ids=["trees", "trunks+recompute", "chains", "chains+recompute"],
)
def test_step_replays_recorded_routes_like_the_unpacked_reference(
    world, seqs, share_trunks, recompute
):
    """Whole trees, and trunk reuse (trunk parts, their chains, branches): each part replays its
    rows' routes; under full activation recompute each backward's recomputation replays its own
    micro-batch's routes, although trunk parts run their backward after their branches'."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from harness.models import (
        VOCAB,
        branching_sequences,
        build_gpt_model,
        long_context_sequences,
        recompute_fields,
        small_moe_config,
    )
    from megatron_tree.core.losses import ppo_clipped_loss
    from megatron_tree.mcore.step import tree_forward_backward
    from megatron_tree.testing.reference import (
        gradient_errors,
        parameter_grads,
        unpacked_reference_step,
    )

    seqs = branching_sequences() if seqs == "branching" else long_context_sequences()
    routes = _recorded_routes(seqs, seed=3)
    batch = _batch(seqs, routes)
    g = torch.Generator().manual_seed(2)
    lengths = batch["attention_mask"].sum(1)
    width = batch["input_ids"].shape[1]
    batch["loss_mask"] = (torch.arange(width)[None] < (lengths - 1)[:, None]).float()
    batch["old_logprobs"] = -3 * torch.rand(len(seqs), width, generator=g) - 3.5
    batch["advantages"] = torch.randn(len(seqs), 1, generator=g).expand(-1, width).contiguous()
    try:
        config = small_moe_config(num_layers=LAYERS, moe_enable_routing_replay=True)
        reference = build_gpt_model(config, tree=False, vocab_size=VOCAB)
        tree_config = small_moe_config(
            num_layers=LAYERS,
            moe_enable_routing_replay=True,
            **recompute_fields("full" if recompute else "none"),
        )
        tree = build_gpt_model(
            tree_config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
        )
        tree.load_state_dict(reference.state_dict())
        reference_batch = {k: v for k, v in batch.items() if k != "routed_experts"}
        want_loss = unpacked_reference_step(
            _ReplayPerSequence(reference, routes), reference_batch, ppo_clipped_loss
        )
        result = tree_forward_backward(
            tree,
            batch,
            ppo_clipped_loss,
            route_key="routed_experts",
            max_tokens_per_mb=64,
            block_size=16,
            share_trunks=share_trunks,
        )
        assert any(mb["rows"].records for mb in result.packed) == share_trunks
        assert float(result.loss) == pytest.approx(float(want_loss), rel=LOSS_RTOL)
        errors = gradient_errors(parameter_grads(tree), parameter_grads(reference))
        assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])
        # Without replay the model routes by its own top-k: a different loss.
        own = tree_forward_backward(
            tree, batch, ppo_clipped_loss, max_tokens_per_mb=64, block_size=16, forward_only=True
        )
        assert abs(float(own.loss) - float(want_loss)) > 1e-2 * abs(float(want_loss))
    finally:
        RouterReplay.clear_global_router_replay_instances()
