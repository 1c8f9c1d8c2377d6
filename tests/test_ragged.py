"""Ragged batches (a list of sequences, a jagged nested tensor, THD + cu_seqlens) pack exactly as
their right-padded form, and results come back in the layout they were given in."""

from __future__ import annotations

import pytest
import torch

from harness.models import branching_sequences
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.ragged import InputLayout, to_padded
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


def test_thd_numpy_arrays_pack_as_tensors():
    """THD ``input_ids`` / ``cu_seqlens`` / extras as numpy arrays, as the padded layout takes them
    (``torch.as_tensor``, keeping their dtype)."""
    seqs = branching_sequences()
    thd = _ragged(seqs, "thd")
    want = build_packed_tree_batch(thd, **PACKING)
    got = build_packed_tree_batch({k: v.numpy() for k, v in thd.items()}, **PACKING)
    assert got.input_layout == want.input_layout == InputLayout("thd", tuple(map(len, seqs)))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for key in ("input_ids", "position_ids", "weights"):
            assert torch.equal(a[key], b[key]), key


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
    from harness.models import VOCAB, build_gpt_model, small_gpt_config
    from megatron_tree.mcore.step import tree_forward_backward

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


@pytest.mark.parametrize("kind", ["list", "nested", "thd"])
def test_attach_reads_the_batch_layout(kind):
    """``attach`` takes per-token values in the layout the batch was packed from: a list on a
    list batch is one tensor per sequence, never one per micro-batch (the lengths below line up
    with the micro-batches' token counts, which used to land values on the wrong sequences)."""
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([9, 1, 2])]
    packed = build_packed_tree_batch(
        _ragged(seqs, kind), max_tokens_per_mb=16, block_size=16, pad_to_max=False
    )
    assert len(packed) == 1 and packed[0]["tree"].num_sequence_tokens == 6
    values = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])]
    given = _ragged(seqs, kind)["weights"]  # the layout's own container, filled below
    if kind == "list":
        given = values
    elif kind == "nested":
        given = torch.nested.nested_tensor(values, layout=torch.jagged)
    else:
        given = torch.cat(values)
    packed.attach("advantages", given)
    tree = packed[0]["tree"]
    for i, b in enumerate(tree.sequence_ids.tolist()):
        got = packed[0]["advantages"][tree.cu_seqlens[i] : tree.cu_seqlens[i + 1]]
        assert torch.equal(got, values[b]), (b, got)


def test_attach_round_trips_step_outputs_through_the_layout():
    """A step's merged outputs in a ragged layout attach back to the same tree entries as its
    tree-layout outputs (``TreeOutputs``)."""
    from megatron_tree.core.batch import TreeOutputs
    from megatron_tree.core.results import merge_packed_tree_results

    seqs = branching_sequences()
    for kind in ("list", "nested", "thd"):
        packed = build_packed_tree_batch(_ragged(seqs, kind), **PACKING)
        tree_layout = TreeOutputs(
            torch.randn(mb["tree"].num_sequence_tokens, generator=torch.Generator().manual_seed(i))
            for i, mb in enumerate(packed)
        )
        merged = packed.input_layout.restore(
            merge_packed_tree_results(list(zip(tree_layout, packed.trees)), packed.batch_size)
        )
        packed.attach("direct", tree_layout).attach("round_trip", merged)
        for mb in packed:
            assert torch.equal(mb["direct"], mb["round_trip"]), kind


def test_attach_of_a_plain_list_on_a_padded_batch_is_deprecated():
    packed = build_packed_tree_batch(pad_sequences(branching_sequences()), **PACKING)
    values = [torch.zeros(mb["tree"].num_sequence_tokens) for mb in packed]
    with pytest.warns(DeprecationWarning, match="attach_tree"):
        packed.attach("old_logprobs", values)
    with pytest.raises(ValueError, match="micro-batch 0 needs a tensor"):
        packed.attach_tree("old_logprobs", [torch.zeros(1)] + values[1:])
