"""Trunk reuse in the training step: loss, every gradient and the outputs equal the unpacked
reference.

The batch (``trunk_sequences``) has prompt groups larger than the 64-token micro-batch: a trunk
holding a system prompt and two tasks, branches attached at the trunk's root and at its leaves, a
multi-turn chain, sequences ending inside the trunk and at a trunk leaf, a second trunk group and an
ordinary tree. The reference runs every sequence alone through the stock GPTModel.
"""

from __future__ import annotations

import types

import pytest
import torch

from harness.dist import run_spawned
from harness.models import (
    RECOMPUTE_MODES,
    VOCAB,
    build_gpt_model,
    long_context_sequences,
    recompute_fields,
    small_gpt_config,
    trunk_sequences,
)
from megatron_tree.core.heads import LogProbs, Values
from megatron_tree.core.losses import ppo_clipped_loss, value_loss
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.mcore.schedule import Phases
from megatron_tree.mcore.step import _check_dropout, tree_forward_backward
from megatron_tree.testing.reference import (
    finalize_sequence_parallel_grads,
    gradient_errors,
    parameter_grads,
    unpacked_reference_step,
)
from megatron_tree.testing.synthetic import rl_batch
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, LOSS_RTOL

# A branch missing the trunk's keys, a lost trunk gradient or a wrong depth moves gradients by
# >= 1e-2 relative.
CAPACITY = 64


def _build(
    tree: bool, critic: bool, recompute: str = "none", state: dict | None = None, **overrides
):
    from megatron.core import parallel_state as ps

    config = small_gpt_config(
        num_layers=3,
        gated_linear_unit=False,
        add_qkv_bias=True,
        init_method_std=0.15,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        **recompute_fields(recompute),
        **overrides,
    )
    model = build_gpt_model(
        config, tree=tree, vocab_size=VOCAB, critic=critic, backend="block_sparse", block_size=16
    )
    if state is not None:
        model.load_state_dict(state)
    return model


def _loss_fn(critic: bool):
    if critic:
        return value_loss
    return lambda outputs, mb: ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)


def _packed(batch: dict):
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=CAPACITY, block_size=16, pad_to_max=False, share_trunks=True
    )
    parts = [mb["rows"] for mb in packed if mb["rows"].group is not None]
    assert {p.group for p in parts} == {0, 1} and any(mb["rows"].group is None for mb in packed)
    return packed


def _chain_packed(batch: dict):
    """The long-context batch: the 150-token history as a chain of three trunk parts with its
    branches, and the 140-token sequence as a chain of its own (two trunk parts, one branch)."""
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=CAPACITY, block_size=16, pad_to_max=False, share_trunks=True
    )
    trunk_parts = {}
    for mb in packed:
        rows = mb["rows"]
        assert rows.group is not None and rows.num_real <= CAPACITY
        trunk_parts[rows.group] = trunk_parts.get(rows.group, 0) + rows.records
    assert sorted(trunk_parts.values()) == [2, 3], trunk_parts
    assert packed.num_tree_tokens == _unique_tokens(batch)
    return packed


def _unique_tokens(batch: dict) -> int:
    """Distinct prefixes of the batch's sequences: the single-trie token count, by brute force."""
    prefixes = set()
    for row, n in zip(batch["input_ids"].tolist(), batch["attention_mask"].sum(1).tolist()):
        prefixes.update(tuple(row[: d + 1]) for d in range(n))
    return len(prefixes)


def _step(model, batch, critic: bool, **kwargs):
    from megatron.core import parallel_state as ps

    kwargs.setdefault("tp_group", ps.get_tensor_model_parallel_group())
    return tree_forward_backward(
        model, batch, _loss_fn(critic), gather=Values() if critic else LogProbs(), **kwargs
    )


def _compare(
    critic: bool,
    recompute: str,
    sequence_parallel: bool = False,
    chains: bool = False,
    **step_kwargs,
):
    batch = rl_batch(long_context_sequences() if chains else trunk_sequences(), response_start=5)
    reference = _build(False, critic)
    want_outputs: dict = {}
    want_loss = unpacked_reference_step(
        reference, batch, _loss_fn(critic), critic=critic, outputs=want_outputs
    )
    model = _build(
        True, critic, recompute, state=reference.state_dict(), sequence_parallel=sequence_parallel
    )
    packed = _chain_packed(batch) if chains else _packed(batch)
    result = _step(model, packed, critic, collect_outputs=True, **step_kwargs)
    if sequence_parallel:
        finalize_sequence_parallel_grads(model)
    grads = parameter_grads(model), parameter_grads(reference)
    return float(result.loss), float(want_loss), *grads, result, want_outputs


def _assert_close(got_loss, want_loss, got, want):
    assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    errors = gradient_errors(got, want)
    assert errors and max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


def _assert_outputs_close(result, want_outputs: dict) -> None:
    merged = result.merged_outputs()
    for name, values in merged.items():
        for i, want in want_outputs.items():
            got = values[i, : want[name].shape[0]].double()
            assert torch.allclose(got, want[name].double(), atol=LOGP_TOL, rtol=0), (name, i)


@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_trunk_reuse_equals_unpacked(world, critic, recompute):
    got_loss, want_loss, got, want, result, want_outputs = _compare(critic, recompute)
    _assert_close(got_loss, want_loss, got, want)
    _assert_outputs_close(result, want_outputs)


@pytest.mark.parametrize("chains", [False, True], ids=["trunks", "chains"])
@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
def test_recomputed_trunks_equal_unpacked(world, critic, chains):
    """The one schedule on one stage (a no-grad trunk pass, the branches, then the trunk parts
    recomputed last part first through Megatron's schedule, as under pipeline parallelism): the
    same loss, gradients and outputs as the unpacked batch."""
    got_loss, want_loss, got, want, result, want_outputs = _compare(critic, "none", chains=chains)
    _assert_close(got_loss, want_loss, got, want)
    _assert_outputs_close(result, want_outputs)


@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_trunk_chains_equal_unpacked(world, critic, recompute):
    """A shared history longer than a micro-batch and a sequence longer than one run as chains of
    trunk parts (each attending to the parts before it), under activation recompute too: still
    the unpacked batch's loss, gradients and outputs."""
    got_loss, want_loss, got, want, result, want_outputs = _compare(critic, recompute, chains=True)
    _assert_close(got_loss, want_loss, got, want)
    _assert_outputs_close(result, want_outputs)


def test_trunk_is_computed_once(world):
    batch = rl_batch(trunk_sequences(), response_start=5)
    prefixes = {tuple(s[: i + 1].tolist()) for s in trunk_sequences() for i in range(len(s))}
    shared = _packed(batch)
    cut = build_packed_tree_batch(
        batch, max_tokens_per_mb=CAPACITY, block_size=16, pad_to_max=False, share_trunks=False
    )
    assert shared.num_tree_tokens == len(prefixes) < cut.num_tree_tokens
    assert shared.tree_token_ratio == pytest.approx(len(prefixes) / shared.num_real_tokens)


def test_forward_only_outputs_and_pack_once(world):
    """Old log-probs from a forward-only pass, attached to the packed batch, then a training
    step."""
    batch = rl_batch(trunk_sequences(), response_start=5)
    reference = _build(False, False)
    want_outputs: dict = {}
    unpacked_reference_step(reference, batch, _loss_fn(False), outputs=want_outputs, backward=False)
    model = _build(True, False, state=reference.state_dict())
    packed = _packed(batch)
    old = _step(model, packed, False, forward_only=True, collect_outputs=True)
    assert all(p.grad is None for p in model.parameters())
    _assert_outputs_close(old, want_outputs)
    packed.attach("old_logprobs", old.tree_outputs["logprobs"])
    result = _step(model, packed, False)
    # On-policy (old = current): the clipped ratio is 1 and the loss is -mean(advantage) plus the
    # entropy term, the same as the reference fed its own log-probs.
    batch["old_logprobs"] = torch.zeros_like(batch["old_logprobs"])
    for i, out in want_outputs.items():
        batch["old_logprobs"][i, : out["logprobs"].shape[0]] = out["logprobs"].float()
    reference.zero_grad()
    want = unpacked_reference_step(reference, batch, _loss_fn(False))
    _assert_close(
        float(result.loss), float(want), parameter_grads(model), parameter_grads(reference)
    )


def test_refusals(world):
    model = _build(True, False)
    with pytest.raises(ValueError, match="route_key='advantages' needs routers that replay"):
        _step(model, _packed(rl_batch(trunk_sequences())), False, route_key="advantages")
    packed = build_packed_tree_batch(
        rl_batch(trunk_sequences()),
        max_tokens_per_mb=CAPACITY,
        block_size=16,
        pad_to_max=False,
        share_trunks=True,
    )
    mbs = list(packed)
    dense = types.SimpleNamespace(hidden_dropout=0.0, attention_dropout=0.0)
    _check_dropout(dense, mbs, forward_only=False)
    dropout = types.SimpleNamespace(hidden_dropout=0.1, attention_dropout=0.0)
    _check_dropout(dropout, mbs, forward_only=True)
    with pytest.raises(ValueError, match="dropout 0.1"):
        _check_dropout(dropout, mbs, forward_only=False)
    first = next(i for i, mb in enumerate(mbs) if mb.rows.group is not None)
    phases = Phases.of(mbs)
    assert phases.trunks and not Phases.of([mb for mb in mbs if mb.rows.group is None]).trunks
    # Every micro-batch but the trunk parts in the middle phase; trunk parts recomputed last first.
    parts = [i for i, mb in enumerate(mbs) if mb.rows.records]
    assert phases.first == parts and sorted(phases.last) == parts
    assert phases.main == [i for i in range(len(mbs)) if i not in parts]
    with pytest.raises(ValueError, match="trunk parts first"):
        Phases.of(mbs[first + 1 :])
    with pytest.raises(ValueError, match="ends before"):
        Phases.of(mbs[: first + 2])


def _tp_worker(rank: int, sequence_parallel: bool) -> dict:
    out = {}
    for critic, recompute in [(False, "full"), (True, "none")]:
        got_loss, want_loss, got, want, _, _ = _compare(
            critic, recompute, sequence_parallel=sequence_parallel
        )
        out[(critic, recompute)] = (got_loss, want_loss, got, want)
    # tp_group=None means Megatron's TP group (it once read one vocabulary shard as the whole).
    got_loss, want_loss, got, want, _, _ = _compare(
        False, "none", sequence_parallel=sequence_parallel, tp_group=None
    )
    out["default tp_group"] = (got_loss, want_loss, got, want)
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_2_trunk_reuse_equals_unpacked(sequence_parallel):
    for rank_result in run_spawned(_tp_worker, 2, sequence_parallel):
        for value in rank_result.values():
            _assert_close(*value)


def test_a_trunk_that_does_not_pay_is_not_used():
    """Sequences sharing only a BOS token: a 1-token trunk would save a token per micro-batch and
    cost a whole padded micro-batch, so the packer keeps the cut plan. Below a 30-token prompt the
    trunk pays when parts pad to the alignment (32 + 5 x 48 rows against 5 x 64 cut), not when every
    micro-batch pads to the capacity (6 x 64 against 5 x 64)."""
    g = torch.Generator().manual_seed(3)
    seqs = [
        torch.cat([torch.tensor([1]), torch.randint(2, VOCAB, (n,), generator=g)])
        for n in (40, 50, 33, 61, 45)
    ]
    batch = rl_batch(seqs)
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=CAPACITY, block_size=16, share_trunks=True
    )
    assert len(packed) > 1 and not any(mb["rows"].group is not None for mb in packed)
    # The same trie below a 30-token shared prompt pays: trunk and branches.
    prompt = torch.randint(2, VOCAB, (30,), generator=g)
    seqs = [torch.cat([prompt, s[: 64 - 30]]) for s in seqs]
    packed = build_packed_tree_batch(
        rl_batch(seqs),
        max_tokens_per_mb=CAPACITY,
        block_size=16,
        share_trunks=True,
        pad_to_max=False,
    )
    assert [mb["rows"].index for mb in packed] == list(
        range(len(packed))
    ) and packed.num_padded_tokens == 272
    padded = build_packed_tree_batch(
        rl_batch(seqs),
        max_tokens_per_mb=CAPACITY,
        block_size=16,
        share_trunks=True,
        pad_to_max=True,
    )
    assert all(mb["rows"].group is None for mb in padded) and padded.num_padded_tokens == 5 * 64


def test_gradient_sync_waits_for_the_trunk_backward(world):
    """Megatron DDP's protocol: every backward but the step's last runs under ``no_sync`` (gradient
    reduction would start too early otherwise), the last is a trunk's (it adds the gradients the
    branches left on the trunk's keys and values), and ``finalize_model_grads`` divides by the
    global token count: still the unpacked batch's gradients."""
    import contextlib

    batch = rl_batch(trunk_sequences(), response_start=5)
    reference = _build(False, False)
    unpacked_reference_step(reference, batch, _loss_fn(False))
    model = _build(True, False, state=reference.state_dict())
    state = {"inside": False, "backwards": [], "tokens": []}

    @contextlib.contextmanager
    def no_sync():
        state["inside"] = True
        try:
            yield
        finally:
            state["inside"] = False

    def finalize(chunks, num_tokens, *args, **kwargs):
        state["tokens"].append(int(num_tokens))
        for p in chunks[0].parameters():
            p.grad /= num_tokens

    # The embedding's gradient hook fires once per backward that reaches the model's first layer.
    model.embedding.word_embeddings.weight.register_hook(
        lambda g: state["backwards"].append(state["inside"])
    )
    model.config.no_sync_func, model.config.finalize_model_grads_func = no_sync, finalize
    model.config.calculate_per_token_loss = True
    try:
        packed = _packed(batch)
        _step(model, packed, False)
    finally:
        model.config.no_sync_func = model.config.finalize_model_grads_func = None
        model.config.calculate_per_token_loss = False
    plain = sum(mb["rows"].group is None for mb in packed)
    branches = sum(mb["rows"].group is not None and not mb["rows"].is_trunk for mb in packed)
    trunks = sum(mb["rows"].group is not None and mb["rows"].is_trunk for mb in packed)
    assert state["backwards"] == [True] * (plain + branches + trunks - 1) + [False]
    assert packed[-1]["rows"].group is not None and state["tokens"] == [
        int(batch["loss_mask"].sum())
    ]
    _assert_close(0.0, 0.0, parameter_grads(model), parameter_grads(reference))
