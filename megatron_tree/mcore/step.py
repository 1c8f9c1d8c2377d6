"""One tree-packed forward (and backward) through Megatron's pipeline schedule, loss as if unpacked.

Pack a rollout batch once, then step on it as often as the RL loop needs::

    packed = build_packed_tree_batch(batch, max_tokens_per_mb=16384)
    old = tree_forward_backward(model, packed, None, forward_only=True, collect_outputs=True)
    packed.attach("old_logprobs", old.tree_outputs["logprobs"])       # tree layout, no [B, L]
    for epoch in range(ppo_epochs):
        tree_forward_backward(model, packed, ppo_clipped_loss)

The step runs every tree through ``get_forward_backward_func()`` (pipeline parallelism included),
reads per-token outputs with a head (:class:`~megatron_tree.core.heads.LogProbs` or
:class:`~megatron_tree.core.heads.Values`) and weights every token so that the result is the loss of
the unpacked global batch. Its loss function speaks Megatron's protocol: ``(loss, num_tokens,
logs)``, with Megatron's per-token mode (``calculate_per_token_loss``), because trees hold
different numbers of tokens and a mean per micro-batch would weight tokens unequally.

Legend: B batch size, L padded length, N packed tree length, T tokens of a tree's sequences.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from ..core.batch import PackedTreeBatch, micro_batch
from ..core.checks import check_bool, check_weights
from ..core.context_parallel import context_parallel_split
from ..core.heads import LogProbs, Values
from ..core.losses import loss_weights
from ..core.packing import build_packed_tree_batch
from ..core.results import merge_packed_tree_results
from .moe import RoutingReplay, router_losses_on, step_loss_scale
from .moe_stats import ExpertTokenCounter
from .runner import MicroBatchInputs, StepRunner, plain_forward_step
from .spec import check_tree_model
from .trunk_step import check_trunk_parts, run_trunks_scheduled, run_with_trunks

logger = logging.getLogger(__name__)

LossFn = Callable[[dict, dict], torch.Tensor]


@dataclass
class TreeStepResult:
    """What one step did.

    ``loss`` is this rank's share of the global batch loss (the shares of all data-parallel ranks
    add up to it); None on pipeline stages other than the last. ``tree_outputs`` (with
    ``collect_outputs=True``, last stage only): each head output (``logprobs``, ``entropy`` or
    ``values``) as one detached [T] tensor per micro-batch of ``packed``, ready for
    ``packed.attach``; :meth:`merged_outputs` turns them into [B, L]. ``expert_tokens`` (with
    ``moe_stats=True``): int64 [E], tokens this rank routed to each expert, summed over its layers.
    """

    loss: torch.Tensor | None
    packed: PackedTreeBatch
    seconds: dict[str, float] = field(default_factory=dict)
    tree_outputs: dict[str, list[torch.Tensor]] | None = None
    expert_tokens: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.packed.batch_size

    @property
    def num_micro_batches(self) -> int:
        return len(self.packed)

    @property
    def tree_token_ratio(self) -> float:
        return self.packed.tree_token_ratio

    def merged_outputs(self, max_seq_len: int | None = None) -> dict[str, torch.Tensor]:
        """``tree_outputs`` in the layout the batch was given in (rolled for log-probs: entry t is
        token t + 1's, the last is 0): [B, L] for a padded batch (0 past each sequence); for a
        ragged one its own layout (a list of [L_b], a nested tensor or THD [T],
        :mod:`megatron_tree.core.ragged`)."""
        if self.tree_outputs is None:
            raise ValueError(
                "no outputs were collected: pass collect_outputs=True (last pipeline stage)"
            )
        layout = self.packed.input_layout
        return {
            name: layout.restore(
                merge_packed_tree_results(
                    list(zip(values, self.packed.trees)),
                    self.packed.batch_size,
                    max_seq_len=max_seq_len,
                )
            )
            for name, values in self.tree_outputs.items()
        }

    def _trunk_summary(self) -> str:
        parts = [mb["rows"] for mb in self.packed if mb["rows"].group is not None]
        if not parts:
            return ""
        trunks = [p.num_real for p in parts if p.is_trunk]
        return f" trunks={len(trunks)} (tokens {sum(trunks)}) branches={len(parts) - len(trunks)}"

    def _kernel_summary(self) -> str:
        """How many micro-batches share nothing (each sequence a chain): their attention runs the
        dense causal kernel rather than a tree kernel (see :mod:`megatron_tree.core.attention`)."""
        chains = sum(mb["rows"].chains is not None for mb in self.packed)
        return f" causal_micro_batches={chains}" if chains else ""

    def log_line(self) -> str:
        p = self.packed
        times = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in self.seconds.items())
        loss = "n/a" if self.loss is None else f"{float(self.loss):.6f}"
        return (
            f"tree step: loss={loss} sequences={p.batch_size} trees={len(p)} (dummy "
            f"{p.num_dummy_trees}) tokens real={p.num_real_tokens} tree={p.num_tree_tokens} "
            f"padded={p.num_padded_tokens} "
            f"tree_token_ratio={p.tree_token_ratio:.4f}{self._trunk_summary()}"
            f"{self._kernel_summary()} {times}"
            + (
                ""
                if self.expert_tokens is None
                else f" expert_tokens={self.expert_tokens.tolist()}"
            )
        )


def _unwrap(model):
    while not hasattr(model, "vocab_size") and hasattr(model, "module"):  # Float16Module, DDP
        model = model.module
    return model


def _as_packed(batch, packing: dict, dp_group, pp_size: int, align: int) -> PackedTreeBatch:
    """The packed batch to step on: ``batch`` itself, or ``batch`` packed with ``packing``.

    ``align``: the factor every packed length needs (context-parallel size, times the
    tensor-parallel size under sequence parallelism).
    """
    if isinstance(batch, PackedTreeBatch):
        given = sorted(k for k, v in packing.items() if v is not None)
        if given:
            raise ValueError(
                f"{given} apply to packing a padded batch, but this batch is already packed; pass "
                "them to build_packed_tree_batch instead"
            )
        if pp_size > 1 and len({mb["rows"].num_rows for mb in batch}) > 1:
            raise ValueError(
                "the packed batch has trees of different lengths, which pipeline parallelism "
                "cannot send between stages; pack with pad_to_max=True"
            )
        bad = [mb["rows"].num_rows for mb in batch if mb["rows"].num_rows % align]
        if bad:
            raise ValueError(
                f"packed lengths {bad[:4]} are not multiples of {align} (the context-parallel "
                "size, times the tensor-parallel size under sequence parallelism); pack with "
                f"parallel_size={align}"
            )
        return batch
    if packing["max_tokens_per_mb"] is None:
        raise ValueError(
            "max_tokens_per_mb is required to pack a padded batch (or pass a PackedTreeBatch)"
        )
    pad_to_max = pp_size > 1 if packing["pad_to_max"] is None else packing["pad_to_max"]
    if pp_size > 1 and not pad_to_max:
        raise ValueError(
            "pad_to_max=False gives trees of different lengths, which pipeline parallelism cannot "
            "send between stages; use pad_to_max=True (the default under pipeline parallelism)"
        )
    kwargs = {k: v for k, v in packing.items() if v is not None and k != "pad_to_max"}
    kwargs["parallel_size"] = math.lcm(kwargs.get("parallel_size", 1), align)
    return build_packed_tree_batch(batch, pad_to_max=pad_to_max, dp_group=dp_group, **kwargs)


def _check_expert_parallel(config, dp_group, packing: dict, prepacked: bool) -> None:
    """Expert parallelism exchanges tokens between data-parallel ranks in every micro-batch: they
    must run as many trees (and, with the allgather dispatcher, trees of one length)."""
    ep = parallel_state.get_expert_model_parallel_world_size() if config.num_moe_experts else 1
    if ep <= 1:
        return
    if dp_group is None:
        raise ValueError(
            f"expert_model_parallel_size={ep}: expert-parallel ranks are data-parallel ranks and "
            "must run the same number of trees; pass "
            "dp_group=parallel_state.get_data_parallel_group()"
        )
    if config.moe_token_dispatcher_type != "allgather" or prepacked:
        return  # a pre-packed batch: pack it with pad_to_max=True for this dispatcher
    if packing["pad_to_max"] is None:
        packing["pad_to_max"] = True
    elif not packing["pad_to_max"]:
        raise ValueError(
            "the allgather token dispatcher gathers equal-length token blocks from the "
            "expert-parallel ranks: use pad_to_max=True (or the alltoall dispatcher)"
        )


def _context_parallel_group(config, cp_group):
    """The CP group of the step (None without context parallelism), checked against the model."""
    if cp_group is None and config.context_parallel_size > 1:
        cp_group = parallel_state.get_context_parallel_group()
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size != config.context_parallel_size:
        raise ValueError(
            f"the model was built with context_parallel_size={config.context_parallel_size} but "
            f"cp_group has {size} ranks; pass the model's context-parallel group (or None)"
        )
    return cp_group if size > 1 else None


def _step_weights(
    packed: PackedTreeBatch, gather, normalization: str, dp_group
) -> tuple[list, list, float]:
    """Per micro-batch (weights float32 [T], loss-token count) and the global count (all DP ranks).

    Each micro-batch's ``loss_mask`` must be [T], finite and >= 0 (checked here, on the host, one
    reduction per micro-batch: a negative entry can cancel the count, a NaN would reach it)."""

    weights, counts = [], []
    for i, mb in enumerate(packed):
        tree = mb["tree"]
        mask = mb["loss_mask"] if "loss_mask" in mb else gather.default_loss_mask(tree)
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


@contextlib.contextmanager
def _schedule_mode(config, interleaved: bool):
    """Megatron's schedule in per-token mode (it does not divide the loss by tokens or
    micro-batches), and, for the interleaved schedule on gloo, unbatched p2p: with PP = 2 both
    pipeline neighbours are the same rank, and Megatron's batched p2p posts (send prev, send next)
    against (recv prev, recv next), which gloo matches in posting order, silently swapping the
    activations and the gradients it exchanges."""
    saved = config.calculate_per_token_loss, config.batch_p2p_comm
    config.calculate_per_token_loss = True
    if (
        interleaved
        and dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) == "gloo"
    ):
        config.batch_p2p_comm = False
    try:
        yield
    finally:
        config.calculate_per_token_loss, config.batch_p2p_comm = saved


def tree_forward_backward(
    model,
    batch: PackedTreeBatch | dict[str, torch.Tensor],
    loss_fn: LossFn | None,
    *,
    gather: LogProbs | Values = LogProbs(),  # noqa: B008 (frozen, immutable)
    normalization: str = "token",
    tp_group=None,
    dp_group=None,
    cp_group=None,
    dp_grad_average: bool = True,
    forward_only: bool = False,
    collect_outputs: bool = False,
    max_tokens_per_mb: int | None = None,
    block_size: int | None = None,
    parallel_size: int | None = None,
    pad_to_max: bool | None = None,
    share_prefixes: bool | None = None,
    share_trunks: bool | None = None,
    route_key: str | None = None,
    moe_stats: bool = False,
    recompute_trunks: bool | None = None,
) -> TreeStepResult:
    """Run a packed batch forward (and backward) through Megatron's schedule.

    Args:
        model: a Megatron model built with tree attention and depth RoPE (``TreeGPTModel`` with
            ``tree_attention_spec``, or a bridge under ``patch_bridge_for_tree_training``), or the
            list of its model chunks under virtual (interleaved) pipeline parallelism. Its last
            stage returns vocab-parallel logits [1, N, V/tp] (for :class:`LogProbs`) or values
            [1, N, 1] (for :class:`Values`); N is this rank's rows under context parallelism.
        batch: a :class:`PackedTreeBatch` (pack once, step many), or a right-padded dict
            (``input_ids`` / ``attention_mask`` [B, L] and per-token tensors [B, L]) that is packed
            here with the packing arguments below. Per-token inputs: ``loss_mask`` (optional; for
            log-probs it is rolled, entry t weights the loss about token t + 1) and what ``loss_fn``
            reads (``old_logprobs``, ``advantages``, ``returns``, ...).
        loss_fn: ``loss_fn(outputs, micro_batch) -> [T]`` per-token loss; ``outputs`` holds the
        head's
            outputs [T], ``micro_batch`` the packed inputs [T]. None with ``forward_only=True``.
        gather: what to read from the model's output: ``LogProbs(temperature=...)`` or ``Values()``.
        normalization: ``"token"`` (mean over all loss tokens) or ``"sequence"`` (mean of the
            per-sequence means of the sequences with loss tokens), over the global batch.
        tp_group: tensor-parallel group the logits' vocabulary is sharded over.
        dp_group: data-parallel group (without context parallelism): the normalization counts every
            rank's tokens (and, when packing here, trees are equalized across it).
        cp_group: context-parallel group; default Megatron's when the model's config has
            ``context_parallel_size > 1``. Each tree is split across it by attention work
            (:func:`~megatron_tree.core.context_parallel.context_parallel_split`); every CP rank
            returns the whole loss and all outputs.
        dp_grad_average: the caller's gradient reduction averages over the data-parallel x
            context-parallel ranks (Megatron DDP's default). Ignored when Megatron divides the
            gradients itself (per-token mode with a ``finalize_model_grads_func``).
        forward_only: no backward (old / reference log-probs, evaluation).
        collect_outputs: keep the head's outputs (``result.tree_outputs``).
        route_key: MoE routing replay: the per-token input holding the routes the rollout engine
            recorded, [B, L, num_layers, topk] in a padded batch (packed with the trie keyed on
            token + route) or already packed in the :class:`PackedTreeBatch`; the model needs
            ``moe_enable_routing_replay=True``. Each micro-batch's routers replay them.
        moe_stats: count the tokens each expert receives (``result.expert_tokens``, summed over
            layers, in the log line; a host read per router call).
        share_trunks: trunk reuse for a padded ``batch`` (see ``build_packed_tree_batch``): a prompt
            group larger than ``max_tokens_per_mb`` computes its shared trunk once (as a chain of
            parts when it is longer) and its branches attend to the trunk's keys and values. None
            (default): on where it pays, under every parallelism (TP, SP, CP, PP, VPP, DP, EP) and
            for MoE models (routing replay included); False switches it off. A packed ``batch``
            carries its own choice.
        recompute_trunks: run the trunk parts twice: a no-grad pass that records their keys and
            values, the branches, then the trunk parts recomputed with their backward (last part
            first). None (default): on where the step runs through Megatron's schedules (pipeline
            parallelism: they run each micro-batch's backward in forward order; expert parallelism:
            the ranks must run their micro-batches in step; MoE router losses: the first pass sums
            the group's routing statistics, the branches with it) and where a trunk is longer than
            a micro-batch (a chain of trunk parts), off otherwise, where the trunk part's
            activations stay alive until its backward instead. It bounds activation memory by one
            micro-batch's (plus the trunk's keys and values), for one more forward of the trunk:
            with chains of trunk parts kept alive instead, memory grows with the trunk's length.
            Needs dropout 0.
        max_tokens_per_mb, block_size, parallel_size, pad_to_max, share_prefixes: packing of a
        padded
            ``batch`` (see ``build_packed_tree_batch``; ``pad_to_max`` defaults to True under
            pipeline parallelism, and packed lengths are aligned to the CP size, times the TP size
            under sequence parallelism). Rejected with a packed ``batch``.

    Returns:
        :class:`TreeStepResult`; its loss equals the unpacked batch's.
    """
    for name, value in dict(
        forward_only=forward_only,
        collect_outputs=collect_outputs,
        dp_grad_average=dp_grad_average,
        moe_stats=moe_stats,
    ).items():
        check_bool(name, value)
    for name, value in dict(
        pad_to_max=pad_to_max,
        share_prefixes=share_prefixes,
        share_trunks=share_trunks,
        recompute_trunks=recompute_trunks,
    ).items():
        check_bool(name, value, optional=True)
    if loss_fn is None and not forward_only:
        raise ValueError(
            "loss_fn is required for a training step; pass loss_fn or forward_only=True"
        )
    chunks = model if isinstance(model, list) else [model]
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if len(chunks) != vpp:
        raise ValueError(
            f"got {len(chunks)} model chunks but the virtual pipeline size is {vpp}; pass one "
            "chunk per virtual stage (the list Megatron's get_model returns)"
        )
    for chunk in chunks:
        check_tree_model(chunk)
    config = get_model_config(chunks[0])
    cp_group = _context_parallel_group(config, cp_group)
    tp_group = _tensor_parallel_group(config, tp_group)
    t0 = time.perf_counter()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if share_trunks is None and not isinstance(batch, PackedTreeBatch):
        share_trunks = True  # on where it pays, for every model and layout
    packing = dict(
        max_tokens_per_mb=max_tokens_per_mb,
        block_size=block_size,
        parallel_size=parallel_size,
        pad_to_max=pad_to_max,
        share_prefixes=share_prefixes,
        share_trunks=share_trunks,
        route_key=None if isinstance(batch, PackedTreeBatch) else route_key,
    )
    _check_expert_parallel(config, dp_group, packing, prepacked=isinstance(batch, PackedTreeBatch))
    align = config.context_parallel_size * (
        config.tensor_model_parallel_size if config.sequence_parallel else 1
    )
    packed = _as_packed(batch, packing, dp_group, pp_size, align)
    vocab_size = getattr(_unwrap(chunks[0]), "vocab_size", None)
    if vocab_size is not None and packed.max_token_id >= vocab_size:
        raise ValueError(
            f"the batch holds token id {packed.max_token_id} (pad_token_id included), outside the "
            f"model's vocabulary [0, {vocab_size})"
        )
    weights, counts, total = _step_weights(packed, gather, normalization, dp_group)
    scale = _loss_scale(
        config, counts, total, forward_only, [dp_group, cp_group] if dp_grad_average else []
    )
    device = next(chunks[0].parameters()).device
    on_device = _split_for_context_parallel(packed, cp_group).to(device)
    weights = [w.to(device=device, dtype=torch.float32) for w in weights]
    timings = {"prepare": time.perf_counter() - t0}

    step = StepRunner(
        chunks,
        config,
        gather=gather,
        loss_fn=loss_fn,
        tp_group=tp_group,
        prepare=MicroBatchInputs(chunks, cp_group),
        weights=weights,
        counts=counts,
        scale=scale,
        collect=collect_outputs,
        max_token_id=packed.max_token_id,
        num_micro_batches=len(packed),
        replay=None if route_key is None else RoutingReplay(chunks, route_key, on_device),
    )
    t1 = time.perf_counter()
    ep_group = (
        dp_group
        if config.num_moe_experts and parallel_state.get_expert_model_parallel_world_size() > 1
        else None
    )
    counter = ExpertTokenCounter(chunks) if moe_stats else contextlib.nullcontext()
    if _any_rank(check_trunk_parts(on_device), ep_group):  # EP ranks run the same calls
        with step_loss_scale(scale), _closing(step.replay), counter:
            logs = _run_trunk_groups(
                step, on_device, recompute_trunks, pp_size, forward_only, ep_group
            )
        timings["forward" if forward_only else "forward_backward"] = time.perf_counter() - t1
        return _result(
            logs,
            total,
            packed,
            step.collected,
            timings,
            counter.totals() if moe_stats and counter.per_layer else None,
        )
    with (
        _schedule_mode(config, interleaved=len(chunks) > 1),
        step_loss_scale(scale),
        _closing(step.replay),
        counter,
    ):
        logs = step.schedule(
            list(enumerate(on_device)), plain_forward_step(step), forward_only=forward_only
        )
    timings["forward" if forward_only else "forward_backward"] = time.perf_counter() - t1
    return _result(
        logs,
        total,
        packed,
        step.collected,
        timings,
        counter.totals() if moe_stats and counter.per_layer else None,
    )


def _result(logs, total, packed, collected, timings, expert_tokens) -> TreeStepResult:
    loss = None
    tree_outputs = None
    logs = [d for d in logs if "loss" in d]
    if logs:
        loss = (torch.stack([d["loss"][0] for d in logs]).sum() / max(total, 1e-30)).float()
    if collected:
        first = next(iter(collected.values()))
        tree_outputs = {name: [collected[i][name] for i in range(len(packed))] for name in first}
    result = TreeStepResult(
        loss=loss,
        packed=packed,
        seconds=timings,
        tree_outputs=tree_outputs,
        expert_tokens=expert_tokens,
    )
    logger.info(result.log_line())
    return result


def _any_rank(flag: bool, group) -> bool:
    """``flag`` on any rank of ``group`` (``flag`` itself without a group)."""
    if group is None:
        return flag
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _run_trunk_groups(
    step, on_device, recompute_trunks, pp_size: int, forward_only: bool, ep_group
) -> list:
    """A batch with trunk groups: the one-stage loop, or Megatron's schedules with the trunk parts
    recomputed (pipeline parallelism, expert parallelism, MoE router losses, or
    ``recompute_trunks=True``)."""
    config, chunks = step.config, step.chunks
    scheduled = pp_size > 1 or len(chunks) > 1 or ep_group is not None or router_losses_on(config)
    if recompute_trunks is None and any(
        mb["rows"].records and mb["rows"].index for mb in on_device
    ):
        recompute_trunks = (
            True  # a trunk longer than a micro-batch: keep one micro-batch's activations
        )
    recompute_trunks = _recompute_trunks(config, recompute_trunks, scheduled, forward_only)
    with _schedule_mode(config, interleaved=len(chunks) > 1):
        if recompute_trunks or (forward_only and scheduled):
            return run_trunks_scheduled(
                step,
                on_device,
                forward_only=forward_only,
                ep_group=ep_group,
                router_stats=router_losses_on(config) and not forward_only,
            )
        return run_with_trunks(step, on_device, forward_only=forward_only)


def _recompute_trunks(config, recompute_trunks, scheduled: bool, forward_only: bool) -> bool:
    """Whether trunk parts run twice (a no-grad pass, then recomputed last: see
    :func:`~megatron_tree.mcore.trunk_step.run_trunks_scheduled`): required where the step runs
    through Megatron's schedules (``scheduled``: pipeline or expert parallelism, MoE router losses,
    which need the group's routing statistics first), a memory setting otherwise."""
    if recompute_trunks is None:
        recompute_trunks = scheduled
    if scheduled and not recompute_trunks:
        raise ValueError(
            "with pipeline or expert parallelism or MoE router losses, trunk reuse runs through "
            "Megatron's schedules with the trunk parts recomputed: recompute_trunks=False needs "
            "one pipeline stage, no expert parallelism and no router losses"
        )
    dropout = max(config.hidden_dropout, config.attention_dropout)
    if recompute_trunks and not forward_only and dropout > 0:
        raise ValueError(
            "recomputed trunk parts must reproduce their first pass, but the model has dropout "
            f"{dropout} (hidden_dropout / attention_dropout): set them to 0 (RL training usually "
            "does), or pack with share_trunks=False"
        )
    return recompute_trunks


def _loss_scale(config, counts, total, forward_only, averaged_over) -> float:
    """What the step multiplies each micro-batch's loss sum by (1 when Megatron divides)."""
    megatron_divides = bool(
        config.calculate_per_token_loss and config.finalize_model_grads_func is not None
    )
    if (
        not forward_only
        and config.finalize_model_grads_func is not None
        and not config.calculate_per_token_loss
    ):
        raise ValueError(
            "trees hold different numbers of tokens, so Megatron's per-micro-batch loss mean would "
            "weight tokens unequally; set config.calculate_per_token_loss=True (Megatron DDP then "
            "sums gradients and finalize_model_grads divides them by the global token count)"
        )
    if megatron_divides:
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


@contextlib.contextmanager
def _closing(replay):
    try:
        yield
    finally:
        if replay is not None:
            replay.close()


def _split_for_context_parallel(packed: PackedTreeBatch, cp_group) -> PackedTreeBatch:
    """Each micro-batch with this CP rank's rows (split on the host, before the batch moves)."""
    if cp_group is None:
        return packed
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    split = []
    for mb in packed:
        new = micro_batch(mb["tree"], context_parallel_split(mb["rows"], size, rank, cp_group))
        new.update({k: v for k, v in mb.items() if k not in new})
        split.append(new)
    return PackedTreeBatch(
        split,
        packed.batch_size,
        packed.num_real_tokens,
        packed.max_token_id,
        cost_model=packed.cost_model,
    )


def _tensor_parallel_group(config, tp_group):
    """The vocabulary's TP group: Megatron's when the model is tensor-parallel and none is given."""
    tp_size = config.tensor_model_parallel_size
    if tp_group is None and tp_size > 1:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    if size != tp_size:
        raise ValueError(
            f"the model was built with tensor_model_parallel_size={tp_size} but tp_group has "
            f"{size} ranks; pass the model's tensor-parallel group (or None for Megatron's)"
        )
    return tp_group if size > 1 else None
