"""Nemotron-H (Mamba-2 hybrid, Megatron-Core's HybridModel) training steps with trees, through
Megatron-Bridge: gradients against the unpacked run under full and selective recompute and trunk
reuse, and the forward under TP=2, CP=2 and PP=2 against HuggingFace.

The unpacked reference for gradients is the same model on each sequence alone (a one-chain tree,
:class:`~megatron_tree.testing.reference.OneSequence`: Megatron's own ``MambaMixer`` runs only on
GPU kernels); the forward is checked against HuggingFace's Nemotron-H, which is independent (run in
one scan chunk per sequence: :func:`~megatron_tree.testing.reference.one_mamba_chunk`). Runs in the
Megatron-Bridge stack (transformers >= 5.8); skipped elsewhere, with the reason shown.
"""

from __future__ import annotations

import pytest
import torch

from harness.dist import run_spawned
from harness.marks import MEGATRON_BRIDGE_STACK
from harness.models import (
    RECOMPUTE_MODES,
    hf_logprobs,
    max_err,
    megatron_bridge_tree_model,
    recompute_fields,
    record_parity,
    recurrent_sequences,
    step_logprobs,
)
from megatron_tree.testing.reference import gradient_errors, parameter_grads
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, LOSS_RTOL

pytestmark = [*MEGATRON_BRIDGE_STACK]


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    """A tiny random Nemotron-H checkpoint (pattern ``M*M-``) and HF's log-probs of every
    sequence of ``recurrent_sequences()`` alone."""
    from harness.models import make_hf_checkpoint

    path = str(tmp_path_factory.mktemp("nemotron_h"))
    make_hf_checkpoint("nemotron_h", path)
    return path, hf_logprobs(path, recurrent_sequences())


def _model(path: str, **fields):
    return megatron_bridge_tree_model(path, backend="sdpa", **fields)


def _ppo_batch() -> dict:
    from megatron_tree.testing.synthetic import rl_batch

    return rl_batch(recurrent_sequences(), response_start=5)


def _ppo_loss(outputs, mb):
    from megatron_tree.core.losses import ppo_clipped_loss

    return ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)


def _step_vs_unpacked(path: str, fields: dict, reference_fields: dict | None = None, **packing):
    """(tree loss, unpacked loss, tree gradients, unpacked gradients) of one PPO step on
    ``recurrent_sequences()``; ``fields`` set on both models' providers (``reference_fields`` on
    the reference's instead, if given)."""
    from megatron.core import parallel_state as ps

    from megatron_tree import tree_forward_backward
    from megatron_tree.core.heads import LogProbs
    from megatron_tree.mcore.step import PackingConfig, ProcessGroups
    from megatron_tree.testing.reference import OneSequence, unpacked_reference_step

    batch, loss_fn = _ppo_batch(), _ppo_loss
    reference = OneSequence(
        _model(path, **(fields if reference_fields is None else reference_fields))
    )
    want = float(unpacked_reference_step(reference, batch, loss_fn))
    model = _model(path, **fields)
    result = tree_forward_backward(
        model,
        batch,
        loss_fn,
        gather=LogProbs(),
        groups=ProcessGroups(tp=ps.get_tensor_model_parallel_group()),
        packing=PackingConfig(**packing),
    )
    grads = [parameter_grads(m, prefix="model.") for m in (model, reference)]
    return float(result.loss), want, *grads


def _grads_worker(rank: int, path: str, fields: dict) -> tuple:
    """One PPO step at a TP / CP layout against the unpacked run of the same sharded model; CP
    ranks' gradients averaged over the data x context group as Megatron's DDP does."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    alone = {**fields, "context_parallel_size": 1}  # each sequence whole on every rank
    loss, want, got, ref = _step_vs_unpacked(
        path, fields, alone, max_tokens_per_mb=64, block_size=16
    )
    group = ps.get_data_parallel_group(with_context_parallel=True)
    for g in got.values():
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=group)
    return loss, want, got, ref


def _assert_step_close(got_loss, want_loss, got, want):
    assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    errors = gradient_errors(got, want)
    for name in ("mixer.in_proj", "mixer.conv1d_weight", "mixer.A_log", "mixer.norm"):
        assert any(name in n for n in errors), name
    worst = max(errors.items(), key=lambda kv: kv[1])
    loss_rel = abs(got_loss - want_loss) / abs(want_loss)
    print(f"loss rel {loss_rel:.1e}, gradients rel {worst[1]:.1e} ({worst[0]})")
    assert worst[1] <= GRAD_RTOL, worst


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_nemotron_h_step_gradients_equal_unpacked(world, recompute, nemotron_h):
    """Full recompute re-runs whole Mamba layers from the micro-batch's mask plan; selective
    recompute (core attention) leaves them and recomputes the attention layer."""
    got = _step_vs_unpacked(
        nemotron_h[0], recompute_fields(recompute), max_tokens_per_mb=128, block_size=16
    )
    _assert_step_close(*got)


def test_nemotron_h_trunk_reuse_gradients_equal_unpacked(world, nemotron_h):
    """Capacity 64 with 200+ tokens of prompt groups: trunk parts record each Mamba layer's
    convolution input and dt logits; their branches rescan along the trunk from them, with
    gradients reaching the trunk through the store."""
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
    got = _step_vs_unpacked(
        nemotron_h[0], {}, max_tokens_per_mb=64, block_size=16, share_trunks=True
    )
    _assert_step_close(*got)


def test_nemotron_h_moe_step_gradients_equal_unpacked(world, tmp_path):
    """Nemotron 3 Nano's layer kinds (``ME*ME``: Mamba, MoE with routed + shared experts and a
    sigmoid router with expert bias, attention). Router losses are as if unpacked over the batch
    (tests/test_moe_aux_loss.py), not per sequence as this reference runs, so they are off here;
    the bridge's seq_aux_loss is refused with trees."""
    from harness.models import NEMOTRON_H_MOE, make_hf_checkpoint

    make_hf_checkpoint("nemotron_h", str(tmp_path), **NEMOTRON_H_MOE)
    fields = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0}
    got = _step_vs_unpacked(str(tmp_path), fields, max_tokens_per_mb=128, block_size=16)
    _assert_step_close(*got)
    assert any("mlp.experts" in n for n in got[2]) and any("shared_experts" in n for n in got[2])


@pytest.mark.parametrize(
    "layout", [pytest.param({"tp": 2}, id="tp2"), pytest.param({"cp": 2, "tp": 1}, id="cp2")]
)
def test_nemotron_h_parallel_step_gradients_equal_unpacked(nemotron_h, layout):
    """TP=2: each rank's shard of every Mamba parameter (heads and groups split) gets the unpacked
    gradient; CP=2: each rank scans the whole tree from the all-gathered inputs and backpropagates
    its rows' share, and the shares add up to the unpacked gradient."""
    fields = {
        "tensor_model_parallel_size": layout.get("tp", 1),
        "context_parallel_size": layout.get("cp", 1),
    }
    for rank in run_spawned(_grads_worker, 2, nemotron_h[0], fields, **layout):
        _assert_step_close(*rank)


def _pp_grads_worker(rank: int, path: str) -> tuple:
    """One PPO step at PP=2 (``M*|M-``): (loss on the last stage or None, gradients by whole-model
    parameter name)."""
    from megatron.core import parallel_state as ps

    from megatron_tree import tree_forward_backward
    from megatron_tree.core.heads import LogProbs
    from megatron_tree.mcore.step import PackingConfig, ProcessGroups

    model = _model(path, pipeline_model_parallel_size=2, hybrid_layer_pattern="M*|M-")
    result = tree_forward_backward(
        model,
        _ppo_batch(),
        _ppo_loss,
        gather=LogProbs(),
        groups=ProcessGroups(tp=ps.get_tensor_model_parallel_group()),
        packing=PackingConfig(max_tokens_per_mb=64, block_size=16),
    )
    names = _global_names(model)
    grads = {names[n]: g for n, g in parameter_grads(model).items()}
    return (float(result.loss) if result.loss is not None else None), grads


def test_nemotron_h_pipeline_parallel_2_step_gradients_equal_unpacked(world, nemotron_h):
    """PP=2: the two stages' gradients, by whole-model name, are the unpacked run's."""
    from megatron_tree.testing.reference import OneSequence, unpacked_reference_step

    reference = OneSequence(_model(nemotron_h[0]))
    want_loss = float(unpacked_reference_step(reference, _ppo_batch(), _ppo_loss))
    want = parameter_grads(reference, prefix="model.")
    first, last = run_spawned(_pp_grads_worker, 2, nemotron_h[0], pp=2, tp=1)
    assert first[0] is None
    assert not first[1].keys() & last[1].keys()
    _assert_step_close(last[0], want_loss, {**first[1], **last[1]}, want)


def _layout_worker(rank: int, path: str, fields: dict, packing: dict):
    from megatron.core import parallel_state as ps

    from megatron_tree.mcore.step import PackingConfig, ProcessGroups, tree_forward_backward
    from megatron_tree.testing.synthetic import pad_sequences

    model = _model(path, **fields).eval()
    if fields.get("pipeline_model_parallel_size", 1) > 1:
        kinds = [
            type(layer.mixer if hasattr(layer, "mixer") else layer).__name__
            for layer in model.decoder.layers
        ]
        want = (
            ["TreeMambaMixer", "TransformerLayer"]
            if ps.is_pipeline_first_stage()
            else ["TreeMambaMixer", "MLPLayer"]
        )
        assert kinds == want, kinds
    if ps.is_pipeline_last_stage():
        return step_logprobs(model, recurrent_sequences(), **packing)
    tree_forward_backward(  # the first stage's part of the schedule: no outputs there
        model,
        pad_sequences(recurrent_sequences()),
        None,
        forward_only=True,
        groups=ProcessGroups(tp=ps.get_tensor_model_parallel_group()),
        packing=PackingConfig(**packing),
    )
    return None


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"tp": 2}, id="tp2"),
        pytest.param({"cp": 2, "tp": 1}, id="cp2"),
        pytest.param({"pp": 2, "tp": 1}, id="pp2"),
    ],
)
def test_nemotron_h_parallel_layouts_match_hf(nemotron_h, layout):
    """TP=2 splits the Mamba heads and groups (each rank scans its heads over the whole tree); CP=2
    all-gathers the convolution input and dt logits so each rank scans the whole tree and keeps its
    rows; PP=2 puts ``M*`` and ``M-`` on two stages (the pattern's ``|``)."""
    path, want = nemotron_h
    fields = {
        "tensor_model_parallel_size": layout.get("tp", 1),
        "context_parallel_size": layout.get("cp", 1),
    }
    packing = {"max_tokens_per_mb": 64, "block_size": 16}
    if layout.get("pp"):
        fields |= {"pipeline_model_parallel_size": 2, "hybrid_layer_pattern": "M*|M-"}
    ranks = run_spawned(_layout_worker, 2, path, fields, packing, **layout)
    results = [r for r in ranks if r is not None]
    assert results
    err = max(max_err(logprobs, want) for logprobs in results)
    assert err <= LOGP_TOL
    name = ", ".join(f"{k.upper()}={v}" for k, v in layout.items() if v > 1)
    record_parity("nemotron_h", "megatron-bridge", err, layout=name)


def _direct_hybrid(**config_fields):
    """A TreeHybridModel built directly (no bridge): Mamba, attention with depth RoPE, MLP; its
    list of this rank's chunks under virtual pipeline parallelism."""
    from megatron.core import parallel_state as ps

    from harness.models import small_gpt_config
    from megatron_tree.mcore.hybrid import TreeHybridModel, local_hybrid_stack_spec
    from megatron_tree.mcore.spec import tree_attention_spec

    config = small_gpt_config(
        num_layers=4,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_state_dim=8,
        mamba_num_groups=2,
        **config_fields,
    )
    spec = tree_attention_spec(local_hybrid_stack_spec(config), backend="sdpa")
    vpp = config.virtual_pipeline_model_parallel_size
    pattern = "M|*|M|-" if vpp else "M*M-"
    torch.manual_seed(0)
    return [
        TreeHybridModel(
            config,
            hybrid_stack_spec=spec,
            vocab_size=256,
            max_sequence_length=512,
            hybrid_layer_pattern=pattern,
            position_embedding_type="rope",
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp,
        ).eval()
        for vp in (range(vpp) if vpp else [None])
    ]


def _global_names(model) -> dict[str, str]:
    """{name in this chunk: name in the whole model} (a chunk numbers its layers from 0)."""
    names = {}
    for name in model.state_dict():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers.") :].split(".", 1)
            number = model.decoder.layers[int(local)].layer_number
            name_global = f"decoder.layers.{number - 1}.{rest}"
        else:
            name_global = name
        names[name] = name_global
    return names


def _vpp_worker(rank: int, state_path: str):
    from megatron.core import parallel_state as ps

    from megatron_tree.mcore.step import PackingConfig, ProcessGroups, tree_forward_backward
    from megatron_tree.testing.synthetic import pad_sequences

    full = torch.load(state_path)
    chunks = _direct_hybrid(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    stage = ps.get_pipeline_model_parallel_rank()
    assert [[layer.layer_number for layer in c.decoder.layers] for c in chunks] == [
        [1 + stage],
        [3 + stage],
    ]
    for chunk in chunks:
        names = _global_names(chunk)
        chunk.load_state_dict({n: full[names[n]] for n in chunk.state_dict() if n in names})
    packing = {"max_tokens_per_mb": 64, "block_size": 16}
    if ps.is_pipeline_last_stage():
        return step_logprobs(chunks, recurrent_sequences(), **packing)
    tree_forward_backward(
        chunks,
        pad_sequences(recurrent_sequences()),
        None,
        forward_only=True,
        groups=ProcessGroups(tp=ps.get_tensor_model_parallel_group()),
        packing=PackingConfig(**packing),
    )
    return None


def test_hybrid_virtual_pipeline_2x2_equals_one_stage(world, tmp_path):
    """PP=2 x VPP=2 of a directly built TreeHybridModel (``M|*|M|-``: chunk c of stage s holds
    layer 2c + s + 1; Megatron-Bridge's HybridModelProvider refuses VPP upstream) gives the
    log-probs of the same weights on one stage."""
    (model,) = _direct_hybrid()
    want = step_logprobs(model, recurrent_sequences(), max_tokens_per_mb=64, block_size=16)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    ranks = run_spawned(_vpp_worker, 2, str(tmp_path / "state.pt"), pp=2, vpp=2, tp=1)
    assert ranks[0] is None
    assert max_err(ranks[1], want) <= LOGP_TOL
