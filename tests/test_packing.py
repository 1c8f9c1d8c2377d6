"""Trie packing against brute-force references built from the original sequences.

The reference identifies every trie node with the tuple of tokens on its path (its prefix); the
packed layout must map every (sequence, depth) to one position per distinct prefix, and the mask
must allow exactly "key prefix is a prefix of query prefix".
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harness.strategies import random_tries
from megatron_tree.core.flops import GPTShape, attention_pairs, cost_weights, train_flops
from megatron_tree.core.mask import build_attention_mask_from_trie
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import grpo_batch, multi_turn_batch, pad_sequences


def make_batch(sequences: list[list[int]], seed: int = 0) -> dict:
    batch = pad_sequences([torch.tensor(s, dtype=torch.int64) for s in sequences])
    g = torch.Generator().manual_seed(seed)
    shape = batch["input_ids"].shape
    # Extras with distinct values per (sequence, position), also where tokens are shared.
    batch["advantages"] = torch.randn(shape, generator=g)
    batch["old_logprobs"] = torch.randn(*shape, 3, generator=g)
    return batch


def original_sequences(batch: dict) -> list[list[int]]:
    lengths = batch["attention_mask"].sum(1).tolist()
    return [batch["input_ids"][i, :n].tolist() for i, n in enumerate(lengths)]


def check_packed(batch: dict, packed, capacity: int) -> None:
    """Every property of a packed batch that a brute-force reference can state."""
    seqs = original_sequences(batch)
    seen_ids = []
    total_unique = 0
    for mb in packed:
        tree = mb["tree"]
        n = tree.padded_length
        assert mb["input_ids"].shape == (1, n) and mb["position_ids"].shape == (1, n)
        assert tree.subtree_end.dtype == torch.int32
        assert tree.num_tree_tokens <= n <= capacity
        seen_ids += tree.sequence_ids.tolist()

        # Node identity: each packed position holds exactly one prefix, each prefix one position.
        prefix_at: dict[int, tuple] = {}
        for i, sid in enumerate(tree.sequence_ids.tolist()):
            seq = seqs[sid]
            index = tree.sequence_token_index(i).tolist()
            assert len(index) == len(seq)
            # Round trip of tokens and of every extra tensor.
            assert mb["input_ids"][0, index].tolist() == seq
            rows = slice(int(tree.cu_seqlens[i]), int(tree.cu_seqlens[i + 1]))
            for name in batch:
                if name not in ("input_ids", "attention_mask"):
                    assert torch.equal(mb[name][rows], batch[name][sid, : len(seq)])
            for d, pos in enumerate(index):
                prefix = tuple(seq[: d + 1])
                assert prefix_at.setdefault(pos, prefix) == prefix
        prefixes = set(prefix_at.values())
        assert len(prefixes) == len(prefix_at), "one prefix laid out twice: sharing is not maximal"
        assert sorted(prefix_at) == list(range(tree.num_tree_tokens)), "real tokens not contiguous"
        total_unique += len(prefix_at)

        # Depth and parent, from the prefixes.
        depth = tree.position_ids.tolist()
        position_of = {p: pos for pos, p in prefix_at.items()}
        for pos, prefix in prefix_at.items():
            assert depth[pos] == len(prefix) - 1
            expected_parent = position_of[prefix[:-1]] if len(prefix) > 1 else -1
            assert int(tree.parent_index[pos]) == expected_parent
        assert all(d == 0 for d in depth[tree.num_tree_tokens :])

        # Mask: k visible from q iff k's prefix is a prefix of q's; padding sees only itself.
        expected = torch.eye(n, dtype=torch.bool)
        for q, pq in prefix_at.items():
            for k, pk in prefix_at.items():
                expected[q, k] = pq[: len(pk)] == pk
        assert torch.equal(build_attention_mask_from_trie(tree), ~expected)

    assert sorted(seen_ids) == list(range(len(seqs))), "every sequence packed exactly once"
    assert packed.num_tree_tokens == total_unique
    assert packed.num_real_tokens == sum(map(len, seqs))


@settings(max_examples=150, deadline=None)
@given(random_tries(), st.sampled_from([1, 4, 8]), st.booleans())
def test_random_tries_match_brute_force(sequences, block_size, pad_to_max):
    batch = make_batch(sequences)
    capacity = block_size * (-(-max(map(len, sequences)) // block_size) + 2)
    packed = build_packed_tree_batch(
        batch,
        max_tokens_per_mb=capacity,
        block_size=block_size,
        pad_to_max=pad_to_max,
        # whole trees, cut at branch points (trunk parts: test_trunk_packing.py)
        share_trunks=False,
    )
    check_packed(batch, packed, capacity)
    for mb in packed:
        n = mb["tree"].padded_length
        assert n % block_size == 0
        assert n == capacity if pad_to_max else n < mb["tree"].num_tree_tokens + block_size


EDGE_CASES = {
    "one sequence": [[5, 6, 7]],
    "one token": [[3]],
    "identical": [[1, 2, 3]] * 4,
    "prefix of another": [[1, 2, 3, 4, 5], [1, 2], [1, 2, 3], [1]],
    "many branches at one node": [[9, 9, 9, b] for b in range(20)],
    "deep multi-turn chain": [list(range(k * 7)) for k in range(1, 9)],
    "branches at several depths": [
        [0, 1, 2, 3, 4, 5],
        [0, 1, 9],
        [0, 1, 2, 3, 8, 8, 8],
        [0, 7],
        [4],
    ],
    "odd lengths": [[1] * 13, [1] * 7 + [2] * 5, [3] * 11],
    "disjoint roots": [[1, 2], [3, 4], [5, 6, 7]],
}


@pytest.mark.parametrize("name", EDGE_CASES)
def test_edge_cases(name):
    batch = make_batch(EDGE_CASES[name])
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=64, block_size=8)
    check_packed(batch, packed, 64)
    assert len(packed) == 1  # everything fits one tree


def test_input_order_does_not_change_sharing():
    seqs = EDGE_CASES["branches at several depths"]
    unique = {
        build_packed_tree_batch(make_batch(s), max_tokens_per_mb=32, block_size=8).num_tree_tokens
        for s in (seqs, seqs[::-1], seqs[2:] + seqs[:2])
    }
    assert unique == {len({tuple(s[: d + 1]) for s in seqs for d in range(len(s))})}


def test_groups_fill_few_trees_and_large_groups_split():
    # 4 prompts of 40 tokens x 4 responses of 6: 64 unique tokens per group.
    seqs = [[p] * 40 + [p, r, r, r, r, r] for p in range(4) for r in range(10, 14)]
    batch = make_batch(seqs)
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=128, block_size=8, pad_to_max=True)
    check_packed(batch, packed, 128)
    assert len(packed) == 2
    # Each group kept whole in one tree.
    for mb in packed:
        assert len({seqs[s][0] for s in mb["tree"].sequence_ids.tolist()}) == 2
    # A group too large for one tree is split, and every tree respects capacity.
    big = make_batch([[1] * 40 + [r] * 10 for r in range(12)])
    packed = build_packed_tree_batch(big, max_tokens_per_mb=80, block_size=8, share_trunks=False)
    check_packed(big, packed, 80)
    assert len(packed) > 1


@pytest.mark.parametrize("make", [grpo_batch, multi_turn_batch])
def test_realistic_batches_round_trip(make):
    batch = make(
        vocab_size=50,
        seed=3,
        **(
            {"prompt_len": 64, "response_len": (8, 16)}
            if make is grpo_batch
            else {"system_len": 16, "task_len": 8, "observation_len": (2, 6), "action_len": (2, 8)}
        ),
    )
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=512, block_size=16)
    # Round trip of every sequence and extra (cheap checks; full mask checks run on small tries).
    for mb in packed:
        tree = mb["tree"]
        for i, sid in enumerate(tree.sequence_ids.tolist()):
            n = int(batch["attention_mask"][sid].sum())
            assert torch.equal(
                tree.input_ids[tree.sequence_token_index(i)], batch["input_ids"][sid, :n]
            )
            assert torch.equal(
                mb["loss_mask"][tree.cu_seqlens[i] : tree.cu_seqlens[i + 1]],
                batch["loss_mask"][sid, :n],
            )
    assert packed.tree_token_ratio < 0.6


def test_alignment_with_parallel_size():
    batch = make_batch([[1, 2, 3], [1, 2, 4, 5, 6, 7]])
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=24, block_size=4, parallel_size=6, pad_to_max=False
    )
    assert packed[0]["tree"].padded_length == 12  # 7 unique tokens -> next multiple of lcm(4, 6)


def test_statistics():
    batch = make_batch([[1, 2, 3, 4], [1, 2, 3, 5], [7]])
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=16, block_size=8, pad_to_max=True)
    assert (packed.num_real_tokens, packed.num_tree_tokens, packed.num_padded_tokens) == (9, 6, 16)
    assert packed.tree_token_ratio == pytest.approx(6 / 9)
    assert "tree_token_ratio=0.6667" in repr(packed)


# ----------------------------------------------------------------------------- errors


def _ok():
    return make_batch([[1, 2, 3], [1, 2]])


@pytest.mark.parametrize(
    "mutate, kwargs, match",
    [
        (None, {}, "max_tokens_per_mb is required"),
        (None, {"max_tokens_per_mb": 0}, "max_tokens_per_mb=0 must be a positive multiple"),
        (
            None,
            {"max_tokens_per_mb": 100, "block_size": 8},
            r"max_tokens_per_mb=100 .* lcm\(block_size=8",
        ),
        (
            None,
            {"max_tokens_per_mb": 32, "block_size": 16, "parallel_size": 6},
            r"lcm\(block_size=16, parallel_size=6\) = 48; e.g. 48",
        ),
        (
            None,
            {"max_tokens_per_mb": 8, "block_size": 0},
            "block_size must be an integer >= 1, got 0",
        ),
        (
            None,
            {"max_tokens_per_mb": 128.0},
            r"max_tokens_per_mb must be an integer, got 128.0 \(float\)",
        ),
        (
            None,
            {"max_tokens_per_mb": True},
            "max_tokens_per_mb must be an integer, got the bool True",
        ),
        (
            None,
            {"max_tokens_per_mb": 128, "block_size": 16.0},
            r"block_size must be an integer, got 16.0",
        ),
        (
            None,
            {"max_tokens_per_mb": 16, "block_size": 8, "pad_token_id": -1},
            "pad_token_id must be an integer >= 0, got -1",
        ),
        (
            None,
            {"max_tokens_per_mb": 16, "block_size": 8, "pad_token_id": 9, "vocab_size": 9},
            "pad_token_id=9 must be < vocab_size=9",
        ),
        (
            None,
            {"max_tokens_per_mb": 16, "block_size": 8, "vocab_size": 3},
            r"input_ids'\] holds token id \d+, outside the vocabulary \[0, 3\)",
        ),
        (
            lambda b: b.update(
                input_ids=torch.ones(2, 20, dtype=torch.int64),
                attention_mask=torch.ones(2, 20),
                advantages=torch.ones(2, 20),
                old_logprobs=torch.ones(2, 20),
            ),
            {"max_tokens_per_mb": 16, "block_size": 8, "share_trunks": False},
            "sequence 0 has 20 tokens, more than max_tokens_per_mb=16.*share_trunks=True",
        ),
        (
            lambda b: b["attention_mask"].__setitem__((0, 0), 0),
            {"max_tokens_per_mb": 16, "block_size": 8},
            r"rows \[0\] are not right-padded",
        ),
        (
            lambda b: b["attention_mask"].__setitem__((1, slice(None)), 0),
            {"max_tokens_per_mb": 16, "block_size": 8},
            r"sequences \[1\] are empty",
        ),
        (
            lambda b: b.update(attention_mask=torch.ones(2, 4)),
            {"max_tokens_per_mb": 16, "block_size": 8},
            "data\\['attention_mask'\\] has shape \\(2, 4\\)",
        ),
        (
            lambda b: b.update(advantages=torch.ones(3, 3)),
            {"max_tokens_per_mb": 16, "block_size": 8},
            "data\\['advantages'\\] must be a tensor shaped \\[B, L, ...\\]",
        ),
        (
            lambda b: b.update(
                input_ids=torch.zeros(0, 3, dtype=torch.int64), attention_mask=torch.zeros(0, 3)
            ),
            {"max_tokens_per_mb": 16, "block_size": 8},
            "the batch is empty",
        ),
        (
            lambda b: b.pop("attention_mask"),
            {"max_tokens_per_mb": 16, "block_size": 8},
            "must be a dict holding 'input_ids'",
        ),
        (
            lambda b: b["input_ids"].__setitem__((0, 0), -5),
            {"max_tokens_per_mb": 16, "block_size": 8},
            "negative token ids",
        ),
        (
            lambda b: b.update(input_ids=b["input_ids"].float()),
            {"max_tokens_per_mb": 16, "block_size": 8},
            "must hold integer token ids",
        ),
        (
            lambda b: b.update(position_ids=torch.zeros(2, 3)),
            {"max_tokens_per_mb": 16, "block_size": 8},
            r"data\['position_ids'\] is reserved",
        ),
    ],
)
def test_errors(mutate, kwargs, match):
    batch = _ok()
    if mutate is not None:
        mutate(batch)
    with pytest.raises(ValueError, match=match):
        build_packed_tree_batch(batch, **kwargs)


# ----------------------------------------------------------------------------- data parallel


def _dp_worker(rank: int) -> dict:
    import torch.distributed as dist

    # Rank 0: 3 disjoint groups of 40 tokens (3 trees of capacity 64); rank 1: one small tree.
    seqs = [[g] * 40 for g in range(3)] if rank == 0 else [[5, 6, 7], [5, 6, 8]]
    batch = make_batch(seqs)
    batch["advantages"] = torch.ones(batch["input_ids"].shape)
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=64, block_size=16, pad_to_max=True, dp_group=dist.group.WORLD
    )
    return {
        "num": len(packed),
        "dummies": packed.num_dummy_trees,
        "shapes": [tuple(mb["input_ids"].shape) for mb in packed],
        "dummy_masks": [
            build_attention_mask_from_trie(mb["tree"]) for mb in packed if mb["tree"].is_dummy
        ],
        "dummy_extras": [mb["advantages"].shape for mb in packed if mb["tree"].is_dummy],
    }


def test_data_parallel_ranks_get_the_same_number_of_trees():
    from harness.dist import run_spawned

    r0, r1 = run_spawned(_dp_worker, 2, megatron=False)
    assert r0["num"] == r1["num"] == 3
    assert (r0["dummies"], r1["dummies"]) == (0, 2)
    assert r0["shapes"] == r1["shapes"] == [(1, 64)] * 3
    for masked in r1["dummy_masks"]:
        assert torch.equal(~masked, torch.eye(64, dtype=torch.bool))  # padding sees only itself
    assert r1["dummy_extras"] == [(0,), (0,)]


@settings(max_examples=40, deadline=None)
@given(random_tries())
def test_unshared_layout_is_one_causal_chain_per_sequence(sequences):
    batch = make_batch(sequences)
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=64, block_size=8, share_prefixes=False
    )
    assert packed.num_tree_tokens == packed.num_real_tokens == sum(map(len, sequences))
    for mb in packed:
        tree = mb["tree"]
        n = tree.padded_length
        owner = torch.full((n,), -1)
        for i, sid in enumerate(tree.sequence_ids.tolist()):
            index = tree.sequence_token_index(i)
            assert mb["input_ids"][0, index].tolist() == sequences[sid]
            assert tree.position_ids[index].tolist() == list(range(len(index)))
            assert (owner[index] == -1).all()
            owner[index] = i
        pos = torch.arange(n)
        same = (owner[:, None] == owner[None, :]) & (owner[:, None] >= 0)
        expected = (same & (pos[None, :] <= pos[:, None])) | torch.eye(n, dtype=torch.bool)
        assert torch.equal(build_attention_mask_from_trie(tree), ~expected)


def test_layout_tree_rejects_a_short_padded_length():
    from megatron_tree.core.packing import layout_tree

    sequences = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    with pytest.raises(
        ValueError, match="padded_length=2 is smaller than the tree's 3 unique tokens"
    ):
        layout_tree(sequences, torch.tensor([3], dtype=torch.int32), padded_length=2)
    assert layout_tree(sequences, torch.tensor([3], dtype=torch.int32), padded_length=4)[5] == 3


def test_attach_and_move_once():
    """Per-token inputs attach in either layout and land where packing puts extras; moving a packed
    batch moves every tensor once (input_ids / position_ids stay views of the moved tree's)."""
    sequences = [[1, 2, 3, 4], [1, 2, 5], [7, 8], [1, 2, 3, 9, 9]]
    batch = make_batch(sequences)
    values = torch.arange(batch["input_ids"].numel(), dtype=torch.float32).view(
        batch["input_ids"].shape
    )
    packed = build_packed_tree_batch({**batch, "v": values}, max_tokens_per_mb=8, block_size=8)
    assert len(packed) > 1
    attached = build_packed_tree_batch(batch, max_tokens_per_mb=8, block_size=8).attach("v", values)
    attached.attach("w", [mb["v"] * 2 for mb in attached])
    for mb, want in zip(attached, packed):
        tree = mb["tree"]
        for i, sid in enumerate(tree.sequence_ids.tolist()):
            rows = slice(int(tree.cu_seqlens[i]), int(tree.cu_seqlens[i + 1]))
            assert mb["v"][rows].tolist() == values[sid, : len(sequences[sid])].tolist()
        assert torch.equal(mb["v"], want["v"]) and torch.equal(mb["w"], 2 * want["v"])
    with pytest.raises(ValueError, match=r"name='tree' is reserved"):
        attached.attach("tree", values)
    with pytest.raises(
        ValueError, match=r"v2: a padded-layout tensor must be \[B, L, ...\] with B = 4"
    ):
        attached.attach("v2", values[:3])
    with pytest.raises(ValueError, match=r"v3: micro-batch 0 needs a tensor \[T=\d+, ...\]"):
        attached.attach("v3", [mb["v"][:-1] for mb in attached])
    with pytest.raises(ValueError, match="got 1 tree-layout tensors for"):
        attached.attach("v4", [attached[0]["v"]])

    moved = attached.to("meta")
    for mb in moved:
        assert all(
            t.is_meta for t in (mb["v"], mb["w"], mb["tree"].subtree_end, mb["tree"].token_index)
        )
        assert mb["input_ids"]._base is mb["tree"].input_ids
        assert mb["position_ids"]._base is mb["tree"].position_ids
    assert (moved.batch_size, moved.num_tree_tokens, moved.max_token_id) == (
        4,
        attached.num_tree_tokens,
        9,
    )


# ----------------------------------------------------------------------------- cuts at branch
# points


def trie_size(sequences) -> int:
    """Unique tokens of the trie of ``sequences``: the number of distinct prefixes."""
    return len({tuple(s[: d + 1]) for s in sequences for d in range(len(s))})


def trie_pairs(sequences) -> int:
    """Attention pairs of the trie: every node sees its ancestors and itself."""
    return sum(len(p) for p in {tuple(s[: d + 1]) for s in sequences for d in range(len(s))})


def set_partitions(items):
    if not items:
        yield []
        return
    for rest in set_partitions(items[1:]):
        for i in range(len(rest)):
            yield rest[:i] + [[items[0]] + rest[i]] + rest[i + 1 :]
        yield [[items[0]]] + rest


def optimum(sequences, capacity) -> tuple[int, int]:
    """Brute force: the fewest trees, then the fewest tokens, over every split of the sequences."""
    best = None
    for blocks in set_partitions(list(range(len(sequences)))):
        sizes = [trie_size([sequences[i] for i in b]) for b in blocks]
        if max(sizes) <= capacity and (best is None or (len(blocks), sum(sizes)) < best):
            best = (len(blocks), sum(sizes))
    return best


def plans(sequences, capacity, **kwargs):
    """Both plans, with trees cut at branch points (no trunk reuse unless asked for)."""
    batch = make_batch(sequences)
    kwargs = {"share_trunks": False, **kwargs}
    return {
        m: build_packed_tree_batch(
            batch, max_tokens_per_mb=capacity, block_size=1, packing=m, **kwargs
        )
        for m in ("runs", "trie")
    }


# Found by a random search: the cut plan alone needs one more tree (5, 84 vs 4, 91) or one more
# token
# (3, 60 vs 3, 59) than the previous plan here; the packer must then keep the previous plan.
WORSE_ALONE = [
    (
        [
            [0, 0, 2, 1, 2, 2, 2, 0, 2],
            [0, 1, 0, 0, 2, 0, 0],
            [0, 1, 0, 0, 2, 0, 1, 0, 0, 0, 0, 2, 2, 1],
            [0, 1, 0, 0, 2, 1],
            [0, 1, 0, 0, 2, 1, 1, 0, 0, 1, 1, 2, 2],
            [0, 1, 0, 0, 2, 1, 1, 0, 0, 1, 2, 1, 0, 1],
            [0, 1, 2],
            [0, 1, 2, 0, 1, 2],
            [0, 1, 2, 1, 1, 1, 1],
            [0, 1, 2, 1, 1, 1, 2, 2, 0, 2, 1],
            [2, 1, 2, 0, 2, 2, 2, 1, 1],
            [2, 1, 2, 2, 1, 2, 0, 0, 2],
            [2, 2, 0, 1, 0, 2, 0, 2, 1],
            [2, 2, 0, 2, 0, 0, 2, 0],
        ],
        11,
    ),
    (
        [
            [0, 0, 0, 0, 1, 0, 1, 1],
            [0, 1, 0, 1],
            [1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0],
            [1, 0, 0, 1, 0, 0, 0, 1, 1],
            [1, 0, 0, 1, 0, 0, 1, 1, 0],
            [1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1],
            [1, 0, 0, 1, 1, 1, 1],
            [1, 1, 1],
            [1, 1, 1, 0, 1],
            [1, 1, 1, 1, 1, 0, 1, 1, 1],
        ],
        12,
    ),
]
# The previous plan's runs [0,2,0,0,0,0,0] and [0,2,1,0,1] share a tree and [0, 2]: it holds
# (3, 32), not the (3, 34) its runs add up to; the cut plan alone packs (3, 33) (capacity 13).
RUNS_SHARE = (
    [
        [0, 2, 1, 0, 0, 0, 0, 0, 0],
        [0, 2, 1, 0, 1],
        [0, 0, 0, 0, 0, 0],
        [0, 2, 1, 0, 0, 1, 0, 0, 0],
        [0],
        [0, 2, 0, 0, 0, 0, 0],
        [0],
        [0, 1, 0, 0],
        [0],
    ],
    4,
)


@settings(max_examples=60, deadline=None)
@given(random_tries(), st.integers(0, 8))
@example(*WORSE_ALONE[0])
@example(*WORSE_ALONE[1])
@example(*RUNS_SHARE)
def test_cuts_at_branch_points_never_pack_worse_than_runs(sequences, slack):
    """Valid tries, and never more trees, nor more tokens in as many trees, than the previous
    plan."""
    capacity = max(map(len, sequences)) + slack
    packed = plans(sequences, capacity)
    check_packed(make_batch(sequences), packed["trie"], capacity)
    runs, trie = packed["runs"], packed["trie"]
    assert (len(trie), trie.num_tree_tokens) <= (len(runs), runs.num_tree_tokens)


def test_runs_in_one_tree_share_their_prefix():
    """RUNS_SHARE by hand: the previous plan's trees hold 13 ([0, 2, 1, 0, 0] and two branches of
    4 and 4), 9 ([0] and branches of 5 and 3) and 10 ([0, 2] and branches of 5 and 3) tokens."""
    sequences, slack = RUNS_SHARE
    packed = plans(sequences, max(map(len, sequences)) + slack)
    assert (len(packed["runs"]), packed["runs"].num_tree_tokens) == (3, 32)
    assert (len(packed["trie"]), packed["trie"].num_tree_tokens) <= (3, 32)


def test_cuts_at_branch_points_near_the_brute_force_optimum():
    """On 80 small random batches the plan is never below the optimum (the token accounting is
    exact) and reaches it in >= 90% of them; the previous plan reaches it far less often."""
    import random

    rng = random.Random(0)
    hits = {"runs": 0, "trie": 0}
    for _ in range(80):
        sequences = []
        for _ in range(rng.randint(2, 6)):
            base = []
            if sequences and rng.random() < 0.7:
                parent = rng.choice(sequences)
                base = parent[: rng.randint(0, len(parent))]
            sequences.append(
                base + [rng.randrange(3) for _ in range(rng.randint(0 if base else 1, 8))]
            )
        capacity = max(map(len, sequences)) + rng.randint(0, 6)
        best = optimum(sequences, capacity)
        for mode, packed in plans(sequences, capacity).items():
            assert (len(packed), packed.num_tree_tokens) >= best
            hits[mode] += (len(packed), packed.num_tree_tokens) == best
    assert hits["trie"] >= 72 and hits["trie"] > hits["runs"] + 8, hits


def test_a_shared_system_prompt_is_repeated_once_per_tree_only():
    """One system prompt shared by tasks, each with branching rollouts: too large for one tree, the
    trie is cut between tasks, so only the system prompt is repeated (runs cut inside a task)."""
    system = [7] * 20
    sequences = [system + [t] * 12 + [t, r] * 4 for t in range(1, 5) for r in range(20, 23)]
    capacity = 112  # two tasks per tree
    unique = trie_size(sequences)  # 20 + 4 * (13 + 3 * 7) = 156
    packed = plans(sequences, capacity)
    check_packed(make_batch(sequences), packed["trie"], capacity)
    assert (len(packed["trie"]), packed["trie"].num_tree_tokens) == (2, unique + len(system))
    assert (len(packed["runs"]), packed["runs"].num_tree_tokens) == (2, 189)
    for mb in packed["trie"]:  # whole tasks per tree
        tasks = [sequences[s][20] for s in mb["tree"].sequence_ids.tolist()]
        assert all(tasks.count(t) == 3 for t in set(tasks))


@pytest.mark.parametrize("seed", [95, 16, 44])
def test_agent_batch_packs_within_3_percent_of_one_trie(seed):
    from megatron_tree.testing.synthetic import agent_batch

    batch = agent_batch(seed=seed)
    one = build_packed_tree_batch(batch, max_tokens_per_mb=128 * 1024).num_tree_tokens
    packed = {  # cut at branch points (trunk reuse is test_trunk_packing's)
        m: build_packed_tree_batch(batch, max_tokens_per_mb=8192, packing=m, share_trunks=False)
        for m in ("runs", "trie")
    }
    assert len(packed["trie"]) == len(packed["runs"]) == 2
    assert packed["trie"].num_tree_tokens <= 1.03 * one < packed["runs"].num_tree_tokens


@settings(max_examples=60, deadline=None)
@given(random_tries(), st.integers(0, 8))
def test_piece_bins_count_their_union_trie(sequences, slack):
    """The planner's token and pair counts per bin equal a brute-force trie of the bin's sequences,
    after packing, longest-cost-first assignment, and moves and swaps (pieces removed again)."""
    from megatron_tree.core.bins import balance_pieces, pack_pieces, refine
    from megatron_tree.core.trie import TrieCounts, cut_tries

    capacity = max(map(len, sequences)) + slack
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    ordered = [sequences[i] for i in order]
    lcp = [0] + [
        next((d for d, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q)))
        for p, q in zip(ordered, ordered[1:])
    ]
    counts = TrieCounts(lcp, [len(s) for s in ordered])
    pieces = cut_tries(counts, max_tokens=capacity)
    assert sorted(i for p in pieces for i in range(p.first, p.end)) == list(range(len(sequences)))
    for piece in pieces:
        members = ordered[piece.first : piece.end]
        assert piece.full_tokens == trie_size(members) <= max(capacity, max(map(len, members)))
        assert piece.base == (0 if not piece.ancestors else piece.ancestors[-1][1])
    weights = (1.0, 0.25)
    packed = pack_pieces(pieces, capacity)
    for bins in (
        packed,
        balance_pieces(pieces, 2, weights, capacity),
        refine(pack_pieces(pieces, capacity), weights, rounds=20, capacity=capacity),
    ):
        assert sorted(p for b in bins for p in b.pieces) == sorted(pieces)
        for b in bins:
            members = [ordered[i] for first, end in b.runs() for i in range(first, end)]
            brute = (trie_size(members), trie_pairs(members))
            assert (b.tokens, b.pairs) == counts.union(b.runs()) == brute
            assert b.tokens <= capacity and (b.tokens > 0) == bool(
                b.pieces
            )  # empty: fewer pieces than bins


# ----------------------------------------------------------------------------- cost


SHAPE = GPTShape(hidden=64, layers=2, heads=4, query_groups=2, ffn_hidden=128, vocab=100)


def test_tree_costs_are_the_flop_model_per_tree():
    batch = make_batch(EDGE_CASES["branches at several depths"] + [[5] * 30, [5] * 29 + [6]])
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=32, block_size=8, cost_model=SHAPE)
    per_token, per_pair = cost_weights(SHAPE)
    costs = packed.tree_costs()
    assert len(costs) == len(packed) == 2
    for mb, cost in zip(packed, costs):
        tree = mb["tree"]
        u = tree.num_tree_tokens
        pairs = int((tree.position_ids[:u] + 1).sum())  # every token sees its ancestors and itself
        assert pairs == attention_pairs(tree)
        assert cost == per_token * u + per_pair * pairs == train_flops([tree], SHAPE)
    assert (packed.min_tree_cost, packed.max_tree_cost) == (min(costs), max(costs))
    assert "tree_tflops_min=" in repr(packed) and "tree_tflops_max=" in repr(packed)
    plain = build_packed_tree_batch(batch, max_tokens_per_mb=32, block_size=8)
    assert plain.max_tree_cost is None and "tflops" not in repr(plain)
    assert plain.tree_costs(SHAPE) == costs and plain.to("cpu").tree_costs(SHAPE) == costs
    assert packed.to("cpu").max_tree_cost == max(costs)
    with pytest.raises(ValueError, match="tree_costs needs a shape"):
        plain.tree_costs()


def test_balance_cost_evens_out_trees():
    """Full trees of a multi-turn batch: moving and swapping pieces lowers the costliest tree."""
    from megatron_tree.testing.synthetic import multi_turn_batch

    batch = multi_turn_batch(
        num_tasks=4,
        rollouts_per_task=4,
        turns=4,
        system_len=32,
        task_len=16,
        observation_len=(4, 12),
        action_len=(4, 16),
        vocab_size=50,
        seed=3,
    )
    plain, balanced = (
        build_packed_tree_batch(
            batch,
            max_tokens_per_mb=256,
            block_size=8,
            cost_model=SHAPE,
            balance_cost=b,
            share_trunks=False,
        )
        for b in (False, True)
    )
    assert len(balanced) == len(plain) == 6
    assert balanced.max_tree_cost < plain.max_tree_cost
    assert (
        balanced.max_tree_cost / balanced.min_tree_cost
        < 1.25
        < plain.max_tree_cost / plain.min_tree_cost
    )
    seen = []
    for mb in balanced:  # a cheap round trip (the property test below checks small tries fully)
        tree = mb["tree"]
        for i, sid in enumerate(tree.sequence_ids.tolist()):
            n = int(batch["attention_mask"][sid].sum())
            assert torch.equal(
                tree.input_ids[tree.sequence_token_index(i)], batch["input_ids"][sid, :n]
            )
        seen += tree.sequence_ids.tolist()
    assert sorted(seen) == list(range(batch["input_ids"].shape[0]))


@settings(max_examples=40, deadline=None)
@given(random_tries(), st.integers(0, 8))
@example([[0] * 9, [0, 0, 1], [0], [0] * 8 + [1]], 0)  # a trie over capacity (found by "wide")
def test_balanced_packing_is_valid_and_uses_no_more_trees(sequences, slack):
    capacity = max(map(len, sequences)) + slack
    batch = make_batch(sequences)
    # Whole trees cut at branch points, as check_packed reads them (trunk parts: elsewhere).
    kwargs = {"max_tokens_per_mb": capacity, "block_size": 1, "share_trunks": False}
    plain = build_packed_tree_batch(batch, **kwargs)
    balanced = build_packed_tree_batch(batch, **kwargs, cost_model=SHAPE, balance_cost=True)
    check_packed(batch, balanced, capacity)
    assert len(balanced) == len(plain)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"packing": "greedy"}, r"packing='greedy' must be one of \('trie', 'runs'\)"),
        ({"balance_cost": True}, r"balance_cost=True needs cost_model \(a GPTShape\)"),
        ({"cost_model": "8b"}, "cost_model must be a GPTShape or None, got str"),
    ],
)
def test_packing_option_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_packed_tree_batch(_ok(), max_tokens_per_mb=16, block_size=8, **kwargs)


# ----------------------------------------------------------------------------- property tests


def test_property_tests_draw_the_same_examples_on_every_run():
    """The default ("ci") Hypothesis profile is derandomized, and a test's own settings (here
    max_examples) override only what they name: two runs of one property draw the same examples."""
    import os

    if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci":
        pytest.skip("the opt-in 'wide' profile draws new random examples on every run")
    runs = [[], []]
    for drawn in runs:

        @settings(max_examples=20)
        @given(st.lists(st.integers(0, 10**9), min_size=3, max_size=3))
        def prop(values):
            drawn.append(values)  # noqa: B023 (prop runs inside this iteration)

        prop()
    assert len(runs[0]) == 20 and runs[0] == runs[1]
    assert settings.get_profile("ci").deadline is None and settings.get_profile("ci").print_blob


def test_min_micro_batches_appends_all_padding_fill_ins():
    """min_micro_batches=4 on a batch that packs into one tree: three all-padding trees follow it
    (padded like the real one, no sequence, no real row); a bad value is refused by name."""
    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 9])]
    packed = build_packed_tree_batch(
        {"input_ids": seqs},
        max_tokens_per_mb=64,
        block_size=16,
        pad_to_max=True,
        min_micro_batches=4,
    )
    alone = build_packed_tree_batch({"input_ids": seqs}, max_tokens_per_mb=64, block_size=16)
    assert len(alone) == 1 and len(packed) == 4
    assert packed.num_dummy_trees == 3
    for mb in list(packed)[1:]:
        assert mb.tree.num_sequences == 0 and mb.rows.num_real == 0
        assert mb.tree.padded_length == packed[0].tree.padded_length == 64
    with pytest.raises(ValueError, match="min_micro_batches"):
        build_packed_tree_batch({"input_ids": seqs}, max_tokens_per_mb=64, min_micro_batches=0)


def test_micro_batch_multiple_rounds_the_count_up_with_fill_ins():
    """micro_batch_multiple=3 on a batch of two trees: one fill-in makes three."""
    seqs = [torch.arange(1, 10), torch.arange(11, 20)]  # 9 + 9 tokens: two trees of 16
    alone = build_packed_tree_batch({"input_ids": seqs}, max_tokens_per_mb=16, block_size=16)
    packed = build_packed_tree_batch(
        {"input_ids": seqs}, max_tokens_per_mb=16, block_size=16, micro_batch_multiple=3
    )
    assert len(alone) == 2 and len(packed) == 3 and packed.num_dummy_trees == 1
