"""Multi-latent attention (DeepSeek-V3, Kimi-K2) with trees, on every stack: the tree model against
the stock ``MLASelfAttention`` model on each sequence alone (its own rotary at offsets 0..L-1, plain
causal attention: :class:`~megatron_tree.testing.reference.CausalCoreAttention`, since Megatron's
local core attention cannot run MLA), for plain RoPE and YaRN, every backend, recompute, trunk
reuse and CP=2 x TP=2; and the refusals (MTP, DeepSeek sparse attention, a stock MLA)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.dist import reinitialize_model_parallel, run_spawned
from harness.models import (
    RECOMPUTE_MODES,
    VOCAB,
    branching_sequences,
    max_err,
    pack,
    packed_logprobs,
    recompute_fields,
    trunk_sequences,
)
from megatron_tree.testing.reference import gradient_errors, parameter_grads
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, LOSS_RTOL

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines"
)

# A rotary angle taken from the packed offset moves the later branches by > 1e-2.


def _config(rope_type: str = "yarn", **overrides):
    from harness.models import small_mla_config

    return small_mla_config(rope_type=rope_type, init_method_std=0.15, **overrides)


def _models(config, backend: str = "block_sparse"):
    """(stock reference, tree model with the same weights)."""
    from harness.models import build_gpt_model

    reference = build_gpt_model(config, tree=False, vocab_size=VOCAB)
    tree = build_gpt_model(config, tree=True, vocab_size=VOCAB, backend=backend, block_size=16)
    tree.load_state_dict(reference.state_dict())
    return reference, tree


def _reference_logprobs(model, seqs) -> dict[int, torch.Tensor]:
    from megatron.core import tensor_parallel

    out = {}
    with torch.no_grad():
        for i, s in enumerate(seqs):
            logits = model(s[None], torch.arange(len(s))[None], attention_mask=None)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            out[i] = torch.log_softmax(logits[0], -1)[:-1].gather(1, s[1:, None])[:, 0]
    return out


def _tree_logprobs(model, seqs) -> dict[int, torch.Tensor]:
    from megatron_tree.core.mask import tree_attention_mask

    out = {}
    with torch.no_grad():
        for mb in pack(seqs):
            logits = model(
                mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(mb["tree"])
            )
            out.update(packed_logprobs(logits, mb))
    return out


@pytest.mark.parametrize("backend", ["sdpa", "block_sparse", "flex"])
@pytest.mark.parametrize("rope_type", ["yarn", "rope"])
def test_tree_mla_matches_stock_mla_per_sequence(world, rope_type, backend):
    from megatron_tree.mcore.mla import TreeMLASelfAttention

    reference, tree = (m.eval() for m in _models(_config(rope_type), backend))
    assert all(
        isinstance(layer.self_attention, TreeMLASelfAttention) for layer in tree.decoder.layers
    )
    seqs = branching_sequences()
    assert max_err(_tree_logprobs(tree, seqs), _reference_logprobs(reference, seqs)) <= LOGP_TOL


def test_depth_rope_is_needed_and_a_stock_mla_is_refused(world):
    """The stock MLASelfAttention around tree core attention rotates by packed offset: the later
    branches are far off, and the step refuses such a model."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_tree.mcore.spec import check_tree_model

    reference, tree = (m.eval() for m in _models(_config()))
    for layer in tree.decoder.layers:
        layer.self_attention.__class__ = MLASelfAttention
    seqs = branching_sequences()
    err = max_err(_tree_logprobs(tree, seqs), _reference_logprobs(reference, seqs))
    assert 1e-2 < err < math.inf, err  # far off, but not NaN/inf (max_err gives inf for those)
    with pytest.raises(ValueError, match="stock MLASelfAttention"):
        check_tree_model(tree)


def _step_vs_unpacked(config, seqs, **step_kwargs):
    """(tree step loss, unpacked loss, gradient errors by parameter name)."""
    from megatron.core import parallel_state as ps

    from megatron_tree import tree_forward_backward
    from megatron_tree.core.heads import LogProbs
    from megatron_tree.core.losses import ppo_clipped_loss
    from megatron_tree.testing.reference import unpacked_reference_step
    from megatron_tree.testing.synthetic import rl_batch

    batch = rl_batch(seqs, response_start=5)
    loss_fn = lambda outputs, mb: ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)  # noqa: E731
    reference, tree = (m.train() for m in _models(config))
    want = float(unpacked_reference_step(reference, batch, loss_fn))
    result = tree_forward_backward(
        tree,
        batch,
        loss_fn,
        gather=LogProbs(),
        tp_group=ps.get_tensor_model_parallel_group(),
        **step_kwargs,
    )
    errors = gradient_errors(
        parameter_grads(tree, require_all=True), parameter_grads(reference, require_all=True)
    )
    return float(result.loss), want, errors


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_mla_step_gradients_equal_unpacked(world, recompute):
    config = _config(**recompute_fields(recompute, "mla_up_proj"))
    got, want, errors = _step_vs_unpacked(
        config, branching_sequences(), max_tokens_per_mb=128, block_size=16
    )
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    assert any("linear_kv_down_proj" in n for n in errors) and any(
        "linear_q_up_proj" in n for n in errors
    )
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


def test_mla_trunk_reuse_gradients_equal_unpacked(world):
    """Capacity 64 under prompts of 200+ tokens: branch parts sit deeper than they have rows, so the
    rotary table must reach past them (the rows' reach)."""
    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.testing.synthetic import rl_batch

    seqs = trunk_sequences()
    packed = build_packed_tree_batch(
        rl_batch(seqs, response_start=5),
        max_tokens_per_mb=64,
        block_size=16,
        pad_to_max=False,
        share_trunks=True,
    )
    assert any(
        mb["rows"].stored is not None and mb["rows"].reach > mb["rows"].num_rows for mb in packed
    )
    got, want, errors = _step_vs_unpacked(
        _config(), seqs, max_tokens_per_mb=64, block_size=16, share_trunks=True
    )
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


def _parallel_worker(rank: int) -> dict:
    from megatron.core import parallel_state as ps

    from harness.models import build_gpt_model, step_logprobs

    cases = (
        ("branching", branching_sequences(), {}),
        ("trunk", trunk_sequences(), {"share_trunks": True}),
    )
    reinitialize_model_parallel(tp=2, cp=1)
    reference = build_gpt_model(
        _config(tensor_model_parallel_size=2), tree=False, vocab_size=VOCAB
    ).eval()
    want = {name: _reference_logprobs(reference, seqs) for name, seqs, _ in cases}
    reinitialize_model_parallel(tp=2, cp=2)
    config = _config(tensor_model_parallel_size=2, context_parallel_size=2)
    tree = build_gpt_model(
        config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
    )
    tree.load_state_dict(reference.state_dict())
    assert ps.get_context_parallel_world_size() == 2
    return {
        name: max_err(
            step_logprobs(tree, seqs, max_tokens_per_mb=64, block_size=16, **packing), want[name]
        )
        for name, seqs, packing in cases
    }


@pytest.mark.slow
def test_mla_context_parallel_2_x_tensor_parallel_2_matches_stock():
    """CP=2 x TP=2: each rank rotates its rows by their depths before the keys are all-gathered."""
    for rank in run_spawned(_parallel_worker, 4, tp=2, cp=2):
        assert max(rank.values()) <= LOGP_TOL, rank


def test_mtp_and_sparse_attention_are_refused(world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_tree.mcore.model import TreeGPTModel
    from megatron_tree.mcore.spec import tree_attention_spec

    spec = tree_attention_spec(
        get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    )
    with pytest.raises(ValueError, match="multi-token prediction .*mtp_num_layers=None"):
        TreeGPTModel(
            config=_config(mtp_num_layers=1),
            transformer_layer_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=64,
        )
    with pytest.raises(ValueError, match="apply_rope_fusion=True"):
        TreeGPTModel(
            config=_config(apply_rope_fusion=True),
            transformer_layer_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=64,
        )

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_tree.mcore.mla import TreeMLASelfAttention

    assert (
        tree_attention_spec(spec).submodules.self_attention.module is TreeMLASelfAttention
    )  # kept as is

    class CustomMLA(MLASelfAttention):
        pass

    custom = get_gpt_layer_local_spec(multi_latent_attention=True)
    custom.submodules.self_attention.module = CustomMLA
    with pytest.raises(
        ValueError,
        match="custom multi-latent attention CustomMLA: "
        ".*megatron_tree.mcore.mla.TreeMLASelfAttention",
    ):
        tree_attention_spec(custom)

    class DSAttention(torch.nn.Module):  # DeepSeek-V3.2's core attention, by name
        pass

    sparse = get_gpt_layer_local_spec(multi_latent_attention=True)
    sparse.submodules.self_attention.submodules.core_attention = DSAttention
    with pytest.raises(ValueError, match="DeepSeek sparse attention"):
        tree_attention_spec(sparse)
