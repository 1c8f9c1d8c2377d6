"""One tree-packed PPO/GRPO (actor) or value (critic) step through Megatron's pipeline schedule.

The caller passes a padded batch and a per-token loss; the step packs the batch into trees, runs
every tree through ``get_forward_backward_func()`` (so pipeline parallelism works), gathers
per-sequence log-probs / entropy (vocab-parallel over ``tp_group``) or values, and weights each
token so that the result equals the loss of the unpacked batch: the same per-token loss, the same
normalization. Gradients accumulate in the model's parameters (``.grad`` or Megatron DDP's
``main_grad``); the optimizer step stays the caller's.

Legend: B batch size, L padded length, N packed tree length, T tokens of a tree's sequences.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .logprobs import (
    gather_packed_tree_logprobs_entropy,
    gather_packed_tree_values,
    merge_packed_tree_results,
)
from .packing import build_packed_tree_batch

logger = logging.getLogger(__name__)

LossFn = Callable[[dict, dict], torch.Tensor]
_WEIGHT = "_loss_weight"
_NORMALIZATIONS = ("token", "sequence")


@dataclass
class TreeStepResult:
    """What one step did.

    ``loss`` is this rank's share of the global batch loss (the shares of all data-parallel ranks
    add up to it); None on pipeline stages other than the last. ``outputs`` (with
    ``collect_outputs=True``, last stage only): ``logprobs`` and ``entropy`` (actor) or ``values``
    (critic), detached, merged back to the batch layout [B, L] (rolled for log-probs, 0 past each
    sequence).
    """

    loss: torch.Tensor | None
    num_sequences: int
    num_micro_batches: int
    num_dummy_trees: int
    real_tokens: int
    tree_tokens: int
    padded_tokens: int
    tree_token_ratio: float
    seconds: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] | None = None

    def log_line(self) -> str:
        times = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in self.seconds.items())
        loss = "n/a" if self.loss is None else f"{float(self.loss):.6f}"
        return (
            f"tree step: loss={loss} sequences={self.num_sequences} trees={self.num_micro_batches} "
            f"(dummy {self.num_dummy_trees}) tokens real={self.real_tokens} tree={self.tree_tokens} "
            f"padded={self.padded_tokens} tree_token_ratio={self.tree_token_ratio:.4f} {times}"
        )


def loss_weights(
    loss_mask: torch.Tensor, *, normalization: str = "token", dp_group=None, dp_grad_average: bool = True
) -> torch.Tensor:
    """Per-token weights [B, L] such that ``sum(weight * per_token_loss)`` is the batch loss.

    ``"token"``: mean over every unmasked token of the global batch (all data-parallel ranks).
    ``"sequence"``: mean over the sequences that have loss tokens (a nonzero mask) of each one's
    token mean; sequences with an all-zero mask take no part. With ``dp_group`` and
    ``dp_grad_average`` (Megatron DDP averages gradients over data-parallel ranks) the weights are
    scaled by the DP size so the averaged gradient is the global loss's.
    """
    if normalization not in _NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} must be one of {_NORMALIZATIONS}")
    mask = loss_mask.to(torch.float64)
    if normalization == "token":
        total = mask.sum()
    else:
        per_seq = mask.sum(dim=1, keepdim=True)
        has_loss = per_seq != 0
        mask = mask / torch.where(has_loss, per_seq, torch.ones_like(per_seq))
        total = has_loss.sum().to(torch.float64)
    scale = 1.0
    if dp_group is not None:
        device = "cuda" if dist.get_backend(dp_group) == "nccl" else "cpu"
        reduced = total.reshape(1).to(device)
        dist.all_reduce(reduced, group=dp_group)
        total = reduced.to(mask.device)[0]
        if dp_grad_average:
            scale = dist.get_world_size(dp_group)
    return (mask * scale / total.clamp(min=1e-30)).to(torch.float32)


def ppo_clipped_loss(
    outputs: dict, micro_batch: dict, *, clip_eps: float = 0.2, entropy_coef: float = 0.0
) -> torch.Tensor:
    """PPO/GRPO clipped surrogate per token [T] (a shipped example of ``loss_fn``).

    Reads ``outputs["logprobs"]`` / ``outputs["entropy"]`` and the micro-batch's packed
    ``old_logprobs`` and ``advantages`` [T], all in the rolled convention (entry t is about token
    t + 1).
    """
    ratio = torch.exp(outputs["logprobs"] - micro_batch["old_logprobs"])
    adv = micro_batch["advantages"]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    loss = -surrogate
    if entropy_coef:
        loss = loss - entropy_coef * outputs["entropy"]
    return loss


def value_loss(outputs: dict, micro_batch: dict) -> torch.Tensor:
    """Squared error of the critic's values against ``returns`` per token [T] (halved)."""
    return 0.5 * (outputs["values"] - micro_batch["returns"]) ** 2


def tree_forward_backward(
    model,
    batch: dict[str, torch.Tensor],
    loss_fn: LossFn | None,
    *,
    max_tokens_per_mb: int,
    critic: bool = False,
    normalization: str = "token",
    temperature: float = 1.0,
    tp_group=None,
    dp_group=None,
    dp_grad_average: bool = True,
    forward_only: bool = False,
    block_size: int = 128,
    parallel_size: int = 1,
    pad_to_max: bool | None = None,
    share_prefixes: bool = True,
    collect_outputs: bool = False,
) -> TreeStepResult:
    """Pack ``batch`` into trees and run forward (and backward) through Megatron's schedule.

    Args:
        model: a Megatron model (or a one-element list of it) built with tree attention and
            depth RoPE (``TreeGPTModel`` with ``tree_attention_spec``, or mbridge under
            ``patch_bridge_for_tree_training``). Actor: its last stage returns vocab-parallel logits
            [1, N, V/tp]. Critic: values [1, N] or [1, N, 1].
        batch: right-padded ``input_ids`` / ``attention_mask`` [B, L], ``loss_mask`` [B, L] (rolled:
            entry t weights the loss about token t + 1; defaults to every entry except each
            sequence's last for the actor, every token for the critic) and the tensors ``loss_fn``
            reads ([B, L], e.g. ``old_logprobs``, ``advantages``, ``returns``).
        loss_fn: ``loss_fn(outputs, micro_batch) -> [T]`` per-token loss. ``outputs`` holds
            ``logprobs`` and ``entropy`` (actor) or ``values`` (critic), each [T]; ``micro_batch``
            holds the packed batch tensors [T] (sequences concatenated in tree order). None with
            ``forward_only=True`` computes outputs only (loss 0).
        max_tokens_per_mb, block_size, parallel_size, pad_to_max: packing (see
            ``build_packed_tree_batch``); ``pad_to_max`` defaults to True under pipeline parallelism
            (constant shapes), else False.
        share_prefixes: False packs without sharing (the unshared baseline, same kernels).
        critic: run a value model instead of an actor.
        normalization: ``"token"`` (mean over all loss tokens) or ``"sequence"`` (mean of the
            per-sequence means of the sequences with loss tokens), over the global batch; see
            :func:`loss_weights`.
        temperature: divides the logits before the softmax (actor).
        tp_group: tensor-parallel group the logits' vocabulary is sharded over.
        dp_group: data-parallel group: trees are equalized across it and the normalization is global.
        dp_grad_average: the gradient reduction averages over DP ranks (Megatron DDP's default).
        forward_only: no backward (evaluation / log-prob computation).
        collect_outputs: return the per-token outputs in the batch layout (e.g. old or reference
            log-probs from a ``forward_only`` pass).

    Returns:
        :class:`TreeStepResult`; the loss equals the unpacked batch's loss.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if loss_fn is None and not forward_only:
        raise ValueError("loss_fn is required for a training step; pass loss_fn or forward_only=True")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    virtual_pp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if (isinstance(model, list) and len(model) > 1) or virtual_pp > 1:
        raise ValueError(
            "tree_forward_backward does not support virtual pipeline parallelism (interleaved "
            "schedule); pass one model chunk per pipeline stage"
        )

    if pad_to_max is None:
        pad_to_max = pp_size > 1
    if pp_size > 1 and not pad_to_max:
        raise ValueError(
            "pad_to_max=False gives trees of different lengths, which pipeline parallelism cannot "
            "send between stages; use pad_to_max=True (the default under pipeline parallelism)"
        )
    if "loss_mask" in batch:
        loss_mask = batch["loss_mask"]
    else:
        loss_mask = batch["attention_mask"].to(torch.float32)
        if not critic:  # the last token of a sequence predicts nothing
            lengths = batch["attention_mask"].sum(dim=1)
            positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
            loss_mask = loss_mask * (positions[None] < (lengths - 1)[:, None])
    data = dict(batch)
    data[_WEIGHT] = loss_weights(
        loss_mask * batch["attention_mask"], normalization=normalization, dp_group=dp_group,
        dp_grad_average=dp_grad_average,
    )
    packed = build_packed_tree_batch(
        data, max_tokens_per_mb=max_tokens_per_mb, block_size=block_size,
        parallel_size=parallel_size, pad_to_max=pad_to_max, dp_group=dp_group,
        share_prefixes=share_prefixes,
    )
    timings["pack"] = time.perf_counter() - t0
    num_mb = len(packed)
    padded_lengths = {mb["tree"].padded_length for mb in packed}
    device = _model_device(model)
    collected: list[tuple[dict, object]] = []

    def forward_step(data_iterator, model_chunk):
        mb = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in next(data_iterator).items()}
        tree = mb["tree"].to(device)
        output = model_chunk(mb["input_ids"], mb["position_ids"], attention_mask=tree.subtree_end)

        def loss_func(output_tensor):
            if critic:
                outputs = {"values": gather_packed_tree_values(output_tensor.float(), tree)}
            else:
                logprobs, entropy = gather_packed_tree_logprobs_entropy(
                    output_tensor, tree, temperature=temperature, tp_group=tp_group
                )
                outputs = {"logprobs": logprobs, "entropy": entropy}
            if collect_outputs:
                collected.append(({k: v.detach() for k, v in outputs.items()}, tree))
            if loss_fn is None:
                per_token = torch.zeros(tree.num_sequence_tokens, device=device)
            else:
                per_token = loss_fn(outputs, mb)
            if per_token.shape != (tree.num_sequence_tokens,):
                raise ValueError(
                    f"loss_fn must return a per-token loss of shape [{tree.num_sequence_tokens}] "
                    f"(the micro-batch's sequence tokens), got {tuple(per_token.shape)}"
                )
            loss = (per_token.float() * mb[_WEIGHT]).sum()
            # The schedule divides a (loss, logs) result by the number of micro-batches.
            return loss * num_mb, {"loss": loss.detach()}

        return output, loss_func

    t1 = time.perf_counter()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(packed),
        model=model if isinstance(model, list) else [model],
        num_microbatches=num_mb,
        seq_length=max(padded_lengths),
        micro_batch_size=1,
        forward_only=forward_only,
    )
    timings["forward_backward" if not forward_only else "forward"] = time.perf_counter() - t1
    loss = None
    if losses:
        loss = torch.stack([d["loss"] for d in losses]).sum()
        if dp_group is not None and dp_grad_average:  # undo the gradient-averaging scale
            loss = loss / dist.get_world_size(dp_group)
    merged = None
    if collect_outputs and collected:
        width = batch["input_ids"].shape[1]
        merged = {
            name: merge_packed_tree_results(
                [(out[name], tree) for out, tree in collected], packed.batch_size, max_seq_len=width
            )
            for name in collected[0][0]
        }
    result = TreeStepResult(
        loss=loss,
        num_sequences=packed.batch_size,
        num_micro_batches=num_mb,
        num_dummy_trees=packed.num_dummy_trees,
        real_tokens=packed.num_real_tokens,
        tree_tokens=packed.num_tree_tokens,
        padded_tokens=packed.num_padded_tokens,
        tree_token_ratio=packed.tree_token_ratio,
        seconds=timings,
        outputs=merged,
    )
    logger.info(result.log_line())
    return result


def _model_device(model) -> torch.device:
    chunk = model[0] if isinstance(model, list) else model
    return next(chunk.parameters()).device
