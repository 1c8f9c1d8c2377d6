"""The FLOP model's counts against brute force: mask pairs and a built model's weights."""

from __future__ import annotations

from megatron_tree.core.flops import GPTShape, attention_pairs, train_flops
from megatron_tree.core.mask import build_attention_mask_from_trie
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import grpo_batch


def test_attention_pairs_count_the_dense_mask():
    batch = grpo_batch(num_prompts=3, samples_per_prompt=3, prompt_len=20, response_len=(3, 9), vocab_size=7)
    for mb in build_packed_tree_batch(batch, max_tokens_per_mb=96, block_size=16):
        tree = mb["tree"]
        u = tree.num_tree_tokens
        allowed = ~build_attention_mask_from_trie(tree)[:u, :u]
        assert attention_pairs(tree) == int(allowed.sum())


def test_unshared_flops_of_a_causal_chain():
    shape = GPTShape(hidden=8, layers=2, heads=2, query_groups=1, ffn_hidden=16, vocab=10)
    batch = grpo_batch(num_prompts=1, samples_per_prompt=1, prompt_len=5, response_len=(2, 2), vocab_size=10)
    tree = build_packed_tree_batch(batch, max_tokens_per_mb=16, block_size=8)[0]["tree"]
    n = 7  # one sequence: 7 tokens, 28 causal pairs
    per_token = 2 * (8 * (2 + 2) * 4 + 8 * 8 + 3 * 8 * 16) + 8 * 10
    expected = 3 * (2 * n * per_token + 4 * 8 * 2 * n * (n + 1) // 2)
    assert train_flops([tree], shape) == expected


def test_linear_params_match_a_built_megatron_model():
    from megatron_tree.testing.dist import single_process_world
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tree.testing.models import build_gpt_model
    from megatron_tree.patches import megatron_cpu

    single_process_world()
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=24,
        ffn_hidden_size=96, gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm",
        use_cpu_initialization=True, masked_softmax_fusion=False,
    )
    try:
        model = build_gpt_model(config, tree=True, vocab_size=50)
    finally:
        megatron_cpu.undo()
    matmul_weights = sum(
        p.numel() for n, p in model.named_parameters()
        if n.endswith("weight") and p.dim() == 2 and "embedding" not in n
    )
    assert GPTShape.from_config(config, vocab=50).linear_params_per_token == matmul_weights
