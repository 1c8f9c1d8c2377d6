"""DeepSeek-V3 and GLM-4.5 through mbridge 0.15.1 + ``patch_bridge_for_tree_training`` (CPU, local
spec, fp32): every sequence of a branching trie gets the log-probs HuggingFace gives it alone.

mbridge's DeepSeek-V3 bridge cannot build its config on megatron-core 0.16 / 0.17 and gets its RoPE
type, group-limited routing and MTP setting wrong (``megatron_tree.patches.mbridge_deepseek``);
its GLM-4.5 bridge has no route for the local spec's ``input_layernorm``, inherits Qwen2-MoE's
shared-expert gate and drops ``n_shared_experts`` (``megatron_tree.bridges.mbridge``)."""

from __future__ import annotations

import pytest
import torch

from harness.models import branching_sequences, max_err, record_parity, tree_logprobs
from megatron_tree.testing.tolerances import LOGP_TOL

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines",
    ),
    pytest.mark.usefixtures("world"),
]

# Plain RoPE for YaRN or routing over all expert groups moves log-probs by ~2 on these checkpoints.
CASES = {  # name: (arch, HF config overrides)
    "deepseek_v3": ("deepseek_v3", {}),
    # GLM-4.5 with 2 shared experts in 2 expert groups (the real model has 1 and 1), so that the
    # shared-expert size and group-limited routing mbridge's GLM-4.5 bridge leaves out are
    # exercised.
    "glm4_moe": ("glm4_moe", {"n_shared_experts": 2, "n_group": 2, "topk_group": 1}),
}


@pytest.fixture(scope="module")
def frontier(tmp_path_factory):
    """{case: (checkpoint path, HF log-probs of each branching sequence alone)}."""
    from harness.models import hf_references, make_hf_checkpoints

    paths = make_hf_checkpoints(tmp_path_factory.mktemp("cases"), CASES)
    references = hf_references(paths, branching_sequences())
    return {case: (paths[case], references[case]) for case in CASES}


def _load(path: str):
    from mbridge import AutoBridge

    from megatron_tree.bridges.mbridge import patch_bridge_for_tree_training

    with patch_bridge_for_tree_training():
        bridge = AutoBridge.from_pretrained(path, dtype=torch.float32)
    return bridge, bridge.get_model(weight_path=path, bf16=False, wrap_with_ddp=False)[0]


def _assert_exports_checkpoint(bridge, model, path: str) -> None:
    """``export_weights`` gives back exactly the HF checkpoint's tensors (names, shapes, values)."""
    from glob import glob

    from safetensors.torch import load_file

    hf = {}
    for file in glob(f"{path}/*.safetensors"):
        hf.update(load_file(file))
    exported = dict(bridge.export_weights([model]))
    assert exported.keys() == hf.keys()
    assert all(torch.equal(exported[name], hf[name]) for name in hf)


def test_deepseek_v3_through_mbridge_matches_hf(frontier):
    """Tiny DeepSeek-V3 (MLA with YaRN from ``rope_type``, 4 experts in 2 groups choosing 1, a
    shared
    expert, dense layer 0, no MTP) loads into a tree model with HF's log-probs."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_tree.mcore.mla import TreeMLASelfAttention
    from megatron_tree.mcore.model import TreeGPTModel

    path, reference = frontier["deepseek_v3"]
    bridge, model = _load(path)
    assert isinstance(model, TreeGPTModel)
    assert all(
        isinstance(layer.self_attention, TreeMLASelfAttention) for layer in model.decoder.layers
    )
    config = bridge.config
    assert (config.rope_type, config.original_max_position_embeddings, config.mtp_num_layers) == (
        "yarn",
        16,
        None,
    )
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.attention_backend == AttnBackend.auto  # mbridge asks for fused: NVTE_* clash
    err = max_err(tree_logprobs(model.eval(), branching_sequences()), reference)
    assert err <= LOGP_TOL
    record_parity("deepseek_v3", "mbridge", err)
    _assert_exports_checkpoint(bridge, model, path)


def test_glm4_moe_through_mbridge_matches_hf(frontier):
    """Tiny GLM-4.5 (half-rotary attention with q/k norms and biases, dense layer 0, routed +
    shared experts, sigmoid routing in groups) loads into a tree model with HF's log-probs; built
    after a DeepSeek-V3 tree model in the same process (Megatron's NVTE_* backend check)."""
    path, reference = frontier["glm4_moe"]
    bridge, model = _load(path)
    config = bridge.config
    assert not config.moe_shared_expert_gate
    assert config.moe_shared_expert_intermediate_size == 2 * 32
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    err = max_err(tree_logprobs(model.eval(), branching_sequences()), reference)
    assert err <= LOGP_TOL
    record_parity("glm4_moe", "mbridge", err)
    _assert_exports_checkpoint(bridge, model, path)


def _hf_config(path: str, **changes):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_deepseek_v3_config_reads_rope_scaling_as_hf(frontier):
    """The legacy ``type`` key reads as ``rope_type``; HF's defaults fill what the config lacks;
    what
    Megatron's YaRN cannot express is refused, as is a routing Megatron's group score differs on."""
    from megatron_tree.patches.mbridge_deepseek import fixed_config_kwargs

    path = frontier["deepseek_v3"][0]
    legacy = {"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    kwargs = fixed_config_kwargs(
        _hf_config(path, rope_scaling=legacy),
        {"max_position_embeddings": 4096, "mtp_num_layers": 0},
    )
    assert "max_position_embeddings" not in kwargs and kwargs["mtp_num_layers"] is None
    assert (
        kwargs["rope_type"],
        kwargs["rotary_scaling_factor"],
        kwargs["original_max_position_embeddings"],
    ) == ("yarn", 40.0, 512)  # HF's fallback: max_position_embeddings
    bare = fixed_config_kwargs(
        _hf_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7}), {}
    )
    assert (bare["mscale"], bare["mscale_all_dim"]) == (
        1.0,
        0.0,
    )  # HF: g(1) cos/sin scale, no softmax scale
    assert fixed_config_kwargs(_hf_config(path, rope_scaling=None), {})["rope_type"] == "rope"
    with pytest.raises(ValueError, match="'linear'"):
        fixed_config_kwargs(
            _hf_config(path, rope_scaling={"rope_type": "linear", "factor": 2.0}), {}
        )
    with pytest.raises(ValueError, match="attention_factor"):
        fixed_config_kwargs(_hf_config(path, rope_scaling={**legacy, "attention_factor": 1.2}), {})
    with pytest.raises(ValueError, match="top-2"):
        fixed_config_kwargs(
            _hf_config(path, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2), {}
        )


def test_deepseek_v3_patch_apply_undo_for_plain_bridges(frontier):
    """Upstream, a plain DeepSeek-V3 bridge cannot be created on megatron-core 0.16 / 0.17; the
    process-wide form fixes plain bridges and undo restores the class exactly."""
    from mbridge import AutoBridge
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    from megatron_tree.patches import mbridge_deepseek

    path = frontier["deepseek_v3"][0]
    before = dict(vars(DeepseekV3Bridge))
    with pytest.raises(TypeError, match="max_position_embeddings"):
        AutoBridge.from_pretrained(path, dtype=torch.float32)
    with mbridge_deepseek.mbridge_deepseek_patch():
        bridge = AutoBridge.from_pretrained(path, dtype=torch.float32)
    assert bridge.config.rope_type == "yarn" and dict(vars(DeepseekV3Bridge)) == before


def test_sigmoid_router_without_norm_topk_prob_is_refused(frontier):
    """HF's sigmoid routers renormalize the top-k scores only with ``norm_topk_prob``; Megatron's
    always
    does, so a tree bridge refuses ``norm_topk_prob=False`` instead of routing differently."""
    from mbridge import AutoBridge

    from megatron_tree.bridges.mbridge import patch_bridge_for_tree_training

    config = _hf_config(frontier["glm4_moe"][0], norm_topk_prob=False)
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        with patch_bridge_for_tree_training():
            AutoBridge.from_config(config, dtype=torch.float32)
