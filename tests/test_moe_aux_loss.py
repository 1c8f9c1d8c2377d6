"""MoE router losses as if unpacked: a tree holds a shared token once, the unpacked batch once per
sequence; TreeMoELayer weighs each tree token by that multiplicity (padding by 0).

Reference: Megatron's stock GPTModel (local MoE spec) on the same sequences unpacked as one
right-padded batch [B, L] with Megatron's own padding mask, which excludes padding from the aux
loss and the z-loss; no tree code runs on that side. Compared per layer: the logged aux loss and
z-loss, and every gradient of the router losses alone (main loss times 0).
"""

from __future__ import annotations

import pytest
import torch

from harness.models import (
    VOCAB,
    branching_sequences,
    build_gpt_model,
    pack,
    recompute_fields,
    small_moe_config,
)
from megatron_tree.core.mask import tree_attention_mask
from megatron_tree.testing.reference import parameter_grads
from megatron_tree.testing.synthetic import pad_sequences
from megatron_tree.testing.tolerances import GRAD_RTOL, LOSS_RTOL

# Counting a shared token once instead of k times moves the aux loss by >= 1e-3 relative here.
COEFFS = dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def _router_losses(model, forward) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-layer logged router losses and the gradients of the router losses alone."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    clear_aux_losses_tracker()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # the shape Megatron sets
    model.train()
    model.zero_grad(set_to_none=True)
    output = forward(model)
    (output.float().sum() * 0).backward()  # only the router losses' gradients remain
    tracker = get_moe_layer_wise_logging_tracker()
    losses = {name: entry["values"].detach().clone() for name, entry in tracker.items()}
    grads = parameter_grads(model)
    clear_aux_losses_tracker()
    return losses, grads


def _unpacked_batch(model, seqs):
    batch = pad_sequences(seqs)
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    return model(ids, positions, attention_mask=None, padding_mask=~mask)  # True = padding


def _tree(model, micro_batch, weighted: bool = True):
    """The tree model on one micro-batch; ``weighted``: its routers get each row's multiplicity
    on the mask plan (the step's context), else no router inputs (a stock MoE layer's counting)."""
    from megatron_tree.mcore.moe import RouterInputs, token_multiplicity

    tree = micro_batch["tree"]
    tokens = RouterInputs(token_multiplicity(tree)[0]) if weighted else None
    return model(
        micro_batch["input_ids"],
        micro_batch["position_ids"],
        attention_mask=tree_attention_mask(tree, tokens=tokens),
    )


def _models(**overrides):
    config = small_moe_config(**{**COEFFS, **overrides})
    reference = build_gpt_model(config, tree=False, vocab_size=VOCAB)
    tree = build_gpt_model(
        config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
    )
    tree.load_state_dict(reference.state_dict())
    return reference, tree


def test_router_losses_equal_the_unpacked_batch(world):
    from megatron_tree.mcore.moe import TreeMoELayer

    seqs = branching_sequences()
    micro_batch = pack(seqs, max_tokens=512)[0]  # one tree holding every sequence
    assert micro_batch["tree"].num_sequences == len(seqs)
    reference, tree = _models()
    assert all(isinstance(layer.mlp, TreeMoELayer) for layer in tree.decoder.layers)
    want_losses, want_grads = _router_losses(reference, lambda m: _unpacked_batch(m, seqs))
    got_losses, got_grads = _router_losses(tree, lambda m: _tree(m, micro_batch))
    assert set(want_losses) == {"load_balancing_loss", "z_loss"}
    for name, want in want_losses.items():
        assert torch.allclose(got_losses[name], want, rtol=LOSS_RTOL, atol=0), (
            name,
            got_losses[name],
            want,
        )
    assert want_grads.keys() == got_grads.keys()
    router_grads = [n for n in want_grads if "router" in n]
    assert router_grads and all(float(want_grads[n].norm()) > 0 for n in router_grads)
    for name, want in want_grads.items():
        err = float((got_grads[name] - want).norm()) / max(float(want.norm()), 1e-12)
        assert err <= GRAD_RTOL or (
            float(want.norm()) < 1e-12 and float(got_grads[name].norm()) < 1e-12
        ), (name, err)

    # The same tree without the weights counts each shared token once (and padding): not the same.
    plain_losses, _ = _router_losses(tree, lambda m: _tree(m, micro_batch, weighted=False))
    rel = (
        (plain_losses["load_balancing_loss"] - want_losses["load_balancing_loss"]).abs()
        / want_losses["load_balancing_loss"]
    ).max()
    assert rel > 1e-3


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_expert_bias_counts_equal_the_unpacked_batch(world, recompute):
    """Aux-loss-free balancing (DeepSeek-V3, GLM-4.5): the token counts the expert-bias update reads
    after the step count each token once per sequence through it and padding not at all (under full
    recompute Megatron counts in the backward's recomputation: once, too)."""
    seqs = branching_sequences()
    micro_batch = pack(seqs, max_tokens=512)[0]
    fields = dict(
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        **recompute_fields(recompute),
    )
    counts = {}

    def one_at_a_time(model):  # every sequence alone, no padding; the counts add up over calls
        return torch.cat(
            [
                model(s[None], torch.arange(len(s))[None], attention_mask=None).flatten()
                for s in seqs
            ]
        )

    for name, forward in (
        ("unpacked", one_at_a_time),
        ("tree", lambda m: _tree(m, micro_batch)),
        ("plain tree", lambda m: _tree(m, micro_batch, weighted=False)),
    ):
        reference, tree = _models(**fields)
        model = reference if name == "unpacked" else tree
        _router_losses(model, forward)
        counts[name] = torch.stack(
            [layer.mlp.router.local_tokens_per_expert for layer in model.decoder.layers]
        )
    assert (
        float(counts["unpacked"].sum()) == sum(len(s) for s in seqs) * 2 * 2
    )  # tokens x top-2 x layers
    assert torch.equal(counts["tree"], counts["unpacked"])
    assert not torch.equal(counts["plain tree"], counts["unpacked"])


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(moe_router_load_balancing_type="seq_aux_loss"), "seq_aux_loss"),
        (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor drops tokens"),
    ],
)
def test_unsupported_router_settings_raise(world, overrides, match):
    _, tree = _models(**overrides)
    micro_batch = pack(branching_sequences(), max_tokens=512)[0]
    with pytest.raises(ValueError, match=match):
        _router_losses(tree, lambda m: _tree(m, micro_batch))


def test_step_reports_expert_tokens(world):
    """moe_stats=True: every routed token counted once per layer and top-k slot (padding included,
    as the experts compute it), none counted twice by recompute."""
    from megatron_tree.core.losses import ppo_clipped_loss
    from megatron_tree.mcore.step import tree_forward_backward

    config = small_moe_config(num_layers=2, **recompute_fields("full"))
    model = build_gpt_model(
        config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
    )
    batch = pad_sequences(branching_sequences())
    width = batch["input_ids"].shape[1]
    lengths = batch["attention_mask"].sum(1)
    batch["loss_mask"] = (torch.arange(width)[None] < (lengths - 1)[:, None]).float()
    batch["old_logprobs"] = torch.full((len(lengths), width), -4.0)
    batch["advantages"] = torch.ones(len(lengths), width)
    result = tree_forward_backward(
        model, batch, ppo_clipped_loss, max_tokens_per_mb=64, block_size=16, moe_stats=True
    )
    # Every micro-batch's rows, routed once per forward: a trunk part runs twice (a no-grad pass
    # recording its keys and values, then recomputed with its backward), so its rows twice.
    trunk_rows = sum(mb.rows.num_rows for mb in result.packed if mb.rows.records)
    routed = result.packed.num_padded_tokens + trunk_rows
    assert trunk_rows > 0
    assert result.expert_tokens.shape == (config.num_moe_experts,)
    assert int(result.expert_tokens.sum()) == routed * config.moe_router_topk * config.num_layers
    assert "expert_tokens=" in result.log_line()
