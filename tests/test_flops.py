"""The FLOP model's counts against brute force: mask pairs and a built model's weights."""

from __future__ import annotations

import pytest

from megatron_tree.core.flops import GPTShape, attention_pairs, cost_weights, train_flops
from megatron_tree.core.mask import build_attention_mask_from_trie
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import grpo_batch


def test_attention_pairs_count_the_dense_mask():
    batch = grpo_batch(
        num_prompts=3, samples_per_prompt=3, prompt_len=20, response_len=(3, 9), vocab_size=7
    )
    for mb in build_packed_tree_batch(batch, max_tokens_per_mb=96, block_size=16):
        tree = mb["tree"]
        u = tree.num_tree_tokens
        allowed = ~build_attention_mask_from_trie(tree)[:u, :u]
        assert attention_pairs(tree) == int(allowed.sum())


def test_unshared_flops_of_a_causal_chain():
    shape = GPTShape(hidden=8, layers=2, heads=2, query_groups=1, ffn_hidden=16, vocab=10)
    batch = grpo_batch(
        num_prompts=1, samples_per_prompt=1, prompt_len=5, response_len=(2, 2), vocab_size=10
    )
    tree = build_packed_tree_batch(batch, max_tokens_per_mb=16, block_size=8)[0]["tree"]
    n = 7  # one sequence: 7 tokens, 28 causal pairs
    per_token = 2 * (8 * (2 + 2) * 4 + 8 * 8 + 3 * 8 * 16) + 8 * 10
    expected = 3 * (2 * n * per_token + 4 * 8 * 2 * n * (n + 1) // 2)
    assert train_flops([tree], shape) == expected


def test_linear_params_match_a_built_megatron_model(world):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.models import build_gpt_model

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=24,
        ffn_hidden_size=96,
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
    )
    model = build_gpt_model(config, tree=True, vocab_size=50)
    matmul_weights = sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.endswith("weight") and p.dim() == 2 and "embedding" not in n
    )
    assert GPTShape.from_config(config, vocab=50).linear_params_per_token == matmul_weights


def test_moe_active_parameters_by_hand():
    """Layer 0 MoE (router 8x4, top-2 of 4 SwiGLU experts of width 6, a gated shared expert of
    width 4), layer 1 dense (SwiGLU 16): a token multiplies by 1272 weights."""
    import pytest

    shape = GPTShape(
        hidden=8,
        layers=2,
        heads=2,
        query_groups=1,
        ffn_hidden=16,
        vocab=10,
        num_experts=4,
        topk=2,
        moe_ffn_hidden=6,
        shared_ffn_hidden=4,
        shared_expert_gate=True,
        moe_layers=1,
    )
    attention = 2 * (8 * (2 + 2) * 4 + 2 * 4 * 8)  # qkv 128 + proj 64, per layer
    dense_mlp = 8 * 16 * 3
    moe_mlp = (
        8 * 4 + 2 * (8 * 6 * 3) + (8 * 4 * 3 + 8)
    )  # router + 2 experts + shared expert and gate
    assert shape.moe_params_per_token == moe_mlp == 424
    assert shape.linear_params_per_token == attention + dense_mlp + moe_mlp + 8 * 10 == 1272
    # Every layer MoE (moe_layers None), no shared expert: 2 x (router + top-2 experts).
    all_moe = GPTShape(
        hidden=8,
        layers=2,
        heads=2,
        query_groups=1,
        ffn_hidden=16,
        vocab=10,
        num_experts=4,
        topk=2,
        moe_ffn_hidden=6,
    )
    assert all_moe.linear_params_per_token == attention + 2 * (32 + 288) + 80
    with pytest.raises(ValueError, match=r"topk=5 must be in \[1, num_experts=4\]"):
        GPTShape(
            hidden=8,
            layers=2,
            heads=2,
            query_groups=1,
            ffn_hidden=16,
            vocab=10,
            num_experts=4,
            topk=5,
        )
    with pytest.raises(ValueError, match=r"moe_layers=3 must be in \[0, layers=2\]"):
        GPTShape(
            hidden=8,
            layers=2,
            heads=2,
            query_groups=1,
            ffn_hidden=16,
            vocab=10,
            num_experts=4,
            topk=2,
            moe_layers=3,
        )


def test_moe_from_config_reads_layer_pattern():
    from types import SimpleNamespace

    import pytest

    from megatron_tree.core.flops import _moe_layer_count

    assert (
        _moe_layer_count(1, 4) == 4
        and _moe_layer_count(2, 5) == 3
        and _moe_layer_count([0, 1, 1, 0], 4) == 2
    )
    with pytest.raises(ValueError, match="must be an int or a list of num_layers=4 zeros and ones"):
        _moe_layer_count([1, 1], 4)
    config = SimpleNamespace(
        hidden_size=8,
        num_layers=4,
        num_attention_heads=2,
        num_query_groups=1,
        ffn_hidden_size=16,
        gated_linear_unit=True,
        kv_channels=None,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=6,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False,
        moe_layer_freq=[1, 0, 1, 0],
    )
    shape = GPTShape.from_config(config, vocab=10)
    assert (
        shape.num_experts,
        shape.topk,
        shape.moe_ffn_hidden,
        shape.shared_ffn_hidden,
        shape.num_moe_layers,
    ) == (4, 2, 6, 0, 2)


def test_moe_active_parameters_match_a_built_megatron_model(world):
    """A local-spec MoE GPT (layers 0 and 2 of 3 MoE, 4 experts, top-2, a gated shared expert): the
    active weights are every non-expert matmul weight (router and shared expert included) plus 2/4
    of the expert weights."""
    from harness.models import build_gpt_model, small_moe_config

    config = small_moe_config(
        num_layers=3,
        moe_layer_freq=[1, 0, 1],
        moe_shared_expert_intermediate_size=48,
        moe_shared_expert_gate=True,
    )
    model = build_gpt_model(config, tree=True, vocab_size=50)
    weights = {
        n: p.numel()
        for n, p in model.named_parameters()
        if p.dim() == 2 and "embedding" not in n and "layernorm" not in n
    }
    experts = sum(v for n, v in weights.items() if "local_experts" in n)
    others = sum(v for n, v in weights.items() if "local_experts" not in n)
    assert any("gate_weight" in n for n in weights) and any(
        "shared_experts.linear_fc1" in n for n in weights
    )
    assert (
        GPTShape.from_config(config, vocab=50).linear_params_per_token == others + experts * 2 // 4
    )


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_multi_latent_attention_costs(world, q_lora_rank):
    """DeepSeek-V3's attention: the per-token weights are the built MLA model's matrices (latent
    down / up projections, rope key, output), and a pair costs 2 x heads x (24 query-key + 12 value
    dims), not 4 x heads x the hidden's head dim."""
    from harness.models import build_gpt_model, small_mla_config

    # Without a query rank there is no query latent to norm (megatron-core 0.17+ refuses the norm).
    config = small_mla_config(q_lora_rank=q_lora_rank, qk_layernorm=q_lora_rank is not None)
    model = build_gpt_model(config, tree=True, vocab_size=50)
    shape = GPTShape.from_config(config, vocab=50)
    matmul_weights = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n
    )
    assert shape.linear_params_per_token == matmul_weights
    assert shape.pair_flops == 2 * 4 * (16 + 8 + 12)
    assert cost_weights(shape)[1] == 1728  # x 3 (forward + backward) x 2 layers


def test_hybrid_pattern_counts_mamba_attention_and_mlp_layers():
    """A HybridModel pattern, by hand: ``M*M-|E`` has two Mamba-2 mixers, one attention layer, one
    dense MLP and one MoE layer (the pipeline bar is no layer); only the attention layer costs per
    pair, the Mamba layers per token (projections, convolution, state)."""
    from types import SimpleNamespace

    from megatron_tree.core.flops import GPTShape

    config = SimpleNamespace(
        hidden_size=64,
        num_layers=5,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        gated_linear_unit=False,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=48,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=8,
    )
    shape = GPTShape.from_config(config, vocab=100, hybrid_layer_pattern="M*M-|E")
    assert (shape.layers, shape.attention_layers, shape.mamba_layers) == (3, 1, 2)
    inner = 4 * 16
    mamba = 64 * (2 * inner + 2 * 2 * 8 + 4) + inner * 64
    attention = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64
    mlp = 64 * 128 * 2
    moe = 64 * 4 + 2 * (64 * 32 * 2) + 64 * 48 * 2
    assert shape.linear_params_per_token == 2 * mamba + attention + mlp + moe + 64 * 100
    conv = 2 * 4 * (inner + 2 * 2 * 8)
    assert shape.recurrent_flops_per_token == 2 * (conv + 6 * 4 * 16 * 8)
    assert shape.pair_flops * shape.attention_layers == 4 * 4 * 16
