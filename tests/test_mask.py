"""Block-level and FlexAttention forms of the tree mask against the dense mask.

The dense mask itself is checked against a brute-force ancestor check in test_packing.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tree.core.mask import (
    build_attention_mask_from_trie,
    build_block_mask_from_trie,
    tree_block_layout,
    tree_mask_mod,
)
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import pad_sequences, random_trie_sequences


def dense_block_reduction(allowed: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = allowed.shape[0] // block
    tiles = allowed.view(nb, block, nb, block).permute(0, 2, 1, 3).reshape(nb, nb, -1)
    return tiles.any(-1), tiles.all(-1)


def random_tree(seed: int, n_seq: int, capacity: int, block: int):
    packed = build_packed_tree_batch(
        pad_sequences(random_trie_sequences(seed, n_seq, capacity // 2)),
        max_tokens_per_mb=capacity,
        block_size=block,
        pad_to_max=True,  # N = capacity: the tilings the tests pick
    )
    return packed[0]["tree"]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 12), st.sampled_from([1, 2, 8, 16, 29]))
def test_block_layout_equals_block_reduction_of_dense(seed, n_seq, block):
    capacity = block * (232 // block + 1)  # odd sizes, several tilings
    tree = random_tree(seed, n_seq, capacity, block)
    allowed = ~build_attention_mask_from_trie(tree)
    any_ref, all_ref = dense_block_reduction(allowed, block)
    any_allowed, all_allowed = tree_block_layout(tree, block)
    assert torch.equal(any_allowed, any_ref)
    assert torch.equal(all_allowed, all_ref)


@pytest.mark.parametrize("block", [8, 16, 128])
def test_block_mask_matches_dense(block):
    tree = random_tree(7, 10, 256, block)
    allowed = ~build_attention_mask_from_trie(tree)
    block_mask = build_block_mask_from_trie(tree, block_size=block)
    n = tree.padded_length
    assert block_mask.shape == (1, 1, n, n)
    # to_dense() gives the block layout (partial and full tiles together).
    any_ref, all_ref = dense_block_reduction(allowed, block)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), any_ref)
    # The full-tile lists name exactly the tiles that need no mask_mod.
    full = torch.zeros_like(all_ref)
    full_num, full_idx = block_mask.full_kv_num_blocks[0, 0], block_mask.full_kv_indices[0, 0]
    for qb in range(full.shape[0]):
        full[qb, full_idx[qb, : full_num[qb]].long()] = True
    assert torch.equal(full, all_ref)
    # mask_mod over every (q, k) equals the dense mask.
    q = torch.arange(n)[:, None].expand(n, n)
    k = torch.arange(n)[None, :].expand(n, n)
    assert torch.equal(block_mask.mask_mod(0, 0, q, k), allowed)


def test_flex_attention_forward_matches_sdpa():
    from torch.nn.attention.flex_attention import flex_attention

    tree = random_tree(3, 8, 128, 16)
    n = tree.padded_length
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=build_block_mask_from_trie(tree, block_size=16))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=~build_attention_mask_from_trie(tree)
    )
    # Same fp32 math, different reduction order: agreement to a few ulps of O(1) values.
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_padding_sees_only_itself():
    tree = random_tree(1, 3, 64, 16)
    masked = build_attention_mask_from_trie(tree)
    pad = torch.arange(tree.num_tree_tokens, tree.padded_length)
    assert torch.equal(~masked[pad], torch.nn.functional.one_hot(pad, tree.padded_length).bool())
    assert not (~masked[:, pad][: tree.num_tree_tokens]).any()


def test_errors():
    tree = random_tree(0, 2, 64, 16)
    with pytest.raises(
        ValueError, match="block_size=24 must be a positive integer dividing the packed length 64"
    ):
        tree_block_layout(tree, 24)
    with pytest.raises(ValueError, match="subtree_end must be an integer tensor"):
        tree_mask_mod(torch.zeros(4))


@pytest.mark.parametrize("max_pixels, tile", [(64, 1), (16, 4), (10, 8)])
def test_mask_picture_grid_equals_brute_force(max_pixels, tile):
    from megatron_tree.demo.visualize import EMPTY, FULL, PAD, PARTIAL, tree_mask_tiles

    tree = random_tree(5, 6, 64, 16)  # N = 64
    grid, got_tile = tree_mask_tiles(tree, max_pixels)
    assert got_tile == tile and grid.shape == (64 // tile, 64 // tile)
    n, real = tree.padded_length, tree.num_tree_tokens
    parent = tree.parent_index.tolist()
    allowed = torch.zeros(n, n, dtype=torch.bool)  # brute force: q sees itself and its ancestors
    for q in range(n):
        k = q
        while k >= 0:
            allowed[q, k], k = True, parent[k]
    if tile == 1:
        assert torch.equal(grid[:real, :real] == FULL, allowed[:real, :real])
        assert torch.equal(grid[:real, :real] == EMPTY, ~allowed[:real, :real])
    any_ref, all_ref = dense_block_reduction(allowed, tile)
    pad = torch.arange(n // tile) * tile >= real
    pad = pad[:, None] | pad[None, :]
    ref = torch.where(pad, PAD, any_ref.to(torch.uint8) + all_ref.to(torch.uint8))
    ref[pad & any_ref] = PARTIAL
    assert torch.equal(grid, ref.to(torch.uint8))


def test_mask_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_tree.demo.visualize import save_tree_mask_png

    path = save_tree_mask_png(
        random_tree(5, 6, 64, 16), tmp_path / "sub" / "mask.png", max_pixels=64
    )
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 1000
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert width >= 256 and height >= 256
