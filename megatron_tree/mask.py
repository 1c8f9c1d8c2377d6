"""Tree attention masks derived from the O(N) ``subtree_end`` encoding of a :class:`PackedTree`.

``allowed(q, k) = (k <= q) & (q < subtree_end[k])``: a key is seen by its own subtree, which the
pre-order layout makes the contiguous range ``[k, subtree_end[k])``. Every other form is derived
from that one vector; none of them is stored.
"""

from __future__ import annotations

import torch

from .tree import PackedTree


def _subtree_end_of(tree_or_subtree_end: PackedTree | torch.Tensor) -> torch.Tensor:
    if isinstance(tree_or_subtree_end, PackedTree):
        return tree_or_subtree_end.subtree_end
    subtree_end = tree_or_subtree_end
    if subtree_end.dtype.is_floating_point or subtree_end.dtype == torch.bool:
        raise ValueError(
            f"subtree_end must be an integer tensor, got dtype {subtree_end.dtype}; pass "
            "PackedTree.subtree_end"
        )
    return subtree_end.reshape(-1)


def build_attention_mask_from_trie(tree: PackedTree | torch.Tensor) -> torch.Tensor:
    """The dense tree mask in Megatron's polarity.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` int tensor [N].

    Returns:
        torch.bool [N, N], True where query row q must NOT attend key column k. A plain tensor, so it
        survives Megatron's activation checkpointing. Broadcasts to [b, heads, N, N].
    """
    subtree_end = _subtree_end_of(tree)
    n = subtree_end.shape[0]
    pos = torch.arange(n, device=subtree_end.device)
    q = pos[:, None]
    k = pos[None, :]
    return ~((k <= q) & (q < subtree_end[None, :]))


def tree_mask_mod(subtree_end: torch.Tensor):
    """A FlexAttention ``mask_mod`` (True = attend) reading ``subtree_end`` [N]."""
    subtree_end = _subtree_end_of(subtree_end)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    return mask_mod


def tree_block_layout(
    tree: PackedTree | torch.Tensor, block_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query block, key block) tiles of the tree mask hold any / only allowed pairs.

    Computed from per-key-block minima and maxima of ``subtree_end``, never from the N x N mask:
    for key block kb below query block qb every key precedes every query, so the tile has an allowed
    pair iff some key's subtree reaches past the tile's first query, and is full iff every key's
    subtree covers the tile's last query. A diagonal tile always holds its own diagonal.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` [N] with N a multiple of ``block_size``.
        block_size: tile edge.

    Returns:
        (any_allowed, all_allowed): torch.bool [nb, nb] each, indexed [query block, key block].
    """
    subtree_end = _subtree_end_of(tree).to(torch.int64)
    n = subtree_end.shape[0]
    if block_size <= 0 or n % block_size:
        raise ValueError(
            f"block_size={block_size} must be positive and divide the packed length {n}; pack with "
            "a block_size that the packed length is aligned to"
        )
    nb = n // block_size
    ends = subtree_end.view(nb, block_size)
    max_end, min_end = ends.max(dim=1).values, ends.min(dim=1).values  # [nb] per key block
    blk = torch.arange(nb, device=subtree_end.device)
    qb, kb = blk[:, None], blk[None, :]
    below = kb < qb
    any_allowed = (kb == qb) | (below & (max_end[None, :] > qb * block_size))
    # A diagonal tile is full only for 1 x 1 tiles; otherwise its upper triangle is masked.
    fully_before = below | (kb == qb) if block_size == 1 else below
    all_allowed = fully_before & (min_end[None, :] >= (qb + 1) * block_size)
    return any_allowed, all_allowed


def _kv_block_lists(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, nb] bool -> (num_blocks [1, 1, nb], indices [1, 1, nb, nb]) with listed blocks first."""
    num = layout.sum(dim=1, dtype=torch.int32)
    # Stable sort on "not listed" puts the listed key blocks first, in increasing order.
    indices = torch.argsort((~layout).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return num[None, None], indices[None, None]


def build_block_mask_from_trie(tree: PackedTree | torch.Tensor, block_size: int = 128):
    """A FlexAttention ``BlockMask`` for the tree, built at block level from ``subtree_end``.

    Build it once per micro-batch and share it across layers. Its memory is O((N / block_size)^2)
    block indices plus the [N] encoding the ``mask_mod`` reads.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` [N].
        block_size: FlexAttention's tile size; N must be a multiple of it.

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` of shape [1, 1, N, N].
    """
    from torch.nn.attention.flex_attention import BlockMask

    subtree_end = _subtree_end_of(tree)
    any_allowed, all_allowed = tree_block_layout(subtree_end, block_size)
    partial = any_allowed & ~all_allowed
    kv_num, kv_idx = _kv_block_lists(partial)
    full_num, full_idx = _kv_block_lists(all_allowed)
    n = subtree_end.shape[0]
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(subtree_end),
        seq_lengths=(n, n),
    )
