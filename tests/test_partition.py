"""The data-parallel partitioner: every sample on exactly one rank, prefixes kept together, costs
balanced; measured by packing each rank's share as a trainer would."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tree import partition_for_data_parallel
from megatron_tree.core.flops import GPTShape, cost_weights, train_flops
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.strategies import random_tries
from megatron_tree.testing.synthetic import agent_batch, grpo_batch, pad_sequences

SHAPE = GPTShape(
    hidden=4096, layers=36, heads=32, query_groups=8, ffn_hidden=12288, vocab=151936, head_dim=128
)


def rank_packs(batch: dict, ranks: list[torch.Tensor], capacity: int):
    return [
        build_packed_tree_batch({k: v[r] for k, v in batch.items()}, max_tokens_per_mb=capacity)
        for r in ranks
    ]


def test_grpo_groups_stay_whole_and_ranks_balance():
    """GRPO 64 prompts x 8 samples over 8 ranks: each prompt on one rank, max/min cost <= 1.1, and
    far fewer tree tokens than the split by sample index."""
    batch = grpo_batch(
        num_prompts=64, samples_per_prompt=8, prompt_len=128, response_len=(16, 48), vocab_size=1000
    )
    ranks = partition_for_data_parallel(batch, 8, cost_model=SHAPE)
    assert len(ranks) == 8
    assert torch.equal(torch.cat(ranks).sort().values, torch.arange(512))
    prompt_of = [tuple(row[:8].tolist()) for row in batch["input_ids"]]
    for r, indices in enumerate(ranks):
        assert indices.dtype == torch.int64 and torch.equal(indices, indices.sort().values)
        for other in ranks[r + 1 :]:
            assert not {prompt_of[i] for i in indices.tolist()} & {
                prompt_of[i] for i in other.tolist()
            }
    costs = [train_flops(p.trees, SHAPE) for p in rank_packs(batch, ranks, 1024)]
    assert max(costs) / min(costs) <= 1.1
    by_index = rank_packs(batch, list(torch.arange(512).chunk(8)), 1024)
    tokens = sum(p.num_tree_tokens for p in rank_packs(batch, ranks, 1024))
    one_trie = build_packed_tree_batch(batch, max_tokens_per_mb=128 * 512).num_tree_tokens
    assert tokens == one_trie < 0.5 * sum(p.num_tree_tokens for p in by_index)


def test_agent_batch_splits_tasks_but_keeps_rollouts():
    """6 tasks over 8 ranks: tasks must be split, so the system and task prompts repeat, but each
    rollout (a chain of turns) stays on one rank and the costs still balance."""
    batch = agent_batch()
    ranks = partition_for_data_parallel(batch, 8, cost_model=SHAPE)
    lengths = batch["attention_mask"].sum(1)
    seqs = [tuple(batch["input_ids"][i, :n].tolist()) for i, n in enumerate(lengths.tolist())]
    rank_of = {i: r for r, indices in enumerate(ranks) for i in indices.tolist()}
    for i, a in enumerate(seqs):
        for j, b in enumerate(seqs):
            if len(a) < len(b) and b[: len(a)] == a:  # an earlier turn of the same rollout
                assert rank_of[i] == rank_of[j]
    costs = [train_flops(p.trees, SHAPE) for p in rank_packs(batch, ranks, 8192)]
    assert max(costs) / min(costs) <= 1.1


def trie_cost(sequences, weights) -> float:
    """Brute force: the cost of the trie of ``sequences``, a node per distinct prefix (a token) that
    attends to its depth + 1 ancestors and itself (pairs)."""
    root, tokens, pairs = {}, 0, 0
    for seq in sequences:
        node = root
        for depth, token in enumerate(seq):
            if token not in node:
                node[token], tokens, pairs = {}, tokens + 1, pairs + depth + 1
            node = node[token]
    return weights[0] * tokens + weights[1] * pairs


def few_groups_batch(seed: int, num_groups: int, bos: bool) -> list[list[list[int]]]:
    """Prompt groups (prompts of 8-120 tokens, 2-6 responses of 4-80), optionally under one BOS
    token; each prompt starts with its own token, so no two groups share more than the BOS."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = [7] * bos + [100 + g] + [rng.randrange(50) for _ in range(rng.randint(8, 120))]
        groups.append(
            [
                prompt + [rng.randrange(50) for _ in range(rng.randint(4, 80))]
                for _ in range(rng.randint(2, 6))
            ]
        )
    return groups


def whole_groups_busiest(groups, dp_size: int, weights) -> float:
    """Reference: whole groups longest-cost-first, each to the rank whose trie then costs least
    (ties: the cheaper rank, then the first); the busiest rank's cost."""
    ranks = [[] for _ in range(dp_size)]
    for group in sorted(groups, key=lambda g: -trie_cost(g, weights)):
        r = min(
            range(dp_size),
            key=lambda r: (trie_cost(ranks[r] + group, weights), trie_cost(ranks[r], weights), r),
        )
        ranks[r] += group
    return max(trie_cost(rank, weights) for rank in ranks)


def test_one_or_two_groups_per_rank_never_worse_than_keeping_groups_whole():
    """48 seeded batches of 1-2 prompt groups per rank: the busiest rank never costs more than with
    the groups kept whole, and splitting groups still helps on some."""
    ratios = []
    for seed in range(4):
        for dp_size, per_rank in [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2)]:
            groups = few_groups_batch(seed, dp_size * per_rank, bos=seed % 2 == 1)
            sequences = [s for g in groups for s in g]
            batch = pad_sequences([torch.tensor(s) for s in sequences])
            for model in (None, SHAPE):
                weights = cost_weights(model)
                ranks = partition_for_data_parallel(batch, dp_size, cost_model=model)
                busiest = max(trie_cost([sequences[i] for i in r.tolist()], weights) for r in ranks)
                ratios.append(busiest / whole_groups_busiest(groups, dp_size, weights))
    assert max(ratios) <= 1 + 1e-12 and min(ratios) < 0.9, (max(ratios), min(ratios))


@st.composite
def random_batches(draw):
    """(sequences, a data-parallel size of 1..their number)."""
    sequences = draw(random_tries(max_vocab=4, max_sequences=14, max_tail=8))
    return sequences, draw(st.integers(1, len(sequences)))


@settings(max_examples=60, deadline=None)
@given(random_batches(), st.booleans())
def test_every_sample_on_exactly_one_nonempty_rank(case, with_model):
    sequences, dp_size = case
    batch = pad_sequences([torch.tensor(s) for s in sequences])
    ranks = partition_for_data_parallel(batch, dp_size, cost_model=SHAPE if with_model else None)
    assert len(ranks) == dp_size and all(len(r) > 0 for r in ranks)
    assert torch.equal(torch.cat(ranks).sort().values, torch.arange(len(sequences)))
    # Same answer from ids and lengths, and twice.
    lengths = batch["attention_mask"].sum(1)
    again = partition_for_data_parallel(
        batch["input_ids"], dp_size, lengths=lengths, cost_model=SHAPE if with_model else None
    )
    assert all(torch.equal(a, b) for a, b in zip(ranks, again))
    # Unless there are fewer leaves (sequences no other extends) than ranks, copies of a sequence
    # share a rank, and a sequence that others extend shares one with at least one of them.
    leaves = {
        tuple(s)
        for s in sequences
        if not any(len(o) > len(s) and o[: len(s)] == s for o in sequences)
    }
    if len(leaves) >= dp_size:
        rank_of = {i: r for r, idx in enumerate(ranks) for i in idx.tolist()}
        for i, a in enumerate(sequences):
            longer = {
                rank_of[j] for j, b in enumerate(sequences) if len(b) > len(a) and b[: len(a)] == a
            }
            copies = {rank_of[j] for j, b in enumerate(sequences) if b == a}
            assert copies == {rank_of[i]} and (not longer or rank_of[i] in longer), a


def _in_layout(sequences: list[torch.Tensor], kind: str):
    """``sequences`` in layout ``kind``, as the packer takes them (see core/ragged.py)."""
    if kind == "padded":
        return pad_sequences(sequences)
    if kind == "list":
        return {"input_ids": [s.tolist() for s in sequences]}
    if kind == "nested":
        return {"input_ids": torch.nested.nested_tensor(sequences, layout=torch.jagged)}
    if kind == "nested tensor":
        return torch.nested.nested_tensor(sequences, layout=torch.jagged)
    cu_seqlens = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    thd = {"input_ids": torch.cat(sequences), "cu_seqlens": cu_seqlens}
    return {k: v.numpy() for k, v in thd.items()} if kind == "thd numpy" else thd


@pytest.mark.parametrize("kind", ["list", "nested", "nested tensor", "thd", "thd numpy"])
def test_every_layout_the_packer_takes(kind):
    """A ragged batch (a list of sequences, a jagged nested tensor, THD) partitions as its
    right-padded form."""
    batch = grpo_batch(
        num_prompts=6, samples_per_prompt=4, prompt_len=24, response_len=(4, 12), vocab_size=50
    )
    sequences = [row[:n] for row, n in zip(batch["input_ids"], batch["attention_mask"].sum(1))]
    want = partition_for_data_parallel(pad_sequences(sequences), 3, cost_model=SHAPE)
    got = partition_for_data_parallel(_in_layout(sequences, kind), 3, cost_model=SHAPE)
    assert [r.tolist() for r in got] == [r.tolist() for r in want]


def test_groups_stay_whole_with_equal_shares():
    """``groups`` (e.g. verl's prompt uids, not the tries: two groups share a prompt here) and
    ``equal_sizes``: each group on one rank, every rank B / dp_size samples, and the busiest rank
    no costlier than whole groups assigned longest-cost-first without sharing across groups."""
    groups = few_groups_batch(0, 8, bos=True)
    groups = [(g * 4)[:4] for g in groups]  # 4 samples each
    groups[1] = [s[:] for s in groups[0]]  # a second group with the first's sequences
    sequences = [s for g in groups for s in g]
    uids = [f"uid-{i}" for i, g in enumerate(groups) for _ in g]
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(0)).tolist()
    sequences, uids = [sequences[i] for i in order], [uids[i] for i in order]
    batch = {"input_ids": [torch.tensor(s) for s in sequences]}
    weights = cost_weights(None)
    for dp_size in (2, 4):
        ranks = partition_for_data_parallel(batch, dp_size, groups=uids, equal_sizes=True)
        assert [len(r) for r in ranks] == [len(sequences) // dp_size] * dp_size
        assert torch.equal(torch.cat(ranks).sort().values, torch.arange(len(sequences)))
        rank_of = {
            uid: {r for r, idx in enumerate(ranks) for i in idx.tolist() if uids[i] == uid}
            for uid in uids
        }
        assert all(len(r) == 1 for r in rank_of.values())
        busiest = max(trie_cost([sequences[i] for i in r.tolist()], weights) for r in ranks)
        by_group = [[s for s, u in zip(sequences, uids) if u == uid] for uid in dict.fromkeys(uids)]
        loads = [0.0] * dp_size
        counts = [0] * dp_size
        for g in sorted(by_group, key=lambda g: -trie_cost(g, weights)):
            r = min(
                (r for r in range(dp_size) if counts[r] < len(by_group) // dp_size),
                key=lambda r: loads[r],
            )
            loads[r] += trie_cost(g, weights)
            counts[r] += 1
        assert busiest <= max(loads)
    with pytest.raises(ValueError, match="do not split into 3 equal shares"):
        partition_for_data_parallel(batch, 3, groups=uids, equal_sizes=True)
    with pytest.raises(ValueError, match="groups must give one label per sample"):
        partition_for_data_parallel(batch, 2, groups=uids[:-1])
    with pytest.raises(ValueError, match="2 groups cannot fill dp_size=3 ranks"):
        partition_for_data_parallel(batch, 3, groups=["a"] * 16 + ["b"] * 16)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0,), {}, "dp_size must be an integer >= 1, got 0"),
        ((3,), {}, r"dp_size=3 is larger than the batch \(2 sequences\)"),
        ((2,), {"lengths": torch.tensor([1, 1])}, "pass lengths only with an input_ids tensor"),
        ((2,), {"cost_model": 7}, "cost_model must be a GPTShape or None, got int"),
    ],
)
def test_errors(args, kwargs, match):
    batch = pad_sequences([torch.tensor([1, 2, 3]), torch.tensor([1, 2])])
    with pytest.raises(ValueError, match=match):
        partition_for_data_parallel(batch, *args, **kwargs)


def test_input_errors():
    ids = torch.tensor([[1, 2, 3], [1, 2, 0]])
    with pytest.raises(ValueError, match=r"lengths must be \[B=2\] with every entry in \[1, L=3\]"):
        partition_for_data_parallel(ids, 2, lengths=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        partition_for_data_parallel(ids.float(), 2)
    with pytest.raises(ValueError, match="negative token ids"):
        partition_for_data_parallel(ids - 2, 2)
    with pytest.raises(ValueError, match="data must be a batch dict or an input_ids tensor"):
        partition_for_data_parallel([[1, 2]], 1)
    with pytest.raises(ValueError, match="data must be a dict holding 'input_ids'"):
        partition_for_data_parallel({"input_ids": ids}, 1)
    assert [r.tolist() for r in partition_for_data_parallel(ids, 2)] in ([[0], [1]], [[1], [0]])


@pytest.mark.parametrize("row", [[0, 1, 1], [1, 0, 1]], ids=["left padding", "a hole"])
def test_masks_that_are_not_right_padded_are_refused(row):
    """Like the packer: lengths read off such a mask would group sequences on padding tokens."""
    batch = pad_sequences([torch.tensor([1, 2, 3]), torch.tensor([1, 2]), torch.tensor([4])])
    batch["attention_mask"][1] = torch.tensor(row)
    rule = r"are not right-padded: each row must be ones for the real tokens followed by zeros"
    with pytest.raises(ValueError, match=r"data\['attention_mask'\] rows \[1\] " + rule):
        partition_for_data_parallel(batch, 2)


def test_mask_errors():
    batch = pad_sequences([torch.tensor([1, 2, 3]), torch.tensor([1, 2])])
    empty = {**batch, "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])}
    with pytest.raises(ValueError, match=r"sequences \[1\] are empty \(attention_mask all zero\)"):
        partition_for_data_parallel(empty, 1)
    shape = r"data\['attention_mask'\] has shape \(2, 2\) but data\['input_ids'\] has \(2, 3\)"
    with pytest.raises(ValueError, match=shape):
        partition_for_data_parallel({**batch, "attention_mask": torch.ones(2, 2)}, 1)
