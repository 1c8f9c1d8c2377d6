"""Sliding windows over depth and attention sinks (softmax types) in tree attention.

Two kinds of reference, both independent of the tree mask code:

* attention level: brute-force masked softmax whose visibility comes from the trie's parent links
  and token depths (``parent_index``, ``position_ids``), never from ``subtree_end``, with the sink
  appended as one more logit column (no value), as Megatron's ``SoftmaxOne`` does;
* model level: Megatron's stock local-spec ``GPTModel`` (``DotProductAttention`` with its own
  sliding-window causal mask and ``softmax_offset``) on every sequence alone, with the tree model's
  state dict loaded into it, against ``TreeGPTModel`` on the packed trie. The trie's branches are
  longer than the window, and windowed and full layers alternate (``window_attn_skip_freq``).
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.models import VOCAB, branching_sequences, pack
from megatron_tree.core.attention import tree_attention
from megatron_tree.core.context_parallel import context_parallel_split
from megatron_tree.core.mask import (
    block_sparse_plan,
    build_attention_mask_from_trie,
    depth_window,
    tree_attention_mask,
    tree_block_layout,
    tree_depth,
)
from megatron_tree.testing.reference import gradient_errors, parameter_grads
from megatron_tree.testing.tolerances import FP64_TOL, GRAD_RTOL, LOGP_TOL

# Attention level in fp64, model level in fp32 (tolerances.py); a key one level outside the window,
# a missing sink or a sink of the wrong sign moves log-probs by >= 1e-3, gradients by >= 1e-3 rel.
WINDOW = (7, 0)  # Megatron's convention: a query sees itself and 7 ancestors, 8 keys on a chain


def long_branching_sequences(seed: int = 0) -> list[torch.Tensor]:
    """A shared prompt with responses mostly longer than the window, a multi-turn chain branching
    twice, a sequence that is a prefix of another, and a duplicate (about 250 unique tokens)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    prompt = rand(20)
    seqs = [torch.cat([prompt, rand(n)]) for n in (30, 22, 9, 41, 3)]
    turn1 = rand(16)
    turn2 = torch.cat([turn1, rand(25)])
    seqs += [
        turn2,
        torch.cat([turn2, rand(18)]),
        torch.cat([turn2, rand(31)]),
        torch.cat([turn1[:6], rand(27)]),
    ]
    seqs += [prompt[:11].clone(), seqs[3].clone()]
    return seqs


def _tree(seqs=None, block_size: int = 16):
    return pack(
        long_branching_sequences() if seqs is None else seqs, block_size=block_size, max_tokens=1024
    )[0]["tree"]


def _visible(tree, window: int | None) -> torch.Tensor:
    """bool [N, N], True = query row attends key column, from parent links and depths alone."""
    n, parent, depth = tree.padded_length, tree.parent_index.tolist(), tree.position_ids.tolist()
    visible = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        k = q
        while k != -1 and (window is None or depth[q] - depth[k] <= window):
            visible[q, k] = True
            k = parent[k] if k < len(parent) else -1
    return visible


def _brute(q, k, v, visible, sink):
    """q [nq, 1, np, hn], k / v [N, 1, ng, hn], visible bool [nq, N], sink [np] or None -> [nq, 1,
    np*hn]."""
    nq, _, heads, dim = q.shape
    rep = heads // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / math.sqrt(dim)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.reshape(1, heads, 1, 1).expand(1, heads, nq, 1)], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("bhqk,kbhd->qbhd", probs, vv).reshape(nq, 1, heads * dim)


def _qkv(n, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    shapes = [(n, 1, 4, 8), (n, 1, 2, 8), (n, 1, 2, 8)]
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_(grad) for s in shapes]


def _sink(kind: str):
    return {
        "none": None,
        "zeros": torch.zeros(4, dtype=torch.float64),
        "learned": torch.tensor([1.5, -0.5, 0.0, 3.0], dtype=torch.float64, requires_grad=True),
    }[kind]


# ----------------------------------------------------------------------------- the mask


def test_depth_from_subtree_end_equals_position_ids():
    for seqs, max_tokens in [
        (long_branching_sequences(), 1024),
        (branching_sequences(), 512),
        (branching_sequences(), 64),
    ]:
        for mb in pack(seqs, max_tokens=max_tokens):
            tree = mb["tree"]
            assert torch.equal(tree_depth(tree), tree.position_ids.to(torch.int64))


@pytest.mark.parametrize("window", [None, 0, 1, 7, 30])
def test_dense_mask_equals_parent_walk(window):
    tree = _tree()
    assert torch.equal(~build_attention_mask_from_trie(tree, window=window), _visible(tree, window))


@pytest.mark.parametrize("block_size", [16, 8])
def test_block_layout_skips_blocks_out_of_the_window(block_size):
    """Every tile holding a visible pair is listed and every tile listed as full is full (so the
    pairs inside listed tiles, masked exactly, give the right answer). The per-tile test is
    conservative where a query tile mixes depths (a branch starts inside it); on GRPO-like branches
    (a 48-token prompt, 4 responses of 150-200 tokens) a window of 8 keys lists under a third of the
    tiles that full attention needs."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, VOCAB, (48,), generator=g)
    grpo = [
        torch.cat([prompt, torch.randint(1, VOCAB, (n,), generator=g)])
        for n in (150, 200, 170, 181)
    ]
    for tree in (_tree(block_size=block_size), _tree(grpo, block_size=block_size)):
        n = tree.padded_length
        tiles = lambda m, n=n: m.view(n // block_size, block_size, n // block_size, block_size)  # noqa: E731
        for window in (None, 7, 0):
            visible = tiles(_visible(tree, window))
            any_allowed, all_allowed = tree_block_layout(tree, block_size, window=window)
            assert bool((any_allowed >= visible.any(3).any(1)).all())
            assert bool((all_allowed <= visible.all(3).all(1)).all())
    listed = {w: int(tree_block_layout(tree, block_size, window=w)[0].sum()) for w in (None, 7)}
    print(f"TILES block {block_size}: {listed}")
    assert listed[7] < listed[None] / 3, listed
    # The block-sparse plan gathers only the listed key blocks (plus its group padding).
    gathered = {
        w: sum(kv.numel() for _, kv, _ in block_sparse_plan(tree.subtree_end, block_size, window=w))
        for w in (None, 7)
    }
    assert gathered[7] < gathered[None] / 2, gathered


def test_depth_window_convention_and_errors():
    assert depth_window(None) is None and depth_window((-1, 0)) is None
    assert depth_window((4095, 0)) == 4095 and depth_window([0, 0]) == 0
    with pytest.raises(ValueError, match=r"right window must be 0.*window_size=\(8, 0\)"):
        depth_window((8, 8))
    with pytest.raises(ValueError, match="pair of ints"):
        depth_window(8)
    with pytest.raises(ValueError, match="left must be >= 0, or -1"):
        depth_window((-2, 0))


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("backend", ["sdpa", "block_sparse"])
@pytest.mark.parametrize(
    "window,sink", [(7, "none"), (0, "zeros"), (7, "learned"), (None, "learned"), (3, "zeros")]
)
@pytest.mark.parametrize("form", ["tree_mask", "subtree_end", "dense"])
def test_backends_match_brute_force_forward_backward(backend, window, sink, form):
    tree = _tree()
    mask = {
        "tree_mask": tree_attention_mask(tree),
        "subtree_end": tree.subtree_end,
        "dense": build_attention_mask_from_trie(tree),
    }[form]
    q, k, v = _qkv(tree.padded_length)
    offset = _sink(sink)
    inputs = [q, k, v] + ([offset] if sink == "learned" else [])
    want = _brute(q, k, v, _visible(tree, window), offset)
    want_grads = torch.autograd.grad(want.square().sum(), inputs)
    got = tree_attention(
        q,
        k,
        v,
        mask,
        backend=backend,
        block_size=16,
        window_size=None if window is None else (window, 0),
        softmax_offset=offset,
    )
    grads = torch.autograd.grad(got.square().sum(), inputs)
    assert (got - want).abs().max() <= FP64_TOL
    for g, w in zip(grads, want_grads):
        assert (g - w).abs().max() <= FP64_TOL


@pytest.mark.parametrize(
    "window,sink", [(7, "none"), (0, "zeros"), (7, "learned"), (None, "learned")]
)
def test_flex_forward_matches_brute_force_on_cpu(window, sink):
    tree = _tree()
    q, k, v = _qkv(tree.padded_length, grad=False)
    offset = None if _sink(sink) is None else _sink(sink).detach()
    want = _brute(q, k, v, _visible(tree, window), offset)
    for block_size in (16, 8):
        got = tree_attention(
            q,
            k,
            v,
            tree_attention_mask(tree),
            backend="flex",
            block_size=block_size,
            window_size=None if window is None else (window, 0),
            softmax_offset=offset,
        )
        assert (got - want).abs().max() <= FP64_TOL


@pytest.mark.parametrize("backend", ["sdpa", "block_sparse", "flex"])
@pytest.mark.parametrize("cp,unit", [(2, None), (4, 4)])
def test_context_parallel_rows_match_brute_force(backend, cp, unit):
    """Each CP rank's rows against the whole tree's keys, with a window and a learned sink."""
    tree = _tree()
    q, k, v = _qkv(tree.padded_length, grad=False)
    offset = _sink("learned").detach()
    want = _brute(q, k, v, _visible(tree, 7), offset)
    for rank in range(cp):
        split = context_parallel_split(tree, cp, rank, unit=unit)
        rows = split.local_positions
        got = tree_attention(
            q[rows],
            k,
            v,
            tree_attention_mask(tree, split),
            backend=backend,
            block_size=16,
            window_size=WINDOW,
            softmax_offset=offset,
        )
        assert (got - want[rows]).abs().max() <= FP64_TOL


def test_windows_share_one_plan_each():
    """A model mixing local and global layers builds each derived form once per window."""
    tree = _tree()
    q, k, v = _qkv(tree.padded_length, grad=False)
    mask = tree_attention_mask(tree)
    for _ in range(3):
        for window_size in (WINDOW, None):
            tree_attention(
                q, k, v, mask, backend="block_sparse", block_size=16, window_size=window_size
            )
    assert sorted(key[-1] is None for key in mask.plan._forms) == [False, True]


def test_attention_argument_errors():
    tree = _tree()
    q, k, v = _qkv(tree.padded_length, grad=False)
    with pytest.raises(ValueError, match=r"window_size=\(7, 2\).*right window must be 0"):
        tree_attention(q, k, v, tree.subtree_end, window_size=(7, 2))
    with pytest.raises(ValueError, match=r"softmax_offset has shape \(2,\), expected \(4,\)"):
        tree_attention(q, k, v, tree.subtree_end, softmax_offset=torch.zeros(2))


# ----------------------------------------------------------------------------- the model


def _config(softmax_type: str, **overrides):
    from harness.models import small_gpt_config

    # Layers 1 and 3 use the window, layer 2 attends fully (Megatron: layer % freq != 0 is local).
    fields = dict(
        num_layers=3, window_size=WINDOW, window_attn_skip_freq=2, softmax_type=softmax_type
    )
    return small_gpt_config(**{**fields, **overrides})


def _models(softmax_type: str, backend: str):
    from harness.models import build_gpt_model

    config = _config(softmax_type)
    tree = build_gpt_model(config, tree=True, vocab_size=VOCAB, backend=backend, block_size=16)
    stock = build_gpt_model(config, tree=False, vocab_size=VOCAB)
    if softmax_type == "learnable":
        with (
            torch.no_grad()
        ):  # Megatron's init (std 0.02) leaves the sinks near 0: make them matter
            for i, layer in enumerate(tree.decoder.layers):
                layer.self_attention.core_attention.softmax_offset.copy_(
                    torch.tensor([1.0, -1.0, 0.5, 2.0]) + 0.1 * i
                )
    stock.load_state_dict(
        tree.state_dict()
    )  # strict: the tree model's state dict is the stock one's
    return tree, stock


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[L, V] logits, [L] ids -> [L - 1] next-token log-probs."""
    return torch.log_softmax(logits.float(), -1)[:-1].gather(1, ids[1:, None])[:, 0]


@pytest.mark.parametrize(
    "softmax_type,backend",
    [
        ("vanilla", "block_sparse"),
        ("off-by-one", "block_sparse"),
        ("learnable", "block_sparse"),
        ("learnable", "sdpa"),
        ("off-by-one", "sdpa"),
    ],
)
def test_tree_model_matches_stock_model_per_sequence(world, softmax_type, backend):
    seqs = long_branching_sequences()
    weights = torch.linspace(0.5, 1.5, len(seqs))  # a different weight per sequence
    tree_model, stock = _models(softmax_type, backend)
    assert [
        layer.self_attention.core_attention.window_size for layer in tree_model.decoder.layers
    ] == [WINDOW, None, WINDOW]

    want, loss = {}, 0.0
    for i, s in enumerate(seqs):
        logits = stock(s[None], torch.arange(len(s))[None], attention_mask=None)[0]
        want[i] = _logprobs(logits, s)
        loss = loss + weights[i] * want[i].sum()
    loss.backward()

    (mb,) = pack(seqs, max_tokens=1024)
    tree = mb["tree"]
    logits = tree_model(
        mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(tree)
    )[0]
    logp = torch.log_softmax(logits.float(), -1)
    got, loss = {}, 0.0
    for j in range(tree.num_sequences):
        idx, i = tree.sequence_token_index(j), int(tree.sequence_ids[j])
        got[i] = logp[idx[:-1], tree.input_ids[idx[1:]]]
        loss = loss + weights[i] * got[i].sum()
    loss.backward()

    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    err = worst_error(max_abs_error(got[i], want[i]) for i in want)
    rel = gradient_errors(
        parameter_grads(tree_model, require_all=True), parameter_grads(stock, require_all=True)
    )
    print(
        f"PARITY {softmax_type} {backend} window={WINDOW} logprob_err={err:.2e} "
        f"grad_rel={max(rel.values()):.2e}"
    )
    assert err <= LOGP_TOL
    assert max(rel.values()) <= GRAD_RTOL, rel
    if softmax_type == "learnable":
        assert all(
            n in rel for n in ("decoder.layers.0.self_attention.core_attention.softmax_offset",)
        )


def test_flex_model_forward_matches_stock_model(world):
    seqs = long_branching_sequences()[:6]
    tree_model, stock = _models("learnable", "flex")
    (mb,) = pack(seqs, max_tokens=1024)
    tree = mb["tree"]
    with torch.no_grad():
        logits = tree_model(
            mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(tree)
        )[0]
        for j in range(tree.num_sequences):
            idx, i = tree.sequence_token_index(j), int(tree.sequence_ids[j])
            want = _logprobs(
                stock(seqs[i][None], torch.arange(len(seqs[i]))[None], attention_mask=None)[0],
                seqs[i],
            )
            assert (_logprobs(logits[idx], tree.input_ids[idx]) - want).abs().max() <= LOGP_TOL


def test_softmax_offset_parameter_and_errors(world):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tree.mcore.core_attention import TreeCoreAttention

    module = TreeCoreAttention(_config("learnable"), 1, AttnMaskType.arbitrary, "self")
    assert isinstance(
        module.softmax_offset, torch.nn.Parameter
    ) and module.softmax_offset.shape == (4,)
    assert list(module.state_dict()) == ["softmax_offset"]
    sharded = module.sharded_state_dict(prefix="layer.")
    assert (
        list(sharded) == ["layer.softmax_offset"]
        and sharded["layer.softmax_offset"].axis_fragmentations[0] == 1
    )
    zeros = TreeCoreAttention(_config("off-by-one"), 1, AttnMaskType.arbitrary, "self")
    assert torch.equal(zeros.softmax_offset, torch.zeros(4)) and list(zeros.state_dict()) == []
    with pytest.raises(
        ValueError, match=r"layer 1: config.window_size=\(7, 3\).*use window_size=\(7, 0\)"
    ):
        TreeCoreAttention(_config("vanilla", window_size=(7, 3)), 1, AttnMaskType.arbitrary, "self")
    # window_attn_skip_freq=2: layer 2 is a full-attention layer, so its window is never read.
    assert (
        TreeCoreAttention(
            _config("vanilla", window_size=(7, 3)), 2, AttnMaskType.arbitrary, "self"
        ).window_size
        is None
    )
