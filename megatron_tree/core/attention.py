"""Tree attention on Megatron's tensor layouts: the function and its backends (pure torch).

Legend for shapes: N = packed length (sq = sk = N), b = micro-batch rows (1 for a packed tree),
np / ng = query heads / key-value groups, hn = head dim, B = block size, nb = N / B.

The mask comes in one of three forms:

* a :class:`~megatron_tree.core.mask.TreeMask` (``tree_attention_mask(tree)``): the ``subtree_end``
  encoding carrying its plan, so what a backend derives from it is built once per micro-batch;
* a plain integer ``subtree_end`` [N], [1, N] or [b, N]: the same, derived again on every call;
* a dense bool mask in Megatron's polarity (True = masked out), [N, N] or [b, 1, N, N]: converted
  to the encoding on every call (used as given by ``"sdpa"``).

Backends:

* ``"sdpa"``: torch scaled_dot_product_attention with the dense allowed-mask. CPU and GPU, forward
  and backward, dropout. O(N^2) mask memory and compute.
* ``"flex"``: FlexAttention with a BlockMask built from ``subtree_end`` at block level, compiled on
  CUDA with dynamic shapes (a new packed length does not recompile). torch has no FlexAttention
  backward on CPU. No dropout.
* ``"block_sparse"``: computes only the (query block, key block) tiles that hold an allowed pair,
  as one batched SDPA per group of query blocks. CPU and GPU, forward and backward, dropout.
* ``"causal"``: for a micro-batch whose sequences share nothing (each a chain; its plan's
  ``chains``, see :func:`~megatron_tree.core.mask.tree_attention_mask`): causal attention within
  each sequence, no mask at all; padding positions see only themselves. On CUDA in bf16 / fp16
  (equal head dims <= 256, a multiple of 8) one FlashAttention varlen call over all sequences
  (``cu_seqlens`` built once per micro-batch); elsewhere torch SDPA with ``is_causal=True`` per
  sequence. Refused for any other mask, a depth window or a sink.
* ``"triton"``: our own flash-style Triton kernels (forward, dQ, dK / dV) reading ``subtree_end``
  directly, with per-tile skip / full / partial decisions from O(N / B) per-key-tile facts
  (:mod:`~megatron_tree.core.triton_attention`, imported on first use). CUDA, or CPU tensors in
  Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run it). fp16 / bf16 / fp32, no
  dropout. Tiles are ``min(block_size, 64)`` tokens square.
* ``"auto"``: ``"causal"`` for a chains-only micro-batch (without window or sink), else ``"flex"``
  on CUDA without dropout, otherwise ``"block_sparse"``. So tree training is never slower than the
  baseline's kernel when nothing is shared. (``"triton"`` is chosen only when asked for, until a
  GPU run has measured it against ``"flex"``.)

On CUDA, ``flex`` uses FlexAttention's FlashAttention-4 backend (``BACKEND="FLASH"``) where the
``flash-attn-4`` package (``flash_attn.cute``) is installed, on Hopper or Blackwell, with 128 x 128
tiles (``block_size=128``, the tile FA4 needs on Hopper for head dims <= 128; the block mask
carries its full-block lists, which FA4 needs) and no sink; otherwise its Triton kernel. The
environment variable ``MEGATRON_TREE_FLEX_BACKEND`` (``auto``, ``triton``, ``flash``) overrides;
``flash`` where FA4 cannot run raises. The choice is logged once per process and variant.

The compiled ``flex`` path never falls back to torch's eager FlexAttention (which materializes the
whole score matrix): past torch's recompile limit it raises :class:`FlexRecompileError`.

Every backend takes a sliding window over depth (``window_size``, Megatron's ``(left, 0)``: a query
sees its ancestors at most ``left`` levels up, see :func:`~megatron_tree.core.mask.allowed`) and an
attention sink (``softmax_offset`` [np], Megatron's ``softmax_type`` "off-by-one" (zeros) or
"learnable"): one extra logit per head in every softmax row, with no value, as Megatron's
``SoftmaxOne`` appends it. ``sdpa`` and ``block_sparse`` then compute the softmax themselves with
the sink column (SDPA has no sink); ``flex`` rescales its output by ``sigmoid(lse - offset)``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os

import torch
import torch.nn.functional as F

from .mask import TreeMask, TreeMaskPlan, depth_window, encoding_from_dense

BACKENDS = ("auto", "sdpa", "flex", "block_sparse", "causal", "triton")
FLEX_BACKEND_ENV = "MEGATRON_TREE_FLEX_BACKEND"

logger = logging.getLogger(__name__)

_COMPILED_FLEX = None


class FlexRecompileError(RuntimeError):
    """The compiled FlexAttention hit torch's recompile limit, where torch would otherwise run it
    eagerly (materializing the full [N, N] score matrix) with only a warning."""


def compiled_flex_attention():
    """torch.compile'd ``flex_attention`` with dynamic shapes, built once per process.

    ``dynamic=True`` makes the packed length symbolic, so trees of new lengths reuse the graph
    instead of compiling one per length. ``fullgraph=True`` turns torch's silent eager fallback
    past the recompile limit into an error (see :func:`_run_compiled_flex`).
    """
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True, fullgraph=True)
    return _COMPILED_FLEX


@functools.cache
def _recompile_limit_names() -> tuple[str, tuple[type, ...]]:
    """(dynamo's fail-on-recompile-limit flag, the exceptions it raises), looked up once: before
    torch 2.6 they were named for the "cache" limit."""
    import torch._dynamo

    config, exc_types = torch._dynamo.config, torch._dynamo.exc
    flag = next(
        name
        for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")
        if hasattr(config, name)
    )
    return flag, tuple(
        getattr(exc_types, name)
        for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
        if hasattr(exc_types, name)
    )


def _run_compiled_flex(*args, **kwargs):
    """Call the compiled flex; a recompile-limit hit raises :class:`FlexRecompileError`."""
    import torch._dynamo

    config = torch._dynamo.config
    # Older torch honours only the config flag (fullgraph alone may still fall back).
    flag, limit_hit = _recompile_limit_names()
    try:
        with config.patch(**{flag: True}):
            return compiled_flex_attention()(*args, **kwargs)
    except limit_hit as exc:
        limit = getattr(config, "recompile_limit", None) or config.cache_size_limit
        raise FlexRecompileError(
            f"the compiled FlexAttention was recompiled more than torch._dynamo.config."
            f"recompile_limit={limit} times (each new dtype, head count or size, GQA ratio, block "
            "size, depth window or sink compiles a graph of its own; packed lengths do not). Past "
            "the limit torch would run FlexAttention eagerly, materializing the full score "
            "matrix. Raise torch._dynamo.config.recompile_limit to the number of attention "
            "variants your model has, or run `TORCH_LOGS=recompiles` to see what recompiles"
        ) from exc


def _dense_form(attention_mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """Validated dense bool mask as [r, N, N] (True = masked)."""
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
            f"and {sk} key positions; build the mask for this micro-batch"
        )
    return dense


def _plan_of(
    attention_mask: torch.Tensor | None, sq: int, sk: int
) -> tuple[TreeMaskPlan | None, torch.Tensor | None]:
    """Validated mask: (plan, None) for the encodings, (None, dense [r, N, N]) for a dense mask."""
    if attention_mask is None:
        raise ValueError(
            "tree attention needs the tree mask: pass attention_mask=tree_attention_mask(tree) (or "
            "PackedTree.subtree_end, or a dense bool mask)"
        )
    plan = attention_mask.plan if isinstance(attention_mask, TreeMask) else None
    if sq != sk and (plan is None or plan.query_positions is None):
        raise ValueError(
            f"tree attention is self-attention; got {sq} queries and {sk} keys (only the mask of a "
            "micro-batch's rows, tree_attention_mask(rows, ...), has fewer queries than keys)"
        )
    if attention_mask.dtype == torch.bool:
        return None, _dense_form(attention_mask, sq, sk)
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(
            "tree attention_mask must be an integer subtree_end or a bool mask, got dtype "
            f"{attention_mask.dtype}"
        )
    shape = tuple(attention_mask.shape)
    if attention_mask.dim() not in (1, 2) or shape[-1] != sk:
        raise ValueError(
            f"subtree_end attention_mask has shape {shape} but the attention has {sk} keys; build "
            "the mask of the rows the model runs: tree_attention_mask(micro_batch['rows'], "
            "store=...) (a trunk-reuse part or a context-parallel share computes some rows of its "
            "tree; tree_forward_backward does this), or tree_attention_mask(tree) for a whole tree"
        )
    if plan is not None:
        if plan.num_queries != sq:
            raise ValueError(
                f"the tree mask is for {plan.num_queries} query rows, got {sq}: pass the model the "
                "rows' own inputs (micro_batch['input_ids'] / ['position_ids'], i.e. "
                "rows.local(...) of the tree's) with the mask of those rows"
            )
        return plan, None
    return TreeMaskPlan(attention_mask.reshape(-1, sq)), None


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
    compile_flex: bool | None = None,
    window_size: tuple[int, int] | None = None,
    softmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention on Megatron's layouts, without the Megatron module around it.

    Args:
        query: [N, b, np, hn] ([n, b, np, hn] under context parallelism: this rank's rows).
        key: [N, b, ng, hn]; ``np`` must be a multiple of ``ng`` (grouped-query attention).
        value: [N, b, ng, hv]; ``hv`` may differ from ``hn`` (multi-latent attention).
        attention_mask: a TreeMask, ``subtree_end`` int [N] / [b, N], or bool [N, N] /
            [b, 1, N, N] with True = masked out (see the module docstring).
        backend: one of ``BACKENDS``.
        softmax_scale: defaults to 1 / sqrt(hn).
        dropout_p: attention-probability dropout (already 0 when not training).
        block_size: tile size of the ``flex`` and ``block_sparse`` backends (``triton``: tiles of
            ``min(block_size, 64)``).
        compile_flex: run ``flex`` through :func:`compiled_flex_attention`; None compiles on CUDA
            only. ``False`` on CUDA is refused (torch's eager flex materializes the score matrix).
        window_size: Megatron's sliding window ``(left, 0)`` over depth (see the module docstring),
            or None; ``(-1, 0)`` is no window.
        softmax_offset: float [np], the sink logit of each query head (zeros for Megatron's
            "off-by-one" softmax, its ``softmax_offset`` parameter for "learnable"), or None.

    Returns:
        [N, b, np * hv] (``[n, ...]`` under context parallelism).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    sq, b, num_heads, head_dim = query.shape
    sk, _, num_groups, _ = key.shape
    value_dim = value.shape[-1]
    if num_heads % num_groups:
        raise ValueError(
            f"{num_heads} query heads are not a multiple of {num_groups} key/value groups"
        )
    window = depth_window(window_size)
    if softmax_offset is not None and tuple(softmax_offset.shape) != (num_heads,):
        raise ValueError(
            f"softmax_offset has shape {tuple(softmax_offset.shape)}, expected ({num_heads},): one "
            "sink logit per query head of this rank"
        )
    plan, dense = _plan_of(attention_mask, sq, sk)
    mask_rows = (dense if plan is None else plan.subtree_end).shape[0]
    if mask_rows not in (1, b):
        raise ValueError(f"attention_mask has {mask_rows} rows for a micro-batch of {b} rows")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    chains = None if plan is None else plan.chains
    backend = _choose_backend(backend, chains, query.is_cuda, dropout_p, window, softmax_offset)
    if backend in ("flex", "triton") and dropout_p > 0.0:
        raise ValueError(
            f"the {backend} backend has no attention dropout (dropout_p={dropout_p}); use "
            "backend='block_sparse' or 'sdpa', or set attention_dropout=0"
        )
    if plan is None and (
        backend != "sdpa" or window is not None
    ):  # sdpa uses a dense mask as given
        plan = TreeMaskPlan(encoding_from_dense(dense))

    if backend == "triton":
        from .triton_attention import triton_tree_attention

        return triton_tree_attention(
            query,
            key,
            value,
            plan,
            scale=scale,
            window=window,
            sink=softmax_offset,
            block_size=block_size,
        )
    # [N, b, h, hn] -> [b, h, N, hn]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    attend = dict(
        scale=scale, dropout_p=dropout_p, gqa=num_heads != num_groups, sink=softmax_offset
    )
    if backend == "causal" and _varlen_flash_fits(query, value):
        return _causal_varlen(query, key, value, plan, scale=scale, dropout_p=dropout_p)
    if backend == "causal":
        out = _causal_chains(q, k, v, chains, scale=scale, dropout_p=dropout_p, gqa=attend["gqa"])
    elif backend == "sdpa":
        keep = (~dense).unsqueeze(1) if plan is None else plan.dense_allowed(window)
        out = _attend(q, k, v, keep, **attend)
    elif backend == "flex":
        compile_flex = q.is_cuda if compile_flex is None else compile_flex
        out = _flex(
            q,
            k,
            v,
            plan,
            scale=scale,
            gqa=attend["gqa"],
            block_size=block_size,
            compile_flex=compile_flex,
            window=window,
            sink=softmax_offset,
        )
    else:
        rows = []
        for row in range(b):
            groups = plan.block_sparse(
                row if plan.subtree_end.shape[0] > 1 else 0, block_size, window
            )
            rows.append(_block_sparse_row(q[row], k[row], v[row], groups, attend)[:, :sq])
        out = torch.stack(rows)
    # [b, np, N, hv] -> [N, b, np * hv]
    return out.permute(2, 0, 1, 3).reshape(sq, b, num_heads * value_dim)


def _choose_backend(backend: str, chains, cuda: bool, dropout_p, window, sink) -> str:
    """``backend`` with "auto" resolved (see the module docstring); "causal" checked."""
    plain = chains is not None and window is None and sink is None
    if backend == "auto":
        if plain:
            return "causal"
        return "flex" if cuda and dropout_p == 0.0 else "block_sparse"
    if backend == "causal" and not plain:
        raise ValueError(
            "backend='causal' runs a micro-batch whose sequences share nothing, without a depth "
            "window or sink; this one "
            + (
                "has a tree mask (or a mask without its plan: pass tree_attention_mask(tree))"
                if chains is None
                else "has a window or sink"
            )
            + ": use backend='auto'"
        )
    return backend


def _attend(q, k, v, keep, *, scale, dropout_p, gqa, sink) -> torch.Tensor:
    """Masked attention. q / k [..., np | ng, nq | nk, hn], v [..., ng, nk, hv], keep bool
    broadcastable to [..., np, nq, nk] (True = attend), sink float [np] or None -> [..., np, nq,
    hv]."""
    if sink is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    *lead, heads, nq, head_dim = q.shape
    groups = k.shape[-3]
    # Query heads of one key/value group together: [..., ng, np/ng, nq, hn] against [..., ng, 1, nk,
    # hn].
    q_grouped = q.reshape(*lead, groups, heads // groups, nq, head_dim)
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax, as Megatron's
    scores = torch.matmul(q_grouped, k.unsqueeze(-3).transpose(-1, -2)) * scale
    scores = (
        scores.reshape(*lead, heads, nq, -1).to(softmax_dtype).masked_fill(~keep, float("-inf"))
    )  # [..., np, nq, nk]
    # Megatron's SoftmaxOne: the sink is one more logit per row, with no value.
    sink_column = sink.to(softmax_dtype).reshape(heads, 1, 1).expand(*lead, heads, nq, 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs.reshape(*lead, groups, heads // groups, nq, -1), v.unsqueeze(-3))
    return out.reshape(*lead, heads, nq, v.shape[-1])


def flex_kernel_options(q, v, *, block_size: int, sink: bool) -> dict | None:
    """FlexAttention ``kernel_options`` for these inputs: FA4 (``{"BACKEND": "FLASH"}``) where it
    can run (see the module docstring), None (Triton) otherwise."""
    choice = os.environ.get(FLEX_BACKEND_ENV, "auto").lower()
    if choice not in ("auto", "triton", "flash"):
        raise ValueError(f"{FLEX_BACKEND_ENV}={choice!r}: use auto, triton or flash")
    if choice == "triton" or not q.is_cuda:
        return None
    why_not = _fa4_unusable(
        torch.cuda.get_device_capability(q.device)[0], q.shape[-1], v.shape[-1], block_size, sink
    )
    if why_not and choice == "flash":
        raise ValueError(f"{FLEX_BACKEND_ENV}=flash, but FlashAttention-4 cannot run: {why_not}")
    _log_flex_choice("Triton" if why_not else "FlashAttention-4", why_not)
    return None if why_not else {"BACKEND": "FLASH"}


@functools.cache
def _fa4_unusable(major: int, head_dim: int, value_dim: int, block_size: int, sink: bool) -> str:
    """Why FA4 cannot run these inputs ('' when it can)."""
    try:
        installed = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:
        installed = False
    if not installed:
        return "flash-attn-4 (flash_attn.cute) is not installed"
    if major not in (9, 10):
        return f"compute capability {major}.x (FA4 runs on Hopper 9.x and Blackwell 10.x)"
    if head_dim != value_dim or head_dim > 128:
        return f"head dims {head_dim} / {value_dim} (equal and <= 128 wanted)"
    if block_size != 128:
        return f"block_size={block_size} (FA4's Hopper tile is 128)"
    if sink:
        return "an attention sink (its LSE rescaling is checked on Triton only)"
    return ""


@functools.cache
def _log_flex_choice(kernel: str, why_not: str) -> None:
    logger.info("flex attention kernel: %s%s", kernel, f" ({why_not})" if why_not else "")


def _varlen_flash_fits(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether FlashAttention's varlen kernel runs these [N, b, h, d] inputs (CUDA, sm80+)."""
    head_dim = query.shape[-1]
    return (
        query.is_cuda
        and query.shape[1] == 1
        and query.dtype in (torch.bfloat16, torch.float16)
        and head_dim == value.shape[-1]
        and head_dim <= 256
        and head_dim % 8 == 0
        and torch.cuda.get_device_capability(query.device)[0] >= 8
    )


def _causal_varlen(query, key, value, plan: TreeMaskPlan, *, scale, dropout_p) -> torch.Tensor:
    """Causal attention of a chains-only micro-batch by one FlashAttention varlen call over its
    sequences, in Megatron's layout: [N, 1, np, hn] queries -> [N, 1, np * hv]. Padding positions
    see only themselves, so their output is their value (not one flash run each: a run per padding
    position would grow the kernel's grid and backward buffers with the padding)."""
    n, _, num_heads, _ = query.shape
    q, k, v = query[:, 0], key[:, 0], value[:, 0]  # [N, h, d]: flash varlen's own layout
    real = sum(plan.chains)
    outs = []
    if real:
        cu_seqlens, longest = plan.chain_offsets(query.device)
        outs.append(
            _flash_varlen(q[:real], k[:real], v[:real], cu_seqlens, longest, scale, dropout_p)
        )
    if real < n:
        outs.append(v[real:].repeat_interleave(num_heads // v.shape[1], dim=1))
    if not real:
        outs[0] = _with_zero_grads(outs[0], q, k)
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.reshape(n, 1, num_heads * v.shape[-1])


def _flash_varlen(q, k, v, cu_seqlens, max_len: int, scale: float, dropout_p: float):
    """Causal FlashAttention over the runs ``cu_seqlens`` (int32 [S + 1]) marks: q [N, np, hn],
    k / v [N, ng, hn] -> [N, np, hn]. The kernel takes grouped-query heads as they are."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, dropout_p, True, False, scale=scale
    )[0]


def _causal_chains(q, k, v, chains, *, scale, dropout_p, gqa) -> torch.Tensor:
    """Causal attention on each chain. q [b, np, N, hn], k [b, ng, N, hn], v [b, ng, N, hv],
    ``chains`` the lengths of the runs of positions, padding after them -> [b, np, N, hv]."""
    outs, start = [], 0
    for length in chains:
        part = slice(start, start + length)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, part],
                k[:, :, part],
                v[:, :, part],
                dropout_p=dropout_p,
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
        )
        start += length
    if start < q.shape[2]:  # padding: each position sees itself only, so its output is its value
        pad = v[:, :, start:]
        outs.append(pad.repeat_interleave(q.shape[1] // v.shape[1], dim=1) if gqa else pad)
    if not start:
        outs[0] = _with_zero_grads(outs[0], q, k)
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _with_zero_grads(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``out`` of an all-padding micro-batch (a data-parallel fill-in), with zero gradients for the
    queries and keys it does not read: otherwise their projections get no gradient at all on this
    rank, and a sharded data-parallel wrapper (FSDP2) reduce-scatters different sets of gradients
    on different ranks."""
    return out + (q.flatten()[:1].sum() + k.flatten()[:1].sum()) * 0.0


def _flex(
    q, k, v, plan: TreeMaskPlan, *, scale, gqa, block_size, compile_flex, window, sink
) -> torch.Tensor:
    """[b=1, h, nq, hn] queries, [1, h, N, hn] keys, [1, h, N, hv] values -> [1, np, nq, hv]."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if plan.subtree_end.shape[0] != 1 or q.shape[0] != 1:
        raise ValueError("the flex backend takes one tree per micro-batch (b = 1)")
    sq, sk = q.shape[2], k.shape[2]
    padded_q, padded_k = (-(-n // block_size) * block_size for n in (sq, sk))
    block_mask = plan.block_mask(block_size, padded_q, padded_k, window)
    if not q.is_cuda:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError(
                "the flex backend has no backward on CPU (a torch limitation); use "
                "backend='block_sparse' or 'sdpa' for CPU training"
            )
        q, k, v = q.detach(), k.detach(), v.detach()  # torch rejects grad-requiring CPU inputs
    q = F.pad(q, (0, 0, 0, padded_q - sq)) if padded_q != sq else q
    if padded_k != sk:
        k, v = (F.pad(t, (0, 0, 0, padded_k - sk)) for t in (k, v))
    if q.is_cuda and not compile_flex:
        raise ValueError(
            "compile_flex=False on CUDA would run torch's eager FlexAttention, which materializes "
            "the full score matrix; leave compile_flex=None (compiled on CUDA)"
        )
    # torch 2.13 compiles flex on CPU for inference without the LSE: a sink runs eagerly there.
    fn = _run_compiled_flex if compile_flex and (sink is None or q.is_cuda) else flex_attention
    options = flex_kernel_options(q, v, block_size=block_size, sink=sink is not None)
    call = dict(block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=options)
    if sink is None:
        return fn(q, k, v, **call)[:, :, :sq]
    out, aux = fn(q, k, v, **call, return_aux=AuxRequest(lse=True))
    # With a sink logit o per head: out' = out * e^lse / (e^lse + e^o) = out * sigmoid(lse - o).
    lse = aux.lse.to(torch.promote_types(aux.lse.dtype, torch.float32))
    rescale = torch.sigmoid(lse - sink.to(lse.dtype)[None, :, None])  # [1, np, padded nq]
    return (out * rescale.unsqueeze(-1).to(out.dtype))[:, :, :sq]


def _block_sparse_row(q, k, v, plan, attend: dict) -> torch.Tensor:
    """One tree. q [np, nq, hn], k [ng, N, hn], v [ng, N, hv] -> [np, padded nq, hv]; ``attend``:
    :func:`_attend`'s keyword arguments."""
    block_size = plan[0][2].shape[-2]
    num_tiles = sum(len(group[0]) for group in plan)
    padded_q, padded_k = num_tiles * block_size, -(-k.shape[1] // block_size) * block_size
    if padded_q != q.shape[1]:
        q = F.pad(q, (0, 0, 0, padded_q - q.shape[1]))
    if padded_k != k.shape[1]:
        k, v = (F.pad(t, (0, 0, 0, padded_k - k.shape[1])) for t in (k, v))
    num_heads, _, head_dim = q.shape
    value_dim = v.shape[-1]
    # [np, tiles*B, hn] -> [tiles, np, B, hn]
    q_all = q.view(num_heads, num_tiles, block_size, head_dim).transpose(0, 1)
    outs, order = [], []
    for q_tiles, kv_index, keep in plan:
        g, span = kv_index.shape
        flat = kv_index.reshape(-1)
        # [ng, g*M*B, hn] -> [g, ng, M*B, hn]
        k_blocks = k[:, flat].view(k.shape[0], g, span, head_dim).transpose(0, 1)
        v_blocks = v[:, flat].view(v.shape[0], g, span, value_dim).transpose(0, 1)
        outs.append(_attend(q_all[q_tiles], k_blocks, v_blocks, keep, **attend))
        order.append(q_tiles)
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [tiles, np, B, hv] in group order
    if len(outs) > 1:
        out = out[torch.argsort(torch.cat(order))]
    # [tiles, np, B, hv] -> [np, tiles*B, hv]
    return out.transpose(0, 1).reshape(num_heads, padded_q, value_dim)
