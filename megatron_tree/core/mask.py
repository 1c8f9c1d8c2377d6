"""The tree attention mask: one rule over the O(N) ``subtree_end`` encoding, and every form derived
from it.

Pre-order layout makes every subtree a contiguous range, so key ``k`` is visible to the queries
``[k, subtree_end[k])``. :func:`allowed` is that rule, written once; :func:`padding_subtree_end` is
the other one (a padding position sees only itself, so no softmax row is empty). The dense mask, the
tile layout, the FlexAttention ``BlockMask`` and the block-sparse gather plan are all derived here.

Sliding windows are over depth: with a window ``w`` (Megatron's ``window_size[0]``) a query also
needs its key at most ``w`` levels above it, so on a chain it sees ``w + 1`` keys, itself included,
exactly Megatron's sliding-window causal mask on each sequence alone. The depths come from
``subtree_end`` itself (:func:`~.tree.tree_depth`), so every mask form carries them; a window is a
per-layer argument of the derived forms, not part of the encoding.

:class:`TreeMask` is what a micro-batch hands its model as ``attention_mask``: the ``subtree_end``
tensor itself (so it passes through Megatron's activation checkpointing like any tensor), carrying a
:class:`TreeMaskPlan` that builds each derived form on first use and keeps it for the micro-batch.
Every layer, and the recomputation in backward, then reuses one plan; a second micro-batch in
flight (pipeline schedules) has its own mask and its own plan.

Legend: N packed length, r trees stacked in the mask's leading dimension (usually 1), B tile
(block) size, nb = N / B, M key blocks a query block sees.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from .recurrent import RecurrentPlan
from .rows import KeyValueStore, TreeRows, chain_lengths
from .tree import PackedTree, subtree_end_of, tree_depth

logger = logging.getLogger(__name__)

PLAN_GROUPS = 4  # block-sparse plan: query blocks grouped by how many key blocks they see


def allowed(
    subtree_end: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    depth: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The tree mask rule, True = query ``q`` attends key ``k`` (broadcasting int tensors).

    ``allowed(q, k) = (k <= q) & (q < subtree_end[k])``: a key is seen by its own subtree, that is
    by itself and its descendants. With a ``window`` (an int >= 0, Megatron's ``window_size[0]``)
    also ``depth[q] - depth[k] <= window``: the key is at most ``window`` levels above the query.

    Args:
        subtree_end: int [N].
        q, k: int position tensors (broadcast against each other).
        depth: int [N], :func:`tree_depth` of ``subtree_end``; needed with a window.
        window: None (no window) or the most levels a visible key may sit above its query.
    """
    ok = (k <= q) & (q < subtree_end[k])
    if window is not None:
        ok = ok & (depth[q] - depth[k] <= window)
    return ok


def depth_window(window_size: Any) -> int | None:
    """Megatron's ``window_size=(left, right)`` -> the depth window of :func:`allowed` (``left``).

    Megatron (its local sliding-window mask and transformer-engine) lets query i see keys
    ``i - left .. i + right``: ``left + 1`` keys of the past, the query included (HuggingFace's
    ``sliding_window`` is ``left + 1``). Tree attention is causal, so ``right`` must be 0; a
    ``left`` of -1 is transformer-engine's unlimited window.

    Returns:
        None (no window) or ``left`` >= 0.
    """
    if window_size is None:
        return None
    ok = (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in window_size)
    )
    if not ok:
        raise ValueError(
            f"window_size={window_size!r} must be None or Megatron's (left, right) pair of ints, "
            "e.g. (4095, 0) for a 4096-token window (HuggingFace sliding_window=4096)"
        )
    left, right = window_size
    if right != 0:
        raise ValueError(
            f"window_size={tuple(window_size)!r}: tree attention is causal, so the right window "
            f"must be 0 (a query sees no later key); use window_size=({left}, 0)"
        )
    if left < -1:
        raise ValueError(
            f"window_size={tuple(window_size)!r}: left must be >= 0, or -1 for no window"
        )
    return None if left == -1 else left


def padding_subtree_end(start: int, end: int, device: Any = None) -> torch.Tensor:
    """int64 [end - start]: ``subtree_end`` of padding positions ``start..end-1`` (each sees
    itself)."""
    return torch.arange(start + 1, end + 1, dtype=torch.int64, device=device)


def pad_encoding(subtree_end: torch.Tensor, padded: int) -> torch.Tensor:
    """int64 [N] -> [padded]: positions added past N are padding."""
    n = subtree_end.shape[0]
    tail = padding_subtree_end(n, padded, subtree_end.device)
    return torch.cat([subtree_end.to(torch.int64), tail])


def build_attention_mask_from_trie(
    tree: PackedTree | torch.Tensor, *, window: int | None = None
) -> torch.Tensor:
    """The dense tree mask in Megatron's polarity.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` int tensor [N].
        window: a depth window (see :func:`allowed`; :func:`depth_window` converts Megatron's
            ``window_size``), or None.

    Returns:
        torch.bool [N, N], True where query row q must NOT attend key column k. Broadcasts to
        [b, heads, N, N]. O(N^2) memory: prefer passing a :class:`TreeMask` to the model.
    """
    subtree_end = subtree_end_of(tree)
    pos = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    depth = None if window is None else tree_depth(subtree_end)
    return ~allowed(subtree_end, pos[:, None], pos[None, :], depth, window)


def encoding_from_dense(masked: torch.Tensor) -> torch.Tensor:
    """[r, N, N] bool (True = masked) -> subtree_end int32 [r, N].

    In a pre-order tree mask the queries that see key k are the contiguous range
    ``[k, subtree_end[k])``, so ``subtree_end[k] = k + (number of queries that see k)``.
    """
    seen_by = (~masked).sum(dim=-2)
    return (torch.arange(masked.shape[-1], device=masked.device) + seen_by).to(torch.int32)


def _mask_mod(subtree_end: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:
    return allowed(subtree_end, q_idx, kv_idx)


def _general_mask_mod(
    subtree_end, query_positions, depth, window, b, h, q_idx, kv_idx
) -> torch.Tensor:
    q = q_idx if query_positions is None else query_positions[q_idx]
    return allowed(subtree_end, q, kv_idx, depth, window)


def tree_mask_mod(
    subtree_end: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    window: int | None = None,
):
    """A FlexAttention ``mask_mod`` (True = attend) reading ``subtree_end`` [N].

    A ``functools.partial`` rather than a closure: torch.compile (2.13) then treats the encoding as
    an input whose length is dynamic like the sequence's, while a closure-captured encoding fails
    to compile on CPU once the length becomes dynamic.

    Args:
        subtree_end: int [N] (or a :class:`PackedTree`).
        query_positions: int64 [nq]: query row i is position ``query_positions[i]`` (context
            parallelism); default row i is position i.
        window: a depth window (see :func:`allowed`), or None.
    """
    subtree_end = subtree_end_of(subtree_end)
    if query_positions is None and window is None:
        return functools.partial(_mask_mod, subtree_end)
    if window is None:
        return functools.partial(_general_mask_mod, subtree_end, query_positions, None, None)
    # The window as a 0-d tensor: compiled with dynamic shapes, a Python int becomes a symbol that
    # torch 2.13's CPU flex code generation fails on (and would guard on every distinct window).
    window = torch.tensor(window, dtype=torch.int64, device=subtree_end.device)
    return functools.partial(
        _general_mask_mod, subtree_end, query_positions, tree_depth(subtree_end), window
    )


def padded_query_positions(query_positions: torch.Tensor, padded: int) -> torch.Tensor:
    """int64 [nq] ascending -> [padded]: the last position repeated (a padded query row then
    computes a valid duplicate row, which is sliced off)."""
    extra = padded - query_positions.shape[0]
    return (
        torch.cat([query_positions, query_positions[-1:].expand(extra)])
        if extra
        else query_positions
    )


def tree_block_layout(
    tree: PackedTree | torch.Tensor,
    block_size: int = 128,
    query_positions: torch.Tensor | None = None,
    *,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query tile, key block) tiles of the tree mask hold any / only allowed pairs.

    Computed from per-key-block minima and maxima of ``subtree_end``, never from the N x N mask.
    A tile of queries ``[qmin, qmax]`` and key block kb has an allowed pair if kb starts at or
    before ``qmax`` and some key's subtree reaches past ``qmin``: exact for a key block below a
    contiguous query tile, and for the diagonal (every query sees itself); for scattered query
    tiles (context parallelism) a superset, which costs work but never correctness because the
    pairs inside a listed tile are masked exactly. A tile is full iff its whole key block lies at
    or before ``qmin`` and every key's subtree covers ``qmax``.

    With a depth ``window`` a tile also needs ``min depth(q) - max depth(keys) <= window`` over the
    queries q of the tile below the key block's largest ``subtree_end`` (the only ones that can see
    it) to hold an allowed pair (a conservative test: the pairs of a listed tile are masked
    exactly), and ``max depth(queries) - min depth(keys) <= window`` to be full. Deep in a long
    branch, key blocks more than a window above the query tile are then skipped: that is where
    windows save work.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` [N] with N a multiple of ``block_size``.
        block_size: tile edge.
        query_positions: int64 [nq] ascending, a multiple of ``block_size`` long: the queries'
            positions (one context-parallel rank's rows); default all N positions.
        window: a depth window (see :func:`allowed`), or None.

    Returns:
        (any_allowed, all_allowed): torch.bool [nq / block_size, N / block_size] each, indexed
        [query tile, key block].
    """
    subtree_end = subtree_end_of(tree).to(torch.int64)
    n = subtree_end.shape[0]
    nq = n if query_positions is None else query_positions.shape[0]
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size <= 0
        or n % block_size
        or nq % block_size
    ):
        raise ValueError(
            f"block_size={block_size!r} must be a positive integer dividing the packed length {n} "
            f"and the number of queries {nq}; pack with a block_size that the packed length is "
            "aligned to"
        )
    ends = subtree_end.view(n // block_size, block_size)
    max_end, min_end = ends.max(dim=1).values, ends.min(dim=1).values  # [nb] per key block
    if query_positions is None:
        qmin = torch.arange(0, n, block_size, device=subtree_end.device)
        qmax = qmin + block_size - 1
    else:
        tiles = query_positions.to(subtree_end.device).view(nq // block_size, block_size)
        qmin, qmax = tiles[:, 0], tiles[:, -1]
    kstart = torch.arange(0, n, block_size, device=subtree_end.device)[None, :]
    any_allowed = (kstart <= qmax[:, None]) & (max_end[None, :] > qmin[:, None])
    all_allowed = (kstart + block_size - 1 <= qmin[:, None]) & (min_end[None, :] > qmax[:, None])
    if window is not None:
        depth = tree_depth(subtree_end)
        key_depth = depth.view(n // block_size, block_size)  # [nb, B]
        q_pos = (
            torch.arange(n, device=depth.device) if query_positions is None else tiles
        ).reshape(-1, block_size)
        query_depth = depth[q_pos]  # [nq / B, B]
        # Only the queries before max_end can see key block kb: a prefix of the (ascending) tile.
        seen = torch.searchsorted(q_pos, max_end[None, :].expand(q_pos.shape[0], -1).contiguous())
        lowest = torch.cummin(query_depth, dim=1).values.gather(
            1, (seen - 1).clamp(min=0)
        )  # [nq / B, nb]
        any_allowed &= lowest - key_depth.max(1).values[None, :] <= window
        all_allowed &= (
            query_depth.max(1).values[:, None] - key_depth.min(1).values[None, :] <= window
        )
    return any_allowed, all_allowed


def _kv_block_lists(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, nb] bool -> (num_blocks [1, 1, nb], indices [1, 1, nb, nb]) with listed blocks first."""
    num = layout.sum(dim=1, dtype=torch.int32)
    # Stable sort on "not listed" puts the listed key blocks first, in increasing order.
    indices = torch.argsort((~layout).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return num[None, None], indices[None, None]


def build_block_mask_from_trie(
    tree: PackedTree | torch.Tensor,
    block_size: int = 128,
    query_positions: torch.Tensor | None = None,
    *,
    window: int | None = None,
):
    """A FlexAttention ``BlockMask`` for the tree, built at block level from ``subtree_end``.

    Its memory is O((N / block_size)^2) block indices plus the [N] encoding the ``mask_mod`` reads.

    Args:
        tree: a :class:`PackedTree`, or its ``subtree_end`` [N].
        block_size: FlexAttention's tile size; N must be a multiple of it.
        query_positions: int64 [nq] ascending (a multiple of ``block_size`` long): the queries'
            positions under context parallelism; default all N.
        window: a depth window (see :func:`allowed`), or None.

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` of shape [1, 1, nq, N].
    """
    from torch.nn.attention.flex_attention import BlockMask

    subtree_end = subtree_end_of(tree)
    any_allowed, all_allowed = tree_block_layout(
        subtree_end, block_size, query_positions, window=window
    )
    kv_num, kv_idx = _kv_block_lists(any_allowed & ~all_allowed)
    full_num, full_idx = _kv_block_lists(all_allowed)
    n = subtree_end.shape[0]
    nq = n if query_positions is None else query_positions.shape[0]
    mask_mod = tree_mask_mod(subtree_end, query_positions=query_positions, window=window)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(nq, n),
    )


def block_sparse_plan(
    subtree_end: torch.Tensor,
    block_size: int,
    query_positions: torch.Tensor | None = None,
    *,
    window: int | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Gather plan of one tree for the block-sparse backend, as groups of query tiles.

    Query tile i attends the key blocks holding an allowed pair for it (``tree_block_layout``).
    Tiles are grouped by that count (group g holds counts up to about (g+1)/G of the maximum), and
    each group's key lists are padded to the group's largest count with masked-out slots; so the
    padding costs at most M/G tiles per query tile.

    Args:
        subtree_end: int [N]; padded here to a multiple of ``block_size``.
        query_positions: int64 [nq] ascending, the queries' positions (a context-parallel rank's
            rows), padded here by repeating the last; default all N.
        window: a depth window (see :func:`allowed`), or None: key blocks wholly out of every
            query's window are not listed.

    Returns:
        A list of (q_tiles [g], kv_index [g, M_g*B], allowed [g, 1, B, M_g*B]) over the groups;
        the q_tiles of all groups together are a permutation of range(nq / B).
    """
    padded = -(-subtree_end.shape[0] // block_size) * block_size
    ends = pad_encoding(subtree_end, padded)
    device = ends.device
    if query_positions is None:
        q_all = torch.arange(padded, device=device)
    else:
        q_all = padded_query_positions(
            query_positions.to(device), -(-query_positions.shape[0] // block_size) * block_size
        )
    any_allowed, _ = tree_block_layout(
        ends, block_size, None if query_positions is None else q_all, window=window
    )
    depth = None if window is None else tree_depth(ends)
    counts = any_allowed.sum(dim=1)
    top = int(counts.max())
    group_of = torch.clamp((counts * PLAN_GROUPS - 1) // top, min=0)
    # Listed key blocks first, in increasing order (stable sort on "not listed").
    order = torch.argsort((~any_allowed).to(torch.int8), dim=1, stable=True)
    offsets = torch.arange(block_size, device=device)
    plan = []
    for group in torch.unique(group_of).tolist():
        q_tiles = torch.nonzero(group_of == group).squeeze(1)
        m = int(counts[q_tiles].max())
        slot_valid = torch.arange(m, device=device)[None, :] < counts[q_tiles, None]  # [g, M]
        kv_blocks = torch.where(slot_valid, order[q_tiles, :m], order[q_tiles, :1])
        kv_index = (kv_blocks[:, :, None] * block_size + offsets).reshape(
            len(q_tiles), m * block_size
        )
        q_pos = q_all.view(-1, block_size)[q_tiles][:, :, None]  # [g, B, 1]
        pair_ok = allowed(ends, q_pos, kv_index[:, None, :], depth, window)  # [g, B, M*B]
        pair_ok &= slot_valid.repeat_interleave(block_size, dim=1)[:, None, :]
        plan.append((q_tiles, kv_index, pair_ok.unsqueeze(1)))
    return plan


class TreeMaskPlan:
    """What the attention backends derive from one micro-batch's ``subtree_end``, each built once.

    Forms are built on first request (by the first layer that needs one) and kept as long as the
    plan lives, that is as long as the micro-batch's :class:`TreeMask` does. A form under a depth
    ``window`` (a layer's sliding window, see :func:`allowed`) is kept per window, so local and
    global layers of one model each build theirs once.

    Args:
        subtree_end: int [r, K], one encoding per micro-batch row (K keys).
        rows: the micro-batch's :class:`~megatron_tree.core.rows.TreeRows` when its queries are
            not simply all K keys (a context-parallel rank's rows, a trunk-reuse part):
            ``subtree_end`` is then ``rows.encoding()[0]``, and the attention gets its keys and
            values through :meth:`keys_values`.
        store: the trunk group's :class:`~megatron_tree.core.rows.KeyValueStore` (a trunk-reuse
            part records its keys there, or extends the ones recorded).
        chains: host ints, the lengths of the chains of a tree whose sequences share nothing
            (:attr:`~megatron_tree.core.rows.TreeRows.chains`): its attention is causal within
            each chain, so ``"auto"`` runs the dense causal kernel instead of a tree kernel.
        tokens: what the micro-batch's token-wise layers read besides the mask (the MoE router's
            per-row weights, replayed routes and loss scale:
            :class:`~megatron_tree.mcore.moe.RouterInputs`); None for none. The plan is the
            micro-batch's one context: Megatron hands ``attention_mask`` to every layer, in the
            forward and in an activation recomputation alike.
    """

    def __init__(
        self,
        subtree_end: torch.Tensor,
        rows: TreeRows | None = None,
        *,
        store: KeyValueStore | None = None,
        chains: tuple[int, ...] | None = None,
        tokens: Any = None,
    ):
        if chains is not None and (
            rows is not None or subtree_end.shape[0] != 1 or sum(chains) > subtree_end.shape[-1]
        ):
            raise ValueError(
                f"chains={chains} describe a whole tree of at least {sum(chains)} positions, got "
                f"an encoding of shape {tuple(subtree_end.shape)}"
                + (" for some rows of a tree" if rows is not None else "")
            )
        self.subtree_end = subtree_end
        self.rows = rows
        self.store = store
        self.chains = chains
        self.tokens = tokens
        queries = None if rows is None else rows.encoding()[1]
        self._queries = None if queries is None else queries.to(subtree_end.device)
        self._forms: dict[Any, Any] = {}

    @property
    def query_positions(self) -> torch.Tensor | None:
        """int64 [nq], the queries' places among the keys when they are a subset of them (a CP
        rank's rows, a trunk-reuse part), else None (the queries are all the keys)."""
        return self._queries

    @property
    def num_queries(self) -> int:
        return self.subtree_end.shape[-1] if self._queries is None else self._queries.shape[0]

    @property
    def reach(self) -> int | None:
        """How deep a rotary table must reach for the rows (None: as deep as they are many)."""
        return None if self.rows is None else self.rows.reach

    def query_depths(self) -> torch.Tensor:
        """int64 [r, nq]: each query row's depth in its tree (:func:`tree_depth` of the keys, which
        hold every row's ancestors), built once per micro-batch; a rotary table indexed by it gives
        each row the angle it has in its own sequences (multi-latent attention rotates this way)."""

        def build():
            depth = torch.stack([tree_depth(ends) for ends in self.subtree_end])
            return depth if self._queries is None else depth[:, self._queries]

        return self._get("query_depths", build)

    def keys_values(
        self, key: torch.Tensor, value: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's keys/values [n, b, ng, hn] -> those of every key [K, b, ng, hn]
        (:meth:`~megatron_tree.core.rows.TreeRows.keys_values`)."""
        if self.rows is None:
            return key, value
        return self.rows.keys_values(key, value, layer, self.store)

    def chain_offsets(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(int32 [S + 1] offsets of the sequences of a chains-only micro-batch on ``device``; the
        longest), for a varlen causal kernel over its real positions, built once per device."""

        def build():
            offsets = torch.tensor([0, *self.chains], dtype=torch.int32).cumsum(
                0, dtype=torch.int32
            )
            return offsets.to(device, non_blocking=True), max(self.chains)

        if not self.chains:
            raise ValueError(
                "chain_offsets: this micro-batch is a tree"
                if self.chains is None
                else "chain_offsets: this micro-batch has no sequence (all padding)"
            )
        return self._get(("chain_offsets", torch.device(device)), build)

    def recurrent(self):
        """The :class:`~megatron_tree.core.recurrent.RecurrentPlan` of the keys (the segments a
        recurrent layer runs over), built by the first recurrent layer and kept."""
        return self._get("recurrent", lambda: RecurrentPlan(self.subtree_end[0]))

    def _get(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._forms:
            self._forms[key] = build()
        return self._forms[key]

    def dense_allowed(self, window: int | None = None) -> torch.Tensor:
        """bool [r, 1, nq, N], True = attend (torch SDPA's polarity), under a depth ``window``."""

        def build():
            keys = torch.arange(self.subtree_end.shape[-1], device=self.subtree_end.device)
            queries = keys if self._queries is None else self._queries
            return torch.stack(
                [
                    allowed(
                        ends,
                        queries[:, None],
                        keys[None, :],
                        None if window is None else tree_depth(ends),
                        window,
                    )
                    for ends in self.subtree_end
                ]
            ).unsqueeze(1)

        return self._get(("dense", window), build)

    def block_sparse(
        self, row: int, block_size: int, window: int | None = None
    ) -> list[tuple[torch.Tensor, ...]]:
        """:func:`block_sparse_plan` of row ``row`` under a depth ``window``."""
        return self._get(
            ("block_sparse", row, block_size, window),
            lambda: block_sparse_plan(
                self.subtree_end[row], block_size, self.query_positions, window=window
            ),
        )

    def block_mask(
        self, block_size: int, padded_queries: int, padded_keys: int, window: int | None = None
    ):
        """FlexAttention ``BlockMask`` [1, 1, padded_queries, padded_keys] of row 0 (one tree per
        micro-batch) under a depth ``window``."""

        def build():
            ends = pad_encoding(self.subtree_end[0], padded_keys).to(torch.int32)
            queries = (
                None
                if self._queries is None
                else padded_query_positions(self._queries, padded_queries)
            )
            return build_block_mask_from_trie(ends, block_size, queries, window=window)

        return self._get(("block_mask", block_size, padded_queries, padded_keys, window), build)


class TreeMask(torch.Tensor):
    """``subtree_end`` (int [K] or [r, K]) carrying its :class:`TreeMaskPlan`: pass it to the model.

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
        if plan is None:
            plan = TreeMaskPlan(subtree_end.reshape(-1, subtree_end.shape[-1]))
        mask.plan = plan
        return mask

    def detach(self) -> TreeMask:
        return TreeMask(torch.Tensor.detach(self), self.plan)

    def __reduce_ex__(self, protocol):  # pickles as the plain encoding
        return torch.Tensor.__reduce_ex__(
            torch.Tensor.detach(self).as_subclass(torch.Tensor), protocol
        )


def tree_attention_mask(
    tree: PackedTree | TreeRows | torch.Tensor,
    rows: TreeRows | None = None,
    *,
    store: KeyValueStore | None = None,
    tokens: Any = None,
) -> TreeMask:
    """The ``attention_mask`` to hand a tree model for one micro-batch (int32 :class:`TreeMask`).

    Call it once per micro-batch; every layer (and the recomputation in backward) then shares the
    masks the backends derive from it (per sliding window, for models that mix local and global
    layers; the depths a window needs come from ``subtree_end`` itself, :func:`tree_depth`). A plain
    ``subtree_end`` tensor works too, but then each layer derives its own.

    A whole tree whose sequences share no token (its :attr:`~.rows.TreeRows.chains`, read at
    packing; from a bare :class:`PackedTree`, read here) carries them in its plan, and the
    ``"auto"`` backend then runs plain causal attention per sequence (logged at debug level).

    Args:
        tree: the micro-batch's :class:`PackedTree` (or its ``subtree_end``), or its
            :class:`~megatron_tree.core.rows.TreeRows` (``micro_batch["rows"]``).
        rows: the rows this rank computes, when they are not all of ``tree``: a context-parallel
            split (:func:`~megatron_tree.core.context_parallel.context_parallel_split`; the model
            then runs on ``rows.positions`` of the tree's tokens and gathers keys and values over
            the CP group) or a trunk-reuse part.
        store: a trunk-reuse part's :class:`~megatron_tree.core.rows.KeyValueStore` (one per
            trunk group and step).
        tokens: the micro-batch's token facts for other layers (see :class:`TreeMaskPlan`).
    """
    chains = None
    if isinstance(tree, TreeRows):
        tree, rows = tree.tree, tree if rows is None else rows
    if rows is not None and rows.is_whole:
        rows, chains = None, rows.chains
    elif rows is None and isinstance(tree, PackedTree):
        chains = chain_lengths(tree)
    if rows is not None:
        if rows.tree.padded_length != subtree_end_of(tree).shape[-1]:
            raise ValueError(
                f"the rows are of a tree of {rows.tree.padded_length} positions, the mask's tree "
                f"has {subtree_end_of(tree).shape[-1]}; build the rows from this micro-batch's "
                "tree"
            )
        if (rows.records or rows.stored is not None) and store is None:
            raise ValueError(
                "these rows are a trunk-reuse part: pass store=KeyValueStore(...) (one per trunk "
                "group and step), or let tree_forward_backward run the batch"
            )
        subtree_end = rows.encoding()[0]
        return TreeMask(
            subtree_end, TreeMaskPlan(subtree_end[None], rows, store=store, tokens=tokens)
        )
    subtree_end = subtree_end_of(tree) if isinstance(tree, PackedTree) else tree
    if subtree_end.dtype.is_floating_point or subtree_end.dtype == torch.bool:
        raise ValueError(
            f"tree_attention_mask needs an integer subtree_end, got {subtree_end.dtype}"
        )
    if chains is not None:
        logger.debug(
            "micro-batch of %d unshared sequences (%d positions): dense causal attention",
            len(chains),
            subtree_end.shape[-1],
        )
    plan = TreeMaskPlan(
        subtree_end.reshape(-1, subtree_end.shape[-1]), chains=chains, tokens=tokens
    )
    return TreeMask(subtree_end, plan)
