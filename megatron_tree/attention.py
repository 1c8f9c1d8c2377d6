"""Tree core attention for Megatron-Core: the module that replaces ``core_attention`` in every layer.

Legend for shapes: N = packed length (sq = sk = N), b = micro-batch rows (1 for a packed tree),
np / ng = query heads / key-value groups on this tensor-parallel rank, hn = head dim,
B = block size, nb = N / B blocks, M = most key blocks any query block sees.

The mask arrives as Megatron's ``attention_mask`` argument, in either form:

* the O(N) encoding: an integer ``subtree_end`` tensor [N], [1, N] or [b, N]
  (``PackedTree.subtree_end``), where ``allowed(q, k) = (k <= q) & (q < subtree_end[k])``;
* a dense bool mask in Megatron's polarity (True = masked out), [N, N], [1, 1, N, N] or [b, 1, N, N].

Both are plain tensors, so they pass through ``tensor_parallel.checkpoint`` (full and selective
activation recompute). Whatever a backend needs (the allowed-mask for SDPA, a FlexAttention
BlockMask, the block-sparse gather plan) is derived from that tensor once and shared by every layer
of the micro-batch, and by the recomputation in backward, through a one-entry cache keyed on the
tensor (see :class:`_DerivedMaskCache`).

Backends:

* ``"sdpa"``: torch scaled_dot_product_attention with the dense allowed-mask. CPU and GPU, forward
  and backward, dropout. O(N^2) mask memory and compute.
* ``"flex"``: FlexAttention with a BlockMask built from ``subtree_end`` at block level (compiled on
  CUDA). GPU training path; torch has no FlexAttention backward on CPU. No dropout.
* ``"block_sparse"``: computes only the (query block, key block) tiles that hold an allowed pair,
  found from ``subtree_end`` at block level, as one batched SDPA over gathered key blocks.
  CPU and GPU, forward and backward, dropout; cost grows with the tree's visible tiles, not N^2.
* ``"auto"``: ``"flex"`` on CUDA without dropout, otherwise ``"block_sparse"``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ._lazy import lazy_class_getattr
from .mask import tree_block_layout

BACKENDS = ("auto", "sdpa", "flex", "block_sparse")


class _DerivedMaskCache:
    """One-entry cache of masks derived from the latest mask tensor seen by any tree attention layer.

    Keyed on the tensor's storage pointer, version counter, shape, strides, dtype and device. The
    cache keeps a reference to the source tensor, so its storage cannot be freed and reused by a
    different tensor while the entry lives; an in-place write bumps the version and invalidates it.
    Under activation recompute the checkpoint hands the layers the same storage again, so the
    recomputation reuses the entry. A new micro-batch's mask replaces the entry.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._source: torch.Tensor | None = None
        self._values: dict[Any, Any] = {}

    @staticmethod
    def _key_of(source: torch.Tensor) -> tuple:
        return (
            source.data_ptr(),
            source._version,
            tuple(source.shape),
            tuple(source.stride()),
            source.dtype,
            source.device,
        )

    def get(self, source: torch.Tensor, kind: Any, build: Callable[[], Any]) -> Any:
        key = self._key_of(source)
        if key != self._key:
            self._key, self._source, self._values = key, source, {}
        if kind not in self._values:
            self._values[kind] = build()
        return self._values[kind]

    def clear(self) -> None:
        self._key, self._source, self._values = None, None, {}


_MASK_CACHE = _DerivedMaskCache()


def clear_tree_mask_cache() -> None:
    """Drop the derived masks of the last micro-batch (they are otherwise kept until the next one)."""
    _MASK_CACHE.clear()


def _normalize_mask(attention_mask: torch.Tensor | None, sq: int, sk: int) -> tuple[str, torch.Tensor]:
    """Validate the mask and return ("encoding", subtree_end [r, N]) or ("dense", masked [r, N, N])."""
    if attention_mask is None:
        raise ValueError(
            "tree attention needs the tree mask: pass attention_mask=PackedTree.subtree_end (int, "
            "[N]) or build_attention_mask_from_trie(tree) (bool, [N, N])"
        )
    if sq != sk:
        raise ValueError(f"tree attention is self-attention; got {sq} queries and {sk} keys")
    if attention_mask.dtype == torch.bool:
        shape = tuple(attention_mask.shape)
        if attention_mask.dim() == 2:
            dense = attention_mask.unsqueeze(0)
        elif attention_mask.dim() == 4 and attention_mask.shape[1] == 1:
            dense = attention_mask[:, 0]
        else:
            raise ValueError(
                f"dense tree attention_mask must be [N, N] or [b, 1, N, N], got shape {shape}"
            )
        if dense.shape[-2:] != (sq, sk):
            raise ValueError(
                f"dense tree attention_mask has shape {shape} but the packed sequence has {sq} query "
                f"and {sk} key positions; build the mask for this micro-batch with "
                "build_attention_mask_from_trie(tree)"
            )
        return "dense", dense
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(
            f"tree attention_mask must be an integer subtree_end or a bool mask, got dtype "
            f"{attention_mask.dtype}"
        )
    shape = tuple(attention_mask.shape)
    encoding = attention_mask.reshape(-1, shape[-1]) if attention_mask.dim() in (1, 2) else None
    if encoding is None or encoding.shape[-1] != sq:
        raise ValueError(
            f"subtree_end attention_mask has shape {shape} but the packed sequence has {sq} "
            "positions; pass PackedTree.subtree_end ([N] or [1, N]) of this micro-batch"
        )
    return "encoding", encoding


def _allowed_from_encoding(subtree_end: torch.Tensor) -> torch.Tensor:
    """[r, N] int -> [r, 1, N, N] bool, True = attend."""
    n = subtree_end.shape[-1]
    pos = torch.arange(n, device=subtree_end.device)
    q, k = pos[:, None], pos[None, :]
    return ((k <= q) & (q < subtree_end[:, None, :])).unsqueeze(1)


def _encoding_from_dense(masked: torch.Tensor) -> torch.Tensor:
    """[r, N, N] bool (True = masked) -> subtree_end [r, N].

    In a pre-order tree mask the queries that see key k are the contiguous range [k, subtree_end[k]),
    so subtree_end[k] = k + (number of queries that see k).
    """
    n = masked.shape[-1]
    seen_by = (~masked).sum(dim=-2)
    return (torch.arange(n, device=masked.device) + seen_by).to(torch.int32)


def _pad_encoding(subtree_end: torch.Tensor, padded: int) -> torch.Tensor:
    """[N] -> [padded]; each added position sees only itself."""
    n = subtree_end.shape[0]
    if padded == n:
        return subtree_end.to(torch.int64)
    tail = torch.arange(n + 1, padded + 1, device=subtree_end.device)
    return torch.cat([subtree_end.to(torch.int64), tail])


_PLAN_GROUPS = 4


def _block_sparse_plan(subtree_end: torch.Tensor, block_size: int) -> list[tuple[torch.Tensor, ...]]:
    """Gather plan for one tree, as groups of query blocks with similar key-block counts.

    Query block i attends the key blocks holding an allowed pair for it (``tree_block_layout``).
    Blocks are grouped by that count (group g holds counts up to about (g+1)/G of the maximum), and
    each group's key lists are padded to the group's largest count with the query block itself,
    masked out; so the padding costs at most M/G tiles per query block.

    Returns:
        A list of (q_blocks [g], kv_index [g, M_g*B], allowed [g, 1, B, M_g*B]) over the groups;
        the q_blocks of all groups together are a permutation of range(nb).
    """
    n = subtree_end.shape[0]
    padded = -(-n // block_size) * block_size
    ends = _pad_encoding(subtree_end, padded)
    any_allowed, _ = tree_block_layout(ends, block_size)  # [nb, nb]
    nb = padded // block_size
    device = ends.device
    counts = any_allowed.sum(dim=1)
    top = int(counts.max())
    group_of = torch.clamp((counts * _PLAN_GROUPS - 1) // top, min=0)
    # Listed key blocks first, in increasing order (stable sort on "not listed").
    order = torch.argsort((~any_allowed).to(torch.int8), dim=1, stable=True)
    offsets = torch.arange(block_size, device=device)
    plan = []
    for group in torch.unique(group_of).tolist():
        q_blocks = torch.nonzero(group_of == group).squeeze(1)
        m = int(counts[q_blocks].max())
        slot_valid = torch.arange(m, device=device)[None, :] < counts[q_blocks, None]  # [g, M]
        own = q_blocks[:, None].expand(-1, m)
        kv_blocks = torch.where(slot_valid, order[q_blocks, :m], own)
        kv_index = (kv_blocks[:, :, None] * block_size + offsets).reshape(len(q_blocks), m * block_size)
        q_pos = (q_blocks[:, None] * block_size + offsets)[:, :, None]  # [g, B, 1]
        k_pos = kv_index[:, None, :]  # [g, 1, M*B]
        allowed = (k_pos <= q_pos) & (q_pos < ends[k_pos])  # [g, B, M*B]
        allowed &= slot_valid.repeat_interleave(block_size, dim=1)[:, None, :]
        plan.append((q_blocks, kv_index, allowed.unsqueeze(1)))
    return plan


def _flex_attention_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cuda":
        global _COMPILED_FLEX
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        return _COMPILED_FLEX
    return flex_attention


_COMPILED_FLEX = None


def _build_block_mask(subtree_end: torch.Tensor, block_size: int, padded: int):
    from .mask import build_block_mask_from_trie

    return build_block_mask_from_trie(_pad_encoding(subtree_end, padded).to(torch.int32), block_size)


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    backend: str = "auto",
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    block_size: int = 128,
) -> torch.Tensor:
    """Tree attention on Megatron's layouts, without the Megatron module around it.

    Args:
        query: [N, b, np, hn].
        key: [N, b, ng, hn]; ``np`` must be a multiple of ``ng`` (grouped-query attention).
        value: [N, b, ng, hn].
        attention_mask: ``subtree_end`` int [N] / [b, N], or bool [N, N] / [b, 1, N, N] with True =
            masked out (see the module docstring).
        backend: one of ``BACKENDS``.
        softmax_scale: defaults to 1 / sqrt(hn).
        dropout_p: attention-probability dropout (already 0 when not training).
        block_size: tile size of the ``flex`` and ``block_sparse`` backends.

    Returns:
        [N, b, np * hn].
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    sq, b, num_heads, head_dim = query.shape
    sk, _, num_groups, _ = key.shape
    if num_heads % num_groups:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_groups} key/value groups")
    form, mask = _normalize_mask(attention_mask, sq, sk)
    if mask.shape[0] not in (1, b):
        raise ValueError(f"attention_mask has {mask.shape[0]} rows for a micro-batch of {b} rows")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    if backend == "auto":
        backend = "flex" if query.is_cuda and dropout_p == 0.0 else "block_sparse"
    if backend == "flex" and dropout_p > 0.0:
        raise ValueError(
            "the flex backend has no attention dropout; use backend='block_sparse' or 'sdpa'"
        )

    source = attention_mask
    if form == "dense":
        encoding = None
        if backend != "sdpa":
            encoding = _MASK_CACHE.get(source, "encoding", lambda: _encoding_from_dense(mask))
    else:
        encoding = mask

    # [N, b, h, hn] -> [b, h, N, hn]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    gqa = num_heads != num_groups

    if backend == "sdpa":
        if form == "dense":
            allowed = _MASK_CACHE.get(source, "allowed", lambda: (~mask).unsqueeze(1))
        else:
            allowed = _MASK_CACHE.get(source, "allowed", lambda: _allowed_from_encoding(encoding))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    elif backend == "flex":
        if encoding.shape[0] != 1:
            raise ValueError("the flex backend takes one tree per micro-batch (b = 1)")
        padded = -(-sq // block_size) * block_size
        block_mask = _MASK_CACHE.get(
            source,
            ("block_mask", block_size),
            lambda: _build_block_mask(encoding[0], block_size, padded),
        )
        if not q.is_cuda:
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
                raise ValueError(
                    "the flex backend has no backward on CPU (a torch limitation); use "
                    "backend='block_sparse' or 'sdpa' for CPU training"
                )
            q, k, v = q.detach(), k.detach(), v.detach()  # torch rejects grad-requiring CPU inputs
        if padded != sq:
            pad = (0, 0, 0, padded - sq)
            q, k, v = (F.pad(t, pad) for t in (q, k, v))
        out = _flex_attention_fn(q.device)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
        out = out[:, :, :sq]
    else:
        rows = []
        for row in range(b):
            enc = encoding[row if encoding.shape[0] > 1 else 0]
            plan = _MASK_CACHE.get(
                source,
                ("plan", block_size, row if encoding.shape[0] > 1 else 0),
                lambda: _block_sparse_plan(enc, block_size),
            )
            rows.append(_block_sparse_row(q[row], k[row], v[row], plan, scale, dropout_p, gqa)[:, :sq])
        out = torch.stack(rows)
    # [b, np, N, hn] -> [N, b, np * hn]
    return out.permute(2, 0, 1, 3).reshape(sq, b, num_heads * head_dim)


def _block_sparse_row(q, k, v, plan, scale, dropout_p, gqa) -> torch.Tensor:
    """One tree. q [np, N, hn], k/v [ng, N, hn] -> [np, padded, hn]."""
    block_size = plan[0][2].shape[-2]
    nb = sum(len(group[0]) for group in plan)
    padded = nb * block_size
    n = q.shape[1]
    if padded != n:
        pad = (0, 0, 0, padded - n)
        q, k, v = (F.pad(t, pad) for t in (q, k, v))
    num_heads, _, head_dim = q.shape
    # [np, nb*B, hn] -> [nb, np, B, hn]
    q_all = q.view(num_heads, nb, block_size, head_dim).transpose(0, 1)
    outs, order = [], []
    for q_blocks, kv_index, allowed in plan:
        g, span = kv_index.shape
        flat = kv_index.reshape(-1)
        # [ng, g*M*B, hn] -> [g, ng, M*B, hn]
        k_blocks = k[:, flat].view(k.shape[0], g, span, head_dim).transpose(0, 1)
        v_blocks = v[:, flat].view(v.shape[0], g, span, head_dim).transpose(0, 1)
        outs.append(
            F.scaled_dot_product_attention(
                q_all[q_blocks], k_blocks, v_blocks, attn_mask=allowed, dropout_p=dropout_p,
                scale=scale, enable_gqa=gqa,
            )
        )
        order.append(q_blocks)
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [nb, np, B, hn] in group order
    if len(outs) > 1:
        out = out[torch.argsort(torch.cat(order))]
    # [nb, np, B, hn] -> [np, nb*B, hn]
    return out.transpose(0, 1).reshape(num_heads, padded, head_dim)


def _make_core_attention_class():
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class TreeCoreAttention(MegatronModule):
        """Megatron ``core_attention`` for packed trees (see the module docstring for the mask forms).

        Built by Megatron's ``build_module`` from a ``SelfAttentionSubmodules.core_attention`` spec
        (see :func:`megatron_tree.spec.tree_attention_spec`); the extra keyword arguments ``backend``
        and ``block_size`` come from the spec's ``params``.

        Args:
            config: the layer's TransformerConfig (attention_dropout, softmax_scale, ...).
            layer_number: 1-based layer index (used in error messages).
            attn_mask_type: must be ``AttnMaskType.arbitrary`` (the tree mask is passed explicitly).
            attention_type: "self" (cross attention is not a tree operation).
            attention_dropout: overrides ``config.attention_dropout``.
            softmax_scale: overrides 1 / sqrt(head_dim).
            cp_comm_type: must be None (context parallelism is not supported).
            pg_collection: process groups (unused: tree attention needs no communication).
            backend: one of ``"auto"``, ``"sdpa"``, ``"flex"``, ``"block_sparse"``.
            block_size: tile size for ``flex`` and ``block_sparse``.
        """

        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type,
            attention_type: str = "self",
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection=None,
            backend: str = "auto",
            block_size: int = 128,
        ):
            super().__init__(config=config)
            where = f"layer {layer_number}"
            if backend not in BACKENDS:
                raise ValueError(f"{where}: backend={backend!r} is not one of {BACKENDS}")
            if attn_mask_type != AttnMaskType.arbitrary:
                raise ValueError(
                    f"{where}: tree attention needs attn_mask_type=AttnMaskType.arbitrary, got "
                    f"{attn_mask_type}; build the layer spec with tree_attention_spec()"
                )
            if attention_type != "self":
                raise ValueError(f"{where}: tree attention is self-attention, got {attention_type!r}")
            if config.context_parallel_size != 1:
                raise ValueError(
                    f"{where}: tree attention does not support context parallelism "
                    f"(context_parallel_size={config.context_parallel_size}); set it to 1"
                )
            if getattr(config, "softmax_type", "vanilla") != "vanilla":
                raise ValueError(
                    f"{where}: tree attention supports softmax_type='vanilla', got "
                    f"{config.softmax_type!r}"
                )
            if getattr(config, "window_size", None) is not None:
                raise ValueError(
                    f"{where}: tree attention does not support sliding windows (window_size)"
                )
            self.layer_number = layer_number
            self.attn_mask_type = attn_mask_type
            self.backend = backend
            self.block_size = block_size
            self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type=None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params=None,
        ) -> torch.Tensor:
            """query [N, b, np, hn], key/value [N, b, ng, hn], mask as documented -> [N, b, np*hn]."""
            if attention_bias is not None:
                raise ValueError("tree attention does not take attention_bias")
            if packed_seq_params is not None:
                raise ValueError(
                    "tree attention takes the tree mask as attention_mask, not packed_seq_params"
                )
            dropout_p = self.dropout_p if self.training else 0.0
            kwargs = dict(
                backend=self.backend,
                softmax_scale=self.softmax_scale,
                dropout_p=dropout_p,
                block_size=self.block_size,
            )
            if dropout_p > 0.0 and not self.config.sequence_parallel:
                # Heads are split across TP ranks: draw dropout from the model-parallel RNG state,
                # as Megatron's DotProductAttention does.
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    return tree_attention(query, key, value, attention_mask, **kwargs)
            return tree_attention(query, key, value, attention_mask, **kwargs)

    return TreeCoreAttention


# TreeCoreAttention subclasses MegatronModule: built on first use (see _lazy.py).
__getattr__ = lazy_class_getattr(__name__, {"TreeCoreAttention": _make_core_attention_class})
