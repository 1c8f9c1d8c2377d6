"""Tree core attention: every backend and mask form against a brute-force reference; spec
rewrite."""

from __future__ import annotations

import math

import pytest
import torch

from harness.models import attention_reference, branching_sequences, pack
from megatron_tree.core import mask as tree_mask
from megatron_tree.core.attention import tree_attention
from megatron_tree.core.mask import build_attention_mask_from_trie, tree_attention_mask
from megatron_tree.testing.tolerances import FP32_ATTN_TOL, FP64_TOL


def _tree(block_size: int = 16):
    return pack(branching_sequences(), block_size=block_size, max_tokens=512)[0]["tree"]


def _qkv(n, heads=4, groups=2, dim=8, seed=0, grad=True, value_dim=None):
    g = torch.Generator().manual_seed(seed)
    shapes = [(n, 1, heads, dim), (n, 1, groups, dim), (n, 1, groups, value_dim or dim)]
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_(grad) for s in shapes]


@pytest.mark.parametrize("backend", ["sdpa", "block_sparse", "auto"])
@pytest.mark.parametrize("form", ["subtree_end", "subtree_end_1N", "dense", "dense_11NN"])
@pytest.mark.parametrize("block_size", [16, 7, 128])
def test_backends_match_reference_forward_backward(backend, form, block_size):
    tree = _tree()
    n = tree.padded_length
    masked = build_attention_mask_from_trie(tree)
    mask = {
        "subtree_end": tree.subtree_end,
        "subtree_end_1N": tree.subtree_end[None],
        "dense": masked,
        "dense_11NN": masked[None, None],
    }[form]
    q, k, v = _qkv(n)
    ref = attention_reference(q, k, v, masked)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    out = tree_attention(q, k, v, mask, backend=backend, block_size=block_size)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert out.shape == (n, 1, 32)
    assert (out - ref).abs().max() < FP64_TOL
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() < FP64_TOL


@pytest.mark.parametrize("block_size", [16, 7])
def test_flex_forward_matches_reference_on_cpu(block_size):
    tree = _tree()
    masked = build_attention_mask_from_trie(tree)
    q, k, v = _qkv(tree.padded_length, grad=False)
    ref = attention_reference(q, k, v, masked)
    for mask in (tree.subtree_end, masked):
        out = tree_attention(q, k, v, mask, backend="flex", block_size=block_size)
        assert (out - ref).abs().max() < FP64_TOL


@pytest.mark.parametrize("backend", ["sdpa", "block_sparse", "flex"])
@pytest.mark.parametrize("sink", [False, True])
def test_value_head_dim_may_differ_from_query_head_dim(backend, sink):
    # Multi-latent attention: queries and keys of 24 (nope + rope parts), values of 16.
    tree = _tree()
    masked = build_attention_mask_from_trie(tree)
    q, k, v = _qkv(tree.padded_length, dim=24, value_dim=16, grad=backend != "flex")
    offset = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64) if sink else None
    scores = torch.einsum("qhd,khd->hqk", q[:, 0], k[:, 0].repeat_interleave(2, dim=1)) / math.sqrt(
        24
    )
    scores = scores.masked_fill(masked, float("-inf"))
    if sink:
        scores = torch.cat([scores, offset[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
    probs = scores.softmax(-1)[..., : tree.padded_length]
    ref = torch.einsum("hqk,khd->qhd", probs, v[:, 0].repeat_interleave(2, dim=1)).reshape(
        -1, 1, 64
    )
    out = tree_attention(
        q, k, v, tree_attention_mask(tree), backend=backend, block_size=16, softmax_offset=offset
    )
    assert out.shape == (tree.padded_length, 1, 64)
    assert (out - ref).abs().max() < FP64_TOL
    if backend != "flex":
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for got, want in zip(grads, ref_grads):
            assert (got - want).abs().max() < FP64_TOL


def test_flex_backward_on_cpu_raises_clearly():
    tree = _tree()
    q, k, v = _qkv(tree.padded_length)
    with pytest.raises(ValueError, match="no backward on CPU"):
        tree_attention(q, k, v, tree.subtree_end, backend="flex")


def test_softmax_scale_is_honoured():
    tree = _tree()
    q, k, v = _qkv(tree.padded_length, grad=False)
    masked = build_attention_mask_from_trie(tree)
    # Scaling q by 2 with scale s/2 equals the default scale s.
    ref = tree_attention(q, k, v, tree.subtree_end, backend="sdpa")
    for backend in ("sdpa", "block_sparse"):
        out = tree_attention(2 * q, k, v, masked, backend=backend, softmax_scale=0.5 / math.sqrt(8))
        assert (out - ref).abs().max() < FP64_TOL


@pytest.mark.parametrize("backend", ["sdpa", "block_sparse"])
def test_dropout_is_applied_and_reproducible(backend):
    tree = _tree()
    q, k, v = _qkv(tree.padded_length, grad=False)
    plain = tree_attention(q, k, v, tree.subtree_end, backend=backend)
    torch.manual_seed(3)
    dropped = tree_attention(q, k, v, tree.subtree_end, backend=backend, dropout_p=0.5)
    torch.manual_seed(3)
    again = tree_attention(q, k, v, tree.subtree_end, backend=backend, dropout_p=0.5)
    assert not torch.allclose(dropped, plain)
    assert torch.equal(dropped, again)


def test_derived_masks_are_built_once_per_micro_batch(monkeypatch):
    """A TreeMask carries its plan: every layer of a micro-batch shares one; a plain subtree_end
    (no plan to carry) derives it on every call; a new micro-batch's mask has its own."""
    tree = _tree()
    calls = []
    original = tree_mask.block_sparse_plan
    monkeypatch.setattr(
        tree_mask, "block_sparse_plan", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    q, k, v = _qkv(tree.padded_length, grad=False)
    mask = tree_attention_mask(tree)
    outs = [
        tree_attention(q, k, v, mask, backend="block_sparse") for _ in range(4)
    ]  # four "layers"
    assert len(calls) == 1
    tree_attention(q, k, v, mask.detach(), backend="block_sparse")  # what recomputation receives
    assert len(calls) == 1
    tree_attention(q, k, v, tree_attention_mask(tree), backend="block_sparse")  # next micro-batch
    assert len(calls) == 2
    for _ in range(2):
        plain = tree_attention(q, k, v, tree.subtree_end, backend="block_sparse")
    assert len(calls) == 4
    assert all(torch.equal(out, plain) for out in outs)


@pytest.mark.parametrize("with_plan", [True, False])
def test_flex_compiles_once_for_many_packed_lengths(with_plan):
    """The compiled flex path takes the packed length as a dynamic dimension: ten different packed
    lengths compile at most two graphs (one static first graph, then one dynamic), not ten."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from harness.models import attention_reference
    from megatron_tree.core import attention as tree_attn

    torch._dynamo.reset()
    tree_attn._COMPILED_FLEX = None
    counters.clear()
    g = torch.Generator().manual_seed(0)
    for n_seq in range(10):
        seqs = [
            torch.randint(1, 50, (int(torch.randint(5, 40, (), generator=g)),), generator=g)
            for _ in range(n_seq + 2)
        ]
        tree = pack(seqs, block_size=16, max_tokens=1024)[0]["tree"]
        q, k, v = (t.float() for t in _qkv(tree.padded_length, grad=False, seed=n_seq))
        mask = tree_attention_mask(tree) if with_plan else tree.subtree_end
        out = tree_attention(q, k, v, mask, backend="flex", block_size=16, compile_flex=True)
        # fp32 compiled kernel vs brute force: reduction order only.
        torch.testing.assert_close(
            out,
            attention_reference(q, k, v, build_attention_mask_from_trie(tree)),
            atol=1e-5,
            rtol=1e-5,
        )
    lengths = counters["stats"]["unique_graphs"]
    assert 1 <= lengths <= 2, dict(counters["stats"])


def test_mask_errors_name_the_sizes():
    tree = _tree()
    n = tree.padded_length
    q, k, v = _qkv(n, grad=False)
    wrong = build_attention_mask_from_trie(tree)[:-16, :-16]
    with pytest.raises(ValueError, match=rf"shape \({n - 16}, {n - 16}\).*{n} query and {n} key"):
        tree_attention(q, k, v, wrong, backend="sdpa")
    with pytest.raises(ValueError, match=rf"has shape \({n - 1},\).*{n} keys"):
        tree_attention(q, k, v, tree.subtree_end[:-1])
    with pytest.raises(ValueError, match="integer subtree_end or a bool mask"):
        tree_attention(q, k, v, torch.zeros(n, n))
    with pytest.raises(ValueError, match="needs the tree mask"):
        tree_attention(q, k, v, None)
    with pytest.raises(ValueError, match="backend='nope'"):
        tree_attention(q, k, v, tree.subtree_end, backend="nope")


# --------------------------------------------------------------------------------------- spec
# rewrite


def _core_attention_of(layer_spec):
    return layer_spec.submodules.self_attention.submodules.core_attention


def test_spec_rewrite_local_layer_and_block():
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tree.mcore.core_attention import TreeCoreAttention
    from megatron_tree.mcore.spec import tree_attention_spec

    local = get_gpt_layer_local_spec()
    rewritten = tree_attention_spec(local, backend="block_sparse", block_size=64)
    core = _core_attention_of(rewritten)
    assert core.module is TreeCoreAttention and core.params == {
        "backend": "block_sparse",
        "block_size": 64,
    }
    assert rewritten.submodules.self_attention.params["attn_mask_type"] == AttnMaskType.arbitrary
    # The input is untouched, the linear layers are kept.
    assert _core_attention_of(local) is DotProductAttention
    assert (
        rewritten.submodules.self_attention.submodules.linear_qkv
        is local.submodules.self_attention.submodules.linear_qkv
    )
    config = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4)
    block = tree_attention_spec(
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    )
    assert len(block.layer_specs) == 3
    assert all(_core_attention_of(s).module is TreeCoreAttention for s in block.layer_specs)
    assert (
        tree_attention_spec(rewritten).submodules.self_attention.params["attn_mask_type"]
        == AttnMaskType.arbitrary
    )


def test_spec_rewrite_te_spec_keeps_te_layers():
    pytest.importorskip("transformer_engine")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_tree.mcore.core_attention import TreeCoreAttention
    from megatron_tree.mcore.spec import tree_attention_spec

    te = get_gpt_layer_with_transformer_engine_spec()
    rewritten = tree_attention_spec(te)
    assert _core_attention_of(rewritten).module is TreeCoreAttention
    assert (
        rewritten.submodules.self_attention.submodules.linear_qkv
        is te.submodules.self_attention.submodules.linear_qkv
    )


def test_spec_rewrite_rejects_what_it_cannot_rewrite():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_tree.mcore.spec import tree_attention_spec

    class CustomAttention(torch.nn.Module):
        pass

    custom_second = TransformerBlockSubmodules(
        layer_specs=[get_gpt_layer_local_spec(), get_gpt_layer_local_spec()]
    )
    custom_second.layer_specs[1].submodules.self_attention.module = CustomAttention
    with pytest.raises(
        ValueError, match="block layer 1: cannot rewrite self-attention CustomAttention"
    ):
        tree_attention_spec(custom_second)

    unknown = get_gpt_layer_local_spec()
    unknown.submodules.self_attention.submodules.core_attention = torch.nn.Identity
    with pytest.raises(ValueError, match="layer spec: unknown core attention Identity"):
        tree_attention_spec(unknown)

    class MambaLayer(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="layer 0: cannot rewrite MambaLayer"):
        tree_attention_spec([ModuleSpec(module=MambaLayer)])

    with pytest.raises(ValueError, match="cannot rewrite a spec of type dict"):
        tree_attention_spec({})


# ------------------------------------------------------------------ chains-only micro-batches


def _unshared_sequences(seed: int = 0) -> list[torch.Tensor]:
    """Sequences that share no token: distinct first tokens (so distinct roots), odd lengths."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.cat([torch.tensor([first]), torch.randint(1, 50, (n,), generator=g)])
        for first, n in zip((51, 52, 53, 54), (12, 1, 30, 7))
    ]


def test_chains_only_micro_batch_runs_causal_kernel(monkeypatch, caplog):
    """A micro-batch whose sequences share nothing runs plain causal attention per sequence (no
    tree kernel), equal to the brute-force tree mask in fp64, forward and backward; the choice is
    logged. Sharing (a common prefix, or a sequence that is a prefix of another) keeps the tree."""
    from megatron_tree.core import attention as tree_attn

    calls = []
    causal = tree_attn._causal_chains
    monkeypatch.setattr(
        tree_attn, "_causal_chains", lambda *a, **kw: calls.append(a[3]) or causal(*a, **kw)
    )
    mb = pack(_unshared_sequences(), block_size=16)[0]
    tree = mb["tree"]
    assert mb["rows"].chains == (13, 2, 31, 8)  # host facts from packing, in tree order
    q, k, v = _qkv(tree.padded_length)
    masked = build_attention_mask_from_trie(tree)
    ref = attention_reference(q, k, v, masked)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    with caplog.at_level("DEBUG", logger="megatron_tree.core.mask"):
        masks = [tree_attention_mask(mb["rows"]), tree_attention_mask(tree)]
    assert "4 unshared sequences" in caplog.text
    for mask in masks:
        out = tree_attention(q, k, v, mask)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        assert (out - ref).abs().max() < FP64_TOL
        for got, want in zip(grads, ref_grads):
            assert (got - want).abs().max() < FP64_TOL
    assert calls == [(13, 2, 31, 8)] * 2

    calls.clear()
    seqs = _unshared_sequences()
    for shared in (seqs + [seqs[2][:9]], seqs + [torch.cat([seqs[0], torch.tensor([5])])]):
        tree = pack(shared, block_size=16)[0]["tree"]
        assert tree_attention_mask(tree).plan.chains is None
        q, k, v = _qkv(tree.padded_length, grad=False)
        tree_attention(q, k, v, tree_attention_mask(tree))
        with pytest.raises(ValueError, match="backend='causal'.*has a tree mask"):
            tree_attention(q, k, v, tree_attention_mask(tree), backend="causal")
    assert calls == []


def test_chains_with_window_or_sink_keep_the_tree_kernel(monkeypatch):
    from megatron_tree.core import attention as tree_attn

    monkeypatch.setattr(tree_attn, "_causal_chains", None)  # any call fails
    tree = pack(_unshared_sequences(), block_size=16)[0]["tree"]
    q, k, v = _qkv(tree.padded_length, grad=False)
    masked = build_attention_mask_from_trie(tree)
    mask = tree_attention_mask(tree)
    out = tree_attention(q, k, v, mask, softmax_offset=torch.zeros(4, dtype=torch.float64))
    assert out.shape == (tree.padded_length, 1, 32)
    windowed = tree_attention(q, k, v, mask, window_size=(3, 0))
    assert windowed.shape == out.shape and not torch.allclose(windowed, out)
    with pytest.raises(ValueError, match="has a window or sink"):
        tree_attention(q, k, v, mask, backend="causal", window_size=(3, 0))
    assert (tree_attention(q, k, v, masked, backend="sdpa") - out).abs().max() > 0  # sink moved it


def test_flex_recompile_limit_raises_instead_of_running_eagerly():
    """Past torch's recompile limit the compiled flex raises (torch would otherwise warn and run
    FlexAttention eagerly, materializing the score matrix). New head dims force new graphs."""
    import torch._dynamo

    from megatron_tree.core import attention as tree_attn

    torch._dynamo.reset()
    tree_attn._COMPILED_FLEX = None
    tree = _tree()
    mask = tree_attention_mask(tree)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            q, k, v = (t.float() for t in _qkv(tree.padded_length, dim=8, grad=False))
            tree_attention(q, k, v, mask, backend="flex", block_size=16, compile_flex=True)
            q, k, v = (t.float() for t in _qkv(tree.padded_length, dim=16, grad=False))
            with pytest.raises(tree_attn.FlexRecompileError, match="recompile_limit=1"):
                tree_attention(q, k, v, mask, backend="flex", block_size=16, compile_flex=True)
    finally:
        torch._dynamo.reset()
        tree_attn._COMPILED_FLEX = None


def test_flex_kernel_choice(monkeypatch):
    """FA4 only where it can run, each refusal named; the override is validated; CPU is Triton."""
    import importlib.util

    from megatron_tree.core import attention as tree_attn

    q = torch.zeros(1, 2, 4, 8)
    monkeypatch.setenv(tree_attn.FLEX_BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="MEGATRON_TREE_FLEX_BACKEND='fast'"):
        tree_attn.flex_kernel_options(q, q, block_size=128, sink=False)
    monkeypatch.setenv(tree_attn.FLEX_BACKEND_ENV, "flash")
    assert tree_attn.flex_kernel_options(q, q, block_size=128, sink=False) is None  # CPU

    tree_attn._fa4_unusable.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "not installed" in tree_attn._fa4_unusable(9, 128, 128, 128, False)
    tree_attn._fa4_unusable.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert tree_attn._fa4_unusable(9, 128, 128, 128, False) == ""
    assert "compute capability 8" in tree_attn._fa4_unusable(8, 128, 128, 128, False)
    assert "head dims 192 / 128" in tree_attn._fa4_unusable(9, 192, 128, 128, False)
    assert "block_size=64" in tree_attn._fa4_unusable(10, 64, 64, 64, False)
    assert "sink" in tree_attn._fa4_unusable(9, 64, 64, 128, True)
    tree_attn._fa4_unusable.cache_clear()


def test_chains_varlen_path_gets_the_runs(monkeypatch):
    """The CUDA varlen path's inputs, checked on the CPU: a stand-in for the flash kernel that runs
    causal attention over the runs it is handed must equal the brute-force tree mask (so the offsets
    mark every sequence and every padding position as a run, the layout is [N, heads, dim] and the
    result lands in Megatron's [N, b, heads * dim])."""
    import torch.nn.functional as F

    from megatron_tree.core import attention as tree_attn

    handed = []

    def varlen_stand_in(q, k, v, cu_seqlens, max_len, scale, dropout_p):
        handed.append((cu_seqlens.tolist(), max_len))
        bounds = cu_seqlens.tolist()
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t[a:b].transpose(0, 1) for t in (q, k, v)),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                ).transpose(0, 1)
                for a, b in zip(bounds[:-1], bounds[1:])
            ]
        )

    monkeypatch.setattr(tree_attn, "_varlen_flash_fits", lambda q, v: True)
    monkeypatch.setattr(tree_attn, "_flash_varlen", varlen_stand_in)
    tree = pack(_unshared_sequences(), block_size=16)[0]["tree"]
    n = tree.padded_length
    q, k, v = _qkv(n)
    ref = attention_reference(q, k, v, build_attention_mask_from_trie(tree))
    out = tree_attention(q, k, v, tree_attention_mask(tree))
    assert (out - ref).abs().max() < FP64_TOL
    assert handed == [([0, 13, 15, 46, 54], 31)]  # the sequences; padding is not a run


@pytest.mark.parametrize("backend", ["auto", "causal", "block_sparse", "sdpa"])
def test_all_padding_fill_in_gives_zero_query_key_gradients(backend):
    """A data-parallel fill-in (all padding: each position sees itself, output = its value) still
    gives queries and keys a gradient, zero: a sharded wrapper (FSDP2) reduce-scatters the same
    parameters' gradients on every rank, also on a rank whose backward covers only fill-ins."""
    from megatron_tree.core.tree import PackedTree

    tree = PackedTree.all_padding(32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 1, h, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    out = tree_attention(q, k, v, tree_attention_mask(tree), backend=backend, block_size=16)
    torch.testing.assert_close(out.view(32, 4, 8), v[:, 0].repeat_interleave(2, dim=1))
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    for name, t in (("q", q), ("k", k)):
        assert t.grad is not None, f"{name} got no gradient"
        # One key per softmax row: exactly zero where a backend skips the softmax; where it computes
        # one, rounding of dO.v - sum(p * dO.v) (<= 1.12e-6 over 20 seeds, block_sparse and sdpa).
        # A second key in a row gives O(0.1).
        torch.testing.assert_close(t.grad, torch.zeros_like(t), atol=FP32_ATTN_TOL, rtol=0)
