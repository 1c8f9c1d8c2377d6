"""Recurrent layers on a packed tree (pure torch) against each sequence alone.

References: a token-by-token gated delta rule on each sequence (the definition), torch's
``conv1d`` on each sequence, and the tree's own ``parent_index`` (built by the packer from the
trie); the tree code never sees them. float64: the chunked and token-by-token rules agree to
rounding (~1e-15); a state carried across a branch or a convolution tap on the wrong token moves
outputs by O(1).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.models import recurrent_sequences
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.core.recurrent import (
    RecurrentPlan,
    chunk_gated_delta_rule,
    chunk_ssd,
    gated_delta_rule_reference,
    l2norm,
    ssd_reference,
    tree_causal_conv,
    tree_gated_delta_rule,
    tree_ssd,
)
from megatron_tree.testing.synthetic import grpo_batch, pad_sequences, random_trie_sequences
from megatron_tree.testing.tolerances import FP64_TOL


def _tree(seqs, capacity=1024, block=16):
    return build_packed_tree_batch(
        pad_sequences(seqs), max_tokens_per_mb=capacity, block_size=block, share_trunks=False
    )[0]["tree"]


def _inputs(n, heads=3, dk=8, dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, heads, dk, generator=g, dtype=torch.float64)) * dk**-0.5
    k = l2norm(torch.randn(n, heads, dk, generator=g, dtype=torch.float64))
    v = torch.randn(n, heads, dv, generator=g, dtype=torch.float64)
    gate = -torch.rand(n, heads, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(n, heads, generator=g, dtype=torch.float64)
    return q, k, v, gate, beta


def _check_tree(tree, chunk):
    plan = RecurrentPlan(tree.subtree_end)
    assert torch.equal(plan.parent, tree.parent_index)
    inputs = _inputs(tree.padded_length)
    out = tree_gated_delta_rule(*inputs, plan, chunk=chunk)
    x = torch.randn(tree.padded_length, 2, 6, dtype=torch.float64)
    weight, bias = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    conv = tree_causal_conv(x, weight, bias, plan)
    for i in range(tree.num_sequences):
        idx = tree.sequence_token_index(i)
        want, _ = gated_delta_rule_reference(*(t[idx] for t in inputs))
        assert (out[idx] - want).abs().max() <= FP64_TOL
        seq = x[idx].permute(1, 2, 0)  # [b, D, L]
        want_conv = torch.nn.functional.conv1d(seq, weight[:, None, :], bias, padding=3, groups=6)[
            ..., : len(idx)
        ]
        assert (conv[idx] - want_conv.permute(2, 0, 1)).abs().max() <= FP64_TOL
    ssd = _ssd_inputs(tree.padded_length)
    y = tree_ssd(*ssd, plan, chunk=chunk)
    x, dt, a, b, c = ssd
    for i in range(tree.num_sequences):
        idx = tree.sequence_token_index(i)
        want, _ = ssd_reference(x[idx], dt[idx], a, *(_per_head(t[idx]) for t in (b, c)))
        assert (y[idx] - want).abs().max() <= FP64_TOL
    return plan


def _ssd_inputs(n, heads=4, p=5, groups=2, state=3, seed=0):
    """Mamba-2 SSD inputs: x [n, H, P], dt [n, H] >= 0, A [H] < 0, B, C [n, G, N]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, p, generator=g, dtype=torch.float64)
    dt = torch.rand(n, heads, generator=g, dtype=torch.float64)
    a = -torch.rand(heads, generator=g, dtype=torch.float64) * 2
    b, c = (torch.randn(n, groups, state, generator=g, dtype=torch.float64) for _ in range(2))
    return x, dt, a, b, c


def _per_head(groups, heads=4):
    """[n, G, N] -> [n, H, N]: head h reads group h // (H // G) (written out, not the library's)."""
    return torch.stack([groups[:, h * groups.shape[1] // heads] for h in range(heads)], 1)


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_tree_equals_each_sequence_alone(chunk):
    _check_tree(_tree(recurrent_sequences()), chunk)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 14), st.sampled_from([2, 8, 64]))
def test_random_tries_equal_each_sequence_alone(seed, n_seq, chunk):
    _check_tree(_tree(random_trie_sequences(seed, n_seq, 120), capacity=2048), chunk)


def test_chunked_rule_carries_initial_state():
    q, k, v, g, beta = _inputs(37)
    state = torch.randn(3, 8, 5, dtype=torch.float64)
    want, want_state = gated_delta_rule_reference(q, k, v, g, beta, state)
    for chunk in (1, 5, 16, 64):
        got, got_state = chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None], state[None], chunk
        )
        zero, _ = chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None], None, chunk, final_state=False
        )
        assert (zero[0] - gated_delta_rule_reference(q, k, v, g, beta)[0]).abs().max() <= FP64_TOL
        assert (got[0] - want).abs().max() <= FP64_TOL
        assert (got_state[0] - want_state).abs().max() <= FP64_TOL


def test_chunked_ssd_carries_initial_state():
    x, dt, a, b, c = _ssd_inputs(37)
    b, c = _per_head(b), _per_head(c)
    state = torch.randn(4, 5, 3, dtype=torch.float64)
    want, want_state = ssd_reference(x, dt, a, b, c, state)
    for chunk in (1, 5, 16, 64):
        got, got_state = chunk_ssd(x[None], dt[None], a, b[None], c[None], state[None], chunk)
        zero, none = chunk_ssd(x[None], dt[None], a, b[None], c[None], None, chunk, False)
        assert none is None
        assert (zero[0] - ssd_reference(x, dt, a, b, c)[0]).abs().max() <= FP64_TOL
        assert (got[0] - want).abs().max() <= FP64_TOL
        assert (got_state[0] - want_state).abs().max() <= FP64_TOL


def test_ssd_padding_with_zero_dt_keeps_the_state():
    """The bucket padding's premise: a token with dt = 0 and x = B = C = 0 leaves the state as it
    is (exp(0 * A) = 1, no input)."""
    x, dt, a, b, c = _ssd_inputs(9)
    b, c = _per_head(b), _per_head(c)
    _, state = ssd_reference(x, dt, a, b, c)
    pad = lambda t: torch.cat([t, t.new_zeros(4, *t.shape[1:])])  # noqa: E731
    _, padded = chunk_ssd(*(pad(t)[None] for t in (x, dt)), a, pad(b)[None], pad(c)[None], chunk=4)
    assert (padded[0] - state).abs().max() <= FP64_TOL


def test_backward_matches_finite_differences():
    """A prompt, two branches (one of them a one-token segment with a child) and a padding
    position."""
    seqs = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 5]), torch.tensor([1, 2, 5, 6, 7])]
    tree = _tree(seqs, block=8)
    plan = RecurrentPlan(tree.subtree_end)
    inputs = [t.requires_grad_(True) for t in _inputs(tree.padded_length, heads=1, dk=2, dv=2)]
    assert torch.autograd.gradcheck(lambda *a: tree_gated_delta_rule(*a, plan, chunk=4), inputs)
    ssd = [t.requires_grad_(True) for t in _ssd_inputs(tree.padded_length, 2, 2, 1, 2)]
    assert torch.autograd.gradcheck(lambda *a: tree_ssd(*a, plan, chunk=2), ssd)


def test_passes_per_layer_follow_levels_not_segments():
    """A GRPO trie (one prompt, 8 responses): two levels, O(1) passes however many responses; a
    multi-turn chain of t turns, each turn's sequence ending one token after it: t levels."""
    grpo = build_packed_tree_batch(
        grpo_batch(
            num_prompts=1, samples_per_prompt=8, prompt_len=64, response_len=(16, 40), seed=3
        ),
        max_tokens_per_mb=4096,
        block_size=1,
        pad_to_max=False,
        share_trunks=False,
    )[0]["tree"]
    plan = RecurrentPlan(grpo.subtree_end)
    assert plan.num_levels == 2 and plan.num_segments >= 9
    assert plan.num_passes <= 2 + 2 * 2  # each level: its length buckets (+ one for the padding)
    for level in plan.buckets:  # padding to a bucket's longest segment at most doubles its work
        for bucket in level:
            lengths = (bucket.index < plan.num_positions).sum(1)
            assert int(lengths.max()) < 2 * int(lengths.min()) or int(lengths.max()) == 1
    turns = [torch.arange(1, 11)]
    for t in range(5):
        turns.append(torch.cat([turns[-1], torch.full((7,), 20 + t)]))
    chain = build_packed_tree_batch(
        pad_sequences([torch.cat([t, torch.tensor([90 + i])]) for i, t in enumerate(turns)]),
        max_tokens_per_mb=1024,
        block_size=1,
        pad_to_max=False,
        share_trunks=False,
    )[0]["tree"]
    plan = RecurrentPlan(chain.subtree_end)
    assert plan.num_levels == len(turns) and plan.num_segments == 2 * len(turns) - 1
