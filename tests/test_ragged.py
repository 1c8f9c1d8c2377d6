"""Ragged batches (a list of sequences, a jagged nested tensor, THD + cu_seqlens) pack exactly as
their right-padded form, and results come back in the layout they were given in."""

from __future__ import annotations

import pytest
import torch

from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.ragged import InputLayout, to_padded
from megatron_tree.testing.models import branching_sequences
from megatron_tree.testing.synthetic import pad_sequences

PACKING = dict(max_tokens_per_mb=128, block_size=16, pad_to_max=False)


def _ragged(seqs: list[torch.Tensor], kind: str) -> dict:
    """``seqs`` with a per-token float extra (its position in its sequence), in layout ``kind``."""
    extra = [torch.arange(len(s), dtype=torch.float32) for s in seqs]
    if kind == "list":
        return {"input_ids": [s.tolist() for s in seqs], "weights": extra}
    if kind == "nested":
        nest = lambda rows: torch.nested.nested_tensor(rows, layout=torch.jagged)  # noqa: E731
        return {"input_ids": nest(seqs), "weights": nest(extra)}
    lengths = torch.tensor([0] + [len(s) for s in seqs])
    return {
        "input_ids": torch.cat(seqs),
        "cu_seqlens": lengths.cumsum(0),
        "weights": torch.cat(extra),
    }


@pytest.mark.parametrize("kind", ["list", "nested", "thd"])
def test_ragged_batches_pack_as_their_padded_form(kind):
    seqs = branching_sequences()
    padded = pad_sequences(seqs)
    padded["weights"] = torch.stack(
        [torch.arange(padded["input_ids"].shape[1], dtype=torch.float32)] * len(seqs)
    )
    padded["weights"] *= padded["attention_mask"]
    want = build_packed_tree_batch(padded, **PACKING)
    got = build_packed_tree_batch(_ragged(seqs, kind), **PACKING)
    assert got.input_layout == InputLayout(kind, tuple(len(s) for s in seqs))
    assert len(got) == len(want) and got.num_tree_tokens == want.num_tree_tokens
    for a, b in zip(got, want):
        for key in ("input_ids", "position_ids", "weights"):
            assert torch.equal(a[key], b[key]), key
        assert torch.equal(a["tree"].subtree_end, b["tree"].subtree_end)


@pytest.mark.parametrize("kind", ["list", "nested", "thd"])
def test_results_return_in_the_layout_given(kind):
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([5, 6]), torch.tensor([9, 1, 2, 3])]
    padded, layout = to_padded(_ragged(seqs, kind))
    result = torch.arange(3 * 4, dtype=torch.float32).view(3, 4).requires_grad_()
    back = layout.restore(result)
    rows = {
        "list": lambda b: b,
        "nested": lambda b: list(b.unbind()),
        "thd": lambda b: list(b.split([3, 2, 4])),
    }[kind](back)
    assert [r.tolist() for r in rows] == [[0.0, 1.0, 2.0], [4.0, 5.0], [8.0, 9.0, 10.0, 11.0]]
    sum(r.sum() for r in rows).backward()
    assert result.grad.tolist() == [
        [1, 1, 1, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 1],
    ]  # past each length: no gradient
    assert torch.equal(
        padded["attention_mask"], torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    )


def test_ragged_input_errors_name_the_fix():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    with pytest.raises(ValueError, match="drop data\\['attention_mask'\\]"):
        to_padded(
            {
                "input_ids": torch.nested.nested_tensor(seqs, layout=torch.jagged),
                "attention_mask": torch.ones(2, 3),
            }
        )
    with pytest.raises(ValueError, match="must have input_ids' sequence lengths \\[3, 2\\]"):
        to_padded({"input_ids": seqs, "weights": [torch.zeros(3), torch.zeros(3)]})
    with pytest.raises(ValueError, match="cu_seqlens must be a non-decreasing"):
        to_padded({"input_ids": torch.cat(seqs), "cu_seqlens": torch.tensor([0, 4, 3])})
    with pytest.raises(
        ValueError, match="input_ids must be \\[T\\] with T = cu_seqlens\\[-1\\] = 4"
    ):
        to_padded({"input_ids": torch.cat(seqs), "cu_seqlens": torch.tensor([0, 3, 4])})
    with pytest.raises(
        ValueError, match="whose rows have different lengths"
    ):  # ragged rows with a mask: padded
        build_packed_tree_batch(
            {"input_ids": [[1, 2, 3], [4, 5]], "attention_mask": [[1, 1, 1], [1, 1]]}, **PACKING
        )


def test_step_outputs_come_back_in_the_nested_layout(world):
    """A jagged nested batch through tree_forward_backward: merged log-probs are nested again, row b
    equal to the padded batch's row b up to its length."""
    from megatron_tree.mcore.step import tree_forward_backward
    from megatron_tree.testing.models import VOCAB, build_gpt_model, small_gpt_config

    model = build_gpt_model(
        small_gpt_config(), tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
    )
    seqs = branching_sequences()
    runs = {}
    for name, batch in (("padded", pad_sequences(seqs)), ("nested", _ragged(seqs, "nested"))):
        batch.pop("weights", None)
        result = tree_forward_backward(
            model, batch, None, forward_only=True, collect_outputs=True, **PACKING
        )
        runs[name] = result.merged_outputs()["logprobs"]
    nested = runs["nested"]
    assert nested.is_nested and [len(r) for r in nested.unbind()] == [len(s) for s in seqs]
    for b, row in enumerate(nested.unbind()):
        assert torch.equal(row, runs["padded"][b, : len(seqs[b])])
