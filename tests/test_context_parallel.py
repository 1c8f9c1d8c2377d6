"""Context parallelism for trees: the split, the attention over a rank's rows, and the tree step at
CP=2 and CP=2 x TP=2 against the unpacked per-sequence reference.

The references are independent of the tree code: brute-force masked attention over the dense mask
for the attention checks; Megatron's stock GPTModel on every sequence alone (causal mask, positions
0..L-1, full-vocab float64 log-softmax) for the step, run at the same TP size without CP.
"""

from __future__ import annotations

import pytest
import torch

from harness.dist import reinitialize_model_parallel, run_spawned
from harness.models import (
    VOCAB,
    attention_reference,
    branching_sequences,
    long_context_sequences,
    pack,
    recompute_fields,
)
from megatron_tree.core.attention import tree_attention
from megatron_tree.core.context_parallel import (
    attention_work,
    context_parallel_split,
    split_positions,
)
from megatron_tree.core.mask import build_attention_mask_from_trie, tree_attention_mask
from megatron_tree.core.tree import PackedTree
from megatron_tree.testing.synthetic import rl_batch
from megatron_tree.testing.tolerances import FP32_ATTN_TOL, GRAD_RTOL, LOGP_TOL, LOSS_RTOL

# A wrong split, a missing key or a double-counted row moves log-probs by >= 1e-2 and gradients by
# >= 1e-2 relative.


def _chain(n: int) -> torch.Tensor:
    """position_ids of one sequence of n tokens (a causal chain)."""
    return torch.arange(n)


def test_split_covers_every_position_once_with_equal_rows():
    tree = pack(branching_sequences())[0]["tree"]
    for cp, unit in [(2, None), (4, None), (2, 4), (4, 1)]:
        splits = [context_parallel_split(tree, cp, r, unit=unit) for r in range(cp)]
        positions = splits[0].cp_positions
        assert positions.shape == (cp, tree.padded_length // cp)
        assert torch.equal(positions.reshape(-1).sort().values, torch.arange(tree.padded_length))
        assert all(bool((p[1:] > p[:-1]).all()) for p in positions)  # ascending on each rank
        for r, split in enumerate(splits):
            local = split.local_index
            assert torch.equal(local[positions[r]], torch.arange(positions.shape[1]))
            assert int((local >= 0).sum()) == positions.shape[1]


def test_split_balances_attention_work():
    """On a causal chain a contiguous split gives the last rank ~3x the first's work at CP=2; the
    serpentine deal evens it out (Megatron's zigzag does the same for causal sequences). On a tree
    with one deep branch at the end, the deep rows are spread too."""
    depth = _chain(4096)
    for cp in (2, 4, 8):
        work = attention_work(depth, split_positions(depth, cp))
        contiguous = (depth + 1).view(cp, -1).sum(1)
        assert float(work.max() / work.min()) < 1.01
        assert float(contiguous.max() / contiguous.min()) > 2.0
    # A shallow wide part (many short branches of depth <= 40) then one 2048-deep chain.
    wide = torch.cat([torch.arange(40)] * 50)
    tree_depth = torch.cat([wide, torch.arange(2048), torch.zeros(48, dtype=torch.int64)])
    work = attention_work(tree_depth, split_positions(tree_depth, 4, unit=16))
    assert float(work.max() / work.min()) < 1.05


def test_split_errors():
    depth = _chain(48)
    tree = PackedTree.all_padding(48)
    with pytest.raises(
        ValueError, match="packed length 48 is not a multiple of the context-parallel size 5"
    ):
        split_positions(depth, 5)
    with pytest.raises(ValueError, match="rank=2 must be below cp_size=2"):
        context_parallel_split(tree, 2, 2)
    with pytest.raises(ValueError, match="unit=5 must divide the 24 rows"):
        context_parallel_split(tree, 2, 0, unit=5)
    split = context_parallel_split(tree, 2, 0)
    with pytest.raises(ValueError, match="already split"):
        context_parallel_split(split, 2, 0)
    with pytest.raises(
        ValueError, match="rows are of a tree of 48 positions, the mask's tree has 32"
    ):
        tree_attention_mask(torch.arange(1, 33), split)


@pytest.mark.parametrize("backend", ["sdpa", "block_sparse", "flex"])
@pytest.mark.parametrize("cp,unit", [(2, None), (4, None), (2, 4), (4, 1)])
def test_attention_of_a_rank_rows_equals_brute_force(backend, cp, unit):
    """Each rank's rows of tree attention over the whole tree's keys equal those rows of brute-force
    masked attention; the block size (16) differs from the split unit in some cases."""
    tree = pack(branching_sequences())[0]["tree"]
    n = tree.padded_length
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 1, 4, 16, generator=g)
    k, v = torch.randn(n, 1, 2, 16, generator=g), torch.randn(n, 1, 2, 16, generator=g)
    want = attention_reference(q, k, v, build_attention_mask_from_trie(tree))
    for rank in range(cp):
        split = context_parallel_split(tree, cp, rank, unit=unit)
        rows = split.local_positions
        got = tree_attention(
            q[rows], k, v, tree_attention_mask(tree, split), backend=backend, block_size=16
        )
        assert (got - want[rows]).abs().max() <= FP32_ATTN_TOL


def test_attention_refuses_fewer_queries_without_a_split():
    tree = pack(branching_sequences())[0]["tree"]
    n = tree.padded_length
    q, kv = torch.randn(n // 2, 1, 2, 8), torch.randn(n, 1, 2, 8)
    with pytest.raises(
        ValueError,
        match=r"only the mask of a micro-batch's rows, tree_attention_mask\(rows, \.\.\.\)",
    ):
        tree_attention(q, kv, kv, tree_attention_mask(tree))
    split = context_parallel_split(tree, 4, 0)
    with pytest.raises(ValueError, match=f"the tree mask is for {n // 4} query rows, got {n // 2}"):
        tree_attention(q, kv, kv, tree_attention_mask(tree, split))


# ----------------------------------------------------------------------------- spawned worlds

NUM_LAYERS = 2


def _batch(seqs: list[torch.Tensor]) -> dict:
    return rl_batch(seqs, response_start=2)


def _short_sequences() -> list[torch.Tensor]:
    """Three sequences sharing 3 tokens: a 12-token tree, shorter than CP (2) x block (16)."""
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(1, VOCAB, (3,), generator=g)
    return [torch.cat([prefix, torch.randint(1, VOCAB, (n,), generator=g)]) for n in (2, 4, 3)]


def _model(tree: bool, critic: bool, cp: int, recompute: dict):
    from megatron.core import parallel_state as ps

    from harness.models import build_gpt_model, small_gpt_config

    config = small_gpt_config(
        num_layers=NUM_LAYERS,
        gated_linear_unit=False,
        add_qkv_bias=True,
        init_method_std=0.15,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        context_parallel_size=cp,
        **recompute,
    )
    return build_gpt_model(
        config, tree=tree, vocab_size=VOCAB, critic=critic, backend="block_sparse", block_size=16
    )


def _reference_logprobs(model, batch: dict) -> torch.Tensor:
    """[B, L] rolled log-probs of every sequence alone through the stock model (0 past the end)."""
    from megatron.core import tensor_parallel

    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            seq = batch["input_ids"][i, :n]
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(
                model(seq[None], torch.arange(n)[None], attention_mask=None)
            )[0]
            logp = torch.log_softmax(logits.double(), dim=-1)
            out[i, : n - 1] = logp[torch.arange(n - 1), seq[1:]]
    return out


def _cp_worker(rank: int, tp: int, cp: int, cases: list[tuple]) -> list[dict]:
    """Per case (name, critic, recompute, sequences, max_tokens): the tree step at TP=tp x CP=cp
    against the unpacked reference at TP=tp; returns the worst errors."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_tree import LogProbs, Values, ppo_clipped_loss, tree_forward_backward, value_loss
    from megatron_tree.testing.reference import (
        gradient_errors,
        parameter_grads,
        unpacked_reference_step,
    )

    results = []
    for name, critic, recompute, seqs, max_tokens, *options in cases:
        batch = _batch(seqs)
        options = options[0] if options else {}
        loss_fn = value_loss if critic else ppo_clipped_loss
        reinitialize_model_parallel(tp=tp, cp=1)
        reference = _model(False, critic, 1, {})
        want_loss = float(unpacked_reference_step(reference, batch, loss_fn, critic=critic))
        want = parameter_grads(reference, require_all=True)
        want_logprobs = None if critic else _reference_logprobs(reference, batch)
        state = reference.state_dict()

        reinitialize_model_parallel(tp=tp, cp=cp)
        model = _model(True, critic, cp, recompute)
        model.load_state_dict(state)
        result = tree_forward_backward(
            model,
            batch,
            loss_fn,
            gather=Values() if critic else LogProbs(),
            max_tokens_per_mb=max_tokens,
            block_size=16,
            tp_group=ps.get_tensor_model_parallel_group(),
            collect_outputs=True,
            **options,
        )
        grads = parameter_grads(model, require_all=True)
        for g in grads.values():  # Megatron DDP averages over the data x context parallel ranks
            dist.all_reduce(g, op=dist.ReduceOp.AVG, group=ps.get_context_parallel_group())
        errors = gradient_errors(grads, want)
        row = {
            "case": name,
            "loss_rel": abs(float(result.loss) - want_loss) / abs(want_loss),
            "grad_rel": max(errors.values()),
            "trees": result.num_micro_batches,
            "lengths": [t.padded_length for t in result.packed.trees],
            "trunk_parts": sum(mb["rows"].records for mb in result.packed),
            "branches": sum(
                mb["rows"].group is not None and not mb["rows"].records for mb in result.packed
            ),
        }
        if not critic:
            got = result.merged_outputs(max_seq_len=batch["input_ids"].shape[1])["logprobs"]
            row["logprob_err"] = float((got.double() - want_logprobs).abs().max())
        results.append(row)
    return results


def _check(rows: list[dict]) -> None:
    for row in rows:
        assert row["loss_rel"] <= LOSS_RTOL, row
        assert row["grad_rel"] <= GRAD_RTOL, row
        assert row.get("logprob_err", 0.0) <= LOGP_TOL, row


FULL, SELECTIVE = recompute_fields("full"), recompute_fields("selective")


NO_TRUNKS = {"share_trunks": False}


def test_context_parallel_2_equals_unpacked():
    """CP=2: the branching trie in 64-token trees cut at its branch points (its 24-token shared
    prompt straddles the split), the critic with full recompute, a 16-token tree (shorter than
    CP x block) with selective recompute; and trunk reuse split across the CP ranks (the default):
    the branching trie's trunk, and a 150-token history plus a 140-token sequence that each run as
    a chain of trunk parts."""
    cases = [
        ("actor", False, {}, branching_sequences(), 64, NO_TRUNKS),
        ("critic+full", True, FULL, branching_sequences(), 64, NO_TRUNKS),
        ("short tree+selective", False, SELECTIVE, _short_sequences(), 64, NO_TRUNKS),
        ("trunk actor", False, {}, branching_sequences(), 64),
        ("chains actor+full", False, FULL, long_context_sequences(), 64),
        ("chains critic", True, {}, long_context_sequences(), 64),
    ]
    ranks = run_spawned(_cp_worker, 2, 1, 2, cases, megatron=False)
    for rows in ranks:
        _check(rows)
    short = ranks[0][2]
    assert short["lengths"] == [16] and short["trees"] == 1
    assert ranks[0][0]["trees"] > 1 and ranks[0][0]["trunk_parts"] == 0
    assert ranks[0][3]["trunk_parts"] >= 1 and ranks[0][3]["branches"] >= 1
    assert ranks[0][4]["trunk_parts"] >= 4  # 150-token history: 3 parts; 140-token sequence: 2


@pytest.mark.slow
def test_context_parallel_2_x_tensor_parallel_2_equals_unpacked():
    cases = [
        ("actor", False, {}, branching_sequences(), 64, NO_TRUNKS),
        ("chains actor", False, {}, long_context_sequences(), 64),
        ("chains critic", True, {}, long_context_sequences(), 64),
    ]
    ranks = run_spawned(_cp_worker, 4, 2, 2, cases, megatron=False)
    for rows in ranks:
        _check(rows)
    assert ranks[0][1]["trunk_parts"] >= 4


def test_sequence_split_gives_contiguous_slices_and_refuses_what_it_cannot_split():
    """Ulysses' split: rank r holds rows r n : (r + 1) n, every rank's rows listed in rank order;
    a row count that does not divide, a rank out of range and an already split tree are refused."""
    from megatron_tree.core.context_parallel import sequence_split
    from megatron_tree.core.packing import build_packed_tree_batch

    seqs = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 6]), torch.tensor([7, 8])]
    (mb,) = build_packed_tree_batch({"input_ids": seqs}, max_tokens_per_mb=16, block_size=8)
    n = mb.rows.num_rows
    assert n == 8
    for rank in range(2):
        rows = sequence_split(mb.rows, 2, rank)
        assert rows.positions.tolist() == list(range(rank * n // 2, (rank + 1) * n // 2))
        assert rows.cp_positions.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert rows.num_real == min(4, max(0, mb.tree.num_tree_tokens - rank * 4))
    with pytest.raises(ValueError, match="equal slices"):
        sequence_split(mb.rows, 3, 0)
    with pytest.raises(ValueError, match="rank=2 must be below"):
        sequence_split(mb.rows, 2, 2)
    with pytest.raises(ValueError, match="whole tree"):
        sequence_split(sequence_split(mb.rows, 2, 0), 2, 0)
