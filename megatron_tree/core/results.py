"""Per-sequence results read back from a packed tree: values, vocab stats, and the merge to [B, L].

Per-sequence outputs are flat tensors ``[T]`` aligned with ``tree.token_index``: entry
``cu_seqlens[i] + t`` is token ``t`` of the tree's ``i``-th sequence, whose batch row is
``tree.sequence_ids[i]``. Legend: N padded packed length, U tree nodes, T sequence tokens,
B batch size, L padded sequence length.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .logprobs import rows_of
from .rows import TreeRows
from .tree import PackedTree

__all__ = [
    "gather_packed_tree_values",
    "gather_packed_tree_vocab_stats",
    "merge_packed_tree_results",
    "values_per_position",
]


@torch.no_grad()
def gather_packed_tree_vocab_stats(
    logits: torch.Tensor,
    tree: PackedTree,
    *,
    tp_group: dist.ProcessGroup | None = None,
    rows: TreeRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max logit over the full (sharded) vocabulary at every sequence token (no grad).

    Args:
        logits: as in gather_packed_tree_logprobs_entropy (raw, no temperature); under context
            parallelism or trunk reuse this rank's n rows [1, n, V / tp].
        tree: the micro-batch's packed tree.
        tp_group: tensor-parallel group the vocab is sharded over; None for no sharding.
        rows: the micro-batch's :class:`~megatron_tree.core.rows.TreeRows` when ``logits`` holds
            only some of the tree's positions: entries of other rows read 0 before
            ``rows.complete`` (which sums them over the context-parallel group).

    Returns:
        (vocab_min [T], vocab_max [T]) fp32, in ``tree.token_index`` order, not rolled: entry t
        is the row of token t.
    """
    whole = rows is None or rows.is_whole
    logits = rows_of(logits, tree, "logits") if whole else logits.reshape(-1, logits.shape[-1])
    real = logits.detach()[: tree.num_tree_tokens] if whole else logits.detach()
    # One collective: max of (max, -min).
    stats = torch.stack([real.amax(-1), -real.amin(-1)]).float()  # [2, U] (whole) or [2, n]
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=tp_group)
    token_index = tree.token_index.to(logits.device)
    if whole:
        return -stats[1][token_index], stats[0][token_index]
    local = rows.local_index.to(logits.device)[token_index]
    mine = torch.where(local >= 0, stats[:, local.clamp(min=0)], 0.0)
    vocab_max, negated_min = rows.complete([mine[0], mine[1]])
    return -negated_min, vocab_max


def gather_packed_tree_values(
    values: torch.Tensor, tree: PackedTree, *, rows: TreeRows | None = None
) -> torch.Tensor:
    """A critic's per-position values read back per sequence ([T], differentiable, not rolled).

    Args:
        values: N values in any shape ([N], [1, N], [N, 1], [1, N, 1], ...); under context
            parallelism this rank's n rows.
        tree: the micro-batch's packed tree.
        rows: the micro-batch's :class:`~megatron_tree.core.rows.TreeRows` when ``values`` holds
            only some of the tree's positions (a context-parallel rank's, a trunk-reuse part's):
            entries of other rows read 0 before ``rows.complete``.

    Returns:
        [T] in ``tree.token_index`` order: entry t of a sequence is the value at its token t.
        A position shared by several sequences receives the sum of their gradients.
    """
    expected = tree.padded_length if rows is None else rows.num_rows
    if values.numel() != expected:
        where = (
            "the tree's padded length" if rows is None else "this micro-batch's rows on this rank"
        )
        raise ValueError(f"values has {values.numel()} elements, expected {where} {expected}")
    flat = values.reshape(-1)
    token_index = tree.token_index.to(values.device)
    if rows is None or rows.is_whole:
        return flat[token_index]
    local = rows.local_index.to(values.device)[token_index]
    mine = torch.where(local >= 0, flat[local.clamp(min=0)], 0.0)
    return rows.complete([mine])[0]


def values_per_position(values: torch.Tensor, tree: PackedTree, *, fill: float = 0) -> torch.Tensor:
    """Per-token values in tree layout [T, ...] -> one per packed position [N, ...].

    For inputs that are equal on every sequence through a position (the tokens themselves, or
    routes packed with ``build_packed_tree_batch(route_key=...)``); padding positions get ``fill``.
    """
    if values.shape[0] != tree.num_sequence_tokens:
        raise ValueError(
            f"values must be [T={tree.num_sequence_tokens}, ...] (the tree's sequence tokens), got "
            f"{tuple(values.shape)}"
        )
    out = values.new_full((tree.padded_length, *values.shape[1:]), fill)
    out[tree.token_index.to(values.device)] = values
    return out


def merge_packed_tree_results(
    outputs: Iterable[tuple[torch.Tensor, PackedTree]],
    batch_size: int,
    *,
    padding_value: float = 0.0,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Per-micro-batch per-sequence results back into the original batch layout.

    Args:
        outputs: ``(result, tree)`` pairs, one per micro-batch in any order (dummy trees allowed);
            ``result`` is [T_mb, ...] in ``tree.token_index`` order (what the gather functions
            and the packed micro-batch's extra keys hold).
        batch_size: B. Every batch row must appear in exactly one tree.
        padding_value: fills positions past each sequence's length.
        max_seq_len: L; defaults to the longest sequence.

    Returns:
        [B, L, ...]: row ``b`` holds sequence ``b`` at positions ``[0, len_b)``. Differentiable.

    Raises:
        ValueError: a result whose length is not its tree's T, a sequence id out of
            [0, batch_size), duplicated or missing, or a sequence longer than ``max_seq_len``.
    """
    results, batch_rows, positions, seq_ids, seq_lens = [], [], [], [], []
    for result, tree in outputs:
        if result.shape[0] != tree.num_sequence_tokens:
            raise ValueError(
                f"a result has {result.shape[0]} entries but its tree has "
                f"{tree.num_sequence_tokens} sequence tokens"
            )
        lengths = tree.sequence_lengths.to(result.device)
        starts = tree.cu_seqlens[:-1].to(result.device).repeat_interleave(lengths)
        ids = tree.sequence_ids.to(result.device)
        results.append(result)
        batch_rows.append(ids.repeat_interleave(lengths))
        positions.append(torch.arange(result.shape[0], device=result.device) - starts)
        seq_ids.append(ids)
        seq_lens.append(lengths)
    if not results:
        raise ValueError("outputs is empty")
    ids = torch.cat(seq_ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= batch_size):
        raise ValueError(f"sequence ids must lie in [0, {batch_size}), got {ids.tolist()}")
    counts = torch.bincount(ids, minlength=batch_size)
    if bool((counts > 1).any()):
        raise ValueError(f"duplicate sequence ids: {torch.nonzero(counts > 1).flatten().tolist()}")
    if bool((counts == 0).any()):
        raise ValueError(f"missing sequence ids: {torch.nonzero(counts == 0).flatten().tolist()}")
    longest = int(torch.cat(seq_lens).max()) if ids.numel() else 0
    if max_seq_len is None:
        max_seq_len = longest
    elif longest > max_seq_len:
        raise ValueError(f"a sequence of length {longest} exceeds max_seq_len={max_seq_len}")
    flat = torch.cat(results)
    merged = flat.new_full((batch_size, max_seq_len, *flat.shape[1:]), padding_value)
    merged[torch.cat(batch_rows), torch.cat(positions)] = flat
    return merged
