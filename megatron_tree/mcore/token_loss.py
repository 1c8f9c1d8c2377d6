"""The package's own head and loss for :func:`~megatron_tree.mcore.schedule.run_phases`: per-token
outputs read with :class:`~megatron_tree.core.heads.LogProbs` / ``Values``, and a per-token loss
weighted so that the step's loss is the unpacked global batch's.

Legend: T a micro-batch's sequence tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core.batch import MicroBatch, PackedTreeBatch
from ..core.checks import check_weights
from ..core.losses import loss_weights
from ..core.rows import TreeRows
from ..core.tree import PackedTree

LossFn = Callable[[dict, dict], torch.Tensor]


@dataclass(frozen=True)
class TreeHead:
    """:class:`~megatron_tree.mcore.schedule.Head` of a log-probs or values head (``gather``) over
    the vocabulary's TP group; the output's width is checked against the batch's largest token."""

    gather: object
    tp_group: dist.ProcessGroup | None
    max_token_id: int

    def __call__(self, output: torch.Tensor, tree: PackedTree, rows: TreeRows) -> dict:
        self.gather.check_output(output, self.tp_group, self.max_token_id)
        return self.gather.gather(output, tree, self.tp_group, rows)


@dataclass
class TokenLoss:
    """:class:`~megatron_tree.mcore.schedule.Loss`: ``loss_fn``'s per-token loss [T] times each
    token's weight, summed, times ``scale`` (Megatron's ``(loss, num_tokens, logs)``).

    Args:
        loss_fn: ``loss_fn(outputs, inputs) -> [T]``; None: no loss (forward only).
        weights, counts: per micro-batch, token weights float32 [T] and loss-token count.
        scale: the factor on every weighted loss sum (1 when Megatron divides by the count).
        report: whether this rank reports loss-token counts (CP rank 0: Megatron's sums over the
            CP group then count each token once).
        collect: keep each micro-batch's detached outputs in ``collected``.
    """

    loss_fn: LossFn | None
    weights: list[torch.Tensor]
    counts: list[float]
    scale: float
    report: bool = True
    collect: bool = False
    collected: dict[int, dict] = field(default_factory=dict)

    def __call__(self, index: int, mb: MicroBatch, outputs: dict, *, num_micro_batches: int):
        """Megatron's ``(loss, num_tokens, logs)`` of micro-batch ``index``.

        A token of weight 0 takes no part, whatever its inputs hold: ``loss_fn`` sees the
        floating-point per-token inputs [T, ...] set to 0 there, and its loss there is dropped
        before weighting, so a NaN or inf at such a token reaches neither the loss nor a gradient.
        """
        if self.collect:
            self.collected[index] = {k: v.detach() for k, v in outputs.items()}
        weights, count = self.weights[index], self.counts[index]
        device = next(iter(outputs.values())).device
        size = mb.tree.num_sequence_tokens
        keep = weights != 0
        if self.loss_fn is None:
            per_token = torch.zeros(size, device=device)
        else:
            per_token = self.loss_fn(outputs, _masked_inputs(mb, keep, size))
            _check_per_token(per_token, size, outputs)
        total = (torch.where(keep, per_token.float(), 0.0) * weights).sum()
        reported = round(count) if self.report else 0
        # Filled on the device (torch.tensor(x, device=cuda) would copy from the host and wait).
        num_tokens = torch.full((), reported, dtype=torch.int, device=total.device)
        pair = torch.stack(
            [total.detach().double(), torch.full((), count, dtype=torch.float64, device=device)]
        )
        return total * self.scale, num_tokens, {"loss": pair}


def _masked_inputs(mb: MicroBatch, keep: torch.Tensor, size: int) -> dict:
    return {
        k: torch.where(keep.view(-1, *(1,) * (v.dim() - 1)), v, 0)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() and v.shape[0] == size
        else v
        for k, v in mb.loss_inputs().items()
    }


def _check_per_token(per_token, size: int, outputs: dict) -> None:
    if not isinstance(per_token, torch.Tensor) or per_token.shape != (size,):
        shape = tuple(per_token.shape) if isinstance(per_token, torch.Tensor) else per_token
        raise ValueError(
            f"loss_fn must return a per-token loss of shape [{size}] (the micro-batch's sequence "
            f"tokens), got {shape}"
        )
    trains = torch.is_grad_enabled() and any(v.requires_grad for v in outputs.values())
    if trains and not per_token.requires_grad:
        raise ValueError(
            "loss_fn returned a tensor without a gradient (detached, or computed under "
            "torch.no_grad / from .item()), so this step would train nothing: build the loss "
            "from outputs[...] with torch operations"
        )


def step_weights(packed: PackedTreeBatch, gather, normalization: str, dp_group):
    """Per micro-batch (weights float32 [T], loss-token count) and the global count (all DP ranks).

    Each micro-batch's ``loss_mask`` must be [T], finite and >= 0 (checked here, on the host, one
    reduction per micro-batch: a negative entry can cancel the count, a NaN would reach it)."""
    weights, counts = [], []
    for i, mb in enumerate(packed):
        tree = mb.tree
        mask = mb.inputs.get("loss_mask")
        mask = gather.default_loss_mask(tree) if mask is None else mask
        if mask.shape != (tree.num_sequence_tokens,):
            raise ValueError(
                f"loss_mask of micro-batch {i} must be [{tree.num_sequence_tokens}] (one weight "
                f"per token: [B, L] in the padded batch), got {tuple(mask.shape)}; squeeze a "
                "trailing dim"
            )
        check_weights(f"loss_mask (micro-batch {i})", mask)
        if (
            gather.rolled
            and tree.num_sequences
            and bool((mask[tree.cu_seqlens[1:] - 1] != 0).any())
        ):
            raise ValueError(
                "loss_mask is nonzero at a sequence's last entry, which predicts no token "
                "(log-prob entries are rolled: entry t is about token t + 1). Roll the mask too: "
                "loss_mask[:, :-1] = response_mask[:, 1:], with the last entry 0"
            )
        w, count = loss_weights(mask, tree.cu_seqlens, normalization=normalization)
        weights.append(w)
        counts.append(float(count))
    total = torch.tensor([sum(counts)], dtype=torch.float64)
    if dp_group is not None:
        total = total.to("cuda" if dist.get_backend(dp_group) == "nccl" else "cpu")
        dist.all_reduce(total, group=dp_group)
    return weights, counts, float(total[0])


def loss_scale(config, counts, total, forward_only, averaged_over) -> float:
    """What the step multiplies each micro-batch's loss sum by (1 when Megatron divides)."""
    finalize = config.finalize_model_grads_func is not None
    if not forward_only and finalize and not config.calculate_per_token_loss:
        raise ValueError(
            "trees hold different numbers of tokens, so Megatron's per-micro-batch loss mean would "
            "weight tokens unequally; set config.calculate_per_token_loss=True (Megatron DDP then "
            "sums gradients and finalize_model_grads divides them by the global token count)"
        )
    if config.calculate_per_token_loss and finalize:
        if any(c != round(c) for c in counts):
            raise ValueError(
                "Megatron counts loss tokens as integers, but the loss mask gives fractional "
                "counts; use a 0/1 loss_mask (with normalization='token') or run without "
                "finalize_model_grads_func"
            )
        return 1.0
    # The caller's reduction averages over these groups (data x context parallel under Megatron
    # DDP); each CP rank's gradient is its rows' share of the whole loss's, so the shares must add.
    ranks = math.prod(dist.get_world_size(g) for g in averaged_over if g is not None)
    return ranks / max(total, 1e-30)


def check_loss_fn(loss_fn: LossFn | None, gather, mb: MicroBatch) -> None:
    """Run ``loss_fn`` once on zero outputs of micro-batch ``mb`` before any forward, so that a
    loss reading an output the head does not give fails now, naming both."""
    if loss_fn is None:
        return
    size = mb.tree.num_sequence_tokens
    device = mb.tree.token_index.device
    outputs = {name: torch.zeros(size, device=device) for name in gather.outputs}
    try:
        with torch.no_grad():
            loss_fn(outputs, mb.loss_inputs())
    except KeyError as error:
        if error.args and error.args[0] in mb.loss_inputs():
            raise
        heads = {"values": "gather=Values()", "entropy": "gather=LogProbs(entropy=True)"}
        fix = heads.get(error.args[0], "a head that gives it")
        raise ValueError(
            f"loss_fn reads outputs[{error.args[0]!r}], which gather={gather!r} does not give (it "
            f"gives {list(gather.outputs)}): pass {fix}"
        ) from None
