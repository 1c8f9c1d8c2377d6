"""Refuse non-finite per-token outputs and losses: one fused check per step, a located error.

A NaN or inf log-prob, entropy, value or loss is never returned silently (an unloaded parameter,
a NaN embedding row or an fp16 overflow otherwise reads as garbage numbers downstream).
:func:`non_finite` is one device flag over a micro-batch's outputs (no host read);
:class:`FiniteCheck` keeps one per micro-batch and reads them all in one host read at the end of
the step (:meth:`FiniteCheck.raise_if_any`); an engine that already reads a value per micro-batch
(a loss ``.item()``) reads the flag with it instead. Only when a flag is set is the error located:
the micro-batch, the sequences (batch rows) and the counts, by :func:`raise_non_finite`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .tree import PackedTree

__all__ = ["FiniteCheck", "NonFiniteOutputError", "non_finite", "raise_non_finite"]


class NonFiniteOutputError(FloatingPointError):
    """A step produced NaN or inf log-probs, entropy, values or loss (message: where)."""


def _floating(outputs: dict) -> dict[str, torch.Tensor]:
    return {
        k: v.detach() for k, v in outputs.items() if torch.is_tensor(v) and v.is_floating_point()
    }


def non_finite(outputs: dict) -> torch.Tensor:
    """One device bool: does any floating tensor of ``outputs`` ({name: tensor}) hold a NaN or an
    inf. No host read."""
    kept = list(_floating(outputs).values())
    if not kept:
        return torch.zeros((), dtype=torch.bool)
    return torch.stack([~torch.isfinite(v).all() for v in kept]).any()


def raise_non_finite(where: str, index: int, tree: PackedTree | None, outputs: dict) -> None:
    """Raise :class:`NonFiniteOutputError` for micro-batch ``index``: each output's non-finite
    count and, for per-token outputs ([T] in tree order, entry ``cu_seqlens[i] + t`` is sequence
    i's token t), the batch rows of the sequences they are in."""
    parts = []
    for name, values in _floating(outputs).items():
        wrong = ~torch.isfinite(values.reshape(-1))
        if not bool(wrong.any()):
            continue
        parts.append(f"{name}: {int(wrong.sum())} of {wrong.numel()} non-finite")
        if tree is not None and values.numel() == int(tree.cu_seqlens[-1]):
            at = wrong.nonzero().flatten().cpu()
            seqs = torch.searchsorted(tree.cu_seqlens.cpu(), at, right=True) - 1
            rows = tree.sequence_ids.cpu()[seqs.unique()].tolist()
            parts[-1] += f" in sequences (batch rows) {rows}"
    raise NonFiniteOutputError(
        f"{where}: micro-batch {index} has non-finite outputs: {'; '.join(parts)}. Likely "
        "causes: a parameter that was never loaded or is NaN (check the checkpoint load), a "
        "NaN/inf input, or an fp16/bf16 overflow. Nothing was returned."
    )


@dataclass
class FiniteCheck:
    """Per-micro-batch finiteness flags of a step's outputs, read once.

    ``add(index, tree, outputs)`` keeps the micro-batch's detached outputs ({name: [T]} in tree
    order) and one device flag; ``add_loss`` the same for a loss (a scalar or any tensor). Nothing
    is read on the host until :meth:`raise_if_any`.
    """

    where: str = "tree step"
    entries: list = field(default_factory=list)  # (index, tree | None, {name: tensor}, flag)

    def add(self, index: int, tree: PackedTree | None, outputs: dict) -> None:
        kept = _floating(outputs)
        if kept:
            self.entries.append((index, tree, kept, non_finite(kept)))

    def add_loss(self, index: int, loss: torch.Tensor) -> None:
        self.add(index, None, {"loss": loss.reshape(-1)})

    def raise_if_any(self) -> None:
        """One host read of all flags; raises :class:`NonFiniteOutputError` for the first
        micro-batch with a non-finite per-token output (else the first non-finite loss)."""
        entries, self.entries = self.entries, []
        if not entries:
            return
        flags = torch.stack([e[3].to(entries[0][3].device) for e in entries]).tolist()
        bad = [e for e, f in zip(entries, flags) if f]
        if not bad:
            return
        index, tree, outputs, _ = next((e for e in bad if e[1] is not None), bad[0])
        where = f"{self.where} (non-finite in micro-batches {sorted({e[0] for e in bad})})"
        raise_non_finite(where, index, tree, outputs)
