"""A step never returns NaN / inf log-probs or loss silently (issue 42 item 3).

One NaN row of the embedding (as a parameter the checkpoint never loaded can be) makes every
token that reads it, and every later token of its sequence, non-finite; the step must raise
naming the micro-batch and the batch rows, on the forward-only step and on a training step, and a
clean model must pass. The expected rows come from the batch itself (the sequences holding the
poisoned token), not from the package.
"""

from __future__ import annotations

import pytest
import torch

from harness.models import (
    VOCAB,
    branching_sequences,
    build_gpt_model,
    make_hf_checkpoint,
    small_gpt_config,
)
from megatron_tree import build_packed_tree_batch
from megatron_tree.core.finite import FiniteCheck, NonFiniteOutputError
from megatron_tree.core.heads import LogProbs
from megatron_tree.core.losses import ppo_clipped_loss
from megatron_tree.mcore.step import PackingConfig, tree_forward_backward
from megatron_tree.testing.synthetic import rl_batch


def _poisoned_token(seqs: list[torch.Tensor]) -> tuple[int, list[int]]:
    """A token id only some sequences hold, and those sequences' batch rows (from the batch)."""
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    for s in seqs:
        counts[s.unique()] += 1
    token = int(torch.nonzero((counts > 0) & (counts < len(seqs)))[0])
    return token, [i for i, s in enumerate(seqs) if bool((s == token).any())]


def _named_rows(message: str) -> set[int]:
    return {
        int(r) for part in message.split("batch rows) [")[1:] for r in part.split("]")[0].split(",")
    }


def _model():
    torch.manual_seed(0)
    return build_gpt_model(
        small_gpt_config(num_layers=2, gated_linear_unit=False, init_method_std=0.15),
        tree=True,
        vocab_size=VOCAB,
        block_size=16,
    )


def _step(model, batch, forward_only: bool):
    return tree_forward_backward(
        model,
        batch,
        None if forward_only else (lambda o, mb: ppo_clipped_loss(o, mb, clip_eps=0.2)),
        gather=LogProbs(),
        forward_only=forward_only,
        collect_outputs=True,
        packing=PackingConfig(max_tokens_per_mb=64, block_size=16),
    )


@pytest.mark.parametrize("forward_only", [True, False], ids=["forward_only", "train"])
def test_nan_embedding_row_raises_naming_micro_batch_and_rows(world, forward_only):
    seqs = branching_sequences()
    batch = rl_batch(seqs, response_start=5)
    model = _model()
    clean = _step(model, batch, forward_only)
    logps = clean.merged_outputs()["logprobs"]
    assert torch.isfinite(logps).all()
    token, want = _poisoned_token(seqs)
    embedding = next(p for n, p in model.named_parameters() if "word_embeddings" in n)
    with torch.no_grad():
        embedding[token] = float("nan")
    with pytest.raises(NonFiniteOutputError, match=r"micro-batch \d+") as err:
        _step(model, batch, forward_only)
    message = str(err.value)
    assert "logprobs" in message
    named = _named_rows(message)
    # The rows named include a sequence holding the token. A sibling branch in the same tile may
    # read NaN too (0 * NaN in a masked tile), so the named rows need not be a subset.
    assert named & set(want), (named, want)


def test_hf_packed_logprobs_raises_on_a_nan_embedding_row(tmp_path):
    """The HF engine (packed_logprobs, under TRL, verl FSDP and AReaL FSDP's shared head_forward):
    a NaN embedding row raises naming the micro-batch and a row holding the token."""
    transformers = pytest.importorskip("transformers")
    from megatron_tree.integrations.transformers import packed_logprobs, prepare_model

    make_hf_checkpoint("qwen3", str(tmp_path))
    model = prepare_model(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)))
    seqs = branching_sequences()
    batch = build_packed_tree_batch(
        {"input_ids": seqs}, max_tokens_per_mb=96, block_size=16, share_trunks=False
    )
    assert all(torch.isfinite(lp).all() for lp in packed_logprobs(model, batch).logprobs)
    token, want = _poisoned_token(seqs)
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("nan")
    with pytest.raises(NonFiniteOutputError, match=r"packed_logprobs.*micro-batch \d+") as err:
        packed_logprobs(model, batch, entropy=True)
    assert _named_rows(str(err.value)) & set(want)


def test_finite_check_reads_once_and_names_the_first_bad_micro_batch():
    """Clean flags pass; a loss-only NaN names the loss; a per-token NaN wins over it and names
    its sequence's batch row (the tree's sequence_ids), checked on a hand-built packing."""
    batch = build_packed_tree_batch(
        {"input_ids": [torch.arange(1, 6), torch.arange(1, 4), torch.arange(7, 12)]},
        max_tokens_per_mb=16,
        block_size=4,
        share_trunks=False,
    )
    mb = next(iter(batch))
    tokens = int(mb.tree.cu_seqlens[-1])
    check = FiniteCheck("step")
    check.add(0, mb.tree, {"logprobs": torch.zeros(tokens)})
    check.add_loss(0, torch.tensor(1.0))
    check.raise_if_any()
    check.add_loss(3, torch.tensor(float("inf")))
    with pytest.raises(NonFiniteOutputError, match="micro-batch 3 .*loss: 1 of 1"):
        check.raise_if_any()
    bad = torch.zeros(tokens)
    second = int(mb.tree.cu_seqlens[1])  # the second sequence of the tree's order
    bad[second] = float("nan")
    check.add_loss(1, torch.tensor(float("nan")))
    check.add(2, mb.tree, {"logprobs": bad})
    with pytest.raises(NonFiniteOutputError) as err:
        check.raise_if_any()
    row = int(mb.tree.sequence_ids[1])
    assert "micro-batch 2 has" in str(err.value)
    assert _named_rows(str(err.value)) == {row}
