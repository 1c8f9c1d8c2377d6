"""Sequence parallelism (TP=2, ``sequence_parallel=True``) for the actor and the critic: the tree
step equals the unpacked per-sequence step.

The tree model runs with sequence parallelism on the local spec (its torch norms allowed by the CPU
runtime patch, the value head gathering the sequence-sharded hidden states). The reference is the
stock GPTModel at TP=2 *without* sequence parallelism, with the same weights: unpacked sequences
have arbitrary lengths, which a sequence split over 2 ranks cannot take, while the packed trees are
padded to a multiple of the TP size (``parallel_size=2``). Sequence parallelism changes where each
token's activations live, not what is computed, so both must agree.

Megatron DDP is not used here, so the test does what ``finalize_model_grads`` does after the
backward for sequence parallelism, with Megatron's own function: the gradients of parameters marked
``sequence_parallel`` (the norms, which see only their rank's tokens) are summed over the TP group.
"""

from __future__ import annotations

import pytest
import torch

from harness.dist import run_spawned
from harness.models import (
    VOCAB,
    branching_sequences,
    build_gpt_model,
    recompute_fields,
    small_gpt_config,
)
from megatron_tree.core.heads import LogProbs, Values
from megatron_tree.core.losses import ppo_clipped_loss, value_loss
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.mcore.step import tree_forward_backward
from megatron_tree.testing.reference import (
    finalize_sequence_parallel_grads,
    gradient_errors,
    parameter_grads,
    unpacked_reference_step,
)
from megatron_tree.testing.synthetic import rl_batch
from megatron_tree.testing.tolerances import GRAD_RTOL, LOSS_RTOL

# A token on the wrong rank, a doubled or missing TP reduction or a wrong mask moves gradients by
# >= 1e-2 relative (the norms' gradient sums split over two ranks round like any other reordering).
TP = 2
# (critic, normalization, recompute of the tree model): RMSNorm has a weight only, LayerNorm a
# weight and a bias; recompute re-runs layers on the sequence shards they saved.
CASES = ((False, "RMSNorm", "selective"), (True, "LayerNorm", "full"))


def _config(*, sequence_parallel: bool, normalization: str, recompute: str = "none"):
    return small_gpt_config(
        gated_linear_unit=False,
        add_qkv_bias=True,
        init_method_std=0.15,
        normalization=normalization,
        tensor_model_parallel_size=TP,
        sequence_parallel=sequence_parallel,
        **recompute_fields(recompute),
    )


def _batch() -> dict:
    # Rolled loss mask: entries about tokens 6.. of each sequence, none at the end.
    return rl_batch(branching_sequences(), response_start=5)


def _loss_fn(critic: bool):
    if critic:
        return value_loss
    return lambda outputs, mb: ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)


def _sp_worker(rank: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_tree.mcore.value_head import ValueHead

    out = {}
    for critic, normalization, recompute in CASES:
        batch = _batch()
        reference = build_gpt_model(
            _config(sequence_parallel=False, normalization=normalization),
            tree=False,
            vocab_size=VOCAB,
            critic=critic,
        )
        want_loss = unpacked_reference_step(reference, batch, _loss_fn(critic), critic=critic)
        tree = build_gpt_model(
            _config(sequence_parallel=True, normalization=normalization, recompute=recompute),
            tree=True,
            vocab_size=VOCAB,
            critic=critic,
            backend="sdpa",
        )
        tree.load_state_dict(reference.state_dict())
        head = tree.output_layer
        step = dict(
            gather=Values() if critic else LogProbs(), tp_group=ps.get_tensor_model_parallel_group()
        )
        result = tree_forward_backward(
            tree,
            batch,
            _loss_fn(critic),
            collect_outputs=True,
            **step,
            # block_size=1 (the sdpa backend needs no tiles): only parallel_size=2 makes the packed
            # lengths even; several trees exercise the micro-batch normalization.
            max_tokens_per_mb=64,
            block_size=1,
            parallel_size=TP,
        )
        finalize_sequence_parallel_grads(tree)
        grads = parameter_grads(tree)
        # A batch packed without parallel_size has odd lengths, which the sequence split refuses
        # (before the forward) with a fix to apply.
        unaligned = build_packed_tree_batch(
            batch, max_tokens_per_mb=64, block_size=1, pad_to_max=False
        )
        refusal = None
        try:
            tree_forward_backward(tree, unaligned, _loss_fn(critic), **step)
        except ValueError as error:
            refusal = str(error)
        out[critic] = {
            "loss": float(result.loss),
            "want_loss": float(want_loss),
            "grads": grads,
            "want_grads": parameter_grads(reference),
            "marked": sorted(
                n for n, p in tree.named_parameters() if getattr(p, "sequence_parallel", False)
            ),
            "head_sequence_parallel": isinstance(head, ValueHead) and head.sequence_parallel,
            "trees": [(t.num_tree_tokens, t.padded_length) for t in result.packed.trees],
            "outputs": result.tree_outputs,
            "unaligned_lengths": [t.padded_length for t in unaligned.trees],
            "refusal": refusal,
        }
    return out


def test_sequence_parallel_tp2_equals_unpacked():
    ranks = run_spawned(_sp_worker, TP)
    for critic, normalization, _ in CASES:
        results = [r[critic] for r in ranks]
        for r in results:
            assert r["loss"] == pytest.approx(r["want_loss"], rel=LOSS_RTOL), critic
            errors = gradient_errors(r["grads"], r["want_grads"])
            worst = max(errors.items(), key=lambda kv: kv[1])
            assert worst[1] <= GRAD_RTOL, (critic, worst)
            # Exactly the norms are marked for the TP gradient sum; the value head (which sees the
            # whole gathered sequence on every rank) is not, or its gradient would count twice.
            norms = sorted(n for n in r["grads"] if "layernorm" in n)
            assert norms and r["marked"] == norms, r["marked"]
            assert (
                len(norms) == (2 if normalization == "LayerNorm" else 1) * 5
            )  # 2 layers x 2 + final
            assert r["head_sequence_parallel"] == critic
            # The sequence split needs even lengths: some tree has an odd number of tokens and was
            # padded by parallel_size, not by the block size (1).
            assert all(padded % TP == 0 for _, padded in r["trees"])
            assert any(unique % TP for unique, _ in r["trees"]) and len(r["trees"]) > 1, (
                "no tree needed the sequence-parallel padding; change the batch so that one does"
            )
            assert any(n % TP for n in r["unaligned_lengths"])
            assert r["refusal"] is not None and f"parallel_size={TP}" in r["refusal"], r["refusal"]
        # Every TP rank returns the outputs of the whole sequence, the same on both.
        for name, per_tree in results[0]["outputs"].items():
            for a, b in zip(per_tree, results[1]["outputs"][name]):
                assert torch.equal(a, b), name
