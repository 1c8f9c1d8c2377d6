"""The tree-packed training step against the unpacked per-sequence step (actor and critic).

The reference is independent of the tree code: Megatron's stock GPTModel (local spec, causal mask,
positions 0..L-1) on each sequence alone, full-vocab float64 log-softmax, the same per-token loss
and the token-mean normalization written out here. Parallel layouts run in spawned gloo worlds.
"""

from __future__ import annotations

import pytest
import torch


from megatron_tree.parity import (  # noqa: E402
    build_gpt_model,
    gradient_errors,
    small_gpt_config,
    stage_parameter_name,
    unpacked_reference_step,
)
from megatron_tree.patches import megatron_cpu  # noqa: E402
from megatron_tree.testing.synthetic import pad_sequences  # noqa: E402
from megatron_tree.train_step import ppo_clipped_loss, tree_forward_backward, value_loss  # noqa: E402

from megatron_tree.testing.dist import run_spawned, single_process_world  # noqa: E402
from megatron_tree.testing.models import VOCAB, branching_sequences  # noqa: E402

# fp32 on CPU: packed and unpacked runs differ only in summation order; relative to each
# parameter's gradient norm that is ~1e-6 here, while a wrong mask, position or normalization
# moves gradients by >= 1e-2.
GRAD_RTOL = 1e-4
LOSS_RTOL = 1e-5
NUM_LAYERS = 4
RECOMPUTE = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
}


def _config(recompute: str = "none"):
    from megatron.core import parallel_state as ps

    return small_gpt_config(
        num_layers=NUM_LAYERS,
        gated_linear_unit=False,
        add_qkv_bias=True,
        init_method_std=0.15,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        **RECOMPUTE[recompute],
    )


def _build(kind: str, critic: bool, recompute: str = "none", state: dict | None = None):
    """kind: "tree" (tree attention + depth RoPE) or "reference" (stock GPTModel)."""
    model = build_gpt_model(
        _config(recompute), tree=kind == "tree", vocab_size=VOCAB, critic=critic,
        backend="block_sparse", block_size=16,
    )
    if state is not None:
        model.load_state_dict(state)
    return model


def _batch(seqs: list[torch.Tensor]) -> dict:
    batch = pad_sequences(seqs)
    b, width = batch["input_ids"].shape
    g = torch.Generator().manual_seed(11)
    lengths = batch["attention_mask"].sum(1)
    pos = torch.arange(width)[None]
    # Rolled loss mask: entries about tokens 6.. of each sequence (a "response"), none at the end.
    batch["loss_mask"] = ((pos >= 5) & (pos < (lengths - 1)[:, None])).float()
    batch["old_logprobs"] = -3 * torch.rand(b, width, generator=g) - 3.5
    batch["advantages"] = torch.randn(b, 1, generator=g).expand(b, width).contiguous()
    batch["returns"] = torch.randn(b, width, generator=g)
    return batch


def _loss_fn(critic: bool):
    if critic:
        return value_loss
    return lambda outputs, mb: ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)


def _reference_step(model, batch: dict, critic: bool) -> torch.Tensor:
    """Per-sequence unpacked forward + backward with the stock model; the token-mean loss."""
    return unpacked_reference_step(model, batch, _loss_fn(critic), critic=critic)


def _tree_step(model, batch: dict, critic: bool, **kwargs):
    from megatron.core import parallel_state as ps

    return tree_forward_backward(
        model,
        batch,
        _loss_fn(critic),
        critic=critic,
        max_tokens_per_mb=64,  # several trees, so micro-batch normalization is exercised
        block_size=16,
        tp_group=ps.get_tensor_model_parallel_group(),
        **kwargs,
    )


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict, want: dict) -> None:
    errors = gradient_errors(got, want)
    assert errors and max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


def _compare_tree_to_reference(critic: bool, recompute: str) -> tuple[float, float, dict, dict]:
    batch = _batch(branching_sequences())
    reference = _build("reference", critic)
    want_loss = _reference_step(reference, batch, critic)
    tree = _build("tree", critic, recompute, state=reference.state_dict())
    result = _tree_step(tree, batch, critic)
    assert result.num_micro_batches > 1
    return float(result.loss), float(want_loss), _grads(tree), _grads(reference)


# ----------------------------------------------------------------------------- TP = 1, in process


@pytest.fixture(scope="module")
def world():
    single_process_world()
    yield
    megatron_cpu.undo()


@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_step_equals_unpacked_step(world, critic, recompute):
    got_loss, want_loss, got, want = _compare_tree_to_reference(critic, recompute)
    assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    _assert_grads_close(got, want)


def test_sequence_normalization_and_forward_only(world):
    batch = _batch(branching_sequences())
    tree = _build("tree", critic=False)
    before = {n: p.detach().clone() for n, p in tree.named_parameters()}
    token = _tree_step(tree, batch, False, forward_only=True)
    seq = _tree_step(tree, batch, False, forward_only=True, normalization="sequence")
    assert all(p.grad is None for p in tree.parameters())
    assert all(torch.equal(before[n], p) for n, p in tree.named_parameters())
    # Re-weighting the token losses by hand reproduces the sequence-mean normalization.
    mask = batch["loss_mask"]
    weights = mask / mask.sum(1, keepdim=True) / mask.shape[0] * mask.sum()
    reweighted = _tree_step(tree, {**batch, "loss_mask": weights}, False, forward_only=True)
    assert float(reweighted.loss) == pytest.approx(float(seq.loss), rel=LOSS_RTOL)
    assert float(seq.loss) != pytest.approx(float(token.loss), rel=1e-3)
    with pytest.raises(ValueError, match="normalization='batch' must be one of"):
        _tree_step(tree, batch, False, normalization="batch")


# ----------------------------------------------------------------------------- spawned worlds


def _tp_worker(rank: int) -> dict:
    out = {}
    for critic, recompute in [(False, "none"), (False, "selective"), (True, "full")]:
        got_loss, want_loss, got, want = _compare_tree_to_reference(critic, recompute)
        out[(critic, recompute)] = (got_loss, want_loss, got, want)
    return out


def test_tensor_parallel_2_equals_unpacked():
    for rank_result in run_spawned(_tp_worker, 2):
        for key, (got_loss, want_loss, got, want) in rank_result.items():
            assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL), key
            _assert_grads_close(got, want)


def _dp_worker(rank: int, state_path: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    batch = _batch(branching_sequences())
    # Rank 0 takes 11 sequences, rank 1 the last 4: different numbers of trees.
    rows = slice(0, 11) if rank == 0 else slice(11, None)
    local = {k: v[rows] for k, v in batch.items()}
    model = _build("tree", False, state=torch.load(state_path))
    dp_group = ps.get_data_parallel_group()
    result = _tree_step(model, local, False, dp_group=dp_group)
    grads = _grads(model)
    for g in grads.values():  # what Megatron DDP does: average over data-parallel ranks
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=dp_group)
    loss = result.loss.clone()
    dist.all_reduce(loss, group=dp_group)
    return {"trees": result.num_micro_batches, "dummies": result.num_dummy_trees, "loss": float(loss), "grads": grads}


def test_data_parallel_2_with_uneven_trees_equals_unpacked(world, tmp_path):
    reference = _build("reference", False)
    want_loss = _reference_step(reference, _batch(branching_sequences()), False)
    torch.save(reference.state_dict(), tmp_path / "state.pt")
    ranks = run_spawned(_dp_worker, 2, str(tmp_path / "state.pt"), tp=1)
    assert ranks[0]["trees"] == ranks[1]["trees"]
    assert ranks[1]["dummies"] > 0  # rank 1 ran dummy trees to stay in step
    for r in ranks:
        assert r["loss"] == pytest.approx(float(want_loss), rel=LOSS_RTOL)
        _assert_grads_close(r["grads"], _grads(reference))


def _pp_worker(rank: int, state_path: str, critic: bool) -> dict:
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    per_stage = NUM_LAYERS // ps.get_pipeline_model_parallel_world_size()
    model = _build("tree", critic)
    full = torch.load(state_path)
    mine = {n: full[stage_parameter_name(n, stage * per_stage)] for n in model.state_dict()}
    model.load_state_dict(mine)
    result = _tree_step(model, _batch(branching_sequences()), critic, pad_to_max=True)
    grads = {stage_parameter_name(n, stage * per_stage): g for n, g in _grads(model).items()}
    return {"loss": None if result.loss is None else float(result.loss), "grads": grads}


@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
def test_pipeline_parallel_2_equals_unpacked(world, tmp_path, critic):
    reference = _build("reference", critic)
    want_loss = _reference_step(reference, _batch(branching_sequences()), critic)
    torch.save(reference.state_dict(), tmp_path / "state.pt")
    first, last = run_spawned(_pp_worker, 2, str(tmp_path / "state.pt"), critic, pp=2, tp=1)
    assert first["loss"] is None
    assert last["loss"] == pytest.approx(float(want_loss), rel=LOSS_RTOL)
    want = _grads(reference)
    got = {**first["grads"], **last["grads"]}
    _assert_grads_close(got, want)


def test_pipeline_parallel_needs_constant_shapes(world):
    from megatron.core import parallel_state as ps

    original = ps.get_pipeline_model_parallel_world_size
    ps.get_pipeline_model_parallel_world_size = lambda *a, **k: 2
    try:
        with pytest.raises(ValueError, match="pad_to_max=False gives trees of different lengths"):
            _tree_step(_build("tree", False), _batch(branching_sequences()), False, pad_to_max=False)
    finally:
        ps.get_pipeline_model_parallel_world_size = original


def test_step_errors(world):
    tree = _build("tree", critic=False)
    batch = _batch(branching_sequences())
    with pytest.raises(ValueError, match="loss_fn is required for a training step"):
        tree_forward_backward(tree, batch, None, max_tokens_per_mb=64, block_size=16)
    with pytest.raises(ValueError, match=r"loss_fn must return a per-token loss of shape \[\d+\]"):
        tree_forward_backward(
            tree, batch, lambda outputs, mb: outputs["logprobs"].sum(), max_tokens_per_mb=64, block_size=16
        )


def test_loss_weights_by_hand():
    from megatron_tree.train_step import loss_weights

    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    token = loss_weights(mask, normalization="token")
    assert torch.allclose(token, mask / 2.5)
    # Sequence mean over the two sequences that have loss tokens; the empty one takes no part,
    # and a fractional mask is normalized by its own sum.
    seq = loss_weights(mask, normalization="sequence")
    expected = torch.tensor([[0.25, 0.25, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    assert torch.allclose(seq, expected)


def test_value_head_through_wrappers(world):
    from megatron_tree.mcore.value_head import ValueHead, attach_value_head

    class Wrapper(torch.nn.Module):  # stands in for Float16Module / DDP: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    wrapped = Wrapper(_build("tree", critic=False))
    assert attach_value_head(wrapped) is wrapped
    assert isinstance(wrapped.module.output_layer, ValueHead)
    with pytest.raises(ValueError, match="needs a GPTModel .optionally wrapped., got Linear"):
        attach_value_head(torch.nn.Linear(2, 2))
