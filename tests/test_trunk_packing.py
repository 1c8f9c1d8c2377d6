"""Trunk reuse packing (``share_trunks=True``) against brute-force references.

The reference identifies every trie node with its prefix (the tuple of tokens on its path) and
counts, for each prefix, the distinct prefixes extending it (itself included): its subtree size.
From the original sequences alone it then states which tries must get a trunk, which prefixes form
it, where each sequence's loss must be taken and which keys each row of each part may attend to.
The group tree G is read back only through ``parent_index`` / ``input_ids`` (a node's prefix is the
walk to its root), never through the implementation's planning helpers.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_tree.core.mask import allowed
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.trunk import TreePart, TrunkKeyValues, part_attention_mask
from megatron_tree.testing.synthetic import multi_turn_batch, pad_sequences

PAD = 0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These batches are tiny: on a busy 2-core machine torch's intra-op threads only wait for each
    other (one ``repeat_interleave`` of 5 elements took ~10 ms with 2 threads, ~10 us with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Brute-force reference
# ---------------------------------------------------------------------------------------------


def original_sequences(batch: dict) -> list[tuple[int, ...]]:
    lengths = batch["attention_mask"].sum(1).tolist()
    return [tuple(batch["input_ids"][i, :n].tolist()) for i, n in enumerate(lengths)]


def subtree_sizes(seqs) -> Counter:
    """{prefix: number of distinct prefixes extending it, itself included} over the batch's trie."""
    prefixes = {s[:d] for s in seqs for d in range(1, len(s) + 1)}
    size = Counter()
    for p in prefixes:
        for d in range(1, len(p) + 1):
            size[p[:d]] += 1
    return size


def first_fit_decreasing(sizes: list[int], capacity: int) -> int:
    """The number of bins first-fit-decreasing fills (independent of how equal sizes are ordered)."""
    room: list[int] = []
    for n in sorted(sizes, reverse=True):
        for b, left in enumerate(room):
            if n <= left:
                room[b] -= n
                break
        else:
            room.append(capacity - n)
    return len(room)


def branch_pieces(size: Counter, capacity: int, roots) -> list[int]:
    """Sizes of the subtrees hanging below trunk nodes of the tries rooted at ``roots``."""
    return [n for p, n in size.items()
            if p[0] in roots and n <= capacity and len(p) > 1 and size[p[:-1]] > capacity]


def expected_trunk_roots(size: Counter, capacity: int, align: int) -> tuple[set[int], set[int]]:
    """(root tokens of the tries that must get a trunk, those larger than the capacity that must
    not). A trie gets one when it holds more than ``capacity`` nodes, its trunk (nodes whose subtree
    holds more) fits one micro-batch, and it pays: trunk x (branch micro-batches - 1) exceeds the
    trunk's padding to the alignment."""
    trunk_size = Counter(p[0] for p, n in size.items() if n > capacity)
    large = {p[0] for p, n in size.items() if len(p) == 1 and n > capacity}
    fits = set()
    for r in large:
        t = trunk_size[r]
        branches = first_fit_decreasing(branch_pieces(size, capacity, {r}), capacity)
        if t <= capacity and t * (branches - 1) > -t % align:
            fits.add(r)
    return fits, large - fits


def walk_tree(tree) -> tuple[list[tuple[int, ...]], list[set[int]]]:
    """Per position of G: its prefix (real nodes only) and its ancestor-or-self set, by walking
    ``parent_index`` up to the root."""
    parent = tree.parent_index.tolist()
    ids = tree.input_ids.tolist()
    u = tree.num_tree_tokens
    prefixes, ancestors = [], []
    for p in range(tree.padded_length):
        chain, x = [], p
        while x >= 0:
            chain.append(x)
            assert len(chain) <= tree.padded_length, "parent_index has a cycle"
            x = parent[x]
        if p >= u:
            assert chain == [p], "a padding position has a parent"
        else:
            assert all(c < u for c in chain), "a real node hangs below padding"
            prefixes.append(tuple(ids[c] for c in reversed(chain)))
        ancestors.append(set(chain))
    return prefixes, ancestors


def pack(batch, capacity, *, block_size=16, parallel_size=1, pad_to_max=False, **kwargs):
    return build_packed_tree_batch(
        batch, max_tokens_per_mb=capacity, block_size=block_size, parallel_size=parallel_size,
        pad_to_max=pad_to_max, pad_token_id=PAD, share_trunks=True, **kwargs,
    )


def check_trunk_batch(batch: dict, packed, capacity: int, align: int) -> dict:
    """Every property of a trunk-reuse packing a brute-force reference can state; returns counts of
    what the batch exercised."""
    seqs = original_sequences(batch)
    size = subtree_sizes(seqs)
    trunk_roots, fallback_roots = expected_trunk_roots(size, capacity, align)
    extras = [k for k in batch if k not in ("input_ids", "attention_mask")]

    # 1. Coverage: every sequence in exactly one micro-batch, its tokens (and extras) read back.
    seen = Counter()
    groups: dict[int, list[dict]] = defaultdict(list)
    ordinary_tokens = 0
    for mb in packed:
        tree = mb["tree"]
        cu = tree.cu_seqlens.tolist()
        for i, sid in enumerate(tree.sequence_ids.tolist()):
            seen[sid] += 1
            index = tree.token_index[cu[i] : cu[i + 1]]
            assert tuple(tree.input_ids[index].tolist()) == seqs[sid]
            for name in extras:
                assert torch.equal(mb[name][cu[i] : cu[i + 1]], batch[name][sid, : len(seqs[sid])])
        if "part" in mb:
            assert isinstance(mb["part"], TreePart)
            groups[mb["part"].group].append(mb)
        else:
            roots = {seqs[sid][0] for sid in tree.sequence_ids.tolist()}
            assert not roots & trunk_roots, "a trie with a fitting trunk was packed the ordinary way"
            assert tree.padded_length <= capacity
            ordinary_tokens += tree.num_tree_tokens
    assert sorted(seen) == list(range(len(seqs))) and set(seen.values()) <= {1}, \
        f"sequences not packed exactly once: {dict(seen)}"

    grouped_roots: list[int] = []
    group_tokens = 0
    multi_trie_groups = 0
    in_trunk = 0
    for g, mbs in groups.items():
        mbs.sort(key=lambda mb: mb["part"].index)
        parts = [mb["part"] for mb in mbs]
        n_parts = len(parts)
        assert [p.index for p in parts] == list(range(n_parts))
        assert all(p.num_parts == n_parts for p in parts) and n_parts >= 2
        G = parts[0].tree
        assert all(p.tree is G for p in parts), "parts of one group on different trees"
        assert all(p.group == g for p in parts)
        u, n = G.num_tree_tokens, G.padded_length
        prefixes, ancestors = walk_tree(G)

        # G is the trie of its sequences, each prefix laid out once.
        group_sids = sorted(sid for mb in mbs for sid in mb["tree"].sequence_ids.tolist())
        assert sorted(G.sequence_ids.tolist()) == group_sids
        assert len(set(prefixes)) == u, "a prefix laid out twice in G"
        assert set(prefixes) == {seqs[s][:d] for s in group_sids for d in range(1, len(seqs[s]) + 1)}
        roots = {seqs[s][0] for s in group_sids}
        assert roots <= trunk_roots, f"tries {roots - trunk_roots} got a trunk but must not"
        assert group_sids == sorted(s for s in range(len(seqs)) if seqs[s][0] in roots), "a trie split over groups"
        grouped_roots += sorted(roots)
        multi_trie_groups += len(roots) > 1
        group_tokens += u

        # The parts partition G's real positions; padding rows come after them.
        owner = {}
        pads = []
        for p in parts:
            pos = p.positions.tolist()
            assert pos == sorted(set(pos)), "positions not strictly ascending"
            real, pad = pos[: p.num_real], pos[p.num_real :]
            assert all(x < u for x in real) and all(x >= u for x in pad)
            for x in real:
                assert x not in owner, f"G position {x} in parts {owner[x]} and {p.index}"
                owner[x] = p.index
            pads += pad
            assert p.num_real <= capacity, f"part {p.index}: {p.num_real} real rows > capacity {capacity}"
            assert p.num_rows % align == 0 and p.num_real <= p.num_rows < p.num_real + align
            assert p.num_rows >= 1
            expected_trunk = None if p.index == 0 else parts[0].positions.tolist()
            assert (p.trunk is None) == (p.index == 0)
            if p.trunk is not None:
                assert p.trunk.tolist() == expected_trunk
        assert sorted(owner) == list(range(u)), "the parts miss real nodes of G"
        assert sorted(pads) == list(range(u, n)), "padding rows do not partition G's padding"

        # 2. The trunk: exactly the nodes whose subtree holds more than the capacity.
        trunk_prefixes = {prefixes[x] for x, i in owner.items() if i == 0}
        expected = {prefixes[x] for x in range(u) if size[prefixes[x]] > capacity}
        assert trunk_prefixes == expected, (
            f"trunk differs: extra {sorted(trunk_prefixes - expected)[:3]}, missing {sorted(expected - trunk_prefixes)[:3]}"
        )
        # The branches: the subtrees hanging below the trunk, first-fit-decreasing.
        assert n_parts - 1 == first_fit_decreasing(branch_pieces(size, capacity, roots), capacity)
        # Branches hold whole subtrees hanging below trunk nodes (or roots).
        parent = G.parent_index.tolist()
        for x in range(u):
            px = parent[x]
            if px >= 0 and owner[px] != 0:
                assert owner[x] == owner[px], f"node {x} cut from its parent {px}'s branch"
            if owner[x] == 0 and px >= 0:
                assert owner[px] == 0, "trunk not ancestor-closed"

        for mb, p in zip(mbs, parts):
            pos = p.positions.tolist()
            # 5. Rows: tokens and depths read off G's prefixes.
            depth = [len(prefixes[x]) - 1 if x < u else 0 for x in pos]
            tokens = [prefixes[x][-1] if x < u else PAD for x in pos]
            assert mb["input_ids"].shape == mb["position_ids"].shape == (1, len(pos))
            assert mb["position_ids"][0].tolist() == depth
            assert mb["input_ids"][0].tolist() == tokens
            assert p.max_depth == max(depth[: p.num_real], default=0)

            # 3. Loss sites: the part holding each sequence's last token takes it; a sequence
            # ending in the trunk (its last node's subtree > capacity) is the trunk's.
            view = mb["tree"]
            assert view.input_ids is G.input_ids or torch.equal(view.input_ids, G.input_ids)
            assert torch.equal(G.token_index[p.group_tokens], view.token_index)
            cu = view.cu_seqlens.tolist()
            real = set(pos[: p.num_real])
            for i, sid in enumerate(view.sequence_ids.tolist()):
                index = view.token_index[cu[i] : cu[i + 1]].tolist()
                assert [prefixes[x] for x in index] == [seqs[sid][: d + 1] for d in range(len(index))]
                assert index[-1] in real, f"sequence {sid}'s last token is not in part {p.index}"
                ends_in_trunk = size[seqs[sid]] > capacity
                assert (p.index == 0) == ends_in_trunk
                in_trunk += ends_in_trunk

        check_masks(parts, ancestors)

    assert sorted(grouped_roots) == sorted(trunk_roots), "a trie with a fitting trunk got no trunk group"
    assert len(grouped_roots) == len(set(grouped_roots))
    assert packed.num_tree_tokens == group_tokens + ordinary_tokens
    if not fallback_roots:  # nothing is repeated: every distinct prefix counted once
        assert packed.num_tree_tokens == len(size)
        assert packed.tree_token_ratio == pytest.approx(len(size) / sum(map(len, seqs)))
    return {"groups": len(groups), "in_trunk": in_trunk, "fallback": len(fallback_roots),
            "multi_trie_groups": multi_trie_groups, "ordinary": sum("part" not in mb for mb in packed)}


def check_masks(parts: list[TreePart], ancestors: list[set[int]]) -> None:
    """4. Every part's mask over its context against "key is an ancestor-or-self of the row in G",
    and the keys/values hook merging [trunk ; own] into context order."""
    store = TrunkKeyValues(False)
    trunk_pos = parts[0].positions.tolist()
    masks = [part_attention_mask(p, store) for p in parts]
    for p, mask in zip(parts, masks):
        pos = p.positions.tolist()
        context = pos if p.index == 0 else sorted(set(trunk_pos) | set(pos))
        ends = mask.plan.subtree_end[0]
        assert ends.shape == (len(context),)
        assert torch.equal(torch.Tensor.as_subclass(mask, torch.Tensor), ends)
        queries = mask.plan.query_positions
        if p.index == 0:
            assert queries is None
            q = torch.arange(len(pos))
        else:
            assert queries.tolist() == [context.index(x) for x in pos]
            q = queries
        got = allowed(ends.to(torch.int64), q[:, None], torch.arange(len(context))[None, :])
        expected = torch.tensor([[k in ancestors[x] for k in context] for x in pos], dtype=torch.bool)
        if not torch.equal(got, expected):
            r, j = torch.nonzero(got != expected)[0].tolist()
            raise AssertionError(
                f"part {p.index}: row {r} (G position {pos[r]}) vs key {j} (G position {context[j]}): "
                f"mask says {bool(got[r, j])}, G says {bool(expected[r, j])}"
            )
        assert mask.plan.rotary_length == p.max_depth + 1

    # The keys/values hook: the trunk records its keys, each branch gets [trunk ; own] in context
    # order (keys and values tagged with their G positions).
    def tagged(pos):
        return torch.tensor(pos, dtype=torch.float32).view(-1, 1, 1, 1)

    masks[0].plan.keys_values(tagged(trunk_pos), -tagged(trunk_pos), 1)
    for p, mask in zip(parts[1:], masks[1:]):
        pos = p.positions.tolist()
        key, value = mask.plan.keys_values(tagged(pos), -tagged(pos), 1)
        context = sorted(set(trunk_pos) | set(pos))
        assert key.flatten().tolist() == context and (-value).flatten().tolist() == context


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def unpad(batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    lengths = batch["attention_mask"].sum(1).tolist()
    return ([batch["input_ids"][i, :n] for i, n in enumerate(lengths)],
            [batch["loss_mask"][i, :n] for i, n in enumerate(lengths)])


def agent_like_batch(seed: int = 0) -> dict:
    """Two multi-turn tries over a small vocabulary (each above 64 unique tokens, one system prompt
    each), a strict prefix of the first system prompt (it ends inside the trunk), a duplicate
    sequence and a few short unrelated sequences packed the ordinary way."""
    seqs, masks = [], []
    for s, first in ((seed, 1), (seed + 100, 2)):
        b = multi_turn_batch(num_tasks=4, rollouts_per_task=4, turns=(1, 2), system_len=8, task_len=4,
                             observation_len=(2, 4), action_len=(2, 5), vocab_size=5, seed=s)
        b["input_ids"][:, 0] = first  # a distinct root token per trie
        ss, mm = unpad(b)
        seqs += ss
        masks += mm
    seqs.append(seqs[0][:6].clone())  # a strict prefix of the first system prompt
    masks.append(torch.ones(6))
    seqs.append(seqs[3].clone())  # a duplicate
    masks.append(masks[3].clone())
    g = torch.Generator().manual_seed(seed)
    for first in (3, 4):  # small tries
        for _ in range(2):
            tail = torch.randint(0, 5, (int(torch.randint(1, 8, (), generator=g)),), generator=g)
            seqs.append(torch.cat([torch.tensor([first]), tail]))
            masks.append(torch.rand(len(tail) + 1, generator=g))
    return pad_sequences(seqs, masks)


@pytest.mark.parametrize("pad_to_max", [False, True])
@pytest.mark.parametrize("capacity, block_size, parallel_size", [(32, 16, 1), (48, 8, 3), (64, 16, 1), (128, 16, 1)])
def test_agent_batch(capacity, block_size, parallel_size, pad_to_max):
    batch = agent_like_batch()
    seqs = original_sequences(batch)
    assert max(map(len, seqs)) <= capacity
    align = math.lcm(block_size, parallel_size)
    packed = pack(batch, capacity, block_size=block_size, parallel_size=parallel_size, pad_to_max=pad_to_max)
    stats = check_trunk_batch(batch, packed, capacity, align)
    size = subtree_sizes(seqs)
    prefix = seqs[-6]  # the strict system-prompt prefix of the first trie (root token 1)
    assert len(prefix) == 6 and prefix[0] == 1 and size[prefix] > capacity
    if capacity <= 64:  # the first trie gets a trunk; the prefix ends in it
        assert stats["groups"] >= 1 and stats["ordinary"] >= 1 and stats["in_trunk"] >= 1
    if capacity == 32:  # both multi-turn tries get one, in one group
        assert stats["fallback"] == 0 and stats["multi_trie_groups"] >= 1
    # Without trunk reuse: no parts at all (and the same sequences).
    plain = build_packed_tree_batch(batch, max_tokens_per_mb=capacity, block_size=block_size,
                                    parallel_size=parallel_size, pad_to_max=pad_to_max)
    assert not any("part" in mb for mb in plain)
    assert sorted(sid for mb in plain for sid in mb["tree"].sequence_ids.tolist()) == list(range(len(seqs)))
    assert packed.num_tree_tokens <= plain.num_tree_tokens


def test_share_trunks_needs_shared_prefixes():
    batch = agent_like_batch()
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=32, block_size=16, share_trunks=True,
                                     share_prefixes=False)
    assert not any("part" in mb for mb in packed)


def test_sequence_ending_in_trunk_takes_loss_in_trunk():
    """A system prompt of 16 tokens, 4 branches of 14 below it and the prompt's first 7 and all 16
    tokens as sequences of their own: with capacity 32 the prompt (its last node's subtree holds
    1 + 56 nodes) is the trunk, the prefix sequences take their loss there, the branches go to
    branch parts."""
    system = list(range(1, 17))
    seqs = [system[:7], system] + [system + [30 + b] * 14 for b in range(4)]
    batch = pad_sequences([torch.tensor(s) for s in seqs])
    packed = pack(batch, 32)
    stats = check_trunk_batch(batch, packed, 32, 16)
    assert stats == {"groups": 1, "in_trunk": 2, "fallback": 0, "multi_trie_groups": 0, "ordinary": 0}
    trunk = next(mb for mb in packed if mb["part"].index == 0)
    assert sorted(trunk["tree"].sequence_ids.tolist()) == [0, 1]
    assert trunk["part"].num_real == 16 and trunk["part"].num_rows == 16
    # The branches (14 nodes each) pair up: two branch parts of 28 real rows.
    branches = [mb["part"] for mb in packed if mb["part"].index > 0]
    assert sorted(p.num_real for p in branches) == [28, 28]


def test_trunk_larger_than_capacity_falls_back():
    """Root 0, three stems of 15 tokens below it, each ending in three tails of 16: every sequence
    has 32 tokens (fits capacity 32), each stem node's subtree holds 15 + 48 > 32 nodes, so the
    trunk is 1 + 3 x 15 = 46 nodes > 32: that trie is cut the ordinary way. A second trie (root 9)
    with a 10-token trunk still gets trunk reuse in the same batch."""
    seqs = []
    for b in (1, 2, 3):
        stem = [0] + [b] * 15
        for t in range(3):
            seqs.append(stem + [4 + t] * 16)
    small_trunk = [9] * 10
    for t in range(3):
        seqs.append(small_trunk + [4 + t] + [5] * 15)
    batch = pad_sequences([torch.tensor(s) for s in seqs])
    size = subtree_sizes(original_sequences(batch))
    assert sum(n > 32 for p, n in size.items() if p[0] == 0) == 46
    assert sum(n > 32 for p, n in size.items() if p[0] == 9) == 10
    for pad_to_max in (False, True):
        packed = pack(batch, 32, pad_to_max=pad_to_max)
        stats = check_trunk_batch(batch, packed, 32, 16)
        assert stats["groups"] == 1 and stats["fallback"] == 1
        part_sids = {sid for mb in packed if "part" in mb for sid in mb["tree"].sequence_ids.tolist()}
        assert part_sids == {9, 10, 11}
        assert packed.num_tree_tokens > len(size)  # the fallback trie repeats its stems


# ---------------------------------------------------------------------------------------------
# Property test
# ---------------------------------------------------------------------------------------------


def random_batch(seed: int, capacity: int) -> list[list[int]]:
    """1-3 tries over a vocabulary of 2-4 tokens (distinct root tokens, or merged roots), each a
    random stem with sequences grown from earlier ones: branches, strict prefixes, duplicates."""
    rng = random.Random(seed)
    vocab = rng.randint(2, 4)
    seqs: list[list[int]] = []
    for t in range(rng.randint(1, 3)):
        root = t if rng.random() < 0.8 else 0
        stem = [root] + [rng.randrange(vocab) for _ in range(rng.randint(0, capacity // 2))]
        own: list[list[int]] = [stem]
        longest = rng.choice([capacity // 2, capacity])  # long tails make wide trunks, some too large
        for _ in range(rng.randint(1, 16)):
            base = rng.choice(own)
            base = base[: rng.randint(1, len(base))]
            seq = (base + [rng.randrange(vocab) for _ in range(rng.randint(0, longest))])[:capacity]
            own.append(seq)
        seqs += own
    rng.shuffle(seqs)
    return seqs


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([32, 48]), st.booleans())
def test_random_batches_match_brute_force(seed, capacity, pad_to_max):
    seqs = random_batch(seed, capacity)
    batch = pad_sequences([torch.tensor(s) for s in seqs])
    g = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g)
    packed = pack(batch, capacity, pad_to_max=pad_to_max)
    check_trunk_batch(batch, packed, capacity, 16)
