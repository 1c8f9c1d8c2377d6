"""Gated delta-net hybrids (Qwen3-Next, Qwen3.5 dense, Qwen3.5-MoE) with trees, through
Megatron-Bridge.

Tiny random HF checkpoints (``HYBRID_TINY``: three gated delta-net layers then one attention layer)
load through ``patch_megatron_bridge_for_tree_training``; every sequence of branching multi-turn
tries (``recurrent_sequences``: prefixes of other sequences, one- and two-token segments between
branch points, a branch at a root's first token) gets the log-probs HuggingFace gives it alone, and
the training step's gradients equal the unpacked run's. Runs in the Megatron-Bridge stack
(transformers >= 5.8); skipped elsewhere, with the reason shown.

The unpacked reference for gradients is the same model on each sequence alone (a one-chain tree:
Megatron's own ``GatedDeltaNet`` cannot run without ``fla``, a GPU-only package); the forward is
checked against HuggingFace, which is independent.
"""

from __future__ import annotations

import pytest
import torch

from harness.dist import run_spawned
from harness.marks import MEGATRON_BRIDGE_STACK
from harness.models import (
    HYBRID_ARCHS,
    RECOMPUTE_MODES,
    max_err,
    megatron_bridge_tree_model,
    pack,
    recompute_fields,
    record_parity,
    recurrent_sequences,
    step_logprobs,
    tree_logprobs,
)
from megatron_tree.testing.reference import gradient_errors, parameter_grads
from megatron_tree.testing.tolerances import (
    FP64_MODEL_TOL,
    GRAD_RTOL,
    HF_HYBRID_LOGP_TOL,
    LOSS_RTOL,
)

pytestmark = [
    *MEGATRON_BRIDGE_STACK,
]

# A wrong segment state or convolution window moves log-probs by >= 1e-3.


@pytest.fixture(scope="module")
def hybrid_checkpoints(tmp_path_factory):
    from harness.models import make_hf_checkpoints

    return make_hf_checkpoints(tmp_path_factory.mktemp("hybrid"), HYBRID_ARCHS)


@pytest.fixture(scope="module")
def hybrid_references(hybrid_checkpoints):
    from harness.models import hf_references

    return hf_references(hybrid_checkpoints, recurrent_sequences())


def _model(path: str, **kwargs):
    return megatron_bridge_tree_model(path, backend="sdpa", **kwargs)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_tree_logprobs_match_hf(world, arch, hybrid_checkpoints, hybrid_references):
    from megatron_tree.mcore.gated_delta_net import TreeGatedDeltaNet
    from megatron_tree.mcore.model import TreeGPTModel

    model = _model(hybrid_checkpoints[arch]).eval()
    assert isinstance(model, TreeGPTModel)
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds == ["TreeGatedDeltaNet"] * 3 + ["SelfAttention"]
    assert all(
        isinstance(layer.self_attention, TreeGatedDeltaNet) for layer in model.decoder.layers[:3]
    )
    err = max_err(tree_logprobs(model, recurrent_sequences()), hybrid_references[arch])
    assert err <= HF_HYBRID_LOGP_TOL
    record_parity(arch, "megatron-bridge", err)


@pytest.mark.parametrize("arch", ["qwen3_5_moe_text"])
def test_hybrid_tree_is_exact_in_float64(world, arch, hybrid_checkpoints):
    """Every rounding difference gone: tree and sequences alone agree to 1e-10."""
    model = _model(hybrid_checkpoints[arch]).eval().double()
    seqs = recurrent_sequences()
    tree = tree_logprobs(model, seqs)
    alone = tree_logprobs(model, seqs, alone=True)
    assert max_err(tree, alone) <= FP64_MODEL_TOL


class _OneSequence(torch.nn.Module):
    """The model on one sequence alone (a one-chain tree), with the stock call signature
    ``model(input_ids [1, L], position_ids, attention_mask=None)`` that the unpacked reference
    uses."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask=None):
        from megatron_tree.core.mask import tree_attention_mask

        n = input_ids.shape[1]
        mb = pack([input_ids[0]])[0]
        out = self.model(
            mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(mb["tree"])
        )
        return out[:, :n]


def _step_vs_unpacked(path: str, fields: dict, **step_kwargs) -> tuple[float, float, dict, dict]:
    """(tree step loss, unpacked loss, tree gradients, unpacked gradients); ``fields`` set on both
    models' providers (recompute, router losses)."""
    from megatron.core import parallel_state as ps

    from megatron_tree import tree_forward_backward
    from megatron_tree.core.heads import LogProbs
    from megatron_tree.core.losses import ppo_clipped_loss
    from megatron_tree.testing.reference import unpacked_reference_step
    from megatron_tree.testing.synthetic import rl_batch

    batch = rl_batch(recurrent_sequences(), response_start=5)
    loss_fn = lambda outputs, mb: ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)  # noqa: E731
    reference = _OneSequence(_model(path, **fields))
    want = float(unpacked_reference_step(reference, batch, loss_fn))
    model = _model(path, **fields)
    result = tree_forward_backward(
        model,
        batch,
        loss_fn,
        gather=LogProbs(),
        tp_group=ps.get_tensor_model_parallel_group(),
        **step_kwargs,
    )
    grads = [parameter_grads(m, prefix="model.") for m in (model, reference)]
    return float(result.loss), want, *grads


def _assert_step_close(got_loss, want_loss, got, want):
    assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    errors = gradient_errors(got, want)
    assert any("in_proj" in n for n in errors) and any("conv1d" in n for n in errors)
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_hybrid_step_gradients_equal_unpacked(world, recompute, hybrid_checkpoints):
    fields = recompute_fields(recompute, "gdn_norm_out")
    _assert_step_close(
        *_step_vs_unpacked(
            hybrid_checkpoints["qwen3_5_text"], fields, max_tokens_per_mb=128, block_size=16
        )
    )


def test_hybrid_trunk_reuse_gradients_equal_unpacked(world, hybrid_checkpoints):
    """Capacity 64 with 200+ tokens of prompt groups: trunk parts record each gated delta-net
    layer's
    inputs, their branches recompute the recurrence along the trunk from them."""
    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.testing.synthetic import rl_batch

    packed = build_packed_tree_batch(
        rl_batch(recurrent_sequences(), response_start=5),
        max_tokens_per_mb=64,
        block_size=16,
        pad_to_max=False,
        share_trunks=True,
    )
    assert any(mb["rows"].records for mb in packed), "the batch must form a trunk group"
    # Qwen3-Next's bridge sets the global aux loss, which accumulates across steps (refused with
    # trees). Router losses are as if unpacked over the *batch* (tests/test_moe_aux_loss.py), not
    # per sequence as this reference runs, so they are off here.
    fields = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0}
    _assert_step_close(
        *_step_vs_unpacked(
            hybrid_checkpoints["qwen3_next"],
            fields,
            max_tokens_per_mb=64,
            block_size=16,
            share_trunks=True,
        )
    )


def _tp2_worker(rank: int, paths: dict) -> dict:
    return {
        arch: tree_logprobs(_model(path, tp=2).eval(), recurrent_sequences())
        for arch, path in paths.items()
    }


def test_hybrid_tensor_parallel_2_matches_hf(hybrid_checkpoints, hybrid_references):
    for rank in run_spawned(_tp2_worker, 2, hybrid_checkpoints):
        for arch, logprobs in rank.items():
            assert max_err(logprobs, hybrid_references[arch]) <= HF_HYBRID_LOGP_TOL, arch


def _cp2_worker(rank: int, path: str) -> dict:
    return step_logprobs(
        _model(path, cp=2), recurrent_sequences(), max_tokens_per_mb=64, block_size=16
    )


def test_hybrid_context_parallel_2_matches_hf(hybrid_checkpoints, hybrid_references):
    """CP=2: each rank all-gathers the gated delta-net inputs of the tree, runs the recurrence over
    all of it and keeps its rows; attention layers split as for dense models."""
    for rank in run_spawned(_cp2_worker, 2, hybrid_checkpoints["qwen3_5_text"], cp=2, tp=1):
        assert max_err(rank, hybrid_references["qwen3_5_text"]) <= HF_HYBRID_LOGP_TOL


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_flop_model_counts_a_built_hybrid(world, arch, hybrid_checkpoints):
    """GPTShape.from_config of the bridge's config: its matmul weights per token are the built
    model's 2-D weights (router and shared-expert gate included); attention pairs are charged to
    the one attention layer of four only."""
    from megatron_tree.core.flops import GPTShape

    model = _model(hybrid_checkpoints[arch])
    shape = GPTShape.from_config(model.config, vocab=model.vocab_size)
    assert shape.linear_layers == 3 and shape.attention_layers == 1
    routed = shape.num_experts - shape.topk if shape.num_experts else 0
    unused = (
        routed * shape._mlp_params(shape.moe_ffn_hidden or shape.ffn_hidden) * shape.num_moe_layers
    )
    matmul_weights = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n
    )
    assert shape.linear_params_per_token == matmul_weights - unused
    assert shape.recurrent_flops_per_token > 0


def test_stock_hybrid_modules_are_refused(world):
    """A model whose token mixers know nothing of trees (megatron-core 0.19's HybridModel with
    stock gated delta-net and attention layers) is refused by the step before anything runs."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_tree import tree_forward_backward
    from megatron_tree.mcore.spec import check_tree_model

    class Stock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Module()
            self.layer.mixer = GatedDeltaNet.__new__(GatedDeltaNet)
            torch.nn.Module.__init__(self.layer.mixer)

    with pytest.raises(ValueError, match="layer.mixer is a stock GatedDeltaNet"):
        check_tree_model(Stock())
    with pytest.raises(ValueError, match="stock GatedDeltaNet"):
        tree_forward_backward(
            Stock(), {"input_ids": torch.ones(1, 4, dtype=torch.long)}, None, forward_only=True
        )
