"""Megatron-Core's HybridModel with trees (megatron-core 0.19, where it replaces GPTModel), through
Megatron-Bridge: Mamba-2 hybrids (Nemotron-H dense, and MoE as in Nemotron 3 Nano) and a GPT
checkpoint (Qwen3) built as a HybridModel with rope.

Tiny random HF checkpoints (``MAMBA_CASES``) load through
``patch_megatron_bridge_for_tree_training`` into ``TreeHybridModel``s whose Mamba layers run
``TreeMambaMixer``; every sequence of branching tries (``recurrent_sequences``: one- and
two-token segments between branch points, a branch at a root's first token) gets the log-probs HF's
reference scan (``torch_forward``, the CPU path) gives it alone. Qwen3's GPT layers become one
attention and one MLP layer each (pattern ``*-*-``), where depth RoPE matters (Nemotron-H has no
position embedding). Runs in the Megatron-Bridge stack (transformers >= 5.8); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from harness.marks import MEGATRON_BRIDGE_STACK
from harness.models import (
    MAMBA_CASES,
    branching_sequences,
    max_err,
    megatron_bridge_gpt_as_hybrid,
    megatron_bridge_tree_model,
    record_parity,
    recurrent_sequences,
    small_gpt_config,
    tree_logprobs,
)
from megatron_tree.testing.tolerances import LOGP_TOL

pytestmark = [
    *MEGATRON_BRIDGE_STACK,
]

# A wrong segment state, convolution window or rotary angle moves log-probs by >= 1e-3; the
# measured errors against HF fp32 are <= 4e-6 (summation order only).


@pytest.fixture(scope="module")
def mamba_checkpoints(tmp_path_factory):
    from harness.models import make_hf_checkpoints

    return make_hf_checkpoints(tmp_path_factory.mktemp("mamba"), MAMBA_CASES)


@pytest.fixture(scope="module")
def mamba_references(mamba_checkpoints):
    from harness.models import hf_references

    return hf_references(mamba_checkpoints, recurrent_sequences())


@pytest.mark.parametrize("case", list(MAMBA_CASES))
def test_nemotron_h_tree_logprobs_match_hf(world, case, mamba_checkpoints, mamba_references):
    from megatron_tree.mcore.hybrid import LocalHybridStack, TreeHybridModel
    from megatron_tree.mcore.mamba import TreeMambaLayer, TreeMambaMixer
    from megatron_tree.mcore.spec import check_tree_model

    model = megatron_bridge_tree_model(mamba_checkpoints[case], backend="sdpa").eval()
    assert isinstance(model, TreeHybridModel) and isinstance(model.decoder, LocalHybridStack)
    pattern = model.hybrid_layer_pattern
    mamba = [layer for layer, kind in zip(model.decoder.layers, pattern) if kind == "M"]
    assert len(mamba) == pattern.count("M") == 2
    assert all(
        isinstance(layer, TreeMambaLayer) and isinstance(layer.mixer, TreeMambaMixer)
        for layer in mamba
    )
    check_tree_model(model)
    err = max_err(tree_logprobs(model, recurrent_sequences()), mamba_references[case])
    assert err <= LOGP_TOL
    record_parity(case, "megatron-bridge", err)


def test_gpt_checkpoint_as_hybrid_model_matches_hf(world, checkpoints, references):
    """Qwen3 as a HybridModel (``*-*-``, rope): the tree model's rotary follows depth, and every
    branch gets HF's log-probs; the same model built stock is refused."""
    from megatron_tree.mcore.hybrid import TreeHybridModel
    from megatron_tree.mcore.rotary import TreeRotaryEmbedding
    from megatron_tree.mcore.spec import check_tree_model

    model = megatron_bridge_gpt_as_hybrid(checkpoints["qwen3"], backend="sdpa").eval()
    assert isinstance(model, TreeHybridModel)
    assert model.hybrid_layer_pattern == "*-*-"
    assert isinstance(model.rotary_pos_emb, TreeRotaryEmbedding)
    check_tree_model(model)
    err = max_err(tree_logprobs(model, branching_sequences()), references["qwen3"])
    assert err <= LOGP_TOL
    record_parity("qwen3_as_hybrid", "megatron-bridge", err)

    stock = megatron_bridge_gpt_as_hybrid(checkpoints["qwen3"], tree=False)
    assert type(stock).__name__ == "HybridModel"
    with pytest.raises(ValueError, match=r"stock DotProductAttention.*build a TreeHybridModel"):
        check_tree_model(stock)


def test_stock_hybrid_model_with_tree_spec_is_refused(world):
    """A stock HybridModel built from a tree stack spec has tree mixers but rotates by packed
    offset: refused, naming TreeHybridModel."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_tree.mcore.hybrid import TreeHybridModel, local_hybrid_stack_spec
    from megatron_tree.mcore.spec import check_tree_model, tree_attention_spec

    config = small_gpt_config(num_layers=2)
    spec = tree_attention_spec(local_hybrid_stack_spec(config))
    kwargs = dict(
        hybrid_stack_spec=spec,
        vocab_size=128,
        max_sequence_length=256,
        hybrid_layer_pattern="*-",
        position_embedding_type="rope",
    )
    with pytest.raises(ValueError, match=r"rotates by packed offset.*TreeHybridModel"):
        check_tree_model(HybridModel(config, **kwargs))
    check_tree_model(TreeHybridModel(config, **kwargs))


@pytest.mark.parametrize("kind", ["local", "transformer_engine"])
def test_tree_spec_rewrites_the_hybrid_stack(kind):
    """Our local hybrid stack spec and megatron-core's transformer-engine one (built on GPUs; its
    modules are stand-ins without transformer-engine): every token mixer becomes a tree one, the
    MLP / DSA / MTP entries are kept, the input is not modified."""
    if kind == "local":
        from megatron_tree.mcore.hybrid import local_hybrid_stack_spec

        stack = local_hybrid_stack_spec()
    else:
        pytest.importorskip("transformer_engine")
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as stack

    from megatron_tree.mcore.core_attention import TreeCoreAttention
    from megatron_tree.mcore.gated_delta_net import TreeGatedDeltaNet
    from megatron_tree.mcore.mamba import TreeMambaLayer, TreeMambaMixer
    from megatron_tree.mcore.mla import TreeMLASelfAttention
    from megatron_tree.mcore.moe import TreeMoELayer, TreeMoETransformerLayer
    from megatron_tree.mcore.spec import _module_class, tree_attention_spec

    before = repr(stack)
    subs = tree_attention_spec(stack).submodules
    assert repr(stack) == before
    assert subs.mamba_layer.module is TreeMambaLayer
    assert subs.mamba_layer.submodules.mixer.module is TreeMambaMixer
    for layer in (subs.attention_layer, subs.mla_layer):
        assert layer.submodules.self_attention.submodules.core_attention.module is TreeCoreAttention
    assert subs.mla_layer.submodules.self_attention.module is TreeMLASelfAttention
    assert subs.gdn_layer.submodules.self_attention.module is TreeGatedDeltaNet
    assert _module_class(subs.moe_layer) is TreeMoETransformerLayer
    assert _module_class(subs.moe_layer.submodules.mlp) is TreeMoELayer
    original = stack.submodules
    assert repr(subs.mlp_layer) == repr(original.mlp_layer)
    assert repr(subs.dsa_layer) == repr(original.dsa_layer)
    assert repr(subs.mtp_block_spec) == repr(original.mtp_block_spec)


def test_custom_mamba_mixer_is_refused_by_name():
    from megatron.core.ssm.mamba_mixer import MambaMixer

    from megatron_tree.mcore.hybrid import local_hybrid_stack_spec
    from megatron_tree.mcore.spec import tree_attention_spec

    spec = local_hybrid_stack_spec()
    spec.submodules.mamba_layer.submodules.mixer.module = type("MyMixer", (MambaMixer,), {})
    with pytest.raises(ValueError, match="mamba_layer mixer: custom Mamba mixer MyMixer"):
        tree_attention_spec(spec)


def test_stock_mamba_mixer_is_refused(world):
    """A model with a stock MambaMixer (its scan would run across branches) is refused, naming the
    fix."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    from megatron_tree.mcore.spec import check_tree_model

    class Stock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Module()
            self.layer.mixer = MambaMixer.__new__(MambaMixer)
            torch.nn.Module.__init__(self.layer.mixer)

    with pytest.raises(ValueError, match="layer.mixer is a stock MambaMixer.*TreeMambaMixer"):
        check_tree_model(Stock())


@pytest.mark.parametrize("positional", [False, True])
@pytest.mark.parametrize(
    ("pattern", "fields", "match"),
    [
        ("MD-", {}, "DeepSeek sparse attention"),
        ("*-/*-", {}, "multi-token prediction"),
        ("*-", {"mtp_num_layers": 1}, "multi-token prediction"),
    ],
)
def test_tree_hybrid_model_refuses_by_name(world, pattern, fields, match, positional):
    """DeepSeek sparse attention layers and multi-token prediction, before anything is built
    (the pattern given by keyword, as Megatron-Bridge does, or by position)."""
    from megatron_tree.mcore.hybrid import TreeHybridModel, local_hybrid_stack_spec

    args = (local_hybrid_stack_spec(), 128, 256)
    with pytest.raises(ValueError, match=match):
        if positional:
            TreeHybridModel(small_gpt_config(**fields), *args, pattern)
        else:
            TreeHybridModel(small_gpt_config(**fields), *args, hybrid_layer_pattern=pattern)


def test_nemotron_h_with_mtp_is_refused_at_provide(world, tmp_path):
    """A Nemotron-H checkpoint with MTP layers (num_nextn_predict_layers): the bridge's provider
    refuses to build until MTP is switched off."""
    from harness.models import make_hf_checkpoint

    make_hf_checkpoint(
        "nemotron_h", str(tmp_path), num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*-"
    )
    with pytest.raises(ValueError, match="multi-token prediction.*mtp_hybrid_override_pattern"):
        megatron_bridge_tree_model(str(tmp_path), backend="sdpa")


@pytest.mark.parametrize("case", list(MAMBA_CASES))
def test_flop_model_counts_a_built_nemotron_h(world, case, mamba_checkpoints):
    """GPTShape.from_config with the model's layer pattern: its matmul weights per token are the
    built model's 2-D weights (the routed experts a token skips aside), its attention pairs are
    charged to the one attention layer, and its Mamba layers cost per token."""
    from megatron_tree.core.flops import GPTShape

    model = megatron_bridge_tree_model(mamba_checkpoints[case], backend="sdpa")
    shape = GPTShape.from_config(
        model.config, vocab=model.vocab_size, hybrid_layer_pattern=model.hybrid_layer_pattern
    )
    assert shape.attention_layers == 1 and shape.mamba_layers == model.hybrid_layer_pattern.count(
        "M"
    )
    routed = shape.num_experts - shape.topk if shape.num_experts else 0
    unused = routed * shape._mlp_params(shape.moe_ffn_hidden) * shape.num_moe_layers
    matmul_weights = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n
    )
    assert shape.linear_params_per_token == matmul_weights - unused
    assert shape.recurrent_flops_per_token > 0


# Issue 42 item 4: Nemotron-H checkpoints as transformers 5.12's save_pretrained writes them from a
# config that carries a stray rms_norm_eps (HF's Nemotron-H reads only layer_norm_epsilon, default
# 1e-5; Megatron-Bridge 0.6.2 took rms_norm_eps first) and 8 Mamba heads (d_inner 128 = 2 x hidden).
# Before megatron_tree.patches.megatron_bridge_nemotron_h: 6.2e-4 (one group), 7.9e-4 (two groups),
# 4.8e-4 (MoE) off HF, and 3.7e-2 with layer_norm_epsilon=1e-6 (Megatron's gated norm kept 1e-5).
HF_SAVED_NEMOTRON_H = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    layers_block_type=["mamba", "attention", "mamba", "mlp", "mamba", "mlp"],
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    conv_kernel=4,
    expand=2,
    chunk_size=8,
    mlp_hidden_act="relu2",
    time_step_limit=(0.0, float("inf")),
    n_groups=1,
)
HF_SAVED_CASES = {
    "groups1": {},
    "groups2": {"n_groups": 2},
    "moe": {
        "layers_block_type": ["mamba", "moe", "attention", "moe", "mamba", "moe"],
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    },
    "groups2_eps1e-6": {"n_groups": 2, "layer_norm_epsilon": 1e-6},
}


def save_hf_nemotron_h(path: str, seed: int = 0, **overrides) -> None:
    """A tiny Nemotron-H written by transformers' own ``save_pretrained``: every weight of rank >= 2
    drawn N(0, 0.1), the rest (norms, A_log, D, dt_bias, conv bias) as HF initializes them. Its
    embedding is ``backbone.embedding.weight``, the name transformers 5 writes (issue 42 item 2:
    Megatron-Bridge 0.6.2 maps only ``backbone.embeddings.weight``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("nemotron_h", **{**HF_SAVED_NEMOTRON_H, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)


def hf_kernel_logprobs(path: str, seqs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """HF fp32 on each sequence alone in one scan chunk, computing what HF's CUDA path computes:
    its CPU scan (``torch_forward``) also clamps dt from below at ``time_step_min`` (1e-3 in these
    checkpoints), which its CUDA path (mamba_ssm, ``dt_limit=time_step_limit``), the rollout
    engines and Megatron do not, so the clamp is lifted (``time_step_min = 0``) for the run."""
    from transformers import AutoModelForCausalLM

    from megatron_tree.testing.reference import one_mamba_chunk

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    mixers = [m for m in model.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    assert mixers and all(m.time_step_min == 1e-3 for m in mixers)
    for m in mixers:
        m.time_step_min = 0.0
    out = {}
    with torch.no_grad():
        for i, s in enumerate(seqs):
            with one_mamba_chunk(model, len(s)):
                logits = model(s[None]).logits[0]
            out[i] = torch.log_softmax(logits, -1)[:-1].gather(1, s[1:, None])[:, 0]
    return out


@pytest.mark.parametrize("case", list(HF_SAVED_CASES))
def test_hf_saved_nemotron_h_matches_hf(world, tmp_path, case):
    """Issue 42 item 4: each HF-saved checkpoint of ``HF_SAVED_CASES`` through the Megatron-Bridge
    tree patch gives every sequence of the branching tries HF's log-probs (fp32, within
    LOGP_TOL; the tree mixer scans chunks of 8, HF one chunk), its norms HF's epsilon."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    overrides = HF_SAVED_CASES[case]
    save_hf_nemotron_h(str(tmp_path), **overrides)
    seqs = recurrent_sequences()
    want = hf_kernel_logprobs(str(tmp_path), seqs)
    model = megatron_bridge_tree_model(str(tmp_path), backend="sdpa").eval()
    eps = overrides.get("layer_norm_epsilon", 1e-5)
    assert model.config.layernorm_epsilon == eps
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    assert len(mixers) == 2 + (case != "moe") and all(m.norm.eps == eps for m in mixers)
    got = tree_logprobs(model, seqs)
    assert got.keys() == want.keys()
    for i in want:
        torch.testing.assert_close(
            got[i], want[i], rtol=0.0, atol=LOGP_TOL, msg=lambda m, i=i: f"sequence {i}: {m}"
        )
    record_parity(f"nemotron_h_hf_saved_{case}", "megatron-bridge", max_err(got, want))


@pytest.mark.parametrize(
    ("field", "value"),
    [("time_step_limit", (0.0, 0.1)), ("mamba_hidden_act", "gelu"), ("mlp_hidden_act", "silu")],
)
def test_hf_saved_nemotron_h_that_megatron_computes_differently_is_refused(
    world, tmp_path, field, value
):
    """A Mamba dt clamp (HF's CUDA scan clamps to time_step_limit), a convolution activation or an
    MLP activation Megatron does not build: refused at to_megatron_provider, naming the field."""
    save_hf_nemotron_h(str(tmp_path), **{field: value})
    with pytest.raises(ValueError, match=f"Nemotron-H {field}="):
        megatron_bridge_tree_model(str(tmp_path), backend="sdpa")


def test_nemotron_h_epsilon_patch_for_plain_bridges(world, tmp_path):
    """The process-wide form: a plain bridge's Nemotron-H provider takes layer_norm_epsilon while
    the patch is applied, and the bridge's own mapping (rms_norm_eps first) after undo."""
    from megatron_tree.patches import megatron_bridge_nemotron_h as patch
    from megatron_tree.patches import megatron_bridge_te

    megatron_bridge_te.apply()  # Megatron-Bridge imports only with it without transformer-engine
    from megatron.bridge import AutoBridge

    save_hf_nemotron_h(str(tmp_path))
    with patch.nemotron_h_epsilon_patch():
        bridge = AutoBridge.from_hf_pretrained(str(tmp_path), dtype=torch.float32)
        assert bridge.to_megatron_provider(load_weights=False).layernorm_epsilon == 1e-5
    assert not patch.is_applied()
    assert bridge.to_megatron_provider(load_weights=False).layernorm_epsilon == 1e-6
