"""The tree attention mask: one rule over the O(N) ``subtree_end`` encoding, and every form derived from it.

Pre-order layout makes every subtree a contiguous range, so key ``k`` is visible to the queries
``[k, subtree_end[k])``. :func:`allowed` is that rule, written once; :func:`padding_subtree_end` is
the other one (a padding position sees only itself, so no softmax row is empty). The dense mask, the
tile layout, the FlexAttention ``BlockMask`` and the block-sparse gather plan are all derived here.

:class:`TreeMask` is what a micro-batch hands its model as ``attention_mask``: the ``subtree_end``
tensor itself (so it passes through Megatron's activation checkpointing like any tensor), carrying a
:class:`TreeMaskPlan` that builds each derived form on first use and keeps it for the micro-batch.
Every layer, and the recomputation in backward, then reuses one plan; a second micro-batch in
flight (pipeline schedules) has its own mask and its own plan.

Legend: N packed length, r mask rows (trees in a micro-batch row dimension, usually 1),
B tile (block) size, nb = N / B, M key blocks a query block sees.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .tree import PackedTree

PLAN_GROUPS = 4  # block-sparse plan: query blocks grouped by how many key blocks they see


def allowed(subtree_end: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The tree mask rule, True = query ``q`` attends key ``k`` (broadcasting int tensors).

    ``allowed(q, k) = (k <= q) & (q < subtree_end[k])``: a key is seen by its own subtree.
    """
    return (k <= q) & (q < subtree_end[k])


def padding_subtree_end(start: int, end: int, device: Any = None) -> torch.Tensor:
    """int64 [end - start]: ``subtree_end`` of padding positions ``start..end-1`` (each sees itself)."""
    return torch.arange(start + 1, end + 1, dtype=torch.int64, device=device)


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


def pad_encoding(subtree_end: torch.Tensor, padded: int) -> torch.Tensor:
    """int64 [N] -> [padded]: positions added past N are padding."""
    n = subtree_end.shape[0]
    tail = padding_subtree_end(n, padded, subtree_end.device)
    return torch.cat([subtree_end.to(torch.int64), tail])


def build_attention_mask_from_trie(tree: PackedTree | torch.Tensor) -> torch.Tensor:
    """The dense tree mask in Megatron's polarity.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` int tensor [N].

    Returns:
        torch.bool [N, N], True where query row q must NOT attend key column k. Broadcasts to
        [b, heads, N, N]. O(N^2) memory: prefer passing a :class:`TreeMask` to the model.
    """
    subtree_end = _subtree_end_of(tree)
    pos = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    return ~allowed(subtree_end, pos[:, None], pos[None, :])


def encoding_from_dense(masked: torch.Tensor) -> torch.Tensor:
    """[r, N, N] bool (True = masked) -> subtree_end int32 [r, N].

    In a pre-order tree mask the queries that see key k are the contiguous range
    ``[k, subtree_end[k])``, so ``subtree_end[k] = k + (number of queries that see k)``.
    """
    seen_by = (~masked).sum(dim=-2)
    return (torch.arange(masked.shape[-1], device=masked.device) + seen_by).to(torch.int32)


def _mask_mod(subtree_end: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:
    return allowed(subtree_end, q_idx, kv_idx)


def tree_mask_mod(subtree_end: torch.Tensor):
    """A FlexAttention ``mask_mod`` (True = attend) reading ``subtree_end`` [N].

    A ``functools.partial`` rather than a closure: torch.compile (2.13) then treats the encoding as
    an input whose length is dynamic like the sequence's, while a closure-captured encoding fails
    to compile on CPU once the length becomes dynamic.
    """
    return functools.partial(_mask_mod, _subtree_end_of(subtree_end))


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
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or n % block_size:
        raise ValueError(
            f"block_size={block_size!r} must be a positive integer dividing the packed length {n}; "
            "pack with a block_size that the packed length is aligned to"
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

    Its memory is O((N / block_size)^2) block indices plus the [N] encoding the ``mask_mod`` reads.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` [N].
        block_size: FlexAttention's tile size; N must be a multiple of it.

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` of shape [1, 1, N, N].
    """
    from torch.nn.attention.flex_attention import BlockMask

    subtree_end = _subtree_end_of(tree)
    any_allowed, all_allowed = tree_block_layout(subtree_end, block_size)
    kv_num, kv_idx = _kv_block_lists(any_allowed & ~all_allowed)
    full_num, full_idx = _kv_block_lists(all_allowed)
    n = subtree_end.shape[0]
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx,
        BLOCK_SIZE=block_size, mask_mod=tree_mask_mod(subtree_end), seq_lengths=(n, n),
    )


def block_sparse_plan(subtree_end: torch.Tensor, block_size: int) -> list[tuple[torch.Tensor, ...]]:
    """Gather plan of one tree for the block-sparse backend, as groups of query blocks.

    Query block i attends the key blocks holding an allowed pair for it (``tree_block_layout``).
    Blocks are grouped by that count (group g holds counts up to about (g+1)/G of the maximum), and
    each group's key lists are padded to the group's largest count with the query block itself,
    masked out; so the padding costs at most M/G tiles per query block.

    Args:
        subtree_end: int [N]; padded here to a multiple of ``block_size``.

    Returns:
        A list of (q_blocks [g], kv_index [g, M_g*B], allowed [g, 1, B, M_g*B]) over the groups;
        the q_blocks of all groups together are a permutation of range(nb).
    """
    padded = -(-subtree_end.shape[0] // block_size) * block_size
    ends = pad_encoding(subtree_end, padded)
    any_allowed, _ = tree_block_layout(ends, block_size)  # [nb, nb]
    device = ends.device
    counts = any_allowed.sum(dim=1)
    top = int(counts.max())
    group_of = torch.clamp((counts * PLAN_GROUPS - 1) // top, min=0)
    # Listed key blocks first, in increasing order (stable sort on "not listed").
    order = torch.argsort((~any_allowed).to(torch.int8), dim=1, stable=True)
    offsets = torch.arange(block_size, device=device)
    plan = []
    for group in torch.unique(group_of).tolist():
        q_blocks = torch.nonzero(group_of == group).squeeze(1)
        m = int(counts[q_blocks].max())
        slot_valid = torch.arange(m, device=device)[None, :] < counts[q_blocks, None]  # [g, M]
        kv_blocks = torch.where(slot_valid, order[q_blocks, :m], q_blocks[:, None].expand(-1, m))
        kv_index = (kv_blocks[:, :, None] * block_size + offsets).reshape(len(q_blocks), m * block_size)
        q_pos = (q_blocks[:, None] * block_size + offsets)[:, :, None]  # [g, B, 1]
        pair_ok = allowed(ends, q_pos, kv_index[:, None, :])  # [g, B, M*B]
        pair_ok &= slot_valid.repeat_interleave(block_size, dim=1)[:, None, :]
        plan.append((q_blocks, kv_index, pair_ok.unsqueeze(1)))
    return plan


class TreeMaskPlan:
    """What the attention backends derive from one micro-batch's ``subtree_end``, each built once.

    Forms are built on first request (by the first layer that needs one) and kept as long as the
    plan lives, that is as long as the micro-batch's :class:`TreeMask` does.

    Args:
        subtree_end: int [r, N], one encoding per micro-batch row.
    """

    def __init__(self, subtree_end: torch.Tensor):
        self.subtree_end = subtree_end
        self._forms: dict[Any, Any] = {}

    def _get(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._forms:
            self._forms[key] = build()
        return self._forms[key]

    def dense_allowed(self) -> torch.Tensor:
        """bool [r, 1, N, N], True = attend (torch SDPA's polarity)."""
        def build():
            pos = torch.arange(self.subtree_end.shape[-1], device=self.subtree_end.device)
            return torch.stack([allowed(row, pos[:, None], pos[None, :]) for row in self.subtree_end]).unsqueeze(1)

        return self._get("dense", build)

    def block_sparse(self, row: int, block_size: int) -> list[tuple[torch.Tensor, ...]]:
        """:func:`block_sparse_plan` of row ``row``."""
        return self._get(("block_sparse", row, block_size),
                         lambda: block_sparse_plan(self.subtree_end[row], block_size))

    def block_mask(self, block_size: int, padded: int):
        """FlexAttention ``BlockMask`` [1, 1, padded, padded] of row 0 (one tree per micro-batch)."""
        def build():
            ends = pad_encoding(self.subtree_end[0], padded).to(torch.int32)
            return build_block_mask_from_trie(ends, block_size)

        return self._get(("block_mask", block_size, padded), build)


class TreeMask(torch.Tensor):
    """``subtree_end`` (int [N] or [r, N]) carrying its :class:`TreeMaskPlan`: pass it to the model.

    Build one per micro-batch with :func:`tree_attention_mask`. It is a tensor, so Megatron's
    ``tensor_parallel.checkpoint`` saves it like any input; its ``detach`` (which the checkpoint's
    recomputation calls on every saved input) keeps the plan, so recomputed layers reuse it. Any
    other operation returns a plain tensor.
    """

    plan: TreeMaskPlan
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, subtree_end: torch.Tensor, plan: TreeMaskPlan | None = None):
        mask = torch.Tensor._make_subclass(cls, subtree_end)
        mask.plan = plan if plan is not None else TreeMaskPlan(subtree_end.reshape(-1, subtree_end.shape[-1]))
        return mask

    def detach(self) -> "TreeMask":
        return TreeMask(torch.Tensor.detach(self), self.plan)

    def __reduce_ex__(self, protocol):  # pickles as the plain encoding
        return torch.Tensor.__reduce_ex__(torch.Tensor.detach(self).as_subclass(torch.Tensor), protocol)


def tree_attention_mask(tree: PackedTree | torch.Tensor) -> TreeMask:
    """The ``attention_mask`` to hand a tree model for one micro-batch (int32 [N] :class:`TreeMask`).

    Call it once per micro-batch; every layer (and the recomputation in backward) then shares the
    masks the backends derive from it. A plain ``subtree_end`` tensor works too, but then each layer
    derives its own.
    """
    subtree_end = _subtree_end_of(tree) if isinstance(tree, PackedTree) else tree
    if subtree_end.dtype.is_floating_point or subtree_end.dtype == torch.bool:
        raise ValueError(f"tree_attention_mask needs an integer subtree_end, got {subtree_end.dtype}")
    return TreeMask(subtree_end)
