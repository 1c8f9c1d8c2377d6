"""Ragged batches in the layouts RL frameworks hold, to and from the right-padded layout.

:func:`~megatron_tree.core.packing.build_packed_tree_batch` packs a right-padded batch
(``input_ids`` / ``attention_mask`` [B, L]). Frameworks hold sequences without padding; each of
these layouts is accepted as it is, per-token extras (loss mask, old log-probs, ...) in the same
layout as ``input_ids``:

* ``"list"``: ``input_ids`` a list of 1-D sequences [L_b] (tensors, arrays or lists), extras lists
  of [L_b, ...];
* ``"nested"``: ``input_ids`` a jagged nested tensor [B, j] (``torch.nested``, as verl's
  micro-batches hold it), extras nested [B, j, ...];
* ``"thd"``: ``input_ids`` [T] with ``cu_seqlens`` [B + 1] (Megatron's / flash-attention's packed
  layout), extras [T, ...].

:class:`InputLayout` records which layout a batch came in and its lengths, and
:meth:`InputLayout.restore` turns a [B, L, ...] result (the step's merged outputs) back into it.

Legend: B sequences, L the longest, L_b sequence b's length, T = sum of L_b.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from .checks import as_tensor

LAYOUTS = ("padded", "list", "nested", "thd")


@dataclass(frozen=True)
class InputLayout:
    """How a batch was given: one of ``LAYOUTS``, and its sequences' lengths (host ints)."""

    kind: str
    lengths: tuple[int, ...]

    def restore(self, padded: torch.Tensor) -> Any:
        """[B, L', ...] (L' >= every length) -> this layout: the tensor itself for ``"padded"``, a
        list of [L_b, ...], a jagged nested tensor [B, j, ...], or [T, ...]. Differentiable."""
        if self.kind == "padded":
            return padded
        if padded.shape[0] != len(self.lengths) or padded.shape[1] < max(self.lengths, default=0):
            raise ValueError(
                f"a result of shape {tuple(padded.shape)} cannot hold {len(self.lengths)} "
                f"sequences of up to {max(self.lengths, default=0)} tokens"
            )
        sequences = [padded[b, :n] for b, n in enumerate(self.lengths)]
        if self.kind == "list":
            return sequences
        if self.kind == "nested":
            return torch.nested.as_nested_tensor(sequences, layout=torch.jagged)
        return torch.cat(sequences) if sequences else padded.new_zeros((0, *padded.shape[2:]))

    def pad(self, name: str, value: Any) -> torch.Tensor:
        """``value`` given in this layout (as the batch's ``input_ids`` was) -> [B, L, ...]
        right-padded with zeros, L the longest sequence: what :meth:`restore` inverts."""
        if self.kind == "padded":
            if not isinstance(value, torch.Tensor):
                value = torch.as_tensor(value)
            return value
        cu_seqlens = torch.tensor([0, *itertools.accumulate(self.lengths)])
        sequences = _per_sequence(name, value, self.kind, cu_seqlens)
        if len(sequences) != len(self.lengths) or any(
            r.dim() < 1 or r.shape[0] != n for r, n in zip(sequences, self.lengths)
        ):
            raise ValueError(
                f"{name}: the batch came as {self.kind!r} with sequence lengths "
                f"{list(self.lengths)[:8]}; got {len(sequences)} sequences of lengths "
                f"{[int(r.shape[0]) if r.dim() else 0 for r in sequences][:8]}"
            )
        return torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)


def _per_sequence(
    name: str, value: Any, kind: str, cu_seqlens: torch.Tensor | None
) -> list[torch.Tensor]:
    """``value`` (in layout ``kind``) as one tensor per sequence."""
    if kind == "list":
        if not isinstance(value, (list, tuple)):
            raise ValueError(
                f"data[{name!r}] must be a list of per-sequence tensors like input_ids, got "
                f"{type(value).__name__}"
            )
        return [torch.as_tensor(v) for v in value]
    if kind == "nested":
        if not (isinstance(value, torch.Tensor) and value.is_nested):
            raise ValueError(
                f"data[{name!r}] must be a nested tensor like input_ids, got {type(value).__name__}"
            )
        return list(value.unbind())
    value = as_tensor(f"data[{name!r}]", value)  # THD: a numpy array as the padded layout takes it
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() < 1
        or value.shape[0] != int(cu_seqlens[-1])
    ):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"data[{name!r}] must be [T, ...] with T = cu_seqlens[-1] = {int(cu_seqlens[-1])} like "
            f"input_ids, got {shape}"
        )
    bounds = cu_seqlens.tolist()
    return [value[bounds[b] : bounds[b + 1]] for b in range(len(bounds) - 1)]


def _kind(data: dict) -> str:
    input_ids = data["input_ids"]
    if "cu_seqlens" in data:
        return "thd"
    if isinstance(input_ids, torch.Tensor) and input_ids.is_nested:
        return "nested"
    if isinstance(input_ids, (list, tuple)) and "attention_mask" not in data:
        return "list"
    return "padded"


def _cu_seqlens(data: dict) -> torch.Tensor:
    cu = torch.as_tensor(data["cu_seqlens"])
    input_ids = as_tensor("data['input_ids']", data["input_ids"])
    if (
        cu.dim() != 1
        or cu.numel() < 2
        or cu.dtype.is_floating_point
        or int(cu[0]) != 0
        or bool((cu[1:] < cu[:-1]).any())
    ):
        raise ValueError(
            f"cu_seqlens must be a non-decreasing int [B + 1] starting at 0, got {cu.tolist()[:8]}"
        )
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 1
        or input_ids.numel() != int(cu[-1])
    ):
        shape = (
            tuple(input_ids.shape)
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise ValueError(
            f"with cu_seqlens, input_ids must be [T] with T = cu_seqlens[-1] = {int(cu[-1])}, got "
            f"{shape}"
        )
    return cu


def to_padded(data: dict) -> tuple[dict, InputLayout]:
    """``data`` in any of ``LAYOUTS`` -> (the right-padded dict ``build_packed_tree_batch`` packs,
    its :class:`InputLayout`). A padded dict is returned as is (its lengths are read later)."""
    if not isinstance(data, dict) or "input_ids" not in data:
        raise ValueError("data must be a dict holding 'input_ids' (and, padded, 'attention_mask')")
    kind = _kind(data)
    if kind == "padded":
        return data, InputLayout("padded", ())
    if "attention_mask" in data:
        raise ValueError(
            f"a {kind!r} batch has no padding: drop data['attention_mask'] (lengths come from the "
            "sequences themselves)"
        )
    cu_seqlens = _cu_seqlens(data) if kind == "thd" else None
    extras = {
        name: value for name, value in data.items() if name not in ("input_ids", "cu_seqlens")
    }
    ids = _per_sequence("input_ids", data["input_ids"], kind, cu_seqlens)
    if not ids or any(row.dim() != 1 for row in ids):
        raise ValueError(
            f"input_ids must hold one 1-D sequence per row ({kind!r} layout), got "
            f"{'no sequences' if not ids else [tuple(r.shape) for r in ids[:4]]}"
        )
    lengths = tuple(int(row.shape[0]) for row in ids)
    padded = {"input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)}
    padded["attention_mask"] = (
        torch.arange(padded["input_ids"].shape[1])[None] < torch.tensor(lengths)[:, None]
    ).to(torch.int64)
    for name, value in extras.items():
        sequences = _per_sequence(name, value, kind, cu_seqlens)
        if len(sequences) != len(ids) or any(r.shape[0] != n for r, n in zip(sequences, lengths)):
            raise ValueError(
                f"data[{name!r}] must have input_ids' sequence lengths {list(lengths)[:8]}, got "
                f"{[int(r.shape[0]) for r in sequences][:8]}"
            )
        padded[name] = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    return padded, InputLayout(kind, lengths)


def read_batch(data: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor, InputLayout]:
    """A batch in any of ``LAYOUTS``, checked and right-padded: what the packer and the
    data-parallel partitioner read.

    Args:
        data: ``input_ids`` [B, L] int and ``attention_mask`` [B, L] (1 on the real tokens,
            right-padded), per-token extras [B, L, ...]; numpy arrays and rectangular nested lists
            are taken as tensors. Or a ragged batch (see :func:`to_padded`).

    Returns:
        (the right-padded dict of tensors, lengths int64 [B] (each >= 1), the batch's
        :class:`InputLayout`).

    Raises:
        ValueError: naming the input and the fix.
    """
    data, layout = to_padded(data)
    if "attention_mask" not in data:
        raise ValueError(
            "data must be a dict holding 'input_ids' [B, L] and 'attention_mask' [B, L] tensors "
            "(or a ragged batch: input_ids a list of sequences, a nested tensor, or [T] with "
            "cu_seqlens)"
        )
    data = {name: as_tensor(f"data[{name!r}]", value) for name, value in data.items()}
    for name in ("input_ids", "attention_mask"):
        if not isinstance(data[name], torch.Tensor):
            raise ValueError(
                f"data[{name!r}] must be a [B, L] tensor (or numpy array), got "
                f"{type(data[name]).__name__}"
            )
    input_ids, attention_mask = data["input_ids"], data["attention_mask"]
    if input_ids.dim() != 2:
        raise ValueError(f"data['input_ids'] must be [B, L], got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"data['attention_mask'] has shape {tuple(attention_mask.shape)} but data['input_ids'] "
            f"has {tuple(input_ids.shape)}; they must be equal"
        )
    if input_ids.shape[0] == 0:
        raise ValueError("the batch is empty: data['input_ids'] has no sequences")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"data['input_ids'] must hold integer token ids, got {input_ids.dtype}")
    for name, value in data.items():
        if name not in ("input_ids", "attention_mask") and (
            not isinstance(value, torch.Tensor) or value.shape[:2] != input_ids.shape
        ):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"data[{name!r}] must be a tensor shaped [B, L, ...] = {tuple(input_ids.shape)} "
                f"like input_ids, got {shape}; pass per-token tensors only"
            )
    return data, _right_padded_lengths(attention_mask), layout


def _right_padded_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the lengths of a right-padded [B, L] mask; ValueError for left padding, holes
    or an empty sequence."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    right_padded = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    bad = (mask != right_padded).any(dim=1)
    if bad.any():
        raise ValueError(
            f"data['attention_mask'] rows {bad.nonzero().flatten()[:8].tolist()} are not "
            "right-padded: each row must be ones for the real tokens followed by zeros (no left "
            "padding or holes)"
        )
    if (lengths == 0).any():
        raise ValueError(
            f"sequences {(lengths == 0).nonzero().flatten()[:8].tolist()} are empty "
            "(attention_mask all zero); drop them from the batch"
        )
    return lengths.to(torch.int64)
