"""Tests of megatron_tree.core.logprobs against per-sequence, unpacked float64 references.

Trees are built here by an independent dict-based trie (pre-order DFS); the references use nothing
of a tree but ``token_index``, to read each sequence's logits rows out of the packed logits, and
take labels from the original sequences.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.dist import run_spawned
from megatron_tree.core import fused_logprobs
from megatron_tree.core import logprobs as logprobs_module
from megatron_tree.core.checks import set_debug_checks
from megatron_tree.core.logprobs import (
    gather_packed_tree_logprobs,
    gather_packed_tree_logprobs_entropy,
    gather_packed_tree_logprobs_entropy_from_hidden,
)
from megatron_tree.core.results import (
    gather_packed_tree_values,
    gather_packed_tree_vocab_stats,
    merge_packed_tree_results,
)
from megatron_tree.core.tree import PackedTree
from megatron_tree.testing.tolerances import (
    FP32_LOGSOFTMAX_TOL,
    FP32_TP_LOGSOFTMAX_TOL,
    FP32_VOCAB_LOGSOFTMAX_TOL,
    FP64_TOL,
)

VOCAB = 48  # divisible by 2 and 4 for the TP tests


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# Independent trie builder and references
# ------------------------------------------------------------------------------------------------


def build_tree(seqs: list[list[int]], ids: list[int], pad_to: int | None = None) -> PackedTree:
    """Packs ``seqs[i] for i in ids`` into one pre-order trie, sequence_ids = ids in that order."""
    children: list[dict[int, int]] = [{}]  # trie node 0 is a virtual root above all trees
    tokens = [-1]
    paths = []
    for i in ids:
        node, path = 0, []
        for tok in seqs[i]:
            if tok not in children[node]:
                children[node][tok] = len(tokens)
                tokens.append(tok)
                children.append({})
            node = children[node][tok]
            path.append(node)
        paths.append(path)
    pos, order, parent_pos, depth = {}, [], {}, {}
    stack = [(c, -1, 0) for c in reversed(list(children[0].values()))]
    while stack:
        node, par, d = stack.pop()
        pos[node] = len(order)
        order.append(node)
        parent_pos[node], depth[node] = par, d
        stack.extend((c, pos[node], d + 1) for c in reversed(list(children[node].values())))
    num_nodes = len(order)
    size = [1] * num_nodes
    for p in range(num_nodes - 1, -1, -1):
        if parent_pos[order[p]] >= 0:
            size[parent_pos[order[p]]] += size[p]
    n = num_nodes if pad_to is None else pad_to
    assert n >= num_nodes
    lengths = [len(path) for path in paths]
    return PackedTree(
        input_ids=torch.tensor([tokens[v] for v in order] + [0] * (n - num_nodes)),
        position_ids=torch.tensor([depth[v] for v in order] + [0] * (n - num_nodes)),
        subtree_end=torch.tensor(
            [p + size[p] for p in range(num_nodes)] + list(range(num_nodes + 1, n + 1)),
            dtype=torch.int32,
        ),
        parent_index=torch.tensor([parent_pos[v] for v in order] + [-1] * (n - num_nodes)),
        sequence_ids=torch.tensor(ids, dtype=torch.int64),
        cu_seqlens=torch.tensor([0] + [sum(lengths[: k + 1]) for k in range(len(lengths))]),
        token_index=torch.tensor([pos[v] for path in paths for v in path], dtype=torch.int64),
        num_tree_tokens=num_nodes,
    )


def random_sequences(gen: torch.Generator, num_groups: int, vocab: int = VOCAB) -> list[list[int]]:
    """Prompt groups with branches, duplicates, prefixes of other sequences and length-1 seqs."""

    def rand(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    seqs = []
    for _ in range(num_groups):
        group = [rand(randint(1, 6)) + rand(randint(1, 8))]
        for _ in range(randint(1, 6)):
            base = group[randint(0, len(group))]
            kind = randint(0, 4)
            if kind == 0:
                group.append(list(base))  # identical
            elif kind == 1:
                group.append(base[: randint(1, len(base) + 1)])  # a prefix (maybe length 1)
            else:
                group.append(base[: randint(0, len(base) + 1)] + rand(randint(1, 6)))  # branch
        seqs.extend(group)
    return seqs


def reference(
    logits: torch.Tensor,
    tree: PackedTree,
    seqs,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float64,
):
    """Per-sequence unpacked log_softmax in ``dtype``: (logprobs [T], entropy [T]) in tree order."""
    logits = logits.reshape(tree.padded_length, -1).to(dtype)
    lps, ents = [], []
    for i, b in enumerate(tree.sequence_ids.tolist()):
        seq = torch.tensor(seqs[b])
        rows = logits[tree.token_index[int(tree.cu_seqlens[i]) : int(tree.cu_seqlens[i + 1])]]
        logp = torch.log_softmax(rows / temperature, dim=-1)  # [L, V]
        lps.append(torch.cat([logp[torch.arange(len(seq) - 1), seq[1:]], logp.new_zeros(1)]))
        ents.append(-(logp.exp() * logp).sum(-1))
    empty = logits.new_zeros(0)
    return torch.cat([empty, *lps]), torch.cat([empty, *ents])


def random_case(seed: int, num_groups: int = 3, vocab: int = VOCAB, pad: int = 5):
    gen = torch.Generator().manual_seed(seed)
    seqs = random_sequences(gen, num_groups, vocab)
    ids = torch.randperm(len(seqs), generator=gen).tolist()
    tree = build_tree(seqs, ids)
    tree = build_tree(seqs, ids, pad_to=tree.num_tree_tokens + pad)
    logits = torch.randn(tree.padded_length, vocab, generator=gen)
    return seqs, tree, logits


def check_trie_invariant(tree: PackedTree) -> None:
    """Within a sequence, each token's packed parent is the previous token's position."""
    for i in range(tree.num_sequences):
        idx = tree.sequence_token_index(i)
        assert tree.parent_index[idx[0]] == -1
        assert torch.equal(tree.parent_index[idx[1:]], idx[:-1])


def _dummy(n: int) -> PackedTree:
    """An all-padding tree of length n, as packing appends to keep DP ranks in step."""
    return PackedTree(
        input_ids=torch.zeros(n, dtype=torch.int64),
        position_ids=torch.zeros(n, dtype=torch.int64),
        subtree_end=torch.arange(1, n + 1, dtype=torch.int32),
        parent_index=torch.full((n,), -1, dtype=torch.int64),
        sequence_ids=torch.zeros(0, dtype=torch.int64),
        cu_seqlens=torch.zeros(1, dtype=torch.int64),
        token_index=torch.zeros(0, dtype=torch.int64),
        num_tree_tokens=0,
    )


EDGE_SEQS = [
    [5, 6, 7, 8],
    [5, 6, 9],  # branch point at 6
    [5, 6, 7, 8],  # identical to 0
    [5, 6],  # prefix of 0 and 1
    [3],  # length 1
    [5, 6, 7, 8, 10],  # 0 is its prefix
    [1, 2],
    [5],  # length 1, prefix of everything at root 5
]


# ------------------------------------------------------------------------------------------------
# Forward values
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
def test_matches_reference_fp32(seed, temperature):
    seqs, tree, logits = random_case(seed)
    check_trie_invariant(tree)
    lp, ent = gather_packed_tree_logprobs_entropy(
        logits, tree, temperature=temperature, chunk_size=4
    )
    ref_lp, ref_ent = reference(logits, tree, seqs, temperature)
    assert lp.dtype == torch.float32 and lp.shape == (tree.num_sequence_tokens,)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=FP32_LOGSOFTMAX_TOL)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=FP32_LOGSOFTMAX_TOL)
    lp_only = gather_packed_tree_logprobs(logits, tree, temperature=temperature)
    torch.testing.assert_close(lp_only, lp, rtol=0, atol=FP32_LOGSOFTMAX_TOL)


def test_edge_cases_fp64():
    """Branch points, prefixes, identical and length-1 sequences, several roots; fp64 is exact."""
    tree = build_tree(EDGE_SEQS, [3, 0, 7, 4, 1, 6, 2, 5], pad_to=20)
    check_trie_invariant(tree)
    logits = torch.randn(tree.padded_length, VOCAB, dtype=torch.float64)
    lp, ent = gather_packed_tree_logprobs_entropy(logits, tree, temperature=0.8)
    ref_lp, ref_ent = reference(logits, tree, EDGE_SEQS, 0.8)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=FP64_TOL)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=FP64_TOL)
    last = tree.cu_seqlens[1:] - 1
    assert torch.all(lp[last] == 0)
    # Identical sequences 0 and 2 get identical results.
    seg = {
        b: slice(int(tree.cu_seqlens[i]), int(tree.cu_seqlens[i + 1]))
        for i, b in enumerate(tree.sequence_ids.tolist())
    }
    assert torch.equal(lp[seg[0]], lp[seg[2]])
    # Sequence 3 = [5, 6] is a prefix of 0: same log p(6 | 5), but its last entry is 0.
    assert lp[seg[3]][0] == lp[seg[0]][0] and lp[seg[3]][1] == 0 and lp[seg[0]][1] != 0


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_chunk_size_does_not_change_results(chunk_size):
    seqs, tree, logits = random_case(11, pad=0)
    logits = logits.double()
    lp, ent = gather_packed_tree_logprobs_entropy(logits, tree, chunk_size=chunk_size)
    ref_lp, ref_ent = reference(logits, tree, seqs)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=FP64_TOL)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=FP64_TOL)


def test_bf16_and_layouts():
    seqs, tree, logits = random_case(5)
    logits = (logits * 3).bfloat16()  # values exactly representable: the reference sees the same
    ref_lp, ref_ent = reference(logits, tree, seqs, 1.3)
    for shaped in (logits, logits[None], logits[:, None]):  # [N, V], [1, N, V], [s, b=1, V]
        lp, ent = gather_packed_tree_logprobs_entropy(shaped, tree, temperature=1.3, chunk_size=5)
        assert lp.dtype == torch.float32  # computed in fp32 from bf16
        # |x - max| reaches ~25 here: 2 ulp at 16-32 is 3.8e-6.
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=4e-6)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=4e-6)


def test_vocab_stats_and_values():
    seqs, tree, logits = random_case(3)
    vmin, vmax = gather_packed_tree_vocab_stats(logits[None], tree)
    for i in range(tree.num_sequences):
        rows = logits[tree.sequence_token_index(i)]
        sl = slice(int(tree.cu_seqlens[i]), int(tree.cu_seqlens[i + 1]))
        assert torch.equal(vmin[sl], rows.min(-1).values)
        assert torch.equal(vmax[sl], rows.max(-1).values)
    values = torch.randn(tree.padded_length, 1, requires_grad=True)  # critic head [N, 1]
    out = gather_packed_tree_values(values, tree)
    for i in range(len(tree.sequence_ids)):
        sl = slice(int(tree.cu_seqlens[i]), int(tree.cu_seqlens[i + 1]))
        assert torch.equal(out[sl], values[tree.sequence_token_index(i), 0])
    out.sum().backward()
    # Each position's gradient counts the sequences through it; padding gets none.
    counts = torch.bincount(tree.token_index, minlength=tree.padded_length).float()
    assert torch.equal(values.grad[:, 0], counts)


def _vocab_stats_cp_worker(rank: int, seed: int):
    import torch.distributed as dist

    from megatron_tree.core.context_parallel import context_parallel_split

    seqs, tree, logits = random_case(seed)
    rows = context_parallel_split(tree, 2, rank, dist.group.WORLD, unit=1)
    mine = logits[rows.positions][None]  # this rank's rows [1, n, V]
    return gather_packed_tree_vocab_stats(mine, tree, rows=rows), tree, logits


def test_vocab_stats_of_context_parallel_rows_equal_the_whole_trees():
    """Each CP rank's rows give the min / max logit of every sequence token (0 at the other
    rank's rows, then summed over the group): each token's own row's, on both ranks."""
    seed = next(s for s in range(20) if random_case(s)[1].padded_length % 2 == 0)
    for (vmin, vmax), tree, logits in run_spawned(_vocab_stats_cp_worker, 2, seed, megatron=False):
        rows = logits[tree.token_index]
        assert torch.equal(vmin, rows.min(-1).values)
        assert torch.equal(vmax, rows.max(-1).values)


def test_dummy_tree():
    n = 6
    dummy = _dummy(n)
    logits = torch.randn(n, VOCAB, requires_grad=True)
    lp, ent = gather_packed_tree_logprobs_entropy(logits, dummy)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum() + logits.sum() * 0).backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    vmin, vmax = gather_packed_tree_vocab_stats(logits, dummy)
    assert vmin.shape == vmax.shape == (0,)


def test_temperature_accepts_numpy_and_torch_scalars():
    import numpy as np

    seqs, tree, logits = random_case(0)
    want = gather_packed_tree_logprobs(logits, tree, temperature=0.75)
    for t in (np.float32(0.75), torch.tensor(0.75), np.float64(0.75)):
        torch.testing.assert_close(gather_packed_tree_logprobs(logits, tree, temperature=t), want)


def test_entropy_of_rows_with_masked_vocabulary_is_finite_and_exact():
    """-inf logits (masked or padded vocabulary columns) have p = 0 and add nothing to the entropy;
    the reference drops those columns altogether."""
    seqs, tree, logits = random_case(3)
    logits = logits.double()
    masked = torch.zeros_like(logits, dtype=torch.bool)
    masked[:, -7:] = True  # padded vocabulary columns
    masked[::3, 5] = True  # a column masked on some rows
    tokens = tree.input_ids
    child = torch.nonzero(tree.parent_index >= 0).squeeze(1)
    masked[tree.parent_index[child], tokens[child]] = False  # keep every target visible
    x = logits.masked_fill(masked, float("-inf")).requires_grad_()
    lp, ent = gather_packed_tree_logprobs_entropy(x, tree, chunk_size=5)
    ((lp * 0.3).sum() + ent.sum()).backward()
    assert torch.isfinite(ent).all() and torch.isfinite(x.grad).all()
    ref_x = logits.clone().requires_grad_()
    logp = torch.log_softmax(ref_x.masked_fill(masked, float("-inf")), -1)
    ref_ent_rows = -(logp.exp() * logp.masked_fill(masked, 0)).sum(-1)
    token_rows = tree.token_index
    torch.testing.assert_close(ent, ref_ent_rows[token_rows], rtol=0, atol=1e-12)
    ref_lp = torch.zeros_like(lp)
    nxt = torch.roll(token_rows, -1)
    last = tree.cu_seqlens[1:] - 1
    keep = torch.ones_like(lp, dtype=torch.bool)
    keep[last] = False
    ref_lp[keep] = logp[token_rows[keep], tokens[nxt[keep]]]
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    ((ref_lp * 0.3).sum() + ref_ent_rows[token_rows].sum()).backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=1e-12)


def test_input_errors():
    seqs, tree, logits = random_case(0)
    with pytest.raises(ValueError, match="padded length"):
        gather_packed_tree_logprobs_entropy(logits[:-1], tree)
    with pytest.raises(ValueError, match="N, X"):
        gather_packed_tree_logprobs_entropy(logits[None, None], tree)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            gather_packed_tree_logprobs(logits, tree, temperature=bad)
    # Token ids are checked at packing time; inside the gather only with debug checks (a host sync).
    set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match="vocab"):
            gather_packed_tree_logprobs(logits[:, : VOCAB // 4], tree)  # tokens beyond the vocab
    finally:
        set_debug_checks(False)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got True"):
        gather_packed_tree_logprobs(logits, tree, temperature=True)
    with pytest.raises(
        ValueError, match="temperature must be a finite number > 0, got a tensor of shape"
    ):
        gather_packed_tree_logprobs(logits, tree, temperature=torch.tensor([0.7, 0.8]))
    with pytest.raises(ValueError, match="floating"):
        gather_packed_tree_logprobs(logits.long(), tree)
    with pytest.raises(ValueError, match="chunk_size"):
        gather_packed_tree_logprobs(logits, tree, chunk_size=0)
    with pytest.raises(ValueError, match="values"):
        gather_packed_tree_values(torch.zeros(tree.padded_length + 1), tree)
    with pytest.raises(ValueError, match="output_weight"):
        gather_packed_tree_logprobs_entropy_from_hidden(
            torch.zeros(tree.padded_length, 8), torch.zeros(VOCAB, 9), tree
        )


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------


def _weights(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    t = tree.num_sequence_tokens
    return tuple(torch.randn(t, generator=gen, dtype=torch.float64) for _ in range(2))


@pytest.mark.parametrize("terms", ["both", "logprobs", "entropy"])
def test_gradients_match_reference(terms):
    seqs, tree, logits = random_case(7, num_groups=4)
    w_lp, w_ent = _weights(tree, 1)
    ref_in = logits.double().requires_grad_()
    ref_lp, ref_ent = reference(ref_in, tree, seqs, 0.7)
    mine_in = logits.clone().requires_grad_()
    if terms == "logprobs":
        (ref_lp * w_lp).sum().backward()
        lp = gather_packed_tree_logprobs(mine_in, tree, temperature=0.7, chunk_size=3)
        (lp.double() * w_lp).sum().backward()
    else:
        lp, ent = gather_packed_tree_logprobs_entropy(mine_in, tree, temperature=0.7, chunk_size=3)
        ref_loss = (ref_ent * w_ent).sum()
        loss = (ent.double() * w_ent).sum()
        if terms == "both":
            ref_loss = ref_loss + (ref_lp * w_lp).sum()
            loss = loss + (lp.double() * w_lp).sum()
        ref_loss.backward()
        loss.backward()
    # A row shared by k sequences sums k weighted terms, so entries reach ~5 at the roots; each is
    # a few fp32 operations on softmax terms: relative rounding ~3e-7 there, absolute ~1e-7 else.
    torch.testing.assert_close(mine_in.grad.double(), ref_in.grad, rtol=1e-6, atol=1e-6)
    assert torch.all(mine_in.grad[tree.num_tree_tokens :] == 0)


def test_gradients_bf16():
    """bf16 logits: fp32 math, gradient rounded once to bf16 (relative 2**-9)."""
    seqs, tree, logits = random_case(8)
    logits = logits.bfloat16()
    w_lp, w_ent = _weights(tree, 5)
    ref_in = logits.double().requires_grad_()
    ref_lp, ref_ent = reference(ref_in, tree, seqs, 1.2)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    mine_in = logits.clone().requires_grad_()
    lp, ent = gather_packed_tree_logprobs_entropy(mine_in, tree, temperature=1.2, chunk_size=7)
    ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
    assert mine_in.grad.dtype == torch.bfloat16
    torch.testing.assert_close(mine_in.grad.double(), ref_in.grad, rtol=2**-8, atol=1e-6)


def test_gradcheck_fp64():
    tree = build_tree(EDGE_SEQS, list(range(len(EDGE_SEQS))), pad_to=16)
    logits = torch.randn(tree.padded_length, 12, dtype=torch.float64, requires_grad=True)
    tokens = [[t % 12 for t in s] for s in EDGE_SEQS]
    tree = build_tree(tokens, list(range(len(tokens))), pad_to=16)

    def fn(x):
        return gather_packed_tree_logprobs_entropy(x, tree, temperature=1.7, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (logits,))


def test_fused_hidden_matches_logits_path():
    seqs, tree, _ = random_case(9)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(tree.padded_length, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, 16, generator=gen, dtype=torch.float64)
    hidden.requires_grad_()
    weight.requires_grad_()
    w_lp, w_ent = _weights(tree, 3)
    lp, ent = gather_packed_tree_logprobs_entropy_from_hidden(
        hidden[:, None], weight, tree, temperature=0.9, chunk_size=4
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    h_ref = hidden.detach().clone().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    ref_lp, ref_ent = reference(h_ref @ w_ref.t(), tree, seqs, 0.9)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-11)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-11)
    torch.testing.assert_close(hidden.grad, h_ref.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(weight.grad, w_ref.grad, rtol=0, atol=1e-11)

    # bf16 (flash-attention style bar): at most twice the error of plain bf16 autograd (bf16
    # matmul, fp32 log-softmax), both measured against fp64 math on the same bf16 inputs.
    h16, w16 = hidden.detach().bfloat16(), weight.detach().bfloat16()

    def grads(fn, dtype):
        h = h16.to(dtype, copy=True).requires_grad_()
        w = w16.to(dtype, copy=True).requires_grad_()
        lp, ent = fn(h, w)
        ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
        return torch.cat([lp.double(), ent.double()]), h.grad.double(), w.grad.double()

    exact = grads(lambda h, w: reference(h @ w.t(), tree, seqs, 0.9), torch.float64)
    plain = grads(lambda h, w: reference(h @ w.t(), tree, seqs, 0.9, torch.float32), torch.bfloat16)
    mine = grads(
        lambda h, w: gather_packed_tree_logprobs_entropy_from_hidden(
            h, w, tree, temperature=0.9, chunk_size=4
        ),
        torch.bfloat16,
    )
    for m, p, e in zip(mine, plain, exact):  # values, hidden grad, weight grad
        assert (m - e).abs().max() <= 2 * (p - e).abs().max() + 1e-6


# ------------------------------------------------------------------------------------------------
# Tensor parallelism on gloo: one spawned world of 4 ranks covers TP=4 and two TP=2 groups.
# ------------------------------------------------------------------------------------------------

TP_SIZES = (2, 4)
TP_WORLD = 4


def _tp_worker(rank: int) -> dict:
    from megatron_tree.testing.tolerances import max_abs_error as err
    from megatron_tree.testing.tolerances import worst_error

    groups = {4: dist.group.WORLD}
    for members in ([0, 1], [2, 3]):
        group = dist.new_group(members)  # every rank creates every group
        if rank in members:
            groups[2] = group
    seqs, tree, logits = random_case(21, num_groups=4)
    w_lp, w_ent = _weights(tree, 4)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(tree.padded_length, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, 16, generator=gen, dtype=torch.float64)

    def run(x, group, temperature=0.8, fused=False):
        x = x.clone().requires_grad_()
        lp, ent = gather_packed_tree_logprobs_entropy(
            x, tree, temperature=temperature, tp_group=group, chunk_size=5, fused=fused
        )
        ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
        return lp, ent, x.grad

    def run_fused(group, h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = gather_packed_tree_logprobs_entropy_from_hidden(
            h, w, tree, temperature=1.1, tp_group=group, chunk_size=7
        )
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return lp, ent, h.grad, w.grad

    errors = {}
    for tp, group in groups.items():
        r, shard = dist.get_rank(group), VOCAB // tp
        cols = slice(r * shard, (r + 1) * shard)
        for name, x in (("fp32", logits), ("fp64", logits.double())):
            full = run(x, None)
            part = run(x[:, cols], group)
            errors[(tp, name, "logprobs")] = err(part[0], full[0])
            errors[(tp, name, "entropy")] = err(part[1], full[1])
            errors[(tp, name, "grad")] = err(part[2], full[2][:, cols])
            if name == "fp32":  # the compiled kernels on each shard against the eager full vocab
                part = run(x[:, cols], group, fused=True)
                for i, quantity in enumerate(("logprobs", "entropy", "grad")):
                    want = full[i][:, cols] if quantity == "grad" else full[i]
                    errors[(tp, "fp32-fused", quantity)] = err(part[i], want)
        vmin, vmax = gather_packed_tree_vocab_stats(logits[:, cols], tree, tp_group=group)
        fmin, fmax = gather_packed_tree_vocab_stats(logits, tree)
        errors[(tp, "fp32", "vocab_stats")] = worst_error([err(vmin, fmin), err(vmax, fmax)])
        full = run_fused(None, hidden, weight)
        part = run_fused(group, hidden, weight[cols])
        errors[(tp, "fp64", "fused")] = worst_error(
            [err(part[0], full[0]), err(part[1], full[1]), err(part[2], full[2])]
            + [err(part[3], full[3][cols])]
        )
    return errors


@pytest.fixture(scope="module")
def tp_errors():
    per_rank = run_spawned(_tp_worker, TP_WORLD, megatron=False)
    from megatron_tree.testing.tolerances import worst_error

    return {key: worst_error(errs[key] for errs in per_rank) for key in per_rank[0]}


# TP only changes how the per-shard partial sums are merged; vocab stats are exact.
TP_TOL = {"fp32": FP32_TP_LOGSOFTMAX_TOL, "fp32-fused": FP32_TP_LOGSOFTMAX_TOL, "fp64": FP64_TOL}


@pytest.mark.slow
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("quantity", ["logprobs", "entropy", "grad"])
@pytest.mark.parametrize("precision", ["fp32", "fp32-fused", "fp64"])
def test_tensor_parallel_matches_tp1(tp_errors, tp, quantity, precision):
    assert tp_errors[(tp, precision, quantity)] <= TP_TOL[precision]


@pytest.mark.slow
@pytest.mark.parametrize("tp", TP_SIZES)
def test_tensor_parallel_vocab_stats_and_fused(tp_errors, tp):
    assert tp_errors[(tp, "fp32", "vocab_stats")] == 0
    assert tp_errors[(tp, "fp64", "fused")] <= TP_TOL["fp64"]


# ------------------------------------------------------------------------------------------------
# merge_packed_tree_results
# ------------------------------------------------------------------------------------------------


def _batch(seed=4, batch=9, num_groups=3):
    """Right-padded [B, L] batch (L = longest + 2) of random branching sequences."""
    gen = torch.Generator().manual_seed(seed)
    seqs = random_sequences(gen, num_groups)[:batch]
    assert len(seqs) == batch
    max_len = max(len(s) for s in seqs) + 2
    input_ids = torch.zeros(len(seqs), max_len, dtype=torch.int64)
    mask = torch.zeros(len(seqs), max_len, dtype=torch.bool)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = True
    return seqs, input_ids, mask


def test_merge_round_trip():
    seqs, input_ids, mask = _batch()
    batch, max_len = input_ids.shape
    trees = [
        build_tree(seqs, [5, 0, 3, 8], pad_to=40),
        _dummy(8),
        build_tree(seqs, [2, 7, 1, 6, 4], pad_to=48),
    ]
    # Per-position values of a token stream are functions of the token: the packed input_ids.
    outputs = [
        (gather_packed_tree_values(t.input_ids.double() + 0.5, t), t) for t in reversed(trees)
    ]
    merged = merge_packed_tree_results(outputs, batch, padding_value=-1.0, max_seq_len=max_len)
    assert torch.equal(merged, torch.where(mask, input_ids.double() + 0.5, -1.0))
    # Log-probs merged back equal the per-sequence reference in the [B, L] layout.
    gen = torch.Generator().manual_seed(0)
    results = []
    expected = torch.zeros(batch, max_len, dtype=torch.float64)
    for t in trees:
        logits = torch.randn(t.padded_length, VOCAB, generator=gen, dtype=torch.float64)
        results.append((gather_packed_tree_logprobs(logits, t), t))
        ref_lp, _ = reference(logits, t, seqs)
        for i, b in enumerate(t.sequence_ids.tolist()):
            expected[b, : len(seqs[b])] = ref_lp[int(t.cu_seqlens[i]) : int(t.cu_seqlens[i + 1])]
    merged = merge_packed_tree_results(results, batch, max_seq_len=max_len)
    torch.testing.assert_close(merged, expected, rtol=0, atol=FP64_TOL)
    # Default length is the longest sequence; trailing dims are kept.
    both = [(torch.stack([v, -v], -1), t) for v, t in outputs]
    merged = merge_packed_tree_results(both, batch)
    assert merged.shape == (batch, max(len(s) for s in seqs), 2)


def test_merge_gradients_flow():
    seqs, _, _ = _batch()
    tree = build_tree(seqs, list(range(len(seqs))))
    values = torch.randn(tree.padded_length, requires_grad=True)
    merged = merge_packed_tree_results([(gather_packed_tree_values(values, tree), tree)], len(seqs))
    merged.sum().backward()
    counts = torch.bincount(tree.token_index, minlength=tree.padded_length).float()
    assert torch.equal(values.grad, counts)


def test_merge_errors():
    seqs, _, _ = _batch()
    a, b = build_tree(seqs, [0, 1, 2, 3]), build_tree(seqs, [4, 5, 6, 7, 8])
    va = torch.zeros(a.num_sequence_tokens)
    vb = torch.zeros(b.num_sequence_tokens)
    with pytest.raises(ValueError, match="duplicate"):
        merge_packed_tree_results([(va, a), (vb, b), (va, a)], 9)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        merge_packed_tree_results([(va, a), (vb, b)], 8)
    with pytest.raises(ValueError, match="missing"):
        merge_packed_tree_results([(va, a), (vb, b)], 10)
    with pytest.raises(ValueError, match="entries"):
        merge_packed_tree_results([(va[:-1], a), (vb, b)], 9)
    with pytest.raises(ValueError, match="max_seq_len"):
        merge_packed_tree_results([(va, a), (vb, b)], 9, max_seq_len=1)
    with pytest.raises(ValueError, match="empty"):
        merge_packed_tree_results([], 9)
    neg = build_tree(seqs, [0])
    neg = PackedTree(**{**neg.__dict__, "sequence_ids": torch.tensor([-1])})
    with pytest.raises(ValueError, match=r"\[0, 9\)"):
        merge_packed_tree_results([(torch.zeros(neg.num_sequence_tokens), neg)], 9)


def test_merge_round_trip_through_packing():
    from megatron_tree.core.packing import build_packed_tree_batch

    seqs, input_ids, mask = _batch(seed=6, batch=16, num_groups=6)
    batch, max_len = input_ids.shape
    gen = torch.Generator().manual_seed(1)
    extra = torch.randn(batch, max_len, generator=gen)
    packed = build_packed_tree_batch(
        {"input_ids": input_ids, "attention_mask": mask.long(), "extra": extra},
        max_tokens_per_mb=32,
        block_size=8,
    )
    assert len(packed) > 1
    trees = [mb["tree"] for mb in packed]
    # The packed extra key ([T_mb], token_index order) merges back into the [B, L] layout.
    merged = merge_packed_tree_results(
        [(mb["extra"], mb["tree"]) for mb in reversed(packed)],
        batch,
        max_seq_len=max_len,
        padding_value=7.0,
    )
    assert torch.equal(merged, torch.where(mask, extra, 7.0))
    # Log-probs of every micro-batch, merged, equal the per-sequence reference.
    expected = torch.zeros(batch, max_len, dtype=torch.float64)
    results = []
    for tree in trees:
        check_trie_invariant(tree)
        logits = torch.randn(tree.padded_length, VOCAB, generator=gen, dtype=torch.float64)
        results.append((gather_packed_tree_logprobs(logits, tree, temperature=0.6), tree))
        ref_lp, _ = reference(logits, tree, seqs, 0.6)
        for i, b in enumerate(tree.sequence_ids.tolist()):
            expected[b, : len(seqs[b])] = ref_lp[
                int(tree.cu_seqlens[i]) : int(tree.cu_seqlens[i + 1])
            ]
    merged = merge_packed_tree_results(results, batch, max_seq_len=max_len)
    torch.testing.assert_close(merged, expected, rtol=0, atol=FP64_TOL)


# ------------------------------------------------------------------------------------------------
# The compiled one-pass kernels (fused=True) and the switch between the paths
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_kernels(monkeypatch):
    """Empties the kernel cache for one test (compiled graphs stay cached by torch itself)."""
    monkeypatch.setattr(fused_logprobs, "_KERNELS", {})
    monkeypatch.setattr(fused_logprobs, "_COMPILED", [])


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls into the compiled kernels (row reductions, gradient chunks)."""
    calls = {"row_stats": 0, "row_grad": 0}
    for name in calls:
        original = getattr(fused_logprobs.FusedKernels, name)

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(fused_logprobs.FusedKernels, name, counted)
    return calls


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 1, 4])  # 1: every chunk a padded 1-row chunk
def test_fused_matches_reference_fp32(temperature, chunk_size, kernel_calls):
    seqs, tree, logits = random_case(7, num_groups=4)
    w_lp, w_ent = _weights(tree, 1)
    ref_in = logits.double().requires_grad_()
    ref_lp, ref_ent = reference(ref_in, tree, seqs, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    mine_in = logits.clone().requires_grad_()
    lp, ent = gather_packed_tree_logprobs_entropy(
        mine_in, tree, temperature=temperature, chunk_size=chunk_size, fused=True
    )
    ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
    assert kernel_calls["row_stats"] > 0 and kernel_calls["row_grad"] > 0
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=FP32_LOGSOFTMAX_TOL)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=FP32_LOGSOFTMAX_TOL)
    # As test_gradients_match_reference: entries reach ~5 at shared roots.
    torch.testing.assert_close(mine_in.grad.double(), ref_in.grad, rtol=1e-6, atol=1e-6)
    assert torch.all(mine_in.grad[tree.num_tree_tokens :] == 0)
    lp_only = gather_packed_tree_logprobs(logits, tree, temperature=temperature, fused=True)
    torch.testing.assert_close(lp_only, lp, rtol=0, atol=FP32_LOGSOFTMAX_TOL)


@pytest.mark.parametrize("terms", ["logprobs", "entropy"])
def test_fused_gradients_fp64_and_bf16(terms):
    """fp64: the compiled kernels are exact to fp64 rounding; bf16: one rounding of the gradient
    (the fp32 chunk gets its one-hot terms before the cast), as test_gradients_bf16."""
    seqs, tree, logits = random_case(8)
    w_lp, w_ent = _weights(tree, 5)
    for dtype, tol in ((torch.float64, dict(rtol=0, atol=FP64_TOL)), (torch.bfloat16, None)):
        x = logits.to(dtype)
        ref_in = x.double().clone().requires_grad_()
        ref_lp, ref_ent = reference(ref_in, tree, seqs, 1.2)
        mine_in = x.clone().requires_grad_()
        lp, ent = gather_packed_tree_logprobs_entropy(
            mine_in, tree, temperature=1.2, chunk_size=7, fused=True
        )
        if terms == "logprobs":
            (ref_lp * w_lp).sum().backward()
            (lp.double() * w_lp).sum().backward()
        else:
            (ref_ent * w_ent).sum().backward()
            (ent.double() * w_ent).sum().backward()
        assert mine_in.grad.dtype == dtype
        if tol is None:
            torch.testing.assert_close(mine_in.grad.double(), ref_in.grad, rtol=2**-8, atol=1e-6)
        else:
            torch.testing.assert_close(lp, ref_lp, **tol)
            torch.testing.assert_close(ent, ref_ent, **tol)
            torch.testing.assert_close(mine_in.grad, ref_in.grad, **tol)


def test_fused_masked_vocabulary():
    """-inf columns: p = 0, nothing added to the entropy, finite gradients (as the eager path)."""
    seqs, tree, logits = random_case(3)
    x = logits.clone()
    x[:, -7:] = float("-inf")
    child = torch.nonzero(tree.parent_index >= 0).squeeze(1)
    x[tree.parent_index[child], tree.input_ids[child]] = logits[
        tree.parent_index[child], tree.input_ids[child]
    ]
    out = {}
    for fused in (False, True):
        xi = x.clone().requires_grad_()
        lp, ent = gather_packed_tree_logprobs_entropy(xi, tree, chunk_size=5, fused=fused)
        (lp.sum() + ent.sum()).backward()
        out[fused] = (lp, ent, xi.grad)
    for got, want, rtol in zip(out[True], out[False], (0, 0, 1e-6)):  # gradients reach ~3
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=rtol, atol=FP32_LOGSOFTMAX_TOL)


def test_fused_realistic_vocab_as_accurate_as_eager():
    """At V = 32000 fp32 rounding grows with the sums over the vocabulary, on both paths; the
    compiled kernels sum in another order (per-lane vector accumulators, which follow the CPU's
    vector width). Both paths are held to the bar measured and justified for this vocabulary
    (FP32_VOCAB_LOGSOFTMAX_TOL, 2e-5; a wrong shift, scale or missing term is >= 1e-3)."""
    seqs, tree, logits = random_case(1, num_groups=2, vocab=32000)
    logits = logits * 2
    ref = reference(logits, tree, seqs, 0.8)
    for fused in (False, True):
        got = gather_packed_tree_logprobs_entropy(logits, tree, temperature=0.8, fused=fused)
        for name, g, r in zip(("log-probs", "entropy"), got, ref):
            err = (g.double() - r).abs().max().item()
            assert err <= FP32_VOCAB_LOGSOFTMAX_TOL, (fused, name, err)  # NaN fails the <=


def test_fused_does_not_recompile_for_other_lengths_or_temperatures():
    """Packed lengths vary per micro-batch: after the first call, trees of other lengths, other
    temperatures and the logprobs-only variant reuse the compiled graphs."""
    from torch._dynamo.utils import counters

    def step(seed, groups, temperature):
        seqs, tree, logits = random_case(seed, num_groups=groups, pad=seed)
        x = logits.requires_grad_()
        lp, ent = gather_packed_tree_logprobs_entropy(x, tree, temperature=temperature, fused=True)
        (lp.sum() + ent.sum()).backward()
        gather_packed_tree_logprobs(logits.detach(), tree, temperature=temperature, fused=True)
        return tree.padded_length

    step(0, 2, 1.0)
    graphs = counters["stats"]["unique_graphs"]
    lengths = {step(seed, groups, t) for seed, groups, t in ((1, 5, 0.6), (2, 9, 1.3), (3, 1, 2))}
    assert len(lengths) == 3
    assert counters["stats"]["unique_graphs"] == graphs


def test_switch_selects_the_path(kernel_calls, monkeypatch):
    """fused=True runs the compiled kernels (never the eager chunks), False never runs them,
    "auto" runs them from AUTO_MIN_ELEMENTS logits on; None reads the process default."""
    seqs, tree, logits = random_case(2)

    def run(fused):
        kernel_calls.update(row_stats=0, row_grad=0)
        x = logits.clone().requires_grad_()
        lp, ent = gather_packed_tree_logprobs_entropy(x, tree, fused=fused)
        (lp.sum() + ent.sum()).backward()
        return kernel_calls["row_stats"] > 0 and kernel_calls["row_grad"] > 0

    def no_eager(*args, **kwargs):
        raise AssertionError("the eager backward ran")

    with monkeypatch.context() as patch:
        patch.setattr(logprobs_module, "_backward_chunks", no_eager)
        assert run(True)
    assert not run(False)
    assert logits.numel() < fused_logprobs.AUTO_MIN_ELEMENTS
    assert not run("auto")
    monkeypatch.setattr(fused_logprobs, "AUTO_MIN_ELEMENTS", logits.numel())
    assert run("auto")
    previous = fused_logprobs.default_mode()
    try:
        fused_logprobs.set_default_mode(False)
        assert not run(None)
        fused_logprobs.set_default_mode("1")
        assert run(None)
    finally:
        fused_logprobs.set_default_mode(previous)
    with pytest.raises(ValueError, match="fused"):
        gather_packed_tree_logprobs(logits, tree, fused="yes")


def _broken_compile():
    raise RuntimeError("no compiler here")


@pytest.mark.parametrize("failure", ["compile", "wrong result"])
def test_fallback_is_loud_and_exact(failure, fresh_kernels, monkeypatch, caplog):
    """A kernel that fails to build, or that computes something else, is reported once with a
    warning; "auto" then runs the eager path (same results), fused=True raises."""
    if failure == "compile":
        monkeypatch.setattr(fused_logprobs, "_compiled_kernels", _broken_compile)
    else:

        def off_by_a_bit(x, c):
            m, s, n = fused_logprobs._row_stats(x, c)
            return m, s * 1.001, n

        monkeypatch.setattr(
            fused_logprobs,
            "_compiled_kernels",
            lambda: fused_logprobs.FusedKernels(off_by_a_bit, fused_logprobs._row_grad),
        )
    seqs, tree, logits = random_case(4)
    monkeypatch.setattr(fused_logprobs, "AUTO_MIN_ELEMENTS", 0)
    want = gather_packed_tree_logprobs_entropy(logits, tree, fused=False)
    with caplog.at_level("WARNING", logger=fused_logprobs.__name__):
        for _ in range(3):
            got = gather_packed_tree_logprobs_entropy(logits, tree, fused="auto")
            for g, w in zip(got, want):
                assert torch.equal(g, w)
    warnings = [r for r in caplog.records if "eager chunked path" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(RuntimeError, match="fused=True"):
        gather_packed_tree_logprobs_entropy(logits, tree, fused=True)
