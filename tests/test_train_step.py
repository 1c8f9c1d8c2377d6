"""The tree-packed training step against the unpacked per-sequence step (actor and critic).

The reference is independent of the tree code: Megatron's stock GPTModel (local spec, causal mask,
positions 0..L-1) on each sequence alone, full-vocab float64 log-softmax, the same per-token loss
and the token-mean normalization written out here. Parallel layouts run in spawned gloo worlds.
"""

from __future__ import annotations

import pytest
import torch

from harness.dist import run_spawned
from harness.models import (
    RECOMPUTE_MODES,
    VOCAB,
    branching_sequences,
    build_gpt_model,
    long_context_sequences,
    recompute_fields,
    small_gpt_config,
)
from megatron_tree.core.heads import LogProbs, Values
from megatron_tree.core.losses import ppo_clipped_loss, value_loss
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.mcore.step import PackingConfig, tree_forward_backward
from megatron_tree.testing.reference import (
    gradient_errors,
    parameter_grads,
    stage_parameter_name,
    unpacked_reference_step,
)
from megatron_tree.testing.synthetic import rl_batch
from megatron_tree.testing.tolerances import GRAD_RTOL, LOSS_RTOL

NUM_LAYERS = 4


def _config(recompute: str = "none", **overrides):
    from megatron.core import parallel_state as ps

    return small_gpt_config(
        num_layers=NUM_LAYERS,
        gated_linear_unit=False,
        add_qkv_bias=True,
        init_method_std=0.15,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        **recompute_fields(recompute),
        **overrides,
    )


def _build(
    kind: str,
    critic: bool,
    recompute: str = "none",
    state: dict | None = None,
    backend: str = "block_sparse",
):
    """kind: "tree" (tree attention + depth RoPE) or "reference" (stock GPTModel)."""
    model = build_gpt_model(
        _config(recompute),
        tree=kind == "tree",
        vocab_size=VOCAB,
        critic=critic,
        backend=backend,
        block_size=16,
    )
    if state is not None:
        model.load_state_dict(state)
    return model


def _batch(seqs: list[torch.Tensor]) -> dict:
    # Rolled loss mask: entries about tokens 6.. of each sequence (a "response"), none at the end.
    return rl_batch(seqs, response_start=5)


def _loss_fn(critic: bool):
    if critic:
        return value_loss
    return lambda outputs, mb: ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)


def _reference_step(model, batch: dict, critic: bool) -> torch.Tensor:
    """Per-sequence unpacked forward + backward with the stock model; the token-mean loss."""
    return unpacked_reference_step(model, batch, _loss_fn(critic), critic=critic)


def _tree_step(model, batch: dict, critic: bool, **kwargs):
    from megatron.core import parallel_state as ps

    packing = {} if not isinstance(batch, dict) else dict(max_tokens_per_mb=64, block_size=16)
    packing.update({k: kwargs.pop(k) for k in ("pad_to_max",) if k in kwargs})
    return tree_forward_backward(
        model,
        batch,
        _loss_fn(critic),
        gather=Values() if critic else LogProbs(),
        tp_group=ps.get_tensor_model_parallel_group(),
        **packing,  # max_tokens_per_mb=64: several trees, so micro-batch normalization is exercised
        **kwargs,
    )


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
    return float(result.loss), float(want_loss), parameter_grads(tree), parameter_grads(reference)


# ----------------------------------------------------------------------------- TP = 1, in process


@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_step_equals_unpacked_step(world, critic, recompute):
    got_loss, want_loss, got, want = _compare_tree_to_reference(critic, recompute)
    assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    _assert_grads_close(got, want)


def test_unshared_micro_batches_run_causal_attention_and_equal_unpacked(world, caplog):
    """With backend "auto", micro-batches whose sequences share nothing run the dense causal
    kernel (counted in the step's log line), the others a tree kernel; the step equals the
    unpacked one either way."""
    g = torch.Generator().manual_seed(3)
    unshared = [
        torch.cat([torch.tensor([100 + i]), torch.randint(1, 90, (n,), generator=g)])
        for i, n in enumerate((20, 9, 27, 14))
    ]
    batch = _batch(branching_sequences() + unshared)
    reference = _build("reference", critic=False)
    want_loss = _reference_step(reference, batch, critic=False)
    tree = _build("tree", False, state=reference.state_dict(), backend="auto")
    with caplog.at_level("INFO", logger="megatron_tree.mcore.step"):
        result = _tree_step(tree, batch, critic=False)
    chains = [mb["rows"].chains for mb in result.packed]
    assert any(c is None for c in chains) and any(c for c in chains)
    assert f"causal_micro_batches={sum(c is not None for c in chains)}" in caplog.text
    assert float(result.loss) == pytest.approx(float(want_loss), rel=LOSS_RTOL)
    _assert_grads_close(parameter_grads(tree), parameter_grads(reference))


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
    # The normalizations differ; written so that a NaN loss fails (NaN != x is True).
    assert abs(float(seq.loss) - float(token.loss)) > 1e-3 * abs(float(token.loss))
    with pytest.raises(ValueError, match="normalization='batch' must be one of"):
        _tree_step(tree, batch, False, normalization="batch")


# ----------------------------------------------------------------------------- spawned worlds


def _dropout_output(rank: int) -> torch.Tensor:
    """Tree core attention with dropout on the same inputs on every TP rank."""
    from megatron.core.transformer.enums import AttnMaskType

    from harness.models import pack
    from megatron_tree.core.mask import tree_attention_mask
    from megatron_tree.mcore.core_attention import TreeCoreAttention

    tree = pack(branching_sequences())[0]["tree"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tree.padded_length, 1, 2, 16, generator=g)
    kv = torch.randn(tree.padded_length, 1, 1, 16, generator=g)
    config = small_gpt_config(tensor_model_parallel_size=2, attention_dropout=0.5)
    module = TreeCoreAttention(
        config, 1, AttnMaskType.arbitrary, "self", backend="block_sparse", block_size=16
    )
    return module.train()(q, kv, kv, tree_attention_mask(tree))


def _tp_worker(rank: int) -> dict:
    out = {}
    for critic, recompute in [(False, "none"), (False, "selective"), (True, "full")]:
        got_loss, want_loss, got, want = _compare_tree_to_reference(critic, recompute)
        out[(critic, recompute)] = (got_loss, want_loss, got, want)
    out["dropout"] = _dropout_output(rank)
    return out


def test_tensor_parallel_2_equals_unpacked():
    ranks = run_spawned(_tp_worker, 2)
    dropout = [rank_result.pop("dropout") for rank_result in ranks]
    for rank_result in ranks:
        for key, (got_loss, want_loss, got, want) in rank_result.items():
            assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL), key
            _assert_grads_close(got, want)
    # The TP ranks hold different heads, so their attention dropout must differ: each draws from
    # its own model-parallel RNG state (seed + 2718 + tp_rank), not the shared default generator.
    assert not torch.equal(dropout[0], dropout[1])


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
    grads = parameter_grads(model)
    for g in grads.values():  # what Megatron DDP does: average over data-parallel ranks
        dist.all_reduce(g, op=dist.ReduceOp.AVG, group=dp_group)
    loss = result.loss.clone()
    dist.all_reduce(loss, group=dp_group)
    return {
        "trees": result.num_micro_batches,
        "dummies": result.packed.num_dummy_trees,
        "loss": float(loss),
        "grads": grads,
    }


def test_data_parallel_2_with_uneven_trees_equals_unpacked(world, tmp_path):
    reference = _build("reference", False)
    want_loss = _reference_step(reference, _batch(branching_sequences()), False)
    torch.save(reference.state_dict(), tmp_path / "state.pt")
    ranks = run_spawned(_dp_worker, 2, str(tmp_path / "state.pt"), tp=1)
    assert ranks[0]["trees"] == ranks[1]["trees"]
    assert ranks[1]["dummies"] > 0  # rank 1 ran dummy trees to stay in step
    for r in ranks:
        assert r["loss"] == pytest.approx(float(want_loss), rel=LOSS_RTOL)
        _assert_grads_close(r["grads"], parameter_grads(reference))


# Each pipeline test runs two batches: the branching trie cut into trees (Megatron's schedule
# once), and a long shared history plus a long sequence with trunk reuse (the default): chains of
# trunk parts, a no-grad trunk pass, the branches, then the trunk parts recomputed last part first.
PIPELINE_CASES = [("branching", {"share_trunks": False}), ("long_context", {})]


def _pipeline_batch(name: str) -> dict:
    return _batch(branching_sequences() if name == "branching" else long_context_sequences())


def _pp_worker(rank: int, state_path: str, critic: bool, recompute: str) -> list[dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    per_stage = NUM_LAYERS // ps.get_pipeline_model_parallel_world_size()
    model = _build("tree", critic, recompute)
    full = torch.load(state_path)
    mine = {n: full[stage_parameter_name(n, stage * per_stage)] for n in model.state_dict()}
    out = []
    for name, kwargs in PIPELINE_CASES:
        model.load_state_dict(mine)
        model.zero_grad(set_to_none=True)
        result = _tree_step(model, _pipeline_batch(name), critic, pad_to_max=True, **kwargs)
        grads = {
            stage_parameter_name(n, stage * per_stage): g for n, g in parameter_grads(model).items()
        }
        for g in grads.values():  # Megatron DDP averages over the data x context parallel ranks
            dist.all_reduce(
                g,
                op=dist.ReduceOp.AVG,
                group=ps.get_data_parallel_group(with_context_parallel=True),
            )
        out.append(
            {
                "loss": None if result.loss is None else float(result.loss),
                "grads": grads,
                "trunk_parts": sum(mb["rows"].records for mb in result.packed),
            }
        )
    return out


def _pipeline_references(critic: bool, path) -> list[tuple[float, dict]]:
    reference = _build("reference", critic)
    torch.save(reference.state_dict(), path)
    wants = []
    for name, _ in PIPELINE_CASES:
        reference.zero_grad(set_to_none=True)
        loss = float(_reference_step(reference, _pipeline_batch(name), critic))
        wants.append((loss, parameter_grads(reference)))
    return wants


def _check_pipeline(first: list[dict], last: list[dict], wants) -> None:
    for (want_loss, want), a, b in zip(wants, first, last):
        assert a["loss"] is None
        assert b["loss"] == pytest.approx(want_loss, rel=LOSS_RTOL)
        got = {**a["grads"], **b["grads"]}
        assert len(got) == len(want)
        _assert_grads_close(got, want)
    assert first[0]["trunk_parts"] == 0 and first[1]["trunk_parts"] == 5  # 3 + 2 chain parts


# The actor runs with full recompute: 1F1B keeps several micro-batches in flight, and each
# recomputation must use its own micro-batch's mask plan.
@pytest.mark.parametrize(
    "critic,recompute", [(False, "full"), (True, "none")], ids=["actor", "critic"]
)
def test_pipeline_parallel_2_equals_unpacked(world, tmp_path, critic, recompute):
    wants = _pipeline_references(critic, tmp_path / "state.pt")
    first, last = run_spawned(
        _pp_worker, 2, str(tmp_path / "state.pt"), critic, recompute, pp=2, tp=1
    )
    _check_pipeline(first, last, wants)


@pytest.mark.slow
def test_context_parallel_2_x_pipeline_parallel_2_equals_unpacked(world, tmp_path):
    """CP=2 x PP=2 (4 ranks): each stage's micro-batches are CP shares of their trees (Megatron's
    p2p shapes are the tree length over CP), with and without trunk reuse."""
    wants = _pipeline_references(False, tmp_path / "state.pt")
    ranks = run_spawned(_pp_worker, 4, str(tmp_path / "state.pt"), False, "none", pp=2, cp=2, tp=1)
    first, last = ranks[0], ranks[-1]  # stage 0 (CP rank 0) and stage 1 (CP rank 1)
    _check_pipeline(first, last, wants)


def _vpp_worker(rank: int, state_path: str, critic: bool) -> list[dict]:
    """PP=2 x VPP=2 over 4 layers: chunk c of stage s holds layer 2c + s."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    full = torch.load(state_path)
    chunks, names = [], {}
    for vp_stage in range(2):
        config = _config(virtual_pipeline_model_parallel_size=2)
        model = build_gpt_model(
            config,
            tree=True,
            vocab_size=VOCAB,
            critic=critic,
            backend="block_sparse",
            block_size=16,
            vp_stage=vp_stage,
        )
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        names.update({(vp_stage, n): stage_parameter_name(n, offset) for n in model.state_dict()})
        chunks.append(model)
    out = []
    for name, kwargs in PIPELINE_CASES:
        for c, chunk in enumerate(chunks):
            chunk.load_state_dict({n: full[names[(c, n)]] for n in chunk.state_dict()})
            chunk.zero_grad(set_to_none=True)
        # 3 trees (branching): not a multiple of PP, so the step adds a fill-in tree for the
        # interleaved schedule; the trunk batch's calls get theirs too.
        result = _tree_step(chunks, _pipeline_batch(name), critic, pad_to_max=True, **kwargs)
        grads = {
            names[(c, n)]: g
            for c, chunk in enumerate(chunks)
            for n, g in parameter_grads(chunk).items()
        }
        for g in grads.values():  # Megatron DDP averages over the data x context parallel ranks
            dist.all_reduce(
                g,
                op=dist.ReduceOp.AVG,
                group=ps.get_data_parallel_group(with_context_parallel=True),
            )
        out.append(
            {
                "loss": None if result.loss is None else float(result.loss),
                "grads": grads,
                "trees": result.num_micro_batches,
                "trunk_parts": sum(mb["rows"].records for mb in result.packed),
            }
        )
    return out


@pytest.mark.slow
def test_virtual_pipeline_2x2_x_context_parallel_2_equals_unpacked(world, tmp_path):
    """PP=2 x VPP=2 x CP=2 (4 ranks): the interleaved schedule's fill-in tree (3 trees, PP 2) is a
    CP share like the others, and so are the trunk calls' fill-ins."""
    wants = _pipeline_references(False, tmp_path / "state.pt")
    ranks = run_spawned(_vpp_worker, 4, str(tmp_path / "state.pt"), False, pp=2, tp=1, vpp=2, cp=2)
    assert ranks[0][0]["trees"] % 2 == 1
    _check_pipeline(ranks[0], ranks[-1], wants)


@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
def test_virtual_pipeline_2x2_equals_unpacked(world, tmp_path, critic):
    wants = _pipeline_references(critic, tmp_path / "state.pt")
    first, last = run_spawned(_vpp_worker, 2, str(tmp_path / "state.pt"), critic, pp=2, tp=1, vpp=2)
    assert first[0]["trees"] % 2 == 1  # the fill-in tree is the step's, not the packed batch's
    _check_pipeline(first, last, wants)


def test_pipeline_parallel_needs_constant_shapes(world):
    from megatron.core import parallel_state as ps

    original = ps.get_pipeline_model_parallel_world_size
    ps.get_pipeline_model_parallel_world_size = lambda *a, **k: 2
    try:
        with pytest.raises(ValueError, match="pad_to_max=False gives trees of different lengths"):
            _tree_step(
                _build("tree", False), _batch(branching_sequences()), False, pad_to_max=False
            )
    finally:
        ps.get_pipeline_model_parallel_world_size = original


def test_step_errors(world):
    tree = _build("tree", critic=False)
    batch = _batch(branching_sequences())
    with pytest.raises(ValueError, match="loss_fn is required for a training step"):
        tree_forward_backward(tree, batch, None, max_tokens_per_mb=64, block_size=16)
    with pytest.raises(ValueError, match=r"loss_fn must return a per-token loss of shape \[\d+\]"):
        tree_forward_backward(
            tree,
            batch,
            lambda outputs, mb: outputs["logprobs"].sum(),
            max_tokens_per_mb=64,
            block_size=16,
        )
    with pytest.raises(ValueError, match="got 2 model chunks but the virtual pipeline size is 1"):
        tree_forward_backward(
            [tree, tree], batch, _loss_fn(False), max_tokens_per_mb=64, block_size=16
        )
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=64, block_size=16)
    with pytest.raises(ValueError, match=r"packing applies to an unpacked batch"):
        tree_forward_backward(
            tree, packed, _loss_fn(False), packing=PackingConfig(max_tokens_per_mb=64)
        )


def test_a_loss_without_gradient_is_refused(world):
    """A loss_fn returning a detached tensor would train nothing: refused, not silently skipped
    (on whole trees and on trunk groups alike)."""
    model = _build("tree", critic=False)
    batch = _batch(branching_sequences())
    for share_trunks in (False, True):
        packed = build_packed_tree_batch(
            batch, max_tokens_per_mb=48, block_size=16, share_trunks=share_trunks
        )
        assert any(mb.rows.group is not None for mb in packed) == share_trunks
        with pytest.raises(ValueError, match="without a gradient"):
            tree_forward_backward(model, packed, lambda out, mb: ppo_clipped_loss(out, mb).detach())


def test_head_misuse_fails_before_the_forward(world):
    """A head that cannot give what the loss reads, or no head instance, is refused before the
    model runs (not as a KeyError / TypeError after the forward)."""
    model = _build("tree", critic=False)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    packed = build_packed_tree_batch(
        _batch(branching_sequences()), max_tokens_per_mb=64, block_size=16
    )
    with pytest.raises(
        ValueError, match=r"reads outputs\['entropy'\].*gather=LogProbs\(entropy=True\)"
    ):
        tree_forward_backward(model, packed, _loss_fn(False), gather=LogProbs(entropy=False))
    for gather in (LogProbs, "logprobs"):
        with pytest.raises(ValueError, match="is not a head: pass an instance"):
            tree_forward_backward(model, packed, _loss_fn(False), gather=gather)
    assert not calls


def test_forward_only_log_line_has_no_loss(world):
    model = _build("tree", critic=False)
    packed = build_packed_tree_batch(
        _batch(branching_sequences()), max_tokens_per_mb=64, block_size=16
    )
    result = tree_forward_backward(model, packed, forward_only=True)
    assert result.loss is None
    assert "loss=n/a (forward only)" in result.log_line()
    assert "loss=0.000000" not in result.log_line()


def test_one_pad_to_max_default():
    """The packer and the step decide pad_to_max in one place: False unless the layout needs
    constant shapes (a padded 417-token batch was 16,384 rows with the packer's old default)."""
    batch = _batch(branching_sequences())
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=1024, block_size=16)
    assert packed.num_padded_tokens < 1024
    assert (
        PackingConfig(max_tokens_per_mb=1024).resolve(constant_shapes=None, align=1)["pad_to_max"]
        is False
    )
    assert (
        PackingConfig(max_tokens_per_mb=1024).resolve(constant_shapes="PP", align=1)["pad_to_max"]
        is True
    )
    with pytest.raises(ValueError, match="pad_to_max=False gives trees of different lengths"):
        PackingConfig(max_tokens_per_mb=1024, pad_to_max=False).resolve(
            constant_shapes="pipeline parallelism", align=1
        )


def test_bad_inputs_fail_before_the_forward(world):
    """Each bad input gets a ValueError naming it, before the model runs."""
    model = _build("tree", critic=False)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    batch = _batch(branching_sequences())

    def step(b, **kw):
        return tree_forward_backward(
            model, b, _loss_fn(False), max_tokens_per_mb=64, block_size=16, **kw
        )

    with pytest.raises(
        ValueError, match=r"data\['loss_mask'\] must be a tensor shaped \[B, L, ...\]"
    ):
        step({**batch, "loss_mask": batch["loss_mask"][:, :-1]})
    too_big = batch["input_ids"].clone()
    too_big[3, 2] = VOCAB
    with pytest.raises(
        ValueError, match=rf"token id {VOCAB} .* outside the model's vocabulary \[0, {VOCAB}\)"
    ):
        step({**batch, "input_ids": too_big})
    with pytest.raises(ValueError, match=rf"token id {VOCAB} .*pad_token_id included"):
        tree_forward_backward(
            model,
            build_packed_tree_batch(batch, max_tokens_per_mb=64, block_size=16, pad_token_id=VOCAB),
            _loss_fn(False),
        )
    # A rolled loss mask is 0 at each sequence's last entry (it predicts no token); a 1 there is
    # what an unrolled mask looks like.
    unrolled = batch["loss_mask"].clone()
    lengths = batch["attention_mask"].sum(1)
    unrolled[torch.arange(len(lengths)), lengths - 1] = 1
    with pytest.raises(ValueError, match="loss_mask is nonzero at a sequence's last entry"):
        step({**batch, "loss_mask": unrolled})
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got True"):
        LogProbs(temperature=True)
    assert calls == []


def test_pack_once_step_many_equals_padded_steps(world):
    """The RL flow on one packed batch (old log-probs attached in tree layout, then two steps)
    gives the padded-batch path's loss and gradients, and the forward-only outputs match their
    [B, L] merge."""
    batch = _batch(branching_sequences())
    model = _build("tree", critic=False)
    packed = build_packed_tree_batch(
        {k: v for k, v in batch.items() if k != "old_logprobs"}, max_tokens_per_mb=64, block_size=16
    )
    old = tree_forward_backward(model, packed, None, forward_only=True, collect_outputs=True)
    packed.attach("old_logprobs", [lp - 0.05 for lp in old.tree_outputs["logprobs"]])
    merged = old.merged_outputs(max_seq_len=batch["input_ids"].shape[1])["logprobs"]
    padded = {**batch, "old_logprobs": merged - 0.05}
    for _ in range(2):
        model.zero_grad()
        got = _tree_step(model, packed, False)
        got_grads = parameter_grads(model)
        model.zero_grad()
        want = _tree_step(model, padded, False)
        assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
        _assert_grads_close(got_grads, parameter_grads(model))


def test_megatron_divides_in_per_token_mode(world):
    """With calculate_per_token_loss and a finalize_model_grads_func (Megatron DDP's setup) the step
    returns loss sums and token counts and Megatron's finalize divides the gradients: still the
    unpacked batch's gradients. Without per-token mode such a setup is refused."""
    batch = _batch(branching_sequences())
    reference = _build("reference", False)
    _reference_step(reference, batch, False)
    model = _build("tree", False, state=reference.state_dict())
    seen = []

    def finalize(chunks, num_tokens, *args, **kwargs):  # what Megatron's finalize_model_grads does
        seen.append(int(num_tokens))
        for chunk in chunks:
            for p in chunk.parameters():
                p.grad /= num_tokens

    model.config.finalize_model_grads_func = finalize
    try:
        with pytest.raises(ValueError, match="set config.calculate_per_token_loss=True"):
            _tree_step(model, batch, False)
        model.config.calculate_per_token_loss = True
        result = _tree_step(model, batch, False)
    finally:
        model.config.finalize_model_grads_func = None
        model.config.calculate_per_token_loss = False
    assert seen == [int(batch["loss_mask"].sum())]
    _assert_grads_close(parameter_grads(model), parameter_grads(reference))
    assert float(result.loss) == pytest.approx(
        float(unpacked_reference_step(reference, batch, _loss_fn(False), backward=False)),
        rel=LOSS_RTOL,
    )


def test_unpacked_reference_is_independent_of_the_tree_code(world, monkeypatch):
    """The reference must not call packing, masks, tree attention or the tree gathers."""
    import megatron_tree.core.attention as attention
    import megatron_tree.core.logprobs as logprobs
    import megatron_tree.core.mask as mask
    import megatron_tree.core.packing as packing
    import megatron_tree.core.results as results

    def forbidden(*args, **kwargs):
        raise AssertionError("the unpacked reference called tree code")

    for module, names in [
        (packing, ["build_packed_tree_batch", "layout_tree"]),
        (
            mask,
            [
                "allowed",
                "build_attention_mask_from_trie",
                "tree_attention_mask",
                "block_sparse_plan",
                "build_block_mask_from_trie",
            ],
        ),
        (attention, ["tree_attention"]),
        (logprobs, ["gather_packed_tree_logprobs", "gather_packed_tree_logprobs_entropy"]),
        (results, ["gather_packed_tree_values", "merge_packed_tree_results"]),
    ]:
        for name in names:
            monkeypatch.setattr(module, name, forbidden)
    batch = _batch(branching_sequences())
    for critic in (False, True):
        loss = _reference_step(_build("reference", critic), batch, critic)
        assert torch.isfinite(loss)
    with pytest.raises(AssertionError, match="called tree code"):  # the patches do bite
        _tree_step(_build("tree", False), batch, False)


def test_loss_weights_by_hand():
    from megatron_tree.core.losses import loss_weights

    # Three sequences of lengths 3, 3, 3 in tree layout.
    cu_seqlens = torch.tensor([0, 3, 6, 9])
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0])
    token, count = loss_weights(mask, cu_seqlens, normalization="token")
    assert torch.equal(token, mask.double()) and float(count) == 2.5
    # Sequence mean over the two sequences that have loss tokens; the empty one takes no part,
    # and a fractional mask is normalized by its own sum.
    seq, count = loss_weights(mask, cu_seqlens, normalization="sequence")
    assert torch.allclose(seq, torch.tensor([0.5, 0.5, 0, 0, 0, 0, 1.0, 0, 0], dtype=torch.float64))
    assert float(count) == 2.0
    with pytest.raises(ValueError, match="normalization='batch' must be one of"):
        loss_weights(mask, cu_seqlens, normalization="batch")


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


def test_ppo_kl_term_by_hand():
    """k3 KL estimate against a hand computation: r = ref - logp, exp(r) - r - 1 per token."""
    logp = torch.tensor([-1.0, -2.0, -0.5])
    mb = {
        "old_logprobs": logp.clone(),
        "advantages": torch.zeros(3),
        "ref_logprobs": torch.tensor([-1.5, -2.0, 0.0]),
    }
    got = ppo_clipped_loss({"logprobs": logp}, mb, kl_coef=0.5)
    r = torch.tensor([-0.5, 0.0, 0.5])
    want = 0.5 * torch.tensor([torch.exp(x) - x - 1 for x in r])
    assert torch.allclose(got, want)
    with pytest.raises(ValueError, match="attach them as 'ref_logprobs'"):
        ppo_clipped_loss(
            {"logprobs": logp}, {k: v for k, v in mb.items() if k != "ref_logprobs"}, kl_coef=0.5
        )


def test_overlapped_moe_preprocessing_is_refused(world):
    """Megatron's fine-grained MoE overlap calls the model's preprocessing outside its forward,
    where the rotary table would follow packed offsets: refused by name."""
    model = _build("tree", critic=False)
    packed = build_packed_tree_batch(
        _batch(branching_sequences()), max_tokens_per_mb=64, block_size=16
    )
    model.config.overlap_moe_expert_parallel_comm = True
    try:
        with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm=True"):
            tree_forward_backward(model, packed, forward_only=True)
    finally:
        model.config.overlap_moe_expert_parallel_comm = False


def test_removed_trunk_options_name_the_replacement(world):
    model = _build("tree", critic=False)
    packed = build_packed_tree_batch(
        _batch(branching_sequences()), max_tokens_per_mb=64, block_size=16
    )
    with pytest.raises(ValueError, match="recompute_trunks=False .* was removed"):
        tree_forward_backward(model, packed, forward_only=True, recompute_trunks=False)
    with pytest.warns(DeprecationWarning, match="trunk parts are always recomputed"):
        tree_forward_backward(model, packed, forward_only=True, recompute_trunks=True)
