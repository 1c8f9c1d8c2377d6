"""The tolerances of the test suite, each justified once here; tests import them.

Every comparison in the suite is of two computations that are equal in exact arithmetic: a tree
(packed, shared prefixes) against each sequence alone, one parallel layout against another, a kernel
against a brute force. What separates them is rounding in another summation order (other matmul
shapes, padded or masked key sets, partial sums merged across ranks), so each bar is a small
multiple of the measured rounding, and far below what a real bug moves (a wrong mask, rotary angle,
route or normalization moves log-probs by >= 1e-3 and gradients by >= 1e-3 relative, mostly much
more). Change a bar only with a measurement, and write it down here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

# ------------------------------------------------------------------------------------- float64
# Kernels in float64 (tree attention backends, the recurrent scans, log-softmax and entropy)
# against a float64 brute force: only summation order differs, ~1e-15 on these O(1) values; 1e-12
# leaves three digits of margin, and any error in the math is orders of magnitude larger.
FP64_TOL = 1e-12
# A whole float64 model (the gated delta-net hybrids): the tree against each sequence alone through
# the same model differs by rounding only (5e-14 measured); above FP64_TOL because a model chains
# many more roundings than one kernel.
FP64_MODEL_TOL = 1e-10

# ------------------------------------------------------------------------- fp32 on CPU, models
# Per-token outputs (log-probs, entropies, values) of small fp32 models on the CPU: tree vs unpacked
# Megatron, vs HF on one sequence (fused QKV and packed rows vs separate projections), vs verl's
# micro-batches, across TP / CP / EP layouts. The summation order differs, which moves them by
# <= 3e-6 on these 2-4 layer models (measured: ~1e-6 dense, ~2e-6 MoE, MLA and verl, <= 3e-6
# bridges and frontier families); 1e-5 keeps a margin while a wrong rotary angle or a leaked key
# (>= 1e-3) fails.
LOGP_TOL = 1e-5
# The gated delta-net hybrids against HF fp32: HF's own log-probs move by up to 7.6e-6 between its
# fp32 and fp64 runs (its gated delta rule, rotary table and softmax stay fp32 even in a float64
# model), and Megatron sums in other orders; measured 4.8e-6 .. 1.24e-5 over the three families.
HF_HYBRID_LOGP_TOL = 2e-5
# A pretrained fp32 model at full depth (SmolLM2-135M-Instruct: 30 layers, vocabulary 49,152,
# peaked distributions with log-probs down to about -23): HF's own fp32 log-probs differ from its
# fp64 run by up to 3.4e-5 on one chat sequence, so the 2-4 layer bar does not hold. Measured on the
# main job's batches (715 and 3,633 tokens): tree vs HF 2.0e-5 / 2.9e-5 (the unshared Megatron run
# vs HF 1.7e-5 / 1.7e-5), tree vs unshared over every token 1.2e-5 / 4.8e-5. 2e-4 is 4x the worst
# and still 5x under what a bug moves (>= 1e-3).
PRETRAINED_LOGP_TOL = 2e-4
# Token-mean losses (and logged router losses), relative: one scalar summed over every token in
# another order, ~1e-7 relative; a token counted once instead of k times moves it by >= 1e-3.
LOSS_RTOL = 1e-5
# Parameter gradients, ``|got - want| / |want|`` per parameter: gradients sum over many tokens and
# sequences, so the fp32 reordering error relative to each gradient's norm is ~1e-6 (dense, MoE,
# SP/CP/PP splits alike); a lost trunk or expert gradient, a doubled TP reduction or a wrong
# normalization moves a gradient by >= 1e-2 relative (a key just outside a window: >= 1e-3).
GRAD_RTOL = 1e-4
# Parameters after one AdamW step (per parameter, relative), two runs from equal parameters whose
# gradients agree to rounding: AdamW's first step moves each element by lr * g / (|g| + eps), so
# they part only where rounding reaches a gradient at eps's scale; measured 9e-8 .. 1.3e-6 over
# three batches (FSDP2 vs plain HF, lr 1e-3, tests/test_fsdp2.py). A step on another rank's shard
# or on stale gradients moves them by ~lr / |element| ~ 1e-2. (Adam's first step ignores a
# gradient's scale: the GRAD_RTOL check catches that.)
OPTIMIZER_STEP_RTOL = 1e-5

# ------------------------------------------------------------------------ fp32 on CPU, kernels
# Fused fp32 log-softmax / entropy vs the float64 reference: fp32 rounds x - max (|x - max| < 8 for
# the randn logits, ulp 9.5e-7 at 8, so <= 4.8e-7) and log(sum) (ulp ~5e-7 at 4-8); over 60 cases
# naive torch.log_softmax errs by up to 7.5e-7 on log-probs and 1.05e-6 on entropy, the fused
# kernel by 7.5e-7 and 5.3e-7. 1e-6 is the bar.
FP32_LOGSOFTMAX_TOL = 1e-6
# The same at a realistic vocabulary (V = 32000, logits ~ 2 randn / 0.8): the entropy (~10) sums
# V terms in fp32, so its rounding grows like sqrt(V) ulp (sqrt(32000) * 2^-24 * 10 ~ 1e-4 for a
# naive sequential sum; blocked and per-lane sums do better). Measured against fp64 over seeds 1-5:
# eager <= 1.6e-6 / 1.1e-6 (log-prob / entropy); the compiled kernel <= 1.6e-6 / 5.1e-6, and its
# summation order follows the CPU's vector width, so it moves between machines. 2e-5 is 4x the worst
# measured; a wrong shift, scale or missing vocabulary term moves either by >= 1e-3.
FP32_VOCAB_LOGSOFTMAX_TOL = 2e-5
# The same across tensor-parallel vocab shards: TP only changes how the per-shard partial sums are
# merged, a few ulp of |logprob| < 8 (ulp 4.8e-7).
FP32_TP_LOGSOFTMAX_TOL = 2e-6
# fp32 attention of unit-scale inputs with 16-dim heads, a context-parallel rank's rows against fp32
# brute force over the whole tree (144 keys): rounding only, <= 3.6e-7 measured over every backend
# and split. backend="triton" in Triton's interpreter against fp64 (outputs and the gradients of a
# unit-scale output gradient, <= 128 keys, windows, sinks, GQA, MLA dims, CP and trunk rows): <=
# 5.1e-7 forward and 1.8e-6 gradients measured (a gradient sums over a key's every query and a
# group's every head); a key off by one tile moves them by >= 0.3.
FP32_ATTN_TOL = 1e-5

# ------------------------------------------------------------------------------------ CUDA
# fp32 without TF32 on the GPU, bridged models vs HF fp32 on the CPU: summation order only, ~1e-6 on
# log-probs of these models; a bug is >= 1e-3.
GPU_FP32_LOGP_TOL = 1e-4
# fp32 flex kernel outputs and gradients vs fp64: rounding of sums over at most N = 256 keys, ~1e-6
# (block_sparse on CPU: <= 3e-6); a masking or scaling bug is O(1e-1).
GPU_FP32_KERNEL_TOL = 1e-4
# bf16: the tree rounds like the same bf16 computation on each sequence alone (the bf16 brute force,
# the unpacked bf16 model), only in another summation order, so its error against the fp32 / fp64
# reference is of the same size; 2x that error leaves room for the different rounding while a
# systematic error (leaked key, wrong rotary angle) adds to it. Small bugs are the fp32 bars' job.
BF16_FACTOR = 2.0


# ------------------------------------------------------------------------ NaN-safe error measures
# A parity check must fail on NaN. Python drops NaN where tensors keep it: ``max(0.0, nan)`` is 0.0
# and ``max([1e-6, nan])`` is 1e-6 (only a NaN in the first place survives), and ``not err > tol``
# holds for a NaN ``err``. So each measure below reads any NaN or infinity in its inputs as an
# infinite error: ``inf`` survives Python's ``max()`` and fails every ``<= tol``.


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|got - want|`` over the elements, as a float; ``inf`` if either holds a NaN or inf.

    Args:
        got, want: tensors of one shape (or shapes that broadcast, as ``got - want`` does).

    Returns:
        ``float((got - want).abs().max())`` when both are finite, else ``math.inf``.
    """
    got, want = torch.as_tensor(got).detach(), torch.as_tensor(want).detach()
    diff = got - want
    if diff.numel() == 0:
        raise ValueError(
            f"max_abs_error: got {tuple(got.shape)} and want {tuple(want.shape)} hold no elements; "
            "compare the tensors that carry the values"
        )
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.inf
    return float(diff.abs().max())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, fp32), as a float; ``inf`` if either holds a NaN
    or inf. A zero ``want`` divides by 1e-30, so any nonzero ``got`` fails."""
    got, want = torch.as_tensor(got).detach().float(), torch.as_tensor(want).detach().float()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.inf
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def worst_error(errors: Iterable[float]) -> float:
    """The largest of ``errors`` (floats, or one-element tensors), ``inf`` if any is NaN or inf;
    Python's ``max()`` would drop a NaN. Raises ``ValueError`` on no errors (nothing compared)."""
    values = [float(e) for e in errors]
    if not values:
        raise ValueError("worst_error: no errors given; a parity check must compare something")
    if not all(math.isfinite(v) for v in values):
        return math.inf
    return max(values)
