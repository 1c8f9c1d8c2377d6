"""Compiled one-pass kernels for the log-prob gather of :mod:`megatron_tree.core.logprobs`.

The chunked eager path reduces each chunk of logits rows in five elementwise passes (max, shift,
exp2, sum, entropy). Here ``torch.compile`` fuses them: inductor generates vectorized C++ (OpenMP)
on CPU and Triton on GPU, reading each row of logits once per reduction loop and writing nothing
of size [C, Vl]. Two kernels:

- ``row_stats(x [C, Vl], c)`` -> (max [C], sum of 2**s [C], sum of s * 2**s [C]) with
  s = max(c * (x - max), floor): what ``_forward_stats`` needs of every chunk;
- ``row_grad(x [C, Vl], shift, offset, slope [C], keep [C] bool, c)`` -> dz [C, Vl] =
  keep * 2**l * (offset + slope * l), l = max(c * (x - shift), floor): the softmax part of
  ``_backward_chunks`` (the target columns are added afterwards with one small ``index_put_``).

Both are compiled once with dynamic shapes (``dynamic=True``): rows and vocab are symbols, so
micro-batches of any packed length, and vocab shards of any width, reuse one graph per dtype and
device. ``c`` (log2(e) / temperature) is a 0-d tensor, so temperatures do not recompile either.
Sizes 0 and 1 would be specialized by the tracer, so a 1-row chunk is padded to 2 rows here and
an empty one is never passed.

Which path runs is decided in one place, :func:`select_kernels`, from a mode:

- ``False``: the eager chunked path;
- ``True``: the compiled kernels, or an error if they cannot be built or fail their check;
- ``"auto"`` (the default): the compiled kernels when the problem is large enough to repay the
  kernel call overhead (``AUTO_MIN_ELEMENTS`` logits) and the kernels work on this device and
  dtype; else the eager path. A kernel that fails to compile, or whose first result disagrees
  with the eager math on a small probe, is reported once with a logged warning and the eager path
  is used from then on for that device type and dtype.

The process default is ``"auto"``; ``MEGATRON_TREE_FUSED_LOGPROBS=0|1|auto`` in the environment or
:func:`set_default_mode` changes it, and the gather functions take ``fused=`` per call.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_MIN_ELEMENTS",
    "FusedKernels",
    "default_mode",
    "select_kernels",
    "set_default_mode",
]

# log2 p floor shared with the eager path (see logprobs._LOG2P_FLOOR).
LOG2P_FLOOR = -2048.0
# "auto" compiles only from this many logits elements on (rows x local vocab): below it a call is
# microseconds either way, and the one-off compile (seconds) would never pay back.
AUTO_MIN_ELEMENTS = 2**20

_MODES = {"auto": "auto", "1": True, "true": True, "0": False, "false": False}


def _parse_mode(mode, name: str = "fused"):
    if isinstance(mode, bool):
        return mode
    if isinstance(mode, str) and mode.strip().lower() in _MODES:
        return _MODES[mode.strip().lower()]
    raise ValueError(f'{name} must be True, False or "auto", got {mode!r}')


_DEFAULT = [_parse_mode(os.environ.get("MEGATRON_TREE_FUSED_LOGPROBS", "auto"), "env")]


def set_default_mode(mode) -> None:
    """Sets the process-wide default of ``fused=`` (True, False or "auto")."""
    _DEFAULT[0] = _parse_mode(mode)


def default_mode():
    """The process-wide default of ``fused=`` (True, False or "auto")."""
    return _DEFAULT[0]


# ---------------------------------------------------------------------------------------------
# The kernels (written once for eager semantics; torch.compile fuses each into one loop nest)
# ---------------------------------------------------------------------------------------------


def _row_stats(x: torch.Tensor, c: torch.Tensor):
    x = x.to(c.dtype)
    m = x.amax(-1, keepdim=True)
    s = ((x - m) * c).clamp(min=LOG2P_FLOOR)  # log2 of the unnormalised p, <= 0
    e = torch.exp2(s)
    return m.squeeze(-1), e.sum(-1), (s * e).sum(-1)


def _row_grad(x, shift, offset, slope, keep, c):
    log2p = ((x.to(c.dtype) - shift[:, None]) * c).clamp(min=LOG2P_FLOOR)
    dz = torch.exp2(log2p) * (offset[:, None] + slope[:, None] * log2p)
    return torch.where(keep[:, None], dz, 0)


@dataclass(frozen=True)
class FusedKernels:
    """The compiled kernels of one device type and dtype (see the module docstring)."""

    stats_fn: object
    grad_fn: object

    def row_stats(self, x: torch.Tensor, c: torch.Tensor):
        """(max, sum of 2**s, sum of s * 2**s), each [C] in c.dtype, of x [C, Vl] (C >= 1)."""
        x, rows = x.detach(), x.shape[0]  # requires_grad is a guard: one graph for both
        if rows == 1:  # size 1 would specialize (recompile): pad with a copy of the row
            x = x.expand(2, -1).contiguous()
        with torch.no_grad():
            out = self.stats_fn(x, c)
        return tuple(t[:rows] for t in out) if rows == 1 else out

    def row_grad(self, x, shift, offset, slope, keep, c):
        """dz [C, Vl] in c.dtype (0 on rows where ``keep`` is False) of x [C, Vl] (C >= 1)."""
        x, rows = x.detach(), x.shape[0]
        if rows == 1:
            x = x.expand(2, -1).contiguous()
            shift, offset, slope, keep = (
                t.expand(2).contiguous() for t in (shift, offset, slope, keep)
            )
        with torch.no_grad():
            out = self.grad_fn(x, shift, offset, slope, keep, c)
        return out[:rows] if rows == 1 else out


def _eager_kernels() -> FusedKernels:
    return FusedKernels(_row_stats, _row_grad)


def _compiled_kernels() -> FusedKernels:
    return FusedKernels(
        torch.compile(_row_stats, dynamic=True, fullgraph=True),
        torch.compile(_row_grad, dynamic=True, fullgraph=True),
    )


# (device type, dtype) -> FusedKernels, or the error that disabled them.
_KERNELS: dict[tuple[str, torch.dtype], FusedKernels | BaseException] = {}
_COMPILED: list[FusedKernels] = []  # one compiled pair, shared: graphs are per device and dtype


def _probe(kernels: FusedKernels, device: torch.device, dtype: torch.dtype) -> None:
    """Compiles and checks the kernels against the eager math; raises if off. The probe is as
    wide as a vocabulary shard (8192): with dynamic shapes, inductor sizes its reduction tiles from
    the first compile's sizes, so a tiny probe would tune the kernels for tiny rows."""
    gen = torch.Generator().manual_seed(0)
    compute = torch.promote_types(dtype, torch.float32)
    x = (torch.randn(5, 8192, generator=gen) * 3).to(dtype)
    x[1, 3] = float("-inf")  # a masked vocabulary column
    x = x.to(device)
    c = torch.full((), 1.7, dtype=compute, device=device)
    per_row = [(torch.randn(5, generator=gen)).to(compute).to(device) for _ in range(3)]
    keep = torch.tensor([True, True, False, True, True], device=device)
    eager = _eager_kernels()
    got = [*kernels.row_stats(x, c), kernels.row_grad(x, *per_row, keep, c)]
    want = [*eager.row_stats(x, c), eager.row_grad(x, *per_row, keep, c)]
    got.append(kernels.row_stats(x[:1], c)[1])  # the 1-row padding
    want.append(eager.row_stats(x[:1], c)[1])
    tol = 1e-12 if compute == torch.float64 else 1e-5
    for g, w in zip(got, want):
        if g.dtype != w.dtype or g.shape != w.shape:
            raise RuntimeError(f"compiled kernel returned {g.dtype} {tuple(g.shape)}")
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def select_kernels(
    mode, device: torch.device, dtype: torch.dtype, elements: int
) -> FusedKernels | None:
    """The compiled kernels to use for logits of ``dtype`` on ``device`` with ``elements``
    elements, or None for the eager chunked path. The one place where the path is decided.

    Args:
        mode: True, False, "auto" or None (the process default, :func:`default_mode`).
    """
    mode = default_mode() if mode is None else _parse_mode(mode)
    if mode is False or (mode == "auto" and elements < AUTO_MIN_ELEMENTS):
        return None
    key = (torch.device(device).type, dtype)
    kernels = _KERNELS.get(key)
    if kernels is None:
        try:
            if not _COMPILED:
                _COMPILED.append(_compiled_kernels())
            kernels = _COMPILED[0]
            import torch._inductor.config as inductor_config

            # The compile happens here, at the probe's first calls. Two small kernels per graph
            # gain nothing from a pool of compile workers, whose start-up costs seconds.
            with inductor_config.patch(compile_threads=1):
                _probe(kernels, torch.device(device), dtype)
        except Exception as error:  # compile unavailable, failed, or a wrong result
            kernels = error
            logger.warning(
                "megatron_tree: the compiled log-prob kernels are unavailable for %s on %s (%s: "
                "%s); using the eager chunked path (fused=False) from now on",
                dtype,
                key[0],
                type(error).__name__,
                str(error).strip().splitlines()[0] if str(error).strip() else "",
            )
        _KERNELS[key] = kernels
    if isinstance(kernels, BaseException):
        if mode is True:
            raise RuntimeError(
                f"fused=True, but the compiled log-prob kernels are unavailable for {dtype} on "
                f"{key[0]}: {kernels}"
            ) from kernels
        return None
    return kernels
