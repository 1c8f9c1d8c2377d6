"""mbridge + ``patch_bridge_for_tree_training``: HF checkpoints load into tree models that give
every
sequence of a branching trie the log-probs HuggingFace gives it alone, at TP=1 and TP=2."""

from __future__ import annotations

import pytest
import torch

from harness.dist import run_spawned
from harness.models import (
    ARCHS,
    branching_sequences,
    max_err,
    pack,
    packed_logprobs,
    record_parity,
)
from megatron_tree.testing.tolerances import LOGP_TOL

# A CPU suite: on a CUDA machine Megatron places rotary tables on the GPU while these models live on
# the CPU. Run it there with CUDA_VISIBLE_DEVICES= (scripts/gpu_check.sh does; it checks CUDA
# itself).
pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines",
    ),
    pytest.mark.usefixtures("world"),
]

# A wrong rotary angle or a leaked key moves log-probs by >= 1e-3 (see
# test_attention_model.test_depth_rope_is_needed_for_branches).


def _load(path: str, **patch_kwargs):
    from mbridge import AutoBridge

    from megatron_tree.bridges.mbridge import patch_bridge_for_tree_training

    with patch_bridge_for_tree_training(**patch_kwargs):
        bridge = AutoBridge.from_pretrained(path, dtype=torch.float32)
    # get_model after the block: the bridge instance keeps building tree models.
    return bridge, bridge.get_model(weight_path=path, bf16=False, wrap_with_ddp=False)[0]


def tree_logprobs(model, micro_batches) -> dict[int, torch.Tensor]:
    """Per-sequence log-probs from the packed forward; vocab-parallel logits gathered at TP > 1."""
    from megatron.core import tensor_parallel

    from megatron_tree.core.mask import tree_attention_mask

    model.eval()
    out = {}
    with torch.no_grad():
        for mb in micro_batches:
            tree = mb["tree"]
            logits = model(
                mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(tree)
            )
            out.update(
                packed_logprobs(
                    tensor_parallel.gather_from_tensor_model_parallel_region(logits), mb
                )
            )
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_bridge_tree_logprobs_match_hf(arch, checkpoints, references):
    from megatron_tree.mcore.model import TreeGPTModel

    bridge, model = _load(checkpoints[arch])
    assert isinstance(model, TreeGPTModel)
    micro_batches = pack(branching_sequences())
    err = max_err(tree_logprobs(model, micro_batches), references[arch])
    assert err <= LOGP_TOL
    record_parity(arch, "mbridge", err)


def test_patch_restores_everything_and_binds_instances(checkpoints):
    from mbridge import AutoBridge
    from mbridge.core import bridge as bridge_module

    from megatron_tree.bridges.mbridge import (
        is_tree_training_bridge,
        patch_bridge_for_tree_training,
    )
    from megatron_tree.mcore.model import TreeGPTModel

    path = checkpoints["qwen2"]
    init = bridge_module.Bridge.__init__
    cuda = torch.nn.Module.cuda
    with pytest.raises(RuntimeError, match="inside"), patch_bridge_for_tree_training():
        assert bridge_module.Bridge.__init__ is not init
        with patch_bridge_for_tree_training(enable=False):
            plain = AutoBridge.from_pretrained(path, dtype=torch.float32)
        with patch_bridge_for_tree_training(backend="sdpa"):
            inner = AutoBridge.from_pretrained(path, dtype=torch.float32)
        outer = AutoBridge.from_pretrained(path, dtype=torch.float32)
        assert isinstance(outer.get_model(bf16=False, wrap_with_ddp=False)[0], TreeGPTModel)
        raise RuntimeError("inside")
    assert bridge_module.Bridge.__init__ is init
    assert torch.nn.Module.cuda is cuda
    assert not is_tree_training_bridge(plain)
    assert is_tree_training_bridge(inner) and is_tree_training_bridge(outer)
    # A bridge made outside any block is untouched.
    assert not is_tree_training_bridge(AutoBridge.from_pretrained(path, dtype=torch.float32))

    model = inner.get_model(bf16=False, wrap_with_ddp=False)[0]
    assert isinstance(model, TreeGPTModel)
    assert torch.nn.Module.cuda is cuda
    backends = {layer.self_attention.core_attention.backend for layer in model.decoder.layers}
    assert backends == {"sdpa"}
    assert {
        layer.self_attention.core_attention.backend
        for layer in outer.get_model(bf16=False, wrap_with_ddp=False)[0].decoder.layers
    } == {"auto"}
    with pytest.raises(ValueError, match="backend='nope'"):
        with patch_bridge_for_tree_training(backend="nope"):
            pass


def test_mbridge_compat_on_megatron_core_without_encoder_and_decoder(checkpoints, monkeypatch):
    """megatron-core >= 0.17 removed ModelType.encoder_and_decoder, which mbridge 0.15.1 reads in
    get_model. Simulated here on 0.16.1: a plain bridge fails as upstream does; a tree bridge builds
    (the compat patch holds while its get_model runs) and leaves the class as it found it."""
    from mbridge import AutoBridge
    from megatron.core.transformer.enums import ModelType

    from megatron_tree.bridges.mbridge import patch_bridge_for_tree_training
    from megatron_tree.mcore.model import TreeGPTModel
    from megatron_tree.patches import mbridge_compat

    path = checkpoints["qwen3"]
    monkeypatch.delattr(
        ModelType, "encoder_and_decoder", raising=False
    )  # absent already on >= 0.17
    real_version = mbridge_compat._version
    monkeypatch.setattr(
        mbridge_compat,
        "_version",
        lambda package: (0, 19) if package == "megatron-core" else real_version(package),
    )
    plain = AutoBridge.from_pretrained(path, dtype=torch.float32)
    with pytest.raises(AttributeError, match="encoder_and_decoder"):
        plain.get_model(bf16=False, wrap_with_ddp=False)
    with patch_bridge_for_tree_training():
        bridge = AutoBridge.from_pretrained(path, dtype=torch.float32)
    assert isinstance(bridge.get_model(bf16=False, wrap_with_ddp=False)[0], TreeGPTModel)
    assert not hasattr(ModelType, "encoder_and_decoder")


def _tp2_worker(rank: int, checkpoints: dict) -> dict:
    micro_batches = pack(branching_sequences())
    out = {}
    for arch, path in checkpoints.items():
        bridge, model = _load(path)
        assert bridge.config.tensor_model_parallel_size == 2
        assert (
            model.decoder.layers[0].self_attention.core_attention.config.tensor_model_parallel_size
            == 2
        )
        out[arch] = tree_logprobs(model, micro_batches)
    return out


def test_bridge_tp2_matches_tp1_and_hf(checkpoints, references):
    """One spawned TP=2 gloo world loads all three checkpoints (sequence parallelism off: the local
    spec's torch norms do not support it). Each rank's gathered log-probs must match TP=1 and HF."""
    ranks = run_spawned(_tp2_worker, 2, checkpoints)
    micro_batches = pack(branching_sequences())
    for arch, path in checkpoints.items():
        tp1 = tree_logprobs(_load(path)[1], micro_batches)
        for rank in ranks:
            assert max_err(rank[arch], tp1) <= LOGP_TOL, arch
            assert max_err(rank[arch], references[arch]) <= LOGP_TOL, arch
        record_parity(
            arch,
            "mbridge",
            max(max_err(rank[arch], references[arch]) for rank in ranks),
            layout="TP=2",
        )


def step_logprobs(model, seqs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per-sequence log-probs from a forward-only ``tree_forward_backward`` (the path that splits
    trees under context parallelism), by batch index."""
    from megatron.core import parallel_state as ps

    from megatron_tree import tree_forward_backward
    from megatron_tree.testing.synthetic import pad_sequences

    batch = pad_sequences(seqs)
    result = tree_forward_backward(
        model,
        batch,
        None,
        forward_only=True,
        collect_outputs=True,
        max_tokens_per_mb=64,
        block_size=16,
        tp_group=ps.get_tensor_model_parallel_group(),
    )
    merged = result.merged_outputs()["logprobs"]
    return {i: merged[i, : len(s) - 1] for i, s in enumerate(seqs)}


def _cp2_worker(rank: int, path: str) -> dict:
    bridge, model = _load(path)
    assert model.config.context_parallel_size == 2
    return step_logprobs(model.eval(), branching_sequences())


def test_bridge_context_parallel_2_matches_hf(checkpoints, references):
    """A CP=2 world: mbridge builds the tree model with context_parallel_size=2 and the step's split
    trees (64-token trees, prompt straddling the split) give HF's log-probs on every rank."""
    for rank in run_spawned(_cp2_worker, 2, checkpoints["qwen3"], cp=2, tp=1):
        assert max_err(rank, references["qwen3"]) <= LOGP_TOL


# ----------------------------------------------------------------------------- mixture of experts

MOE_CASES = {  # name: (arch, HF config overrides)
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_no_norm_topk": ("qwen3_moe", {"norm_topk_prob": False}),
    "qwen2_moe": ("qwen2_moe", {}),
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """{case: (path, HF log-probs on each branching sequence alone)} for the tiny MoE
    checkpoints."""
    from harness.models import hf_references, make_hf_checkpoints

    paths = make_hf_checkpoints(tmp_path_factory.mktemp("cases"), MOE_CASES)
    references = hf_references(paths, branching_sequences())
    return {case: (paths[case], references[case]) for case in MOE_CASES}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_bridge_moe_tree_logprobs_match_hf(case, moe_checkpoints):
    """mbridge's Qwen3-MoE / Qwen2-MoE bridges (4 experts, top-2; Qwen2-MoE with its gated shared
    expert) through the local spec: SequentialMLP experts named after mbridge's grouped ones, the
    router's softmax order set from the checkpoint's norm_topk_prob (mbridge hard-codes one per
    architecture), the alltoall dispatcher mbridge configures."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    path, reference = moe_checkpoints[case]
    bridge, model = _load(path)
    assert isinstance(model.decoder.layers[0].mlp, MoELayer)
    assert bridge.config.moe_router_pre_softmax == (not bridge.hf_config.norm_topk_prob)
    assert bridge.config.moe_token_dispatcher_type == "alltoall"
    err = max_err(tree_logprobs(model, pack(branching_sequences())), reference)
    assert err <= LOGP_TOL
    record_parity(MOE_CASES[case][0], "mbridge", err)


def _moe_ep2_worker(rank: int, path: str) -> dict:
    from megatron.core import parallel_state as ps

    bridge, model = _load(path)
    assert bridge.config.expert_model_parallel_size == 2
    experts = model.decoder.layers[0].mlp.experts.local_experts
    return {
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "local_experts": len(experts),
        "logprobs": tree_logprobs(model, pack(branching_sequences())),
    }


def test_bridge_moe_expert_parallel_2_matches_hf(moe_checkpoints):
    """EP=2 (TP=1): each rank loads global experts 2r, 2r+1 of the HF checkpoint into its local
    experts 0, 1, and tokens cross ranks through the alltoall dispatcher."""
    path, reference = moe_checkpoints["qwen3_moe"]
    ranks = run_spawned(_moe_ep2_worker, 2, path, tp=1, ep=2)
    assert [(r["ep_rank"], r["local_experts"]) for r in ranks] == [(0, 2), (1, 2)]
    for r in ranks:
        assert max_err(r["logprobs"], reference) <= LOGP_TOL
    record_parity(
        "qwen3_moe", "mbridge", max(max_err(r["logprobs"], reference) for r in ranks), layout="EP=2"
    )


def test_bridge_moe_refuses_expert_tp_other_than_tp(moe_checkpoints, monkeypatch):
    from mbridge import AutoBridge
    from mbridge.core import parallel_states

    from megatron_tree.bridges.mbridge import patch_bridge_for_tree_training

    real = parallel_states.ParallelStates.get_parallel_state

    def etp2():
        states = real()
        states.etp_size = 2
        return states

    monkeypatch.setattr(parallel_states.ParallelStates, "get_parallel_state", staticmethod(etp2))
    with (
        pytest.raises(
            ValueError,
            match="expert_tensor_parallel_size=2 differs from tensor_model_parallel_size=1",
        ),
        patch_bridge_for_tree_training(),
    ):
        AutoBridge.from_pretrained(moe_checkpoints["qwen3_moe"][0], dtype=torch.float32)
