"""Trunk reuse packing (``share_trunks=True``) against brute-force references.

The reference identifies every trie node with its prefix (the tuple of tokens on its path) and
counts, for each prefix, the distinct prefixes extending it (itself included): its subtree size.
From the original sequences alone it then states each trie's trunk (the prefixes whose subtree
holds more than the capacity), the rows of a reference trunk plan (the trunk as a chain of parts of
at most the capacity, the subtrees below it in first-fit-decreasing branch bins) and the rows of
cutting it at its branch points (pieces as prefix sets, packed first-fit-decreasing where they add
the fewest nodes), every micro-batch padded to the alignment (to the capacity with pad_to_max);
where each sequence's loss must be taken and which keys each row of each part may attend to. A
packing without trunk reuse gives the rows of a trie that is cut.

Exact structure is checked (every node computed once in a group, the trunk, whole subtrees in
branches, loss sites, masks); the bin packing is held to invariants only: a group never computes
more rows than the reference plan, a trie that must run with trunk reuse (a sequence longer than
the capacity) does, a batch never computes more rows than the reference choice (trunk reuse where
the reference plan computes fewer rows than the packer's cut, tries grouped first-fit-decreasing by
trunk size) and a lone trie no more than the better of its two plans. A better packer passes. The
group tree G is read back only through ``parent_index`` / ``input_ids`` (a node's prefix is the
walk to its root), never through the implementation's planning helpers.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tree.core.mask import allowed, tree_attention_mask
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.rows import KeyValueStore, TreeRows
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
    prefixes = nodes_of(map(tuple, seqs))
    size = Counter()
    for p in prefixes:
        for d in range(1, len(p) + 1):
            size[p[:d]] += 1
    return size


def row_padding(capacity: int, align: int, pad_to_max: bool):
    """Real rows -> the rows of a micro-batch (a part too): the capacity with ``pad_to_max``
    (constant shapes), else rounded up to the alignment, at least one block."""
    if pad_to_max:
        return lambda n: capacity
    return lambda n: max(-(-n // align), 1) * align


def ffd_bins(sizes: list[int], capacity: int) -> list[list[int]]:
    """The items (indices) of each bin first-fit-decreasing fills, equal sizes in index order; an
    item larger than the capacity gets a bin of its own."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                loads[b] += sizes[i]
                bins[b].append(i)
                break
        else:
            loads.append(sizes[i])
            bins.append([i])
    return bins


def ffd_loads(sizes: list[int], capacity: int) -> list[int]:
    """The loads of the bins first-fit-decreasing fills (independent of how equal sizes are
    ordered)."""
    return [sum(sizes[i] for i in b) for b in ffd_bins(sizes, capacity)]


def trunk_size(size: Counter, capacity: int, roots) -> int:
    return sum(n > capacity for p, n in size.items() if p[0] in roots)


def trunk_plan(size: Counter, capacity: int, roots) -> tuple[list[int], list[int]]:
    """(real rows of each trunk part in order, of each branch) of the tries rooted at ``roots``
    run together with trunk reuse: the trunk (prefixes whose subtree holds more than the
    capacity) cut into parts of ``capacity`` nodes, the subtrees hanging below it (or whole tries
    that fit) bin-packed first-fit-decreasing."""
    t = trunk_size(size, capacity, roots)
    parts = [capacity] * (t // capacity) + ([t % capacity] if t % capacity else [])
    pieces = [
        n
        for p, n in size.items()
        if p[0] in roots and n <= capacity and (len(p) == 1 or size[p[:-1]] > capacity)
    ]
    return parts, ffd_loads(pieces, capacity)


def plan_rows(plan: tuple[list[int], list[int]], pad) -> int:
    return sum(pad(n) for n in plan[0] + plan[1])


def plain_pack(seqs, capacity: int, block_size: int, parallel_size: int, pad_to_max: bool = False):
    """``seqs`` packed without trunk reuse."""
    return build_packed_tree_batch(
        pad_sequences([torch.tensor(s) for s in seqs]),
        max_tokens_per_mb=capacity,
        block_size=block_size,
        parallel_size=parallel_size,
        pad_to_max=pad_to_max,
        pad_token_id=PAD,
        share_trunks=False,
    )


def plain_rows(seqs, capacity: int, block_size: int, parallel_size: int, pad_to_max: bool) -> int:
    """Rows of ``seqs`` packed without trunk reuse."""
    plain = plain_pack(seqs, capacity, block_size, parallel_size, pad_to_max)
    assert all(mb["rows"].group is None and mb["rows"].is_whole for mb in plain)
    return plain.num_padded_tokens


def nodes_of(seqs) -> set[tuple[int, ...]]:
    return {s[:d] for s in seqs for d in range(1, len(s) + 1)}


def cut_rows(seqs, capacity: int, pad) -> int:
    """Rows of one trie cut at its branch points, the pieces bin-packed alone: a piece (the
    sequences below a node, with the path to it) larger than the capacity splits at its top
    branch node (the shallowest with two children) into one piece per child, the sequences ending
    above it going with the first; pieces by decreasing size (then in pre-order) each go to the
    first bin where they add the fewest nodes, within the capacity; every bin padded."""
    pieces, stack = [], [sorted(set(map(tuple, seqs)))]
    while stack:
        piece = stack.pop()
        nodes = nodes_of(piece)
        forks = [
            v
            for v in nodes
            if len({s[len(v)] for s in piece if len(s) > len(v) and s[: len(v)] == v}) > 1
        ]
        if len(nodes) <= capacity or not forks:
            pieces.append((-len(nodes), piece[0], nodes))
            continue
        v = min(forks, key=len)
        children = sorted({s[len(v)] for s in piece if len(s) > len(v)})
        split = [[s for s in piece if len(s) > len(v) and s[len(v)] == c] for c in children]
        split[0] = [s for s in piece if len(s) <= len(v)] + split[0]
        stack += split
    bins: list[set] = []
    for _, _, nodes in sorted(pieces, key=lambda p: p[:2]):
        fits = [
            (len(nodes - b), i) for i, b in enumerate(bins) if len(nodes - b) <= capacity - len(b)
        ]
        if fits:
            bins[min(fits)[1]] |= nodes
        else:
            bins.append(set(nodes))
    return sum(pad(len(b)) for b in bins)


def expected_choice(
    seqs, size: Counter, capacity: int, pad, plain_rows
) -> tuple[dict[int, tuple[int, int | None]], set[int]]:
    """({root token: (trunk plan rows, rows without trunk reuse or None)} of every trie larger
    than the capacity, the roots of the tries that must run with trunk reuse). A trie does when its
    trunk plan computes fewer rows than the packer computes for it alone without trunk reuse
    (``plain_rows(members)``: cut at branch points or as contiguous runs, whichever it picks), or
    when it holds a sequence longer than the capacity (None: it cannot be packed without)."""
    by_root = defaultdict(list)
    for s in seqs:
        by_root[s[0]].append(s)
    costs = {}
    for r, members in by_root.items():
        if size[(r,)] <= capacity:
            continue
        trunk = plan_rows(trunk_plan(size, capacity, {r}), pad)
        too_long = max(map(len, members)) > capacity
        costs[r] = (trunk, None if too_long else plain_rows(members))
    return costs, {r for r, (trunk, cut) in costs.items() if cut is None or trunk < cut}


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
        batch,
        max_tokens_per_mb=capacity,
        block_size=block_size,
        parallel_size=parallel_size,
        pad_to_max=pad_to_max,
        pad_token_id=PAD,
        share_trunks=True,
        **kwargs,
    )


def check_trunk_batch(
    batch: dict,
    packed,
    capacity: int,
    *,
    block_size: int = 16,
    parallel_size: int = 1,
    pad_to_max: bool = False,
) -> dict:
    """Every property of a trunk-reuse packing a brute-force reference can state; returns counts of
    what the batch exercised."""
    align = math.lcm(block_size, parallel_size)
    seqs = original_sequences(batch)
    size = subtree_sizes(seqs)
    pad = row_padding(capacity, align, pad_to_max)
    costs, chosen = expected_choice(
        seqs,
        size,
        capacity,
        pad,
        lambda m: plain_pack(m, capacity, block_size, parallel_size, pad_to_max).num_padded_tokens,
    )
    must = {r for r, (_, cut) in costs.items() if cut is None}
    extras = [k for k in batch if k not in ("input_ids", "attention_mask")]

    # 1. Coverage: every sequence in exactly one micro-batch, its tokens (and extras) read back.
    seen = Counter()
    groups: dict[int, list[dict]] = defaultdict(list)
    places: dict[int, list[int]] = defaultdict(list)
    ordinary_tokens = 0
    ordinary_roots: set[int] = set()
    for i_mb, mb in enumerate(packed):
        tree, rows = mb["tree"], mb["rows"]
        assert isinstance(rows, TreeRows)
        cu = tree.cu_seqlens.tolist()
        for i, sid in enumerate(tree.sequence_ids.tolist()):
            seen[sid] += 1
            index = tree.token_index[cu[i] : cu[i + 1]]
            assert tuple(tree.input_ids[index].tolist()) == seqs[sid]
            for name in extras:
                assert torch.equal(mb[name][cu[i] : cu[i + 1]], batch[name][sid, : len(seqs[sid])])
        if rows.group is not None:
            groups[rows.group].append(mb)
            places[rows.group].append(i_mb)
        else:
            roots = {seqs[sid][0] for sid in tree.sequence_ids.tolist()}
            assert not roots & must, "a trie holding a sequence over the capacity was cut"
            ordinary_roots |= roots
            assert rows.is_whole and rows.tree is tree and rows.stored is None and not rows.records
            assert rows.num_real == tree.num_tree_tokens and rows.num_rows == tree.padded_length
            assert tree.padded_length <= capacity and tree.padded_length % align == 0
            if pad_to_max:
                assert tree.padded_length == capacity
            ordinary_tokens += tree.num_tree_tokens
    assert sorted(seen) == list(range(len(seqs))) and set(seen.values()) <= {1}, (
        f"sequences not packed exactly once: {dict(seen)}"
    )

    # A group's parts run one after another, in order, trunk parts first.
    for g, where in places.items():
        assert where == list(range(where[0], where[0] + len(where))), f"group {g} is interleaved"

    grouped_roots: list[int] = []
    group_rows = 0
    group_tokens = 0
    multi_trie_groups = chains = in_trunk = 0
    for g, mbs in groups.items():
        parts = [mb["rows"] for mb in mbs]
        n_parts = len(parts)
        assert [p.index for p in parts] == list(range(n_parts)), "a group's parts out of order"
        assert all(p.num_parts == n_parts for p in parts) and n_parts >= 2
        G = parts[0].tree
        assert all(p.tree is G for p in parts), "parts of one group on different trees"
        assert all(p.group == g for p in parts)
        assert [p.ends_group for p in parts] == [False] * (n_parts - 1) + [True]
        u, n = G.num_tree_tokens, G.padded_length
        prefixes, ancestors = walk_tree(G)

        # G is the trie of its sequences, each prefix laid out once.
        group_sids = sorted(sid for mb in mbs for sid in mb["tree"].sequence_ids.tolist())
        assert sorted(G.sequence_ids.tolist()) == group_sids
        assert len(set(prefixes)) == u, "a prefix laid out twice in G"
        assert set(prefixes) == nodes_of(seqs[s] for s in group_sids)
        roots = {seqs[s][0] for s in group_sids}
        assert roots <= set(costs), f"tries {roots - set(costs)} fit one micro-batch: no trunk"
        assert group_sids == sorted(s for s in range(len(seqs)) if seqs[s][0] in roots), (
            "a trie split over groups"
        )
        grouped_roots += sorted(roots)
        multi_trie_groups += len(roots) > 1
        group_tokens += u

        # The plan: the trunk as a chain of as few parts as the capacity allows, then branches
        # holding the rest; no more rows than the reference plan (branches first-fit-decreasing),
        # whatever bin packer fills the branches.
        trunk_rows, branch_rows = trunk_plan(size, capacity, roots)
        n_trunk = sum(p.records for p in parts)
        assert [p.records for p in parts] == [True] * n_trunk + [False] * (n_parts - n_trunk)
        assert n_trunk == len(trunk_rows), "the trunk in more parts than the capacity needs"
        assert sum(p.num_real for p in parts[:n_trunk]) == sum(trunk_rows), "trunk parts differ"
        assert sum(p.num_real for p in parts[n_trunk:]) == sum(branch_rows), "branches differ"
        rows = sum(p.num_rows for p in parts)
        assert rows <= plan_rows((trunk_rows, branch_rows), pad), "more rows than the plan"
        group_rows += rows
        firsts = [int(p.positions[0]) for p in parts[n_trunk:]]
        assert firsts == sorted(firsts), "branches not in pre-order of their first piece"
        chains += n_trunk > 1

        # The parts partition G's real positions; padding rows come after them.
        owner = {}
        pads = []
        for p in parts:
            pos = p.positions.tolist()
            assert pos == sorted(set(pos)), "positions not strictly ascending"
            real, tail = pos[: p.num_real], pos[p.num_real :]
            assert all(x < u for x in real) and all(x >= u for x in tail)
            for x in real:
                assert x not in owner, f"G position {x} in parts {owner[x]} and {p.index}"
                owner[x] = p.index
            pads += tail
            assert 1 <= p.num_real <= capacity, f"part {p.index}: {p.num_real} real rows"
            assert p.num_rows == pad(p.num_real)
            # Part i extends the keys of the trunk parts before it (a branch: all of them).
            before = min(p.index, n_trunk)
            assert p.stored_parts == before and (p.stored is None) == (before == 0)
            if before:
                stored = [x for q in parts[:before] for x in q.positions.tolist()]
                assert p.stored.tolist() == stored, f"part {p.index}: stored keys differ"
        assert sorted(owner) == list(range(u)), "the parts miss real nodes of G"
        assert sorted(pads) == list(range(u, n)), "padding rows do not partition G's padding"

        # 2. The trunk: exactly the nodes whose subtree holds more than the capacity, laid out in
        # consecutive pre-order slices (ascending positions, part after part).
        trunk_pos = [x for p in parts[:n_trunk] for x in p.positions[: p.num_real].tolist()]
        assert trunk_pos == sorted(trunk_pos), "trunk parts are not consecutive pre-order slices"
        trunk_prefixes = {prefixes[x] for x in trunk_pos}
        expected = {prefixes[x] for x in range(u) if size[prefixes[x]] > capacity}
        assert trunk_prefixes == expected, (
            f"trunk differs: extra {sorted(trunk_prefixes - expected)[:3]}, missing "
            f"{sorted(expected - trunk_prefixes)[:3]}"
        )
        # Branches hold whole subtrees hanging below trunk nodes (or roots).
        parent = G.parent_index.tolist()
        for x in range(u):
            px = parent[x]
            if px >= 0 and owner[px] >= n_trunk:
                assert owner[x] == owner[px], f"node {x} cut from its parent {px}'s branch"
            if owner[x] < n_trunk and px >= 0:
                assert owner[px] < n_trunk, "trunk not ancestor-closed"

        for mb, p in zip(mbs, parts):
            pos = p.positions.tolist()
            # 5. Rows: tokens and depths read off G's prefixes.
            depth = [len(prefixes[x]) - 1 if x < u else 0 for x in pos]
            tokens = [prefixes[x][-1] if x < u else PAD for x in pos]
            assert mb["input_ids"].shape == mb["position_ids"].shape == (1, len(pos))
            assert mb["position_ids"][0].tolist() == depth
            assert mb["input_ids"][0].tolist() == tokens
            assert p.reach == max(depth[: p.num_real]) + 1

            # 3. Loss sites: the part holding each sequence's last token takes it; a sequence
            # ending in the trunk (its last node's subtree > capacity) is a trunk part's.
            view = mb["tree"]
            assert view.input_ids is G.input_ids or torch.equal(view.input_ids, G.input_ids)
            assert torch.equal(G.token_index[p.group_tokens], view.token_index)
            cu = view.cu_seqlens.tolist()
            for i, sid in enumerate(view.sequence_ids.tolist()):
                index = view.token_index[cu[i] : cu[i + 1]].tolist()
                path = [seqs[sid][: d + 1] for d in range(len(index))]
                assert [prefixes[x] for x in index] == path
                assert owner[index[-1]] == p.index, f"sequence {sid} ends outside part {p.index}"
                ends_in_trunk = size[seqs[sid]] > capacity
                assert p.records == ends_in_trunk
                in_trunk += ends_in_trunk

        check_masks(parts, ancestors)

    assert must <= set(grouped_roots), "a trie holding a sequence over the capacity got no group"
    assert len(grouped_roots) == len(set(grouped_roots)) and not ordinary_roots & set(grouped_roots)
    assert packed.num_tree_tokens == group_tokens + ordinary_tokens
    assert packed.num_padded_tokens == sum(mb["rows"].num_rows for mb in packed)
    fallback = set(costs) - set(grouped_roots)
    if not fallback:  # nothing is repeated: every distinct prefix counted once
        assert packed.num_tree_tokens == len(size)
        assert packed.tree_token_ratio == pytest.approx(len(size) / sum(map(len, seqs)))
    # Never more rows than the reference: the tries it chooses, grouped first-fit-decreasing by
    # trunk size (ties in root order), each group's reference plan, the rest packed without trunk
    # reuse.
    trunks = {r: trunk_size(size, capacity, {r}) for r in sorted(chosen)}
    reference = sum(
        plan_rows(trunk_plan(size, capacity, {list(trunks)[i] for i in members}), pad)
        for members in ffd_bins(list(trunks.values()), capacity)
    )
    rest = [s for s in seqs if s[0] not in chosen]
    if rest:
        reference += plain_rows(rest, capacity, block_size, parallel_size, pad_to_max)
    assert packed.num_padded_tokens <= reference, "more rows than the reference choice"
    if len({s[0] for s in seqs}) == 1 and costs:
        # One large trie: no more rows than the better of its two plans.
        ((trunk, cut),) = costs.values()
        assert packed.num_padded_tokens <= (trunk if cut is None else min(trunk, cut))
    return {
        "groups": len(groups),
        "grouped": set(grouped_roots),
        "in_trunk": in_trunk,
        "fallback": len(fallback),
        "multi_trie_groups": multi_trie_groups,
        "chains": chains,
        "costs": costs,
        "ordinary": sum(mb["rows"].group is None for mb in packed),
    }


def check_masks(parts: list[TreeRows], ancestors: list[set[int]]) -> None:
    """4. Every part's mask over its context against "key is an ancestor-or-self of the row in G",
    and the keys/values of [stored ; own] put in context order through the store."""
    n_trunk = sum(p.records for p in parts)
    store = KeyValueStore(False)

    def tagged(pos, layer):  # keys tagged with their G positions and layer
        return torch.tensor([4 * x + layer for x in pos], dtype=torch.float32).view(-1, 1, 1, 1)

    for p in parts:
        pos = p.positions.tolist()
        stored = [] if p.stored is None else p.stored.tolist()
        context = sorted(stored + pos)
        assert len(set(context)) == len(context), f"part {p.index}: a key twice in its context"
        assert p.key_positions.tolist() == context and p.num_keys == len(context)
        for x in pos:
            assert ancestors[x] <= set(context), f"part {p.index}: G position {x} misses ancestors"
        mask = tree_attention_mask(p, store=store)
        ends = mask.plan.subtree_end[0]
        assert ends.shape == (len(context),)
        assert torch.equal(torch.Tensor.as_subclass(mask, torch.Tensor), ends)
        q = mask.plan.query_positions
        assert q.tolist() == [context.index(x) for x in pos]
        got = allowed(ends.to(torch.int64), q[:, None], torch.arange(len(context))[None, :])
        expected = torch.tensor(
            [[k in ancestors[x] for k in context] for x in pos], dtype=torch.bool
        )
        if not torch.equal(got, expected):
            r, j = torch.nonzero(got != expected)[0].tolist()
            raise AssertionError(
                f"part {p.index}: row {r} (G position {pos[r]}) vs key {j} (G position "
                f"{context[j]}): mask says {bool(got[r, j])}, G says {bool(expected[r, j])}"
            )
        assert mask.plan.reach == p.reach
        # Keys/values: a trunk part records its own, every part gets [stored ; own] in context
        # order, per layer.
        for layer in (0, 1):
            key, value = mask.plan.keys_values(tagged(pos, layer), -tagged(pos, layer), layer)
            want = [4 * x + layer for x in context]
            assert key.flatten().tolist() == want and (-value).flatten().tolist() == want
    assert set(store.saved) == {(i, layer) for i in range(n_trunk) for layer in (0, 1)}

    # A part run before the trunk parts it extends finds no recorded keys.
    later = parts[1]
    key = torch.zeros(later.num_rows, 1, 1, 1)
    with pytest.raises(ValueError, match="run in order"):
        tree_attention_mask(later, store=KeyValueStore(False)).plan.keys_values(key, key, 0)
    with pytest.raises(ValueError, match="KeyValueStore"):
        tree_attention_mask(parts[0])


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def unpad(batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    lengths = batch["attention_mask"].sum(1).tolist()
    return (
        [batch["input_ids"][i, :n] for i, n in enumerate(lengths)],
        [batch["loss_mask"][i, :n] for i, n in enumerate(lengths)],
    )


def agent_like_batch(seed: int = 0) -> dict:
    """Two multi-turn tries over a small vocabulary (each above 64 unique tokens, one system prompt
    each), a strict prefix of the first system prompt (it ends inside the trunk), a duplicate
    sequence and a few short unrelated sequences packed the ordinary way."""
    seqs, masks = [], []
    for s, first in ((seed, 1), (seed + 100, 2)):
        b = multi_turn_batch(
            num_tasks=4,
            rollouts_per_task=4,
            turns=(1, 2),
            system_len=8,
            task_len=4,
            observation_len=(2, 4),
            action_len=(2, 5),
            vocab_size=5,
            seed=s,
        )
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


# (capacity, pad_to_max) where the reference trunk plan of the first multi-turn trie computes far
# fewer rows than cutting it (176 and 192 rows against 256): trunk reuse must be taken.
TRUNK_WINS = {(32, False), (32, True)}


@pytest.mark.parametrize("pad_to_max", [False, True])
@pytest.mark.parametrize(
    "capacity, block_size, parallel_size", [(32, 16, 1), (48, 8, 3), (64, 16, 1), (128, 16, 1)]
)
def test_agent_batch(capacity, block_size, parallel_size, pad_to_max):
    batch = agent_like_batch()
    seqs = original_sequences(batch)
    assert max(map(len, seqs)) <= capacity
    packed = pack(
        batch, capacity, block_size=block_size, parallel_size=parallel_size, pad_to_max=pad_to_max
    )
    stats = check_trunk_batch(
        batch,
        packed,
        capacity,
        block_size=block_size,
        parallel_size=parallel_size,
        pad_to_max=pad_to_max,
    )
    size = subtree_sizes(seqs)
    prefix = seqs[-6]  # the strict system-prompt prefix of the first trie (root token 1)
    assert len(prefix) == 6 and prefix[0] == 1 and size[prefix] > capacity
    # check_trunk_batch holds the rows to the reference; here what the batch must exercise.
    assert 1 in stats["costs"] and stats["ordinary"] >= 1
    if (capacity, pad_to_max) in TRUNK_WINS:
        assert 1 in stats["grouped"]
    if 1 in stats["grouped"]:  # the strict prefix ends in the trunk: its loss in a trunk part
        assert stats["in_trunk"] >= 1
    # Without trunk reuse: no parts at all (and the same sequences).
    plain = build_packed_tree_batch(
        batch,
        max_tokens_per_mb=capacity,
        block_size=block_size,
        parallel_size=parallel_size,
        pad_to_max=pad_to_max,
        share_trunks=False,
    )
    assert not any(mb["rows"].group is not None for mb in plain)
    sids = sorted(sid for mb in plain for sid in mb["tree"].sequence_ids.tolist())
    assert sids == list(range(len(seqs)))
    assert packed.num_tree_tokens <= plain.num_tree_tokens


def test_share_trunks_needs_shared_prefixes():
    batch = agent_like_batch()
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=32, block_size=16, share_trunks=True, share_prefixes=False
    )
    assert not any(mb["rows"].group is not None for mb in packed)
    # A sequence longer than the capacity then cannot run as a chain either: the message names
    # share_prefixes, the option to change, not share_trunks, which is on already.
    long = pad_sequences([torch.arange(1, 41)])
    with pytest.raises(ValueError, match="needs share_prefixes=True") as error:
        build_packed_tree_batch(
            long, max_tokens_per_mb=32, block_size=16, share_trunks=True, share_prefixes=False
        )
    assert "pack with share_trunks=True" not in str(error.value)
    with pytest.raises(ValueError, match="pack with share_trunks=True"):
        build_packed_tree_batch(long, max_tokens_per_mb=32, block_size=16, share_trunks=False)


def test_sequence_ending_in_trunk_takes_loss_in_trunk():
    """A system prompt of 16 tokens, 4 branches of 14 below it and the prompt's first 7 and all 16
    tokens as sequences of their own: with capacity 32 the prompt (its last node's subtree holds
    1 + 56 nodes) is the trunk, the prefix sequences take their loss there, the branches go to
    branch parts (16 + 2 x 32 rows against 4 x 32 cut)."""
    system = list(range(1, 17))
    seqs = [system[:7], system] + [system + [30 + b] * 14 for b in range(4)]
    batch = pad_sequences([torch.tensor(s) for s in seqs])
    packed = pack(batch, 32)
    stats = check_trunk_batch(batch, packed, 32)
    assert stats["costs"][1][0] == 80 and stats["grouped"] == {1}
    assert {k: v for k, v in stats.items() if k not in ("costs", "grouped")} == {
        "groups": 1,
        "in_trunk": 2,
        "fallback": 0,
        "multi_trie_groups": 0,
        "chains": 0,
        "ordinary": 0,
    }
    trunk = next(mb for mb in packed if mb["rows"].index == 0)
    assert sorted(trunk["tree"].sequence_ids.tolist()) == [0, 1]
    assert trunk["rows"].num_real == 16 and trunk["rows"].num_rows == 16
    # The branches (14 nodes each) fill two branch parts (56 nodes, more than one holds).
    branches = [mb["rows"] for mb in packed if mb["rows"].index > 0]
    assert len(branches) == 2 and sum(p.num_real for p in branches) == 56


@pytest.mark.parametrize("pad_to_max", [False, True])
def test_trunk_larger_than_capacity_runs_as_a_chain(pad_to_max):
    """Root 0, three stems of 15 tokens below it, each ending in three tails of 16: every sequence
    has 32 tokens (fits capacity 32), each stem node's subtree holds 15 + 48 > 32 nodes, so the
    trunk is 1 + 3 x 15 = 46 nodes: a chain of two trunk parts (32 + 14 -> 48 rows) and five
    branches of two tails (144 rows) against nine cut pieces of 32 (288 rows). A second trie
    (root 9) with a 10-token trunk gets trunk reuse too (16 + 32 + 16 rows against three pieces
    of 26 -> 96), in a group of its own (46 + 10 > 32). With pad_to_max every micro-batch has 32
    rows: the first trie still takes trunk reuse (7 against 9 micro-batches), the second ties
    (3 against 3) and is cut."""
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
    assert trunk_size(size, 32, {0}) == 46 and trunk_size(size, 32, {9}) == 10
    packed = pack(batch, 32, pad_to_max=pad_to_max)
    stats = check_trunk_batch(batch, packed, 32, pad_to_max=pad_to_max)
    reference = {0: 224, 9: 96} if pad_to_max else {0: 192, 9: 64}
    assert {r: trunk for r, (trunk, _) in stats["costs"].items()} == reference
    assert stats["grouped"] == ({0} if pad_to_max else {0, 9}) and stats["chains"] >= 1
    # Nothing repeated, but for the cut trie's stem (in each of its micro-batches).
    assert packed.num_tree_tokens <= len(size) + (2 * 10 if pad_to_max else 0)
    chain = [mb["rows"] for mb in packed if mb["rows"].group is not None and mb["rows"].records]
    assert sum(p.num_real for p in chain) == 46 + (0 if pad_to_max else 10) and len(chain) >= 2


def test_trunk_that_computes_more_rows_is_not_used():
    """Five tails of 33-61 tokens below one shared root token, capacity 64: the trunk plan (the
    root, padded to 16 rows, and five branches: 288 rows) computes more than cutting (five pieces
    repeating the root: 272 rows), so the trie is cut. Below a 30-token shared prompt the trunk
    plan wins."""
    g = torch.Generator().manual_seed(0)
    tails = [torch.randint(2, 50, (n,), generator=g).tolist() for n in (40, 50, 33, 61, 45)]
    batch = pad_sequences([torch.tensor([1] + t) for t in tails])
    packed = pack(batch, 64)
    stats = check_trunk_batch(batch, packed, 64)
    assert stats["costs"][1][0] == 288 and stats["groups"] == 0 and stats["fallback"] == 1
    assert packed.num_padded_tokens <= 272
    prompt = torch.randint(2, 50, (30,), generator=g).tolist()
    batch = pad_sequences([torch.tensor(prompt + t[: 64 - 30]) for t in tails])
    packed = pack(batch, 64)
    stats = check_trunk_batch(batch, packed, 64)
    trunk, cut = stats["costs"][prompt[0]]
    assert trunk < cut and stats["groups"] == 1
    assert [mb["rows"].index for mb in packed] == list(range(len(packed)))


@pytest.mark.parametrize("stem, trunk_wins", [(16, True), (17, False)])
def test_equal_rows_are_cut(stem, trunk_wins):
    """A stem and four tails of 15 at capacity 48 (alignment 16). A 17-token stem pads to 32 rows:
    the trunk plan (32 + 48 + 16 rows) computes as many rows as cutting (two micro-batches of
    17 + 15 + 15 = 47 -> 48 rows), and a tie is cut. A 16-token stem tips it (80 against 96)."""
    seqs = [[1] * stem + [2 + b] * 15 for b in range(4)]
    batch = pad_sequences([torch.tensor(s) for s in seqs])
    packed = pack(batch, 48)
    stats = check_trunk_batch(batch, packed, 48)
    assert stats["costs"][1][0] == (80 if trunk_wins else 96)
    assert stats["groups"] == int(trunk_wins)
    assert packed.num_padded_tokens <= (80 if trunk_wins else 96)


def test_choice_compares_with_the_cut_the_packer_makes():
    """Root 1 with three children of 17, 16 and 16 nodes, capacity 32 (alignment 16). Trunk reuse:
    the root (16 rows) and branches [17], [16 + 16] (64 rows), 80 rows. Cut at the root, the three
    pieces (18, 17, 17 nodes with the root) pair with none: 96 rows; so trunk reuse is chosen. But
    packed without trunk reuse the trie is two contiguous runs of 24 and 28 nodes: 64 rows."""
    seqs = [
        [1, 2, 3],
        [1, 2, 4] + [5] * 14,
        [1, 6] + [7] * 5,
        [1, 6] + [8] * 10,
        [1, 9] + [10] * 15,
    ]
    size = subtree_sizes(seqs)
    pad = row_padding(32, 16, False)
    assert plan_rows(trunk_plan(size, 32, {1}), pad) == 80 and cut_rows(seqs, 32, pad) == 96
    plain = plain_pack(seqs, 32, 16, 1)
    packed = pack(pad_sequences([torch.tensor(s) for s in seqs]), 32)
    assert packed.num_padded_tokens <= plain.num_padded_tokens <= 64


def test_grpo_prompt_group():
    """One prompt of 110 tokens with 8 responses of 12 (distinct first tokens), capacity 124,
    alignment 1: cutting repeats the prompt in 8 micro-batches (976 rows); with trunk reuse the
    prompt's first 82 tokens (subtree > 124) are one trunk part and the rest, 28 + 96 = 124 nodes,
    one branch: 2 micro-batches of exactly the trie's 206 unique tokens."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(20, 1000, (110,), generator=g)
    seqs = [
        torch.cat([prompt, torch.tensor([1 + r]), torch.randint(20, 1000, (11,), generator=g)])
        for r in range(8)
    ]
    batch = pad_sequences(seqs, [torch.cat([torch.zeros(110), torch.ones(12)])] * 8)
    plain = build_packed_tree_batch(
        batch, max_tokens_per_mb=124, block_size=1, pad_to_max=False, share_trunks=False
    )
    assert len(plain) == 8 and plain.num_padded_tokens == 976
    packed = pack(batch, 124, block_size=1)
    assert len(packed) == 2
    assert packed.num_tree_tokens == 206 and packed.num_padded_tokens == 206
    assert [mb["rows"].num_real for mb in packed] == [82, 124]
    stats = check_trunk_batch(batch, packed, 124, block_size=1)
    assert stats["costs"] == {int(prompt[0]): (206, 976)} and stats["groups"] == 1


def test_long_shared_history_runs_as_a_chain():
    """A 300-token shared history, 6 tasks of 12-32 tokens each with 2 responses of 4 (task
    subtrees of 20-40 nodes), capacity 64, alignment 16: every sequence is longer than the
    capacity, the history is the trunk and runs as a chain of ceil(300 / 64) = 5 trunk parts,
    the tasks fill the branches, and every unique token is computed once."""
    g = torch.Generator().manual_seed(5)
    history = torch.randint(20, 1000, (300,), generator=g)
    seqs = []

    def tokens(first, n):  # a distinct first token, then random ones
        return torch.cat([torch.tensor([first]), torch.randint(20, 1000, (n - 1,), generator=g)])

    for t, task_len in enumerate((12, 16, 20, 24, 28, 32)):
        task = tokens(1 + t, task_len)
        for r in range(2):
            response = tokens(2 + r, 4)
            seqs.append(torch.cat([history, task, response]))
    batch = pad_sequences(seqs)
    size = subtree_sizes(original_sequences(batch))
    assert trunk_size(size, 64, {int(history[0])}) == 300
    with pytest.raises(ValueError, match="share_trunks"):
        build_packed_tree_batch(batch, max_tokens_per_mb=64, block_size=16, share_trunks=False)
    for pad_to_max in (False, True):
        packed = pack(batch, 64, pad_to_max=pad_to_max)
        stats = check_trunk_batch(batch, packed, 64, pad_to_max=pad_to_max)
        rows = 64 * 8 if pad_to_max else 64 * 4 + 48 + 64 * 3  # 5 trunk parts, 3 branches
        assert stats["costs"] == {int(history[0]): (rows, None)}
        assert stats["groups"] == 1 and stats["chains"] == 1 and stats["ordinary"] == 0
        trunk_parts = [mb["rows"].num_real for mb in packed if mb["rows"].records]
        assert len(trunk_parts) == 5 and sum(trunk_parts) == 300
        assert packed.num_tree_tokens == len(size) == 300 + sum(n + 8 for n in range(12, 33, 4))


def test_sequence_longer_than_capacity():
    """One sequence of 200 tokens, capacity 64: its first 136 tokens (subtree > 64) are the trunk,
    a chain of three parts (64, 64 and 8 rows, or any split as cheap), the last 64 one branch
    taking its loss; every token once. Without trunk reuse it is refused, naming share_trunks."""
    seq = torch.randint(1, 1000, (200,), generator=torch.Generator().manual_seed(7))
    batch = pad_sequences([seq], [torch.ones(200)])
    with pytest.raises(ValueError, match="share_trunks=True"):
        build_packed_tree_batch(batch, max_tokens_per_mb=64, block_size=16, share_trunks=False)
    packed = pack(batch, 64)
    stats = check_trunk_batch(batch, packed, 64)
    parts = [mb["rows"] for mb in packed]
    assert [p.records for p in parts] == [True] * 3 + [False]
    assert sum(p.num_real for p in parts[:3]) == 136 and parts[3].num_real == 64
    assert sorted(x for p in parts for x in p.positions[: p.num_real].tolist()) == list(range(200))
    assert packed.num_tree_tokens == 200 and packed.num_padded_tokens <= 64 + 64 + 16 + 64
    assert [mb["tree"].num_sequences for mb in packed] == [0, 0, 0, 1]
    assert stats["in_trunk"] == 0 and stats["costs"] == {int(seq[0]): (208, None)}


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------


def random_trie(
    rng: random.Random, root: int, vocab: int, capacity: int, longest: int
) -> list[list[int]]:
    """A random stem with sequences grown from earlier ones: branches, strict prefixes,
    duplicates, at most ``longest`` tokens each."""
    stem = [root] + [rng.randrange(vocab) for _ in range(rng.randint(0, capacity // 2))]
    own: list[list[int]] = [stem[:longest]]
    tail = rng.choice([capacity // 2, capacity, longest])  # long tails make wide trunks
    for _ in range(rng.randint(1, 16)):
        base = rng.choice(own)
        base = base[: rng.randint(1, len(base))]
        own.append((base + [rng.randrange(vocab) for _ in range(rng.randint(0, tail))])[:longest])
    return own


def random_batch(seed: int, capacity: int) -> list[list[int]]:
    """1-3 tries over a vocabulary of 2-4 tokens (distinct root tokens, or merged roots); now and
    then one whose sequences may be longer than the capacity."""
    rng = random.Random(seed)
    vocab = rng.randint(2, 4)
    seqs: list[list[int]] = []
    for t in range(rng.randint(1, 3)):
        root = t if rng.random() < 0.8 else 0
        longest = capacity if rng.random() < 0.7 else rng.choice([2, 3]) * capacity
        seqs += random_trie(rng, root, vocab, capacity, longest)
    rng.shuffle(seqs)
    return seqs


ALIGNMENTS = [(32, 16, 1), (48, 16, 1), (48, 8, 3), (32, 1, 1)]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(ALIGNMENTS), st.booleans())
def test_random_batches_match_brute_force(seed, layout, pad_to_max):
    capacity, block_size, parallel_size = layout
    seqs = random_batch(seed, capacity)
    batch = pad_sequences([torch.tensor(s) for s in seqs])
    g = torch.Generator().manual_seed(seed % 2**31)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g)
    packed = pack(
        batch, capacity, block_size=block_size, parallel_size=parallel_size, pad_to_max=pad_to_max
    )
    check_trunk_batch(
        batch,
        packed,
        capacity,
        block_size=block_size,
        parallel_size=parallel_size,
        pad_to_max=pad_to_max,
    )


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(ALIGNMENTS), st.booleans())
def test_one_trie_takes_the_plan_with_fewer_rows(seed, layout, pad_to_max):
    """A batch of one trie larger than the capacity: no more rows than the better of the reference
    trunk plan and the packer's own cut (check_trunk_batch), and trunk reuse whenever even the
    reference trunk plan computes fewer rows than the cut."""
    capacity, block_size, parallel_size = layout
    rng = random.Random(seed)
    seqs = random_trie(rng, 1, rng.randint(2, 5), capacity, capacity)
    while len(subtree_sizes(seqs)) <= capacity:
        seqs += random_trie(rng, 1, rng.randint(2, 5), capacity, capacity)
    batch = pad_sequences([torch.tensor(s) for s in seqs])
    packed = pack(
        batch, capacity, block_size=block_size, parallel_size=parallel_size, pad_to_max=pad_to_max
    )
    stats = check_trunk_batch(
        batch,
        packed,
        capacity,
        block_size=block_size,
        parallel_size=parallel_size,
        pad_to_max=pad_to_max,
    )
    ((trunk, cut),) = stats["costs"].values()
    if trunk < cut:  # even the reference plan beats the packer's cut
        assert stats["groups"] == 1
