"""The frontier MoE families through NVIDIA Megatron-Bridge with trees: DeepSeek-V3 and Kimi-K2
(multi-latent attention with YaRN, dense first layer, routed + shared experts, sigmoid routing with
expert bias in groups), GLM-4.5 (partial rotary, q/k norms, routed + shared experts), gpt-oss
(sinks, sliding / full layers, biased experts) and Qwen3-MoE. Tiny random checkpoints, fp32, CPU:
every sequence of a branching multi-turn trie gets the log-probs HuggingFace gives it alone, the
step's gradients equal the unpacked ones, and DeepSeek-V3 holds at TP=2 and EP=2. Runs in the
Megatron-Bridge stack (``MEGATRON_TREE_BRIDGE=megatron-bridge``, Python 3.12); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from harness.dist import run_spawned
from harness.marks import MEGATRON_BRIDGE_STACK
from harness.models import (
    FRONTIER_ARCHS,
    branching_sequences,
    max_err,
    megatron_bridge_tree_model,
    record_parity,
    step_logprobs,
    tree_logprobs,
)
from megatron_tree.testing.reference import gradient_errors, parameter_grads
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, LOSS_RTOL

pytestmark = [
    *MEGATRON_BRIDGE_STACK,
]

FAMILIES = FRONTIER_ARCHS + ("qwen3_moe",)
# A rotary angle from the packed offset, a leaked key or a wrongly mapped weight moves log-probs by
# >= 1e-3.
# Router losses off in the step comparisons: the bridges set per-sequence / batch losses whose
# unpacked meaning depends on micro-batching (tests/test_moe_aux_loss.py covers the tree side).
NO_ROUTER_LOSS = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0}


@pytest.fixture(scope="module")
def frontier_checkpoints(tmp_path_factory):
    from harness.models import make_hf_checkpoints

    return make_hf_checkpoints(tmp_path_factory.mktemp("frontier"), FAMILIES)


@pytest.fixture(scope="module")
def frontier_references(frontier_checkpoints):
    from harness.models import hf_references

    return hf_references(frontier_checkpoints, branching_sequences())


def _assert_family_modules(arch: str, model) -> None:
    from megatron_tree.mcore.mla import TreeMLASelfAttention
    from megatron_tree.mcore.moe import TreeMoELayer

    layers = model.decoder.layers
    assert isinstance(layers[-1].mlp, TreeMoELayer)
    if arch in ("deepseek_v3", "kimi_k2"):
        assert all(isinstance(layer.self_attention, TreeMLASelfAttention) for layer in layers)
        assert layers[0].self_attention.config.rope_type == "yarn"
    if arch == "gpt_oss":
        cores = [layer.self_attention.core_attention for layer in layers]
        assert [c.window_size for c in cores] == [
            (7, 0),
            None,
        ]  # HF's sliding_window=8 keys, itself included
        assert all(isinstance(c.softmax_offset, torch.nn.Parameter) for c in cores)


@pytest.mark.parametrize("arch", FAMILIES)
def test_frontier_tree_logprobs_match_hf(world, arch, frontier_checkpoints, frontier_references):
    model = megatron_bridge_tree_model(frontier_checkpoints[arch], backend="block_sparse").eval()
    _assert_family_modules(arch, model)
    err = max_err(tree_logprobs(model, branching_sequences()), frontier_references[arch])
    assert err <= LOGP_TOL
    record_parity(arch, "megatron-bridge", err)


class _OneSequence(torch.nn.Module):
    """The tree model on one sequence alone (a chain, which is causal attention: the HF parity above
    checks it), with the stock call signature the unpacked reference uses."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask=None):
        from harness.models import pack
        from megatron_tree.core.mask import tree_attention_mask

        mb = pack([input_ids[0]])[0]
        out = self.model(
            mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(mb["tree"])
        )
        return out[:, : input_ids.shape[1]]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_moe"])
def test_frontier_step_gradients_equal_unpacked(world, arch, frontier_checkpoints):
    from megatron.core import parallel_state as ps

    from megatron_tree import tree_forward_backward
    from megatron_tree.core.heads import LogProbs
    from megatron_tree.core.losses import ppo_clipped_loss
    from megatron_tree.testing.reference import unpacked_reference_step
    from megatron_tree.testing.synthetic import rl_batch

    batch = rl_batch(branching_sequences(), response_start=5)
    loss_fn = lambda outputs, mb: ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)  # noqa: E731
    path = frontier_checkpoints[arch]
    reference = _OneSequence(megatron_bridge_tree_model(path, **NO_ROUTER_LOSS))
    want = float(unpacked_reference_step(reference, batch, loss_fn))
    model = megatron_bridge_tree_model(path, **NO_ROUTER_LOSS)
    result = tree_forward_backward(
        model,
        batch,
        loss_fn,
        gather=LogProbs(),
        max_tokens_per_mb=128,
        block_size=16,
        tp_group=ps.get_tensor_model_parallel_group(),
    )
    errors = gradient_errors(parameter_grads(model), parameter_grads(reference, prefix="model."))
    assert float(result.loss) == pytest.approx(want, rel=LOSS_RTOL)
    assert any("experts" in n for n in errors) and any("router" in n for n in errors)
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


def _deepseek_worker(rank: int, path: str, fields: dict) -> dict:
    seqs = branching_sequences()
    tp = fields.pop("tp", 1)
    model = megatron_bridge_tree_model(path, tp=tp, **fields).eval()
    out = {"logits": tree_logprobs(model, seqs)}
    if tp > 1:  # the step at EP > 1 splits the batch over data-parallel ranks (tests/test_moe.py)
        out["step"] = step_logprobs(model, seqs, max_tokens_per_mb=128, block_size=16)
    return out


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_deepseek_v3_parallel_matches_hf(layout, frontier_checkpoints, frontier_references):
    """TP=2 splits the latent up-projections and heads; EP=2 puts two experts on each rank (the
    alltoall dispatcher the bridge sets)."""
    fields, world = (
        ({"tp": 2}, {"tp": 2})
        if layout == "tp2"
        else ({"expert_model_parallel_size": 2}, {"tp": 1, "ep": 2})
    )
    errors = {
        (r, name): max_err(logprobs, frontier_references["deepseek_v3"])
        for r, rank in enumerate(
            run_spawned(_deepseek_worker, 2, frontier_checkpoints["deepseek_v3"], fields, **world)
        )
        for name, logprobs in rank.items()
    }
    assert max(errors.values()) <= LOGP_TOL, errors
    record_parity(
        "deepseek_v3",
        "megatron-bridge",
        max(errors.values()),
        layout=layout.upper().replace("2", "=2"),
    )


def test_multi_token_prediction_is_refused_until_switched_off(world, tmp_path, frontier_references):
    """A DeepSeek-V3 checkpoint with num_nextn_predict_layers=1: the bridge turns MTP on, the tree
    provider refuses it at provide(); with provider.mtp_num_layers = None it loads and matches HF
    (HF's model has no MTP layers either)."""
    from harness.models import make_hf_checkpoint

    path = str(tmp_path / "deepseek_mtp")
    make_hf_checkpoint("deepseek_v3", path, num_nextn_predict_layers=1)
    with pytest.raises(
        ValueError, match=r"mtp_num_layers=1: multi-token prediction .*mtp_num_layers = None"
    ):
        megatron_bridge_tree_model(path)
    model = megatron_bridge_tree_model(path, mtp_num_layers=None).eval()
    assert (
        max_err(tree_logprobs(model, branching_sequences()), frontier_references["deepseek_v3"])
        <= LOGP_TOL
    )


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_flop_model_counts_a_built_frontier_model(world, arch, frontier_checkpoints):
    """GPTShape.from_config of the bridge's config: the active matmul weights per token are the
    built model's 2-D weights less the routed experts a token does not use (MLA's latent
    projections,
    the dense first layer, routers and shared experts included)."""
    from megatron_tree.core.flops import GPTShape

    model = megatron_bridge_tree_model(frontier_checkpoints[arch])
    shape = GPTShape.from_config(model.config, vocab=model.vocab_size)
    unused = (
        (shape.num_experts - shape.topk)
        * shape._mlp_params(shape.moe_ffn_hidden)
        * shape.num_moe_layers
    )
    matmul_weights = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n
    )
    assert shape.num_moe_layers == 1 and bool(shape.kv_lora_rank) == (arch == "deepseek_v3")
    assert shape.linear_params_per_token == matmul_weights - unused


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
        (
            {"n_group": 2, "topk_group": 2, "num_experts_per_tok": 2},
            None,
        ),  # every group chosen: unlimited
        ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "top-2 scores"),
    ],
)
def test_sigmoid_routing_megatron_cannot_reproduce_is_refused(world, tmp_path, overrides, match):
    """HF routing that Megatron's sigmoid router computes differently is refused when the provider
    is made, not loaded with other routing."""
    from harness.models import make_hf_checkpoint

    path = str(tmp_path / "deepseek")
    make_hf_checkpoint("deepseek_v3", path, **overrides)
    if match is None:
        assert megatron_bridge_tree_model(path).config.moe_router_num_groups in (None, 2)
        return
    with pytest.raises(ValueError, match=match):
        megatron_bridge_tree_model(path)
