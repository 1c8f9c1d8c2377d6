"""Per-sequence log-probs, entropy, vocab stats and values read back from a packed tree's outputs.

In a trie every non-root node ``c`` has exactly one parent, so the rolled log-prob of a sequence
(entry ``t`` is log p(token t+1 | tokens <= t)) is a per-node quantity: node ``c`` is predicted by
row ``parent_index[c]``. Everything is computed once per row/node of the tree, over all rows in one
chunked pass, and mapped to sequences with one gather; a position shared by several sequences is
computed once and its gradients add through that gather.

Vocab-parallel convention (as Megatron's ``vocab_parallel_cross_entropy``): with ``tp`` ranks in
``tp_group``, rank ``r`` holds the logits of vocab columns ``[r * Vl, (r + 1) * Vl)``. Each rank
reduces its shard chunk by chunk with no communication, then one ``all_gather`` of per-row
(max, sum-exp, entropy numerator) and per-node target logits merges the shards, the way split-KV
attention merges partial softmaxes. The backward is local (no collectives).

Each chunk's reduction runs either eagerly (five elementwise passes over [C, Vl]) or, with
``fused=True`` / ``"auto"`` on large logits, as one compiled kernel per chunk (forward) and per
logits tensor (backward); see :mod:`megatron_tree.core.fused_logprobs`, where the path is chosen.

Per-sequence outputs are flat tensors ``[T]`` aligned with ``tree.token_index``: entry
``cu_seqlens[i] + t`` is token ``t`` of the tree's ``i``-th sequence, whose batch row is
``tree.sequence_ids[i]`` (the layout of the packed micro-batch's extra keys).
``megatron_tree.core.results.merge_packed_tree_results`` turns them back into ``[B, L]``.

Legend for shapes: N = padded packed length, U = real tree nodes (``tree.num_tree_tokens``),
R = output rows reduced (U, or this rank's under context parallelism), P = predicted (non-root)
nodes, T = sequence tokens (``tree.num_sequence_tokens``), H = hidden size,
V = vocab size, Vl = V / tp (local shard), C = rows in a chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .checks import check_int, check_positive_number, debug_checks
from .fused_logprobs import FusedKernels, select_kernels
from .rows import TreeRows, pair_offsets
from .tree import PackedTree

__all__ = [
    "gather_packed_tree_logprobs",
    "gather_packed_tree_logprobs_entropy",
    "gather_packed_tree_logprobs_entropy_from_hidden",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Default chunk sizes in elements of [C, Vl]. On CPU the logits path keeps its two fp32 chunk
# buffers (4 MiB each) in cache: 32 rows at V = 32000 measured fastest (8 rows: too many small
# ops; 512 rows: 2x slower). The fused path needs more rows per matmul. Elsewhere chunks only
# bound memory.
_CHUNK_ELEMENTS_CPU = 2**20
_FUSED_CHUNK_ELEMENTS_CPU = 2**24
_CHUNK_ELEMENTS = 2**26
# The compiled kernels (fused_logprobs.py) keep no [C, Vl] temporaries; chunks there only bound the
# fp32 gradient chunk of bf16/fp16 logits (16 MiB on CPU, reused by the allocator) and amortise a
# kernel call over many rows.
_COMPILED_CHUNK_ELEMENTS_CPU = 2**22


# log2 p below this is p = 0 in fp32 and fp64 alike (2**-1075 rounds to 0); clamping a -inf logit's
# log2 p here keeps p * log p at 0 instead of 0 * -inf = NaN, and changes no nonzero probability.
_LOG2P_FLOOR = -2048.0


@dataclass(frozen=True)
class _Pairs:
    """The (row, label) pairs of a tree: node ``nodes[j]`` is predicted by row ``rows[j]``.

    Attributes:
        rows: int64 [P]. Parent row of each predicted node, sorted ascending.
        nodes: int64 [P]. The predicted node.
        labels: int64 [P]. Local vocab column of the node's token (0 where ``owned`` is False).
        owned: bool [P]. Whether the token's column lives in this rank's vocab shard.
        num_rows: R, the output rows reduced (U; under context parallelism this rank's rows up to
            its last real one).
        chunk_starts: Row offset of each chunk, then R.
        pair_starts: Offset in the pairs of each chunk's first row, then P.
    """

    rows: torch.Tensor
    nodes: torch.Tensor
    labels: torch.Tensor
    owned: torch.Tensor
    num_rows: int
    chunk_starts: list[int]
    pair_starts: list[int]

    def chunks(self):
        """Yields (row start, row end, pair start, pair end) of every chunk."""
        for k in range(len(self.chunk_starts) - 1):
            yield (
                self.chunk_starts[k],
                self.chunk_starts[k + 1],
                self.pair_starts[k],
                self.pair_starts[k + 1],
            )


def _tp_size_rank(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def rows_of(
    tensor: torch.Tensor, tree: PackedTree, name: str, rows: TreeRows | None = None
) -> torch.Tensor:
    """Views [n, X], [1, n, X] or [n, 1, X] (Megatron's [s, b, X] with b = 1) as [n, X]; n is the
    tree's padded length, or this rank's rows under context parallelism."""
    if tensor.dim() == 3 and 1 in tensor.shape[:2]:
        tensor = tensor.reshape(-1, tensor.shape[-1])
    if tensor.dim() != 2:
        raise ValueError(
            f"{name} must be [N, X], [1, N, X] or [N, 1, X], got {tuple(tensor.shape)}"
        )
    expected = tree.padded_length if rows is None else rows.num_rows
    if tensor.shape[0] != expected:
        where = (
            "the tree's padded length" if rows is None else "this micro-batch's rows on this rank"
        )
        raise ValueError(f"{name} has {tensor.shape[0]} positions but {where} is {expected}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating point tensor, got {tensor.dtype}")
    return tensor


def _tree_pairs(
    tree: PackedTree,
    *,
    vocab_local: int,
    tp_size: int,
    tp_rank: int,
    chunk_rows: int,
    device: torch.device,
    rows: TreeRows | None = None,
) -> _Pairs:
    num_nodes = tree.num_tree_tokens
    parent = tree.parent_index[:num_nodes].to(device)
    tokens = tree.input_ids[:num_nodes].to(device)
    vocab_size = vocab_local * tp_size
    # Packing checks token ids on the host; re-checking here would sync with the device.
    if debug_checks() and num_nodes and not bool(((tokens >= 0) & (tokens < vocab_size)).all()):
        raise ValueError(f"tree tokens must lie in [0, {vocab_size}) (the logits' full vocab)")
    if rows is None or not rows.pair_offsets:
        # Rows built by hand (not at packing): count here, with one host read.
        rows = (
            TreeRows.whole(tree, chains=False)
            if rows is None
            else replace(rows, pair_offsets=pair_offsets(tree, rows.positions))
        )
    # Each node keyed by its parent's row here; roots and nodes predicted by other rows last. The
    # host counts (set with the rows) say how many pairs there are and where each chunk starts.
    outside = rows.num_rows
    if rows.is_whole:
        key = torch.where(parent >= 0, parent, outside)
    else:  # this micro-batch's rows only; they ascend with tree positions
        local = rows.local_index.to(device)[parent.clamp(min=0)]
        key = torch.where((parent >= 0) & (local >= 0), local, outside)
    order = torch.argsort(key, stable=True)
    num_pairs = rows.pair_offsets[-1]
    nodes = order[:num_pairs]
    parents = key[nodes]
    num_rows = rows.num_real  # real rows come first (host fact, set with the rows)
    labels = tokens[nodes] - tp_rank * vocab_local
    owned = (labels >= 0) & (labels < vocab_local)
    chunk_starts = list(range(0, num_rows, chunk_rows)) + [num_rows]
    pair_starts = [rows.pair_offsets[a] for a in chunk_starts]
    return _Pairs(
        parents, nodes, torch.where(owned, labels, 0), owned, num_rows, chunk_starts, pair_starts
    )


def _chunk_rows(
    chunk_size: int | None,
    vocab_local: int,
    device: torch.device,
    *,
    cpu_elements: int = _CHUNK_ELEMENTS_CPU,
) -> int:
    if chunk_size is None:
        budget = cpu_elements if device.type == "cpu" else _CHUNK_ELEMENTS
        return max(1, budget // vocab_local)
    return check_int("chunk_size", chunk_size, minimum=1)


# ---------------------------------------------------------------------------------------------
# The shared chunked kernels. `get_chunk(a, b)` returns logits rows [a, b) as [C, Vl] in any
# float dtype; all math is in `dtype` (fp32, or fp64 for fp64 inputs), in base 2 (exp2 is ~3x
# faster than exp on CPU): with c = log2(e) / temperature, log2 p = c * (x - M) - log2(s).
# ---------------------------------------------------------------------------------------------


def _forward_stats(
    get_chunk: Callable[[int, int], torch.Tensor],
    pairs: _Pairs,
    *,
    num_nodes: int,
    vocab_local: int,
    temperature: float,
    with_entropy: bool,
    tp_group: dist.ProcessGroup | None,
    dtype: torch.dtype,
    device: torch.device,
    kernels: FusedKernels | None = None,
):
    """Returns (node_logprob [U], row_entropy [R] or None, row_shift [R]) over the full vocab.

    ``row_shift`` = M + log2(s) / c, so that log2 p = c * (x - row_shift) (what backward needs).
    With ``kernels``, each chunk's row max, sum and entropy numerator come from one compiled
    kernel instead of the eager passes below.
    """
    c = _LOG2E / temperature
    num_pairs, num_rows = pairs.rows.shape[0], pairs.num_rows
    # [3R + P]: per-row local max, sum of exp2, sum of exp2 * log2-shift; per-pair target logit.
    local = torch.zeros(3 * num_rows + num_pairs, dtype=dtype, device=device)
    row_max, sum_exp, ent_num = local[: 3 * num_rows].view(3, num_rows)
    target = local[3 * num_rows :]
    chunk_rows = max((b - a for a, b, _, _ in pairs.chunks()), default=0)
    if kernels is not None:
        chunk_rows = 0  # no [C, Vl] temporaries
        c_tensor = torch.full((), c, dtype=dtype, device=device)
    shifted = torch.empty(chunk_rows, vocab_local, dtype=dtype, device=device)  # [C, Vl]
    exps = torch.empty_like(shifted)  # [C, Vl]
    for a, b, pa, pb in pairs.chunks():
        x = get_chunk(a, b)  # [C, Vl]
        if kernels is not None:
            row_max[a:b], sum_exp[a:b], numer = kernels.row_stats(x, c_tensor)
            if with_entropy:
                ent_num[a:b] = numer
            picked = x[pairs.rows[pa:pb] - a, pairs.labels[pa:pb]].to(dtype)  # [P_chunk]
            target[pa:pb] = torch.where(pairs.owned[pa:pb], picked, 0)
            continue
        m = x.amax(-1, keepdim=True).to(dtype)  # [C, 1]
        row_max[a:b] = m.squeeze(-1)
        s1 = torch.sub(x, m, out=shifted[: b - a]).mul_(c)  # log2 of unnormalised p, <= 0
        # A -inf logit (masked vocabulary) has p = 0 and adds 0 to the entropy, not 0 * -inf.
        s1.clamp_(min=_LOG2P_FLOOR)
        e = torch.exp2(s1, out=exps[: b - a])
        sum_exp[a:b] = e.sum(-1)
        if with_entropy:
            ent_num[a:b] = s1.mul_(e).sum(-1)
        picked = x[pairs.rows[pa:pb] - a, pairs.labels[pa:pb]].to(dtype)  # [P_chunk]
        target[pa:pb] = torch.where(pairs.owned[pa:pb], picked, 0)

    tp_size, _ = _tp_size_rank(tp_group)
    if tp_size > 1:
        gathered = [torch.empty_like(local) for _ in range(tp_size)]
        dist.all_gather(gathered, local, group=tp_group)
        stacked = torch.stack(gathered)  # [tp, 3R + P]
    else:
        stacked = local[None]
    per_rank = stacked[:, : 3 * num_rows].reshape(tp_size, 3, num_rows)
    row_max_r, sum_exp_r, ent_num_r = per_rank.unbind(1)  # each [tp, R]
    big_m = row_max_r.amax(0)  # [R]
    shift = (row_max_r - big_m) * c  # [tp, R], <= 0
    weight = torch.exp2(shift)
    total = (weight * sum_exp_r).sum(0)  # [R]
    log2_total = torch.log2(total)
    target = stacked[:, 3 * num_rows :].sum(0)  # [P], exactly one rank contributes each
    node_logprob = torch.zeros(num_nodes, dtype=dtype, device=device)
    node_logprob[pairs.nodes] = (target - big_m[pairs.rows]) / temperature - _LN2 * log2_total[
        pairs.rows
    ]
    entropy = None
    if with_entropy:
        numer = (weight * (ent_num_r + shift * sum_exp_r)).sum(0)
        entropy = _LN2 * (log2_total - numer / total)
    return node_logprob, entropy, big_m + log2_total / c


def _row_coefficients(pairs: _Pairs, grad_logprob, grad_entropy, entropy, temperature, dtype):
    """(offset [R], slope [R] or None, label_grad [P]) of the gradient wrt the logits: row r's
    gradient is 2**l * (offset + slope * l) with l = log2 p, plus label_grad at each target."""
    device = entropy.device if entropy is not None else pairs.rows.device
    if grad_logprob is None:
        pair_grad = torch.zeros(pairs.rows.shape[0], dtype=dtype, device=device)
    else:
        pair_grad = grad_logprob.to(dtype)[pairs.nodes]  # [P]
    row_grad = torch.zeros(pairs.num_rows, dtype=dtype, device=device)
    row_grad.index_add_(0, pairs.rows, pair_grad)  # [R], G of every row
    offset = -row_grad / temperature  # [R]
    slope = None  # multiplies log2 p
    if grad_entropy is not None:
        grad_entropy = grad_entropy.to(dtype)
        offset -= grad_entropy * entropy / temperature
        slope = -grad_entropy * (_LN2 / temperature)
    label_grad = torch.where(pairs.owned, pair_grad / temperature, 0)  # [P]
    return offset, slope, label_grad


def _backward_chunks(
    get_chunk: Callable[[int, int], torch.Tensor],
    put_grad: Callable[[int, int, torch.Tensor], None] | None,
    pairs: _Pairs,
    *,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    row_shift: torch.Tensor,
    entropy: torch.Tensor | None,
    vocab_local: int,
    temperature: float,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> None:
    """Writes the gradient wrt logits rows [a, b) (dz [C, Vl] in dtype) of every chunk into
    ``out[a:b]`` ([N, Vl] in dtype) when given, else calls ``put_grad(a, b, dz)``.

    With z = x / temperature, p = softmax(z), H = -sum p log p:
    d logp_y / dz = onehot(y) - p and dH / dz = -p (log p + H), so for row r with children
    gradients g_c and entropy gradient h:  dz = sum_c g_c onehot(y_c) - p (G + h (log p + H)),
    G = sum_c g_c; everything is then divided by the temperature.
    """
    c = _LOG2E / temperature
    device = row_shift.device
    offset, slope, label_grad = _row_coefficients(
        pairs, grad_logprob, grad_entropy, entropy, temperature, dtype
    )
    chunk_rows = max((b - a for a, b, _, _ in pairs.chunks()), default=0)
    log2p_buf = torch.empty(chunk_rows, vocab_local, dtype=dtype, device=device)
    prob_buf = torch.empty_like(log2p_buf)
    for a, b, pa, pb in pairs.chunks():
        x = get_chunk(a, b)  # [C, Vl]
        log2p = torch.sub(x, row_shift[a:b, None], out=log2p_buf[: b - a]).mul_(c)
        log2p.clamp_(min=_LOG2P_FLOOR)  # p = 0 columns: keep p * log p at 0
        prob = torch.exp2(log2p, out=prob_buf[: b - a])
        dz = log2p if out is None else out[a:b]
        if slope is None:
            torch.mul(prob, offset[a:b, None], out=dz)
        else:
            torch.mul(log2p.mul_(slope[a:b, None]).add_(offset[a:b, None]), prob, out=dz)
        dz.index_put_(
            (pairs.rows[pa:pb] - a, pairs.labels[pa:pb]), label_grad[pa:pb], accumulate=True
        )
        if out is None:
            put_grad(a, b, dz)


def _backward_compiled(
    logits: torch.Tensor,
    pairs: _Pairs,
    kernels: FusedKernels,
    *,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    row_shift: torch.Tensor,
    entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The gradient wrt ``logits`` [N, Vl] (as _backward_chunks) from the compiled kernel.

    Logits in the compute dtype (fp32, fp64) get one kernel over all N rows writing the gradient
    itself (0 on padding rows), then the targets' one-hot terms; bf16/fp16 logits go chunk by
    chunk through an fp32 chunk, so the one-hot terms are added before the single rounding.
    """
    dtype = row_shift.dtype
    device = logits.device
    offset, slope, label_grad = _row_coefficients(
        pairs, grad_logprob, grad_entropy, entropy, temperature, dtype
    )
    if slope is None:
        slope = torch.zeros_like(offset)
    c = torch.full((), _LOG2E / temperature, dtype=dtype, device=device)
    num_rows, total = pairs.num_rows, logits.shape[0]
    if logits.dtype == dtype:
        if total == 0:
            return torch.empty_like(logits)
        per_row = torch.zeros(3, total, dtype=dtype, device=device)
        per_row[0, :num_rows], per_row[1, :num_rows], per_row[2, :num_rows] = (
            row_shift,
            offset,
            slope,
        )
        keep = torch.arange(total, device=device) < num_rows
        grad = kernels.row_grad(logits, *per_row.unbind(0), keep, c)
        grad.index_put_((pairs.rows, pairs.labels), label_grad, accumulate=True)
        return grad
    grad = torch.empty_like(logits)
    grad[num_rows:].zero_()  # padding rows
    keep = torch.ones(
        max((b - a for a, b, _, _ in pairs.chunks()), default=0), dtype=torch.bool, device=device
    )
    for a, b, pa, pb in pairs.chunks():
        dz = kernels.row_grad(
            logits[a:b], row_shift[a:b], offset[a:b], slope[a:b], keep[: b - a], c
        )
        dz.index_put_(
            (pairs.rows[pa:pb] - a, pairs.labels[pa:pb]), label_grad[pa:pb], accumulate=True
        )
        grad[a:b].copy_(dz)
    return grad


class _TreeLogprobEntropy(torch.autograd.Function):
    """logits [N, Vl] -> (node_logprob [U], row_entropy [R]); see _forward_stats."""

    @staticmethod
    def forward(ctx, logits, pairs, num_nodes, temperature, with_entropy, tp_group, kernels):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        node_logprob, entropy, row_shift = _forward_stats(
            lambda a, b: logits[a:b],
            pairs,
            num_nodes=num_nodes,
            vocab_local=logits.shape[1],
            temperature=temperature,
            with_entropy=with_entropy,
            tp_group=tp_group,
            dtype=dtype,
            device=logits.device,
            kernels=kernels,
        )
        ctx.save_for_backward(logits, row_shift, entropy)
        ctx.pairs, ctx.num_nodes, ctx.temperature = pairs, num_nodes, temperature
        ctx.kernels = kernels
        ctx.set_materialize_grads(False)
        if entropy is None:
            return node_logprob
        return node_logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        logits, row_shift, entropy = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 7
        if ctx.kernels is not None:
            grad = _backward_compiled(
                logits,
                ctx.pairs,
                ctx.kernels,
                grad_logprob=grad_logprob,
                grad_entropy=grad_entropy,
                row_shift=row_shift,
                entropy=entropy,
                temperature=ctx.temperature,
            )
            return grad, None, None, None, None, None, None
        grad = torch.empty_like(logits)
        grad[ctx.pairs.num_rows :].zero_()  # padding rows
        direct = grad.dtype == row_shift.dtype  # else computed in fp32 and cast chunk by chunk

        def put_grad(a, b, dz):
            grad[a:b].copy_(dz)

        _backward_chunks(
            lambda a, b: logits[a:b],
            put_grad,
            ctx.pairs,
            grad_logprob=grad_logprob,
            grad_entropy=grad_entropy,
            row_shift=row_shift,
            entropy=entropy,
            vocab_local=logits.shape[1],
            temperature=ctx.temperature,
            dtype=row_shift.dtype,
            out=grad if direct else None,
        )
        return grad, None, None, None, None, None, None


class _TreeLogprobEntropyFromHidden(torch.autograd.Function):
    """(hidden [N, H], weight [Vl, H]) -> (node_logprob [U], row_entropy [R]) without [N, Vl]."""

    @staticmethod
    def forward(ctx, hidden, weight, pairs, num_nodes, temperature, tp_group):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        node_logprob, entropy, row_shift = _forward_stats(
            lambda a, b: hidden[a:b] @ weight.t(),
            pairs,
            num_nodes=num_nodes,
            vocab_local=weight.shape[0],
            temperature=temperature,
            with_entropy=True,
            tp_group=tp_group,
            dtype=dtype,
            device=hidden.device,
        )
        ctx.save_for_backward(hidden, weight, row_shift, entropy)
        ctx.pairs, ctx.num_nodes, ctx.temperature = pairs, num_nodes, temperature
        ctx.tp_group = tp_group
        ctx.set_materialize_grads(False)
        return node_logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, row_shift, entropy = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 6
        grad_hidden = torch.zeros_like(hidden)
        # A bf16/fp16 weight gradient is accumulated over chunks in fp32, then cast once.
        grad_weight = torch.zeros_like(
            weight, dtype=torch.promote_types(weight.dtype, torch.float32)
        )

        def put_grad(a, b, dz):
            dz = dz.to(weight.dtype)  # [C, Vl]
            grad_hidden[a:b] = dz @ weight
            grad_weight.add_(dz.t() @ hidden[a:b])

        _backward_chunks(
            lambda a, b: hidden[a:b] @ weight.t(),
            put_grad,
            ctx.pairs,
            grad_logprob=grad_logprob,
            grad_entropy=grad_entropy,
            row_shift=row_shift,
            entropy=entropy,
            vocab_local=weight.shape[0],
            temperature=ctx.temperature,
            dtype=row_shift.dtype,
        )
        if _tp_size_rank(ctx.tp_group)[0] > 1:
            # hidden is replicated across the TP ranks: its gradient is the sum of every shard's.
            dist.all_reduce(grad_hidden, group=ctx.tp_group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _per_sequence(
    node_logprob: torch.Tensor,
    row_entropy: torch.Tensor | None,
    tree: PackedTree,
    rows: TreeRows | None,
) -> list[torch.Tensor]:
    """Node log-probs [U] (0 at roots) and row entropies [R] -> [T] outputs in token order.

    Log-prob entry t of a sequence reads node t+1 (rolled). The entry after a sequence's last token
    is the next sequence's first token (the first sequence's for the last one): always a root, so
    every last entry reads 0. Entropy entry t reads the row of token t. Under context parallelism
    each rank fills the entries of its rows and the outputs are then shared over the CP group.
    """
    token_index = tree.token_index.to(node_logprob.device)
    outputs = [node_logprob[torch.roll(token_index, -1)]]
    if row_entropy is not None:
        local = token_index
        if rows is not None and not rows.is_whole:  # rows not computed here read an appended 0
            local = rows.local_index.to(local.device)[token_index]
            local = torch.where(local >= 0, local, row_entropy.shape[0])
            row_entropy = torch.cat([row_entropy, row_entropy.new_zeros(1)])
        outputs.append(row_entropy[local])
    return outputs if rows is None else rows.complete(outputs)


def _gather_logprobs(logits, tree, *, temperature, tp_group, chunk_size, with_entropy, rows, fused):
    temperature = check_positive_number("temperature", temperature)
    logits = rows_of(logits, tree, "logits", rows)
    tp_size, tp_rank = _tp_size_rank(tp_group)
    kernels = select_kernels(fused, logits.device, logits.dtype, logits.numel())
    cpu_elements = _CHUNK_ELEMENTS_CPU if kernels is None else _COMPILED_CHUNK_ELEMENTS_CPU
    pairs = _tree_pairs(
        tree,
        vocab_local=logits.shape[1],
        tp_size=tp_size,
        tp_rank=tp_rank,
        chunk_rows=_chunk_rows(
            chunk_size, logits.shape[1], logits.device, cpu_elements=cpu_elements
        ),
        device=logits.device,
        rows=rows,
    )
    out = _TreeLogprobEntropy.apply(
        logits, pairs, tree.num_tree_tokens, temperature, with_entropy, tp_group, kernels
    )
    if not with_entropy:
        return _per_sequence(out, None, tree, rows)[0]
    return tuple(_per_sequence(*out, tree, rows))


def gather_packed_tree_logprobs_entropy(
    logits: torch.Tensor,
    tree: PackedTree,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    rows: TreeRows | None = None,
    fused: bool | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rolled per-sequence log-probs and entropy of a packed tree's (vocab-parallel) logits.

    Differentiable with respect to ``logits``. Computed in fp32 (fp64 for fp64 logits) chunk by
    chunk; for the backward it keeps ``logits`` itself, two floats per tree node (the softmax shift
    and the entropy) and the (row, column) index pairs of the targets. Logits may hold ``-inf``
    (masked vocabulary columns): those columns have probability 0 and add nothing to the entropy.

    Args:
        logits: [N, Vl], [1, N, Vl] or [N, 1, Vl], any float dtype; this rank's vocab shard.
        tree: the micro-batch's packed tree (N = ``tree.padded_length``).
        temperature: logits are divided by it before the softmax.
        tp_group: tensor-parallel group the vocab is sharded over; None for no sharding.
        chunk_size: rows reduced at once (bounds the fp32 temporaries to 2 x [chunk, Vl]);
            None picks a cache-sized chunk on CPU and 2**26 / Vl rows elsewhere.
        rows: the micro-batch's :class:`~megatron_tree.core.rows.TreeRows` when ``logits`` holds
            only some of the tree's positions [n, Vl] (a context-parallel rank's, a trunk-reuse
            part's): entries predicted by other rows read 0, then ``rows.complete`` sums them over
            the CP group, and gradients flow only into this rank's rows.
        fused: True for the compiled one-pass kernels (torch.compile; an error if they cannot be
            built), False for the eager chunked path, "auto" for the compiled kernels on large
            logits when they work on this device (else the eager path, after one logged warning),
            None for the process default (:func:`~megatron_tree.core.fused_logprobs.default_mode`,
            "auto" unless ``MEGATRON_TREE_FUSED_LOGPROBS`` says otherwise). Same results either
            way, to fp32 rounding.

    Returns:
        (logprobs [T], entropy [T]), in ``tree.token_index`` order. ``logprobs`` entry t of a
        sequence of length L is log p(token t+1 | tokens <= t) and entry L-1 is 0; ``entropy``
        entry t is the entropy of the distribution at token t (defined for t = L-1 too).
    """
    return _gather_logprobs(
        logits,
        tree,
        temperature=temperature,
        tp_group=tp_group,
        chunk_size=chunk_size,
        with_entropy=True,
        rows=rows,
        fused=fused,
    )


def gather_packed_tree_logprobs(
    logits: torch.Tensor,
    tree: PackedTree,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    rows: TreeRows | None = None,
    fused: bool | str | None = None,
) -> torch.Tensor:
    """The ``logprobs`` of :func:`gather_packed_tree_logprobs_entropy` alone ([T]), cheaper."""
    return _gather_logprobs(
        logits,
        tree,
        temperature=temperature,
        tp_group=tp_group,
        chunk_size=chunk_size,
        with_entropy=False,
        rows=rows,
        fused=fused,
    )


def gather_packed_tree_logprobs_entropy_from_hidden(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    tree: PackedTree,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    rows: TreeRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused output layer + :func:`gather_packed_tree_logprobs_entropy`: never builds [N, Vl].

    Logits are ``hidden @ output_weight.T`` one chunk at a time, recomputed in the backward.
    ``hidden`` is the replicated input of the column-parallel output layer (the decoder's final
    hidden states, not sequence-parallel); its gradient is all-reduced over ``tp_group`` here, as
    Megatron's ``copy_to_tensor_model_parallel_region`` would. No output bias.

    Args:
        hidden: [N, H], [1, N, H] or [N, 1, H].
        output_weight: [Vl, H], this rank's rows of the output layer (or tied embedding).
        tree, temperature, tp_group, chunk_size, rows: as in gather_packed_tree_logprobs_entropy.

    Returns:
        (logprobs [T], entropy [T]) as gather_packed_tree_logprobs_entropy.
    """
    temperature = check_positive_number("temperature", temperature)
    hidden = rows_of(hidden, tree, "hidden", rows)
    if output_weight.dim() != 2 or output_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"output_weight must be [Vl, {hidden.shape[1]}], got {tuple(output_weight.shape)}"
        )
    tp_size, tp_rank = _tp_size_rank(tp_group)
    vocab_local = output_weight.shape[0]
    pairs = _tree_pairs(
        tree,
        vocab_local=vocab_local,
        tp_size=tp_size,
        tp_rank=tp_rank,
        chunk_rows=_chunk_rows(
            chunk_size, vocab_local, hidden.device, cpu_elements=_FUSED_CHUNK_ELEMENTS_CPU
        ),
        device=hidden.device,
        rows=rows,
    )
    node_logprob, row_entropy = _TreeLogprobEntropyFromHidden.apply(
        hidden, output_weight, pairs, tree.num_tree_tokens, temperature, tp_group
    )
    return tuple(_per_sequence(node_logprob, row_entropy, tree, rows))
