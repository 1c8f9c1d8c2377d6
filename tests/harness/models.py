"""Small models and tries for tests, demos and benchmarks.

Tiny random HuggingFace checkpoints (weights re-drawn larger than HF's default init, std 0.02, so
that logits are far from uniform and attention far from flat: a wrong rotary angle or a leaked key
then moves log-probs visibly), small Megatron GPT configs and models, a branching trie, and
HuggingFace / brute-force references.
"""

from __future__ import annotations

import math

import torch

from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import pad_sequences

VOCAB = 128

ARCHS = ("qwen2", "qwen3", "llama")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")

# The tiny MoE checkpoints of the tests: 4 experts, top-2, expert FFN 32, every layer sparse.
# Qwen3-MoE renormalizes the chosen experts' weights (norm_topk_prob, as in Qwen3-30B-A3B);
# Qwen2-MoE does not and adds a sigmoid-gated shared expert (FFN 48).
MOE_TINY = {
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.0,
        head_dim=16,
    ),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.0,
    ),
}


# Gated delta-net hybrids (transformers >= 5.8, the Megatron-Bridge stack): 4 layers, three gated
# delta-net layers then one attention layer (the real models' pattern), 2 key / 4 value heads of 16.
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_GDN_TINY = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    full_attention_interval=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    head_dim=16,
)
_MOE_HYBRID = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.0,
)
HYBRID_TINY = {
    "qwen3_next": {**_GDN_TINY, **_MOE_HYBRID},
    "qwen3_5_text": dict(_GDN_TINY),
    "qwen3_5_moe_text": {**_GDN_TINY, **_MOE_HYBRID},
}


# Frontier MoE families (tiny; HF classes in transformers 4.57 and 5.12 unless noted), two layers:
# DeepSeek-V3 (multi-latent attention with unequal query-key 16 + 8 rope / value 12 head dims, YaRN
# x4 over 16 positions with both mscales, layer 0 dense then routed + shared experts, sigmoid
# routing
# with expert bias in 2 groups, scaled by 2.5); GLM-4.5 (half-rotary attention with q/k norms and
# biases, a dense first layer, routed + shared experts); gpt-oss (5.x: sinks, sliding window 8 then
# full attention, YaRN, biased experts with its clamped SwiGLU). Kimi-K2 is DeepSeek-V3's
# architecture
# under its own model type (its HF code is remote); see :func:`register_kimi_k2`.
FRONTIER_ARCHS = ("deepseek_v3", "kimi_k2", "glm4_moe", "gpt_oss")
FRONTIER_TINY = {
    "deepseek_v3": dict(
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=1.0,
        ),
    ),
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        head_dim=16,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
    ),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


# Mamba-2 hybrids (Nemotron-H; transformers >= 5.8, the Megatron-Bridge stack), built by
# Megatron-Core's HybridModel from a layer pattern (M Mamba-2, * attention without position
# embedding, - squared-ReLU MLP, E MoE): 4 Mamba heads of 16 (d_inner 64 = hidden) in 2 groups of
# state 16, convolution kernel 4. HF's reference scan (torch_forward, the CPU path) differs from
# Megatron's in three ways that these settings remove: it clamps dt from below at time_step_min
# (Megatron limits it to (0, inf) only: 0 here, set after the weights are drawn since HF's init
# takes its log); its gated norm's eps is layer_norm_epsilon (Megatron's is 1e-5, as is the real
# models' layer_norm_epsilon); and it carries the state across its scan chunks wrongly (transformers
# 5.12 sums the inter-chunk decay over the wrong axis), so hf_logprobs runs each sequence in one
# chunk (testing.reference.one_mamba_chunk). The tree mixer scans in chunks of 16, so the test
# tries' longer segments span several.
MAMBA_ARCHS = ("nemotron_h",)
MAMBA_TINY = {
    "nemotron_h": dict(
        hybrid_override_pattern="M*M-",
        num_hidden_layers=4,
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        layer_norm_epsilon=1e-5,
    ),
}
# Nemotron 3 Nano's layer kinds, scaled down: Mamba and MoE layers around one attention layer; the
# MoE routes sigmoid scores plus a correction bias to the top 2 of 4 squared-ReLU experts (FFN 32),
# renormalized and scaled by 2.5, plus a shared expert (FFN 48).
NEMOTRON_H_MOE = dict(
    hybrid_override_pattern="ME*ME",
    num_hidden_layers=5,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
# The Mamba hybrid checkpoints of the tests ({name: (arch, HF config overrides)}, for
# make_hf_checkpoints): dense and MoE.
MAMBA_CASES = {"nemotron_h": ("nemotron_h", {}), "nemotron_h_moe": ("nemotron_h", NEMOTRON_H_MOE)}


def register_kimi_k2() -> None:
    """Make ``model_type="kimi_k2"`` / ``KimiK2ForCausalLM`` (Megatron-Bridge's Kimi-K2 bridge)
    loadable offline in this process: Kimi-K2 checkpoints run DeepSeek-V3's modeling code from their
    own repository (``trust_remote_code``), so the stand-in is HF's DeepSeek-V3 classes under that
    model type, with DeepSeek-V3's checkpoint conversion (per-expert weights -> fused experts;
    without
    it HF would leave the experts random). Idempotent."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

    try:
        AutoConfig.for_model("kimi_k2")
        return
    except ValueError:
        pass
    config_cls = type("KimiK2Config", (DeepseekV3Config,), {"model_type": "kimi_k2"})
    model_cls = type("KimiK2ForCausalLM", (DeepseekV3ForCausalLM,), {"config_class": config_cls})
    AutoConfig.register("kimi_k2", config_cls)
    AutoModelForCausalLM.register(config_cls, model_cls)
    from transformers import conversion_mapping

    conversion_mapping.register_checkpoint_conversion_mapping(
        "kimi_k2",
        conversion_mapping.get_checkpoint_conversion_mapping("deepseek_v3"),
        overwrite=True,
    )


def make_hf_checkpoint(arch: str, path: str, *, seed: int = 0, **overrides) -> None:
    """Save a tiny random ``arch`` model (hidden 64, 2 layers, 4 heads, 2 KV heads) to ``path``.

    ``arch`` is one of ``ARCHS`` (dense), ``MOE_ARCHS`` (experts as in :data:`MOE_TINY`),
    ``HYBRID_ARCHS`` (:data:`HYBRID_TINY`, transformers >= 5.8), ``FRONTIER_ARCHS``
    (:data:`FRONTIER_TINY`) or ``MAMBA_ARCHS`` (:data:`MAMBA_TINY`, transformers >= 5.8; the MoE
    variant with ``**NEMOTRON_H_MOE``); ``overrides`` replace HF config fields (e.g.
    ``norm_topk_prob=False``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    known = ARCHS + MOE_ARCHS + HYBRID_ARCHS + FRONTIER_ARCHS + MAMBA_ARCHS
    if arch not in known:
        raise ValueError(f"arch={arch!r} is not one of {known}")

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if arch == "qwen3":
        common["head_dim"] = 16
    common.update(MOE_TINY.get(arch, {}))
    common.update(HYBRID_TINY.get(arch, {}))
    common.update(FRONTIER_TINY.get(arch, {}))
    if arch in MAMBA_ARCHS:  # no rotary; its eps is layer_norm_epsilon (the bridge maps both)
        del common["rope_theta"], common["rms_norm_eps"]
        common.update(MAMBA_TINY[arch])
    common.update(overrides)
    if (
        arch == "kimi_k2"
    ):  # written as DeepSeek-V3 (per-expert weights, as Kimi-K2 ships), renamed below
        common.update(FRONTIER_TINY["deepseek_v3"])
    config = AutoConfig.for_model("deepseek_v3" if arch == "kimi_k2" else arch, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        # Hybrids' norms are zero-centered (scale 1 + weight), except the gated delta-net's output
        # norm;
        # their matrices are drawn smaller (0.1), or fp32 rounding alone moves HF's own log-probs by
        # ~2e-5 (measured against HF in fp64), above the 1e-5 parity bar.
        centered = arch in HYBRID_ARCHS
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight")):  # norm_f: Nemotron-H's final
                shift = 1.0 if centered and not name.endswith("linear_attn.norm.weight") else 0.0
                p.uniform_(0.6 - shift, 1.4 - shift)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1 if centered else 0.15)
            else:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            # Nemotron-H's router bias (a buffer). DeepSeek-V3's stays 0 here: with a random bias
            # its mbridge build (transformers 4.57 stack) is 0.58 nats off HF for every sequence
            # alone (tree or not; the router alone matches HF), not yet explained.
            if arch in MAMBA_ARCHS and name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_checkpoint(model, path)
    if arch == "kimi_k2":
        _rename_to_kimi_k2(path)


def save_checkpoint(model, path: str) -> None:
    """``model.save_pretrained(path)`` (safetensors), with ``time_step_min = 0`` for Nemotron-H so
    that HF is an exact reference (HF's CPU scan clamps dt from below there, Megatron does not; set
    after the weights are drawn, as HF's init takes its log). Its embedding stays as transformers
    writes it (``backbone.embedding.weight``), which the bridge patches load (issue 42 item 2)."""
    if getattr(model.config, "model_type", None) == "nemotron_h":
        model.config.time_step_min = 0.0
    model.save_pretrained(path, safe_serialization=True)


def rename_weights(path: str, renames: dict[str, str]) -> None:
    """Rename tensors of the single-file checkpoint at ``path`` (``renames``: {old: new})."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    save_file({renames.get(k, k): v for k, v in tensors.items()}, file, metadata={"format": "pt"})


def _rename_to_kimi_k2(path: str) -> None:
    """A DeepSeek-V3 checkpoint as a Kimi-K2 one: its model type, architecture and routing
    fields."""
    import json
    from pathlib import Path

    register_kimi_k2()
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config.update(
        model_type="kimi_k2",
        architectures=["KimiK2ForCausalLM"],
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )
    config_file.write_text(json.dumps(config, indent=2))


def make_hf_checkpoints(root, archs=ARCHS) -> dict[str, str]:
    """Tiny checkpoints under ``root``: one per architecture of ``archs`` (default ``ARCHS``), or
    one
    per case of a dict ``{name: (arch, HF config overrides)}``; returns {arch or name: path}."""
    from pathlib import Path

    cases = archs if isinstance(archs, dict) else {arch: (arch, {}) for arch in archs}
    paths = {}
    for name, (arch, overrides) in cases.items():
        paths[name] = str(Path(root) / name)
        make_hf_checkpoint(arch, paths[name], **overrides)
    return paths


def hf_references(
    paths: dict[str, str], seqs: list[torch.Tensor]
) -> dict[str, dict[int, torch.Tensor]]:
    """:func:`hf_logprobs` of every checkpoint of ``paths`` on ``seqs``: {name: {sequence:
    log-probs}}."""
    return {name: hf_logprobs(path, seqs) for name, path in paths.items()}


def branching_sequences(seed: int = 0) -> list[torch.Tensor]:
    """A shared prompt with 6 responses, a multi-turn chain branching at several depths, and
    sequences that are prefixes of others (including an exact duplicate)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    prompt = rand(24)
    seqs = [torch.cat([prompt, rand(n)]) for n in (9, 17, 5, 12, 1, 20)]
    turn1 = torch.cat([rand(10), rand(8)])
    turn2 = torch.cat([turn1, rand(7)])
    turn3a = torch.cat([turn2, rand(11)])
    turn3b = torch.cat([turn2, rand(6)])
    branch_early = torch.cat([turn1[:5], rand(13)])
    seqs += [turn1, turn2, turn3a, turn3b, branch_early]
    seqs += [prompt[:15].clone(), seqs[0].clone()]  # prefix of the prompt group; duplicate
    return seqs


def recurrent_sequences(seed: int = 0) -> list[torch.Tensor]:
    """:func:`branching_sequences` plus the tries a recurrent layer gets wrong first: a one-token
    and a two-token segment between branch points (a child's 3-token convolution window then reaches
    two and three segments up), a branch at a root's first token, and a chain of one-token
    segments each with a leaf."""
    g = torch.Generator().manual_seed(seed + 1)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    stem = rand(6)
    one = torch.cat([stem, rand(1)])  # one-token segment (a branch point below and above it)
    two = torch.cat([one, rand(2)])  # two-token segment
    seqs = [
        torch.cat([one, rand(5)]),
        torch.cat([two, rand(4)]),
        torch.cat([two, rand(7)]),
        torch.cat([stem, rand(9)]),
    ]
    root = rand(1)
    seqs += [torch.cat([root, rand(8)]), torch.cat([root, rand(3)])]
    ladder = rand(4)
    for _ in range(3):
        seqs.append(torch.cat([ladder, rand(2)]))
        ladder = torch.cat([ladder, rand(1)])
    seqs.append(torch.cat([ladder, rand(5)]))
    return branching_sequences(seed) + seqs


def trunk_sequences(seed: int = 0) -> list[torch.Tensor]:
    """Prompt groups larger than a 64-token micro-batch, for trunk reuse (block size 16).

    One 24-token system prompt with two task prompts whose rollouts exceed 64 tokens each (so the
    trunk holds the system prompt and both tasks), a sequence sharing only the first token (a branch
    attached at the trunk's root), a strict prefix of a task prompt and the task prompt itself
    (sequences ending inside the trunk and at a trunk leaf), a multi-turn chain below one task, a
    second large group (a second trunk group) and a small group packed as an ordinary tree.
    """
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    system = rand(24)
    task_a, task_b = torch.cat([system, rand(10)]), torch.cat([system, rand(8)])
    seqs = [torch.cat([task_a, rand(n)]) for n in (22, 16, 20, 12)]
    turn = torch.cat([task_b, rand(14)])
    seqs += [
        turn,
        torch.cat([turn, rand(9)]),
        torch.cat([task_b, rand(26)]),
        torch.cat([task_b, rand(20)]),
    ]
    seqs += [torch.cat([system[:1], rand(25)]), task_a[:29].clone(), task_a.clone()]
    other = rand(30)
    seqs += [torch.cat([other, rand(n)]) for n in (20, 11, 17, 24)]
    small = rand(9)
    seqs += [torch.cat([small, rand(n)]) for n in (6, 10)]
    return seqs


def long_context_sequences(seed: int = 0) -> list[torch.Tensor]:
    """A shared history longer than a 64-token micro-batch and a sequence longer than one.

    A 150-token history with four tasks below it (12-30 tokens, one with a second turn), one
    sequence ending inside the history, and a 140-token sequence sharing nothing: with trunk reuse
    the history runs as a chain of three trunk parts and the long sequence as a chain of its own.
    """
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    history = rand(150)
    seqs = [torch.cat([history, rand(n)]) for n in (12, 30, 21)]
    turn = torch.cat([history, rand(16)])
    seqs += [turn, torch.cat([turn, rand(11)]), history[:97].clone(), rand(140)]
    return seqs


def pack(seqs: list[torch.Tensor], *, block_size: int = 16, max_tokens: int = 512) -> list[dict]:
    """``seqs`` packed into whole trees (no trunk reuse: every micro-batch's rows are its tree)."""
    batch = pad_sequences(seqs)
    return list(
        build_packed_tree_batch(
            batch,
            max_tokens_per_mb=max_tokens,
            block_size=block_size,
            pad_to_max=False,
            share_trunks=False,
        )
    )


def packed_logprobs(logits: torch.Tensor, micro_batch: dict) -> dict[int, torch.Tensor]:
    """Per-sequence next-token log-probs [L_i - 1] from packed logits [1, N, V], by batch index."""
    tree = micro_batch["tree"]
    logp = torch.log_softmax(
        logits[0] if logits.dtype == torch.float64 else logits[0].float(), dim=-1
    )
    out = {}
    for i in range(tree.num_sequences):
        idx = tree.sequence_token_index(i)
        out[int(tree.sequence_ids[i])] = logp[idx[:-1], tree.input_ids[idx[1:]]]
    return out


def megatron_bridge_tree_model(
    path: str,
    *,
    tp: int = 1,
    cp: int = 1,
    backend: str = "auto",
    **provider_fields,
):
    """The tree model Megatron-Bridge builds from the HF checkpoint at ``path`` under
    ``patch_megatron_bridge_for_tree_training`` (fp32, no DDP; ``provider_fields`` set on the
    provider before it is finalized, e.g. recompute or router settings). Needs parallel_state."""
    from megatron_tree.bridges.megatron_bridge import patch_megatron_bridge_for_tree_training
    from megatron_tree.patches import megatron_bridge_te

    # Megatron-Bridge imports only with it where transformer-engine is missing
    megatron_bridge_te.apply()
    from megatron.bridge import AutoBridge

    with patch_megatron_bridge_for_tree_training(backend=backend):
        bridge = AutoBridge.from_hf_pretrained(path, dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)  # after the block: still bound
    provider.tensor_model_parallel_size = tp
    provider.context_parallel_size = cp
    for name, value in provider_fields.items():
        setattr(provider, name, value)
    provider.finalize()
    return provider.provide_distributed_model(wrap_with_ddp=False, bf16=False, fp16=False)[0]


def megatron_bridge_gpt_as_hybrid(path: str, *, tree: bool = True, backend: str = "auto"):
    """The GPT checkpoint at ``path`` (e.g. the tiny Qwen3) as a Megatron-Core ``HybridModel``: its
    Megatron-Bridge GPT provider's fields in a ``HybridModelProvider`` with one attention and one
    MLP layer per GPT layer (pattern ``"*-" * L``, rope), the GPT model's weights renamed onto it
    (:func:`gpt_state_dict_as_hybrid`). ``tree``: built through
    :func:`~megatron_tree.bridges.megatron_bridge.make_tree_provider` (a ``TreeHybridModel``);
    else a stock ``HybridModel`` from :func:`~megatron_tree.mcore.hybrid.local_hybrid_stack_spec`.
    fp32, no DDP. Needs parallel_state."""
    import dataclasses

    from megatron_tree.bridges.megatron_bridge import make_tree_provider
    from megatron_tree.mcore.hybrid import local_hybrid_stack_spec

    gpt = megatron_bridge_tree_model(path, backend=backend)
    # imported here: Megatron-Bridge imports without transformer-engine only once
    # megatron_tree.patches.megatron_bridge_te is applied (the bridge module above applies it)
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    config = gpt.config  # the finalized GPT provider
    own = {"num_layers", "hybrid_stack_spec", "position_embedding_type"}
    fields = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(HybridModelProvider)
        if f.init and not f.name.startswith("_") and f.name not in own and hasattr(config, f.name)
    }
    pattern = "*-" * config.num_layers
    provider = HybridModelProvider(
        **fields, hybrid_layer_pattern=pattern, position_embedding_type="rope"
    )
    if tree:
        make_tree_provider(provider, backend=backend)
    else:
        provider.hybrid_stack_spec = local_hybrid_stack_spec
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, bf16=False, fp16=False)[0]
    model.load_state_dict(gpt_state_dict_as_hybrid(gpt.state_dict(), pattern))
    return model


def gpt_state_dict_as_hybrid(state: dict, pattern: str) -> dict:
    """A GPTModel state dict renamed for a HybridModel of ``pattern`` (one attention ``*`` and one
    MLP ``-`` / ``E`` position per GPT layer, Mamba positions having no GPT source), by
    Megatron-Core's own layer correspondence (``gpt_compatible_layer_maps``): GPT layer i's
    ``input_layernorm`` / ``self_attention`` go to its attention position, ``pre_mlp_layernorm`` /
    ``mlp`` to its MLP position, ``decoder.final_layernorm`` becomes ``decoder.final_norm``."""
    import re

    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import gpt_compatible_layer_maps

    maps = gpt_compatible_layer_maps(pattern)
    attention = {gpt: hybrid for hybrid, gpt in maps.attention_to_gpt.items()}
    mlp = {gpt: hybrid for hybrid, gpt in maps.mlp_to_gpt.items()}
    layer = re.compile(
        r"decoder\.layers\.(\d+)\.((input_layernorm|self_attention|pre_mlp_layernorm|mlp)\..*)"
    )
    out = {}
    for key, value in state.items():
        match = layer.fullmatch(key)
        if match:
            gpt, rest, part = int(match[1]), match[2], match[3]
            target = attention if part in ("input_layernorm", "self_attention") else mlp
            key = f"decoder.layers.{target[gpt]}.{rest}"
        elif key.startswith("decoder.final_layernorm."):
            key = "decoder.final_norm." + key.removeprefix("decoder.final_layernorm.")
        out[key] = value
    return out


def tree_logprobs(
    model, seqs: list[torch.Tensor], *, alone: bool = False
) -> dict[int, torch.Tensor]:
    """Per-sequence log-probs of a tree model (vocab-parallel logits gathered over TP), the
    sequences packed into whole trees, or each packed alone (``alone``), by index in ``seqs``."""
    from megatron.core import tensor_parallel

    from megatron_tree.core.mask import tree_attention_mask

    groups = [[s] for s in seqs] if alone else [seqs]
    out = {}
    with torch.no_grad():
        for g, group in enumerate(groups):
            for mb in pack(group):
                logits = model(
                    mb["input_ids"],
                    mb["position_ids"],
                    attention_mask=tree_attention_mask(mb["tree"]),
                )
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
                for i, values in packed_logprobs(logits, mb).items():
                    out[g if alone else i] = values
    return out


def step_logprobs(model, seqs: list[torch.Tensor], **packing) -> dict[int, torch.Tensor]:
    """Per-sequence log-probs from a forward-only ``tree_forward_backward`` (packing as given:
    context-parallel splits, trunk reuse), by index in ``seqs``."""
    from megatron.core import parallel_state as ps

    from megatron_tree.mcore.step import PackingConfig, ProcessGroups, tree_forward_backward

    result = tree_forward_backward(
        model,
        pad_sequences(seqs),
        None,
        forward_only=True,
        collect_outputs=True,
        groups=ProcessGroups(tp=ps.get_tensor_model_parallel_group()),
        packing=PackingConfig(**packing),
    )
    merged = result.merged_outputs()["logprobs"]
    return {i: merged[i, : len(s) - 1] for i, s in enumerate(seqs)}


PARITY_LOG_ENV = "MEGATRON_TREE_PARITY_LOG"


def record_parity(
    model_type: str,
    bridge: str,
    max_logprob_err: float,
    *,
    layout: str = "TP=1",
    engine: str = "megatron",
    max_grad_rel: float | None = None,
) -> None:
    """Append one parity result (a JSON line: model type, engine, bridge, stack, layout, max
    |log-prob - HF|, and the largest relative gradient error when measured) to the file
    ``$MEGATRON_TREE_PARITY_LOG`` names, if set; ``scripts/models_table.py`` turns the lines of a
    suite run into the README's supported-models table. ``engine`` is "megatron" (a bridged
    Megatron model) or "hf" (HF's model code, ``megatron_tree.integrations.transformers``)."""
    import json
    import os
    import platform
    from importlib import metadata

    target = os.environ.get(PARITY_LOG_ENV)
    if not target:
        return

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    stack = {
        "python": platform.python_version(),
        "megatron-core": version("megatron-core"),
        "bridge": version(
            {"megatron-bridge": "megatron-bridge", "mbridge": "mbridge"}.get(bridge, bridge) or ""
        ),
        "transformers": version("transformers"),
        "torch": version("torch"),
    }
    row = {
        "model_type": model_type,
        "engine": engine,
        "bridge": bridge,
        "layout": layout,
        "max_logprob_err": float(max_logprob_err),
        "stack": stack,
    }
    if max_grad_rel is not None:
        row["max_grad_rel"] = float(max_grad_rel)
    with open(target, "a") as f:
        f.write(json.dumps(row) + "\n")


def max_err(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> float:
    """Largest absolute difference between two {sequence: log-probs} maps over the same
    sequences; ``inf`` if any value is NaN or inf."""
    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    assert a.keys() == b.keys()
    return worst_error(max_abs_error(a[i], b[i]) for i in a)


def hf_logprobs(path: str, seqs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Reference: HuggingFace on each sequence alone."""
    from transformers import AutoModelForCausalLM

    from megatron_tree.testing.reference import one_mamba_chunk

    model = AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    out = {}
    with torch.no_grad():
        for i, s in enumerate(seqs):
            with one_mamba_chunk(model, len(s)):  # exact HF Mamba-2 (no-op for other models)
                logits = model(s[None]).logits[0]
            out[i] = torch.log_softmax(logits.float(), -1)[:-1].gather(1, s[1:, None])[:, 0]
    return out


def attention_reference(q, k, v, masked):
    """Brute force: repeat KV groups, scores, -inf on masked pairs, softmax. [N, b, np*hn]."""
    n, b, heads, dim = q.shape
    rep = heads // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / math.sqrt(dim)
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, vv).reshape(n, b, heads * dim)


# The activation-recompute modes the step tests run each model under (see recompute_fields).
RECOMPUTE_MODES = ("none", "full", "selective")


def recompute_fields(mode: str, *modules: str) -> dict:
    """``TransformerConfig`` fields of a recompute mode of ``RECOMPUTE_MODES``, a fresh dict each
    call (Megatron may append to ``recompute_modules``): ``"none"``, ``"full"`` (every layer, one
    at a time) or ``"selective"`` (``core_attn`` plus ``modules``, e.g. ``"mla_up_proj"``)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} must be one of {RECOMPUTE_MODES}")
    return {
        "none": {},
        "full": {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        },
        "selective": {
            "recompute_granularity": "selective",
            "recompute_modules": ["core_attn", *modules],
        },
    }[mode]


def small_gpt_config(**overrides):
    """A ``TransformerConfig`` for small test / benchmark GPTs that runs anywhere, CPU included.

    Defaults: 2 layers, hidden 64, 4 heads in 2 query groups, FFN 128, RMSNorm, SwiGLU, no linear
    biases, fp32, no dropout, CPU initialization (the same weights at any tensor-parallel size for
    the same seed), and the unfused softmax (the fused kernel is CUDA-only). ``overrides`` replace
    any of them or set other fields.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(
    config,
    *,
    tree: bool,
    vocab_size: int,
    critic: bool = False,
    backend: str = "auto",
    block_size: int = 128,
    seed: int = 0,
    vp_stage: int | None = None,
):
    """A local-spec GPT for this pipeline stage (and virtual stage ``vp_stage``): ``TreeGPTModel``
    with tree attention, or the stock ``GPTModel`` (the reference), with untied output weights and
    rope. A config with ``num_moe_experts`` gets Megatron's local block spec (SequentialMLP experts
    in the layers ``moe_layer_freq`` names; see :func:`small_moe_config`).

    The same ``seed`` and config give the same weights for both kinds (tree attention has no
    parameters of its own), so a reference can also load the tree model's state dict.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_tree.mcore.model import TreeGPTModel
    from megatron_tree.mcore.spec import tree_attention_spec
    from megatron_tree.mcore.value_head import attach_value_head

    if config.num_moe_experts:  # the block spec: MoE and dense layers as config.moe_layer_freq says
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=config.normalization,
            vp_stage=vp_stage,
        )
    else:
        spec = get_gpt_layer_local_spec(
            normalization=config.normalization,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
        )
    if config.multi_latent_attention and not tree:
        # Megatron's local core attention cannot run MLA (it is TE-only): the reference's is ours.
        from megatron_tree.testing.reference import CausalCoreAttention

        for layer in spec.layer_specs if hasattr(spec, "layer_specs") else [spec]:
            layer.submodules.self_attention.submodules.core_attention = CausalCoreAttention
    cls = GPTModel
    if tree:
        spec, cls = tree_attention_spec(spec, backend=backend, block_size=block_size), TreeGPTModel
    torch.manual_seed(seed)
    model = cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=8192,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    return attach_value_head(model) if critic else model


def small_mla_config(*, rope_type: str = "yarn", **overrides):
    """A ``small_gpt_config`` with multi-latent attention (DeepSeek-V3's shape, scaled down): query
    rank 32, key-value rank 16, per head 16 no-rope + 8 rope query-key dims and 12 value dims
    (unequal, as in DeepSeek-V3's 192 / 128), latent norms on; ``rope_type="yarn"`` scales by 4
    over 16 original positions with ``mscale`` 0.707 / ``mscale_all_dim`` 1.0 (so both YaRN factors,
    on the rotary cos / sin and on the softmax scale, differ from 1), or plain ``"rope"``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = small_gpt_config(num_query_groups=None).__dict__
    fields = {
        k: base[k]
        for k in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "normalization",
            "gated_linear_unit",
            "add_bias_linear",
            "use_cpu_initialization",
            "masked_softmax_fusion",
            "hidden_dropout",
            "attention_dropout",
            "params_dtype",
            "pipeline_dtype",
        )
    }
    fields.update(
        multi_latent_attention=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        qk_layernorm=True,
        rope_type=rope_type,
        rotary_base=10000,
        rotary_scaling_factor=4.0 if rope_type == "yarn" else 1.0,
        original_max_position_embeddings=16,
        mscale=0.707,
        mscale_all_dim=1.0,
        apply_rope_fusion=False,
    )
    fields.update(overrides)
    return MLATransformerConfig(**fields)


def small_moe_config(
    *, dispatcher: str = "allgather", num_experts: int = 4, topk: int = 2, **overrides
):
    """A ``small_gpt_config`` whose MLPs are mixtures of experts: ``num_experts`` experts of FFN 32,
    top-``topk`` softmax routing renormalized over the chosen experts, no token dropping (no
    capacity factor), the ``dispatcher`` token dispatcher, the expert-parallel size of
    ``parallel_state``, and no load-balancing loss or z-loss (their token means differ between a
    tree and the unpacked batch; ``overrides`` can switch them on)."""
    from megatron.core import parallel_state as ps

    fields = dict(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
        moe_router_pre_softmax=False,
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_router_load_balancing_type="aux_loss",
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        init_method_std=0.15,
    )
    fields.update(overrides)
    return small_gpt_config(**fields)


def moe_layer_spec(config):
    """The local layer spec of ``config``'s MoE layers (SequentialMLP experts, no grouped GEMM)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        normalization=config.normalization,
    )


def global_expert_name(name: str, *, ep_rank: int, num_local_experts: int) -> str:
    """A parameter name on expert-parallel rank ``ep_rank`` with its local expert index replaced by
    the global one (``...local_experts.{i}...`` -> ``{i + ep_rank * num_local_experts}``)."""
    parts = name.split(".")
    if "local_experts" in parts:
        at = parts.index("local_experts") + 1
        parts[at] = str(int(parts[at]) + ep_rank * num_local_experts)
    return ".".join(parts)
