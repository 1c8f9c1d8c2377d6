"""Bad or unusual inputs: refused with a ValueError naming them, or handled as documented.

Each numerical test compares against an independent run: the same step with the bad entry
replaced by 0 (a zero-weight token's inputs must not matter), or the same batch given as torch
tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.models import (
    VOCAB,
    branching_sequences,
    build_gpt_model,
    small_gpt_config,
    trunk_sequences,
)
from megatron_tree.core.heads import LogProbs, Values
from megatron_tree.core.losses import ppo_clipped_loss, value_loss
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.mcore.step import tree_forward_backward
from megatron_tree.testing.reference import parameter_grads
from megatron_tree.testing.synthetic import rl_batch

PACKING = dict(max_tokens_per_mb=64, block_size=16)


def _model(critic: bool = False):
    return build_gpt_model(
        small_gpt_config(init_method_std=0.15),
        tree=True,
        vocab_size=VOCAB,
        critic=critic,
        backend="block_sparse",
        block_size=16,
    )


def _ppo(outputs, mb):
    return ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)


def _step(model, batch, loss_fn=_ppo, **kwargs):
    model.zero_grad()
    result = tree_forward_backward(model, batch, loss_fn, **{**PACKING, **kwargs})
    return result, parameter_grads(model)


def _no_forward(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


# ------------------------------------------------------------ 1. zero-weight tokens let nothing in


def _runs_trunk_reuse(packed) -> bool:
    """Whether some micro-batch is a trunk-reuse part (its ``rows`` belong to a trunk group)."""
    return any("part" in mb or getattr(mb.get("rows"), "group", None) is not None for mb in packed)


@pytest.mark.parametrize(
    "seqs,share_trunks",
    [(branching_sequences, False), (trunk_sequences, True)],
    ids=["trees", "trunk-reuse"],
)
def test_nonfinite_inputs_at_zero_weight_tokens_reach_neither_loss_nor_grads(
    world,
    seqs,
    share_trunks,
):
    batch = rl_batch(seqs(), response_start=5)
    lengths = batch["attention_mask"].sum(1)
    assert batch["loss_mask"][0, 0] == 0 and batch["loss_mask"][1, lengths[1] - 1] == 0
    bad = {k: v.clone() for k, v in batch.items()}
    bad["advantages"][0, 0] = float("nan")  # a prompt token
    bad["old_logprobs"][1, lengths[1] - 1] = float("-inf")  # a sequence's (rolled) last entry
    bad["advantages"][2, 1] = float("inf")
    zeroed = {k: v.clone() for k, v in batch.items()}
    zeroed["advantages"][0, 0] = 0
    zeroed["old_logprobs"][1, lengths[1] - 1] = 0
    zeroed["advantages"][2, 1] = 0
    model = _model()
    want, want_grads = _step(model, zeroed, share_trunks=share_trunks)
    got, got_grads = _step(model, bad, share_trunks=share_trunks)
    assert _runs_trunk_reuse(got.packed) == share_trunks
    assert torch.isfinite(got.loss) and float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, g in got_grads.items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_nonfinite_returns_at_zero_weight_tokens_leave_the_critic_finite(world):
    batch = rl_batch(branching_sequences(), response_start=5)
    bad, zeroed = dict(batch), dict(batch)
    bad["returns"], zeroed["returns"] = batch["returns"].clone(), batch["returns"].clone()
    bad["returns"][3, 2], zeroed["returns"][3, 2] = float("nan"), 0.0
    model = _model(critic=True)
    want, want_grads = _step(model, zeroed, value_loss, gather=Values())
    got, got_grads = _step(model, bad, value_loss, gather=Values())
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


# ------------------------------------------------------------ 2. loss_mask values


@pytest.mark.parametrize(
    "value,match",
    [
        (-1.0, r"loss_mask .*must be >= 0.*got -1"),
        (float("nan"), r"loss_mask .*NaN or inf"),
        (float("inf"), r"loss_mask .*NaN or inf"),
    ],
)
def test_negative_or_nonfinite_loss_mask_is_refused(world, value, match):
    batch = rl_batch(branching_sequences(), response_start=5)
    mask = batch["loss_mask"].clone()
    mask[4, 7] = value
    model = _model()
    calls = _no_forward(model)
    with pytest.raises(ValueError, match=match):
        tree_forward_backward(model, {**batch, "loss_mask": mask}, _ppo, **PACKING)
    packed = build_packed_tree_batch(batch, **PACKING).attach("loss_mask", mask)
    with pytest.raises(ValueError, match=match):
        tree_forward_backward(model, packed, _ppo)
    assert calls == []


# ------------------------------------------------------------ 3. numpy, lists, trailing dims


def _same_packing(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.inputs.keys() == y.inputs.keys()
        assert torch.equal(x.tree.input_ids, y.tree.input_ids)
        for k in ("input_ids", "position_ids", *x.inputs):
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def test_numpy_arrays_and_rectangular_lists_pack_like_tensors():
    batch = rl_batch(branching_sequences(), response_start=5)
    want = build_packed_tree_batch(batch, **PACKING)
    arrays = {k: v.numpy() for k, v in batch.items()}
    _same_packing(build_packed_tree_batch(arrays, **PACKING), want)
    lists = {k: v.tolist() for k, v in batch.items()}
    _same_packing(
        build_packed_tree_batch(lists, **PACKING),
        build_packed_tree_batch(
            {k: torch.as_tensor(v.tolist()) for k, v in batch.items()}, **PACKING
        ),
    )


def test_ragged_lists_and_non_arrays_are_refused_by_name():
    batch = rl_batch(branching_sequences(), response_start=5)
    ragged = [s.tolist() for s in branching_sequences()]
    with pytest.raises(ValueError, match=r"data\['input_ids'\] .*rows have different lengths.*pad"):
        build_packed_tree_batch({**batch, "input_ids": ragged}, **PACKING)
    with pytest.raises(ValueError, match=r"data\['advantages'\] .*rows have different lengths"):
        build_packed_tree_batch({**batch, "advantages": [[1.0, 2.0], [3.0]]}, **PACKING)
    with pytest.raises(ValueError, match=r"data\['advantages'\] must be a tensor"):
        build_packed_tree_batch({**batch, "advantages": "high"}, **PACKING)


def test_attach_reads_an_ndarray_as_the_padded_layout():
    batch = rl_batch(branching_sequences(), response_start=5)
    packed = build_packed_tree_batch({k: v for k, v in batch.items() if k != "returns"}, **PACKING)
    want = build_packed_tree_batch(batch, **PACKING)
    packed.attach("returns", batch["returns"].numpy())
    for got_mb, want_mb in zip(packed, want):
        assert torch.equal(got_mb["returns"], want_mb["returns"])
    packed.attach_padded({"returns2": batch["returns"].numpy()})
    packed.attach("returns3", [mb["returns"].numpy() for mb in want])  # tree layout, per tree
    for mb in packed:
        assert torch.equal(mb["returns2"], mb["returns"])
        assert torch.equal(mb["returns3"], mb["returns"])


def test_numpy_batch_steps_like_the_tensor_batch(world):
    batch = rl_batch(branching_sequences(), response_start=5)
    model = _model()
    want, want_grads = _step(model, batch)
    got, got_grads = _step(model, {k: v.numpy() for k, v in batch.items()})
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("key", ["advantages", "old_logprobs"])
def test_a_trailing_dim_on_a_per_token_input_is_blamed_on_the_input(world, key):
    batch = rl_batch(branching_sequences(), response_start=5)
    model = _model()
    match = (
        rf"micro_batch\['{key}'\] has shape \(\d+, 1\).*"
        r"\[B, L\] in the padded batch, \[T\] in tree layout.*squeeze"
    )
    with pytest.raises(ValueError, match=match):
        tree_forward_backward(model, {**batch, key: batch[key][..., None]}, _ppo, **PACKING)


def test_loss_functions_name_a_missing_or_misshapen_input():
    logp = torch.zeros(4)
    mb = {"old_logprobs": torch.zeros(4), "advantages": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"micro_batch\['advantages'\].*attach"):
        ppo_clipped_loss({"logprobs": logp}, {"old_logprobs": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"micro_batch\['ref_logprobs'\] has shape \(4, 1\)"):
        ppo_clipped_loss({"logprobs": logp}, {**mb, "ref_logprobs": torch.zeros(4, 1)}, kl_coef=0.1)
    match = r"micro_batch\['returns'\] has shape \(3,\), expected \[T\] = \(4,\)"
    with pytest.raises(ValueError, match=match):
        value_loss({"values": torch.zeros(4)}, {"returns": torch.zeros(3)})
    got = value_loss({"values": torch.ones(4)}, {"returns": torch.zeros(4)})
    assert torch.equal(got, torch.full((4,), 0.5))


# ------------------------------------------------------------ 4. bool flags


def test_check_bool():
    from megatron_tree.core.checks import check_bool

    assert check_bool("flag", True) is True and check_bool("flag", np.bool_(False)) is False
    assert check_bool("flag", None, optional=True) is None
    for bad in ("no", 1, 0, None, torch.tensor(True), 1.0):
        with pytest.raises(ValueError, match="flag must be True or False"):
            check_bool("flag", bad)


@pytest.mark.parametrize("flag", ["pad_to_max", "share_prefixes", "share_trunks", "balance_cost"])
def test_packing_bool_flags_are_type_checked(flag):
    batch = rl_batch(branching_sequences(), response_start=5)
    with pytest.raises(ValueError, match=rf"{flag} must be True or False.*, got 'no' \(str\)"):
        build_packed_tree_batch(batch, **PACKING, **{flag: "no"})


@pytest.mark.parametrize(
    "flag",
    [
        "forward_only",
        "collect_outputs",
        "dp_grad_average",
        "moe_stats",
        "pad_to_max",
        "share_prefixes",
        "share_trunks",
    ],
)
def test_step_bool_flags_are_type_checked(world, flag):
    batch = rl_batch(branching_sequences(), response_start=5)
    model = _model()
    calls = _no_forward(model)
    name = "grad_average" if flag == "dp_grad_average" else flag  # ProcessGroups.grad_average
    with pytest.raises(ValueError, match=rf"{name} must be True or False.*got 'no' \(str\)"):
        tree_forward_backward(model, batch, _ppo, **PACKING, **{flag: "no"})
    assert calls == []


# ------------------------------------------------------------ heads that cannot read the output


def test_log_probs_of_a_critic_and_values_of_an_actor_are_refused(world):
    """A value head's [1, N, 1] read as logits gave finite "log-probs" (some positive); logits read
    as values took one column of them. Both are refused before any loss is computed."""
    batch = rl_batch(branching_sequences())
    with pytest.raises(ValueError, match=r"width 1 \(a value head\?\): pass gather=Values\(\)"):
        _step(_model(critic=True), batch, _ppo, gather=LogProbs())
    # A loss reading values with a log-prob head: refused before the forward, naming the head.
    with pytest.raises(ValueError, match=r"reads outputs\['values'\].*gather=Values\(\)"):
        _step(_model(critic=True), batch, value_loss, gather=LogProbs())
    with pytest.raises(ValueError, match=r"attach a value head .*or use LogProbs\(\)"):
        _step(_model(), batch, value_loss, gather=Values())


def test_logits_narrower_than_the_batch_vocabulary_are_refused():
    """A TP shard's logits taken for the whole vocabulary (tp_group missing): the head knows the
    output width and the batch's largest id on the host."""
    head = LogProbs()
    shard = torch.zeros(1, 16, VOCAB // 2)
    with pytest.raises(
        ValueError, match=f"cover {VOCAB // 2} vocabulary entries .*token id {VOCAB - 1}"
    ):
        head.check_output(shard, None, VOCAB - 1)
    head.check_output(torch.zeros(1, 16, VOCAB), None, VOCAB - 1)  # the whole vocabulary: fine


def test_the_building_block_loop_on_a_part_names_the_rows_mask(world):
    """The README's hand-written loop on a trunk-packed batch: the tree's mask does not fit a
    part's rows, and the error says which mask does."""
    from megatron_tree.core.mask import tree_attention_mask

    packed = build_packed_tree_batch(
        rl_batch(trunk_sequences()), share_trunks=True, pad_to_max=False, **PACKING
    )
    part = next(mb for mb in packed if mb["rows"].group is not None and not mb["rows"].records)
    with pytest.raises(
        ValueError, match=r"tree_attention_mask\(micro_batch\['rows'\], store=\.\.\.\)"
    ):
        _model()(
            part["input_ids"],
            part["position_ids"],
            attention_mask=tree_attention_mask(part["tree"]),
        )
    with pytest.raises(ValueError, match="pass store=KeyValueStore"):
        tree_attention_mask(part["rows"])


def test_a_model_without_tree_attention_is_refused_by_the_step(world):
    """The stock GPTModel (causal core attention) would attend across the tree's branches: the step
    names its first layer's core attention before anything runs; the tree model passes."""
    stock = build_gpt_model(small_gpt_config(), tree=False, vocab_size=VOCAB)
    with pytest.raises(
        ValueError, match=r"decoder.layers.0.self_attention is a stock DotProductAttention"
    ):
        tree_forward_backward(stock, rl_batch(branching_sequences()), _ppo, **PACKING)
    _step(_model(), rl_batch(branching_sequences()))
