"""What one tree step shares between its loops: each micro-batch's inputs, its forward through a
model chunk (routing replay included), its loss in Megatron's protocol, and Megatron's schedule
call. :func:`megatron_tree.mcore.step.tree_forward_backward` builds one :class:`StepRunner` per
step; whole trees run through :func:`plain_forward_step`, trunk groups through
:mod:`megatron_tree.mcore.trunk_step`.

Legend: T a micro-batch's sequence tokens, n its rows on this rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from ..core.batch import micro_batch
from ..core.context_parallel import context_parallel_split
from ..core.mask import tree_attention_mask
from ..core.tree import PackedTree
from .moe import token_multiplicity


def micro_batch_loss(
    outputs: dict,
    mb: dict,
    weights: torch.Tensor,
    count: float,
    scale: float,
    loss_fn,
    collect: Callable | None,
    report: bool = True,
):
    """Megatron's ``(loss, num_tokens, logs)`` of one micro-batch from its head outputs [T].

    ``loss`` is the weighted loss sum times ``scale``, ``num_tokens`` the loss-token count (0 when
    ``report`` is False: another context-parallel rank reports it) and ``logs["loss"]`` the unscaled
    (sum, count) pair. ``collect`` (if given) is called with the detached outputs.

    A token of weight 0 takes no part, whatever its inputs hold: ``loss_fn`` sees the micro-batch's
    floating-point per-token inputs [T, ...] set to 0 there, and its loss there is dropped before
    weighting, so a NaN or inf at such a token reaches neither the loss nor a gradient (0 * NaN
    is NaN, and masking only the loss would still send NaN back through the loss function).
    """
    tree = mb["tree"]
    if collect is not None:
        collect({k: v.detach() for k, v in outputs.items()})
    device = next(iter(outputs.values())).device
    size = tree.num_sequence_tokens
    keep = weights != 0
    if loss_fn is None:
        per_token = torch.zeros(size, device=device)
    else:
        inputs = {
            k: torch.where(keep.view(-1, *(1,) * (v.dim() - 1)), v, 0)
            if isinstance(v, torch.Tensor)
            and v.is_floating_point()
            and v.dim()
            and v.shape[0] == size
            else v
            for k, v in mb.items()
        }
        per_token = loss_fn(outputs, inputs)
    if per_token.shape != (size,):
        raise ValueError(
            f"loss_fn must return a per-token loss of shape [{size}] (the micro-batch's sequence "
            f"tokens), got {tuple(per_token.shape)}"
        )
    total = (torch.where(keep, per_token.float(), 0.0) * weights).sum()
    reported = round(count) if report else 0
    # Filled on the device (torch.tensor(x, device=cuda) would copy from the host and wait).
    num_tokens = torch.full((), reported, dtype=torch.int, device=total.device)
    pair = torch.stack(
        [total.detach().double(), torch.full((), count, dtype=torch.float64, device=total.device)]
    )
    return total * scale, num_tokens, {"loss": pair}


class MicroBatchInputs:
    """The one per-micro-batch preparation of every loop: a micro-batch's model inputs (its rows'
    ``input_ids`` / ``position_ids`` [1, n], the tree mask of its rows and, for MoE models, each
    row's multiplicity in the unpacked batch as ``padding_mask`` [1, n], which
    :class:`~megatron_tree.mcore.moe.TreeMoELayer` weighs its router losses by).

    Args:
        chunks: the step's model chunks.
        cp_group: the CP group (None without context parallelism); the micro-batches' rows are
            already this rank's (``_split_for_context_parallel``).
    """

    def __init__(self, chunks, cp_group):
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self.moe = bool(get_model_config(chunks[0]).num_moe_experts)

    def __call__(self, mb: dict, store=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        rows = mb["rows"]
        kwargs = {"attention_mask": tree_attention_mask(rows, store=store)}
        if self.moe:
            kwargs["padding_mask"] = token_multiplicity(
                rows.tree, None if rows.is_whole else rows.positions
            )
        return mb["input_ids"], mb["position_ids"], kwargs


class StepRunner:
    """What one step shares between its loops: the per-micro-batch preparation, the head, the
    loss weighting and Megatron's schedule call.

    Args:
        chunks, config: the model chunks and their config.
        gather: the head; loss_fn: the per-token loss; tp_group: the vocabulary's TP group.
        prepare: :class:`MicroBatchInputs`.
        weights, counts, scale: per micro-batch loss weights [T] and loss-token counts, and the
            factor on every loss sum (see :func:`micro_batch_loss`).
        collect: keep the head's outputs (``collected``, by micro-batch).
        max_token_id: the batch's largest token id (the head checks the output's width).
        num_micro_batches: the batch's; indices past it are all-padding fill-ins.
        replay: the step's :class:`~megatron_tree.mcore.moe.RoutingReplay`, or None.
    """

    def __init__(
        self,
        chunks,
        config,
        *,
        gather,
        loss_fn,
        tp_group,
        prepare,
        weights,
        counts,
        scale,
        collect,
        max_token_id,
        num_micro_batches,
        replay=None,
    ):
        self.chunks, self.config, self.replay = chunks, config, replay
        self.gather_head, self.loss_fn, self.tp_group, self.prepare = (
            gather,
            loss_fn,
            tp_group,
            prepare,
        )
        self.weights, self.counts, self.scale = weights, counts, scale
        self.collected: dict[int, dict] | None = {} if collect else None
        self.max_token_id, self.num_micro_batches = max_token_id, num_micro_batches
        self.extra_tokens = 0  # loss tokens of earlier schedule calls, reported with the next loss
        self.num_scheduled = 0

    def forward(self, model_chunk, mb: dict, store=None, prepared=None) -> torch.Tensor:
        """One micro-batch through one model chunk: its inputs (``prepared``, or prepared here),
        the routes it replays, the chunk's output."""
        input_ids, position_ids, kwargs = (
            prepared if prepared is not None else self.prepare(mb, store)
        )
        pending = None
        if self.replay is not None:
            pending = self.replay.before_forward(
                model_chunk, mb, mb["rows"], parallel_state.get_tensor_model_parallel_rank()
            )
        output = model_chunk(input_ids, position_ids, **kwargs)
        if self.replay is not None:
            self.replay.after_forward(model_chunk, output, pending)
        return output

    def forward_step(self, loss_of, store_of=None):
        """Megatron's ``forward_step_func`` over (index, micro-batch) pairs: each micro-batch
        prepared once (at its first model chunk), ``loss_of(i, mb, output)`` its loss function
        (fill-ins past the batch: no loss), ``store_of(rows)`` its trunk group's store."""
        prepared: dict[int, tuple] = {}
        last_chunk = self.chunks[-1]

        def forward_step(data_iterator, model_chunk):
            i, mb = next(data_iterator)
            if i not in prepared:
                prepared[i] = self.prepare(mb, None if store_of is None else store_of(mb["rows"]))
            inputs = prepared.pop(i) if model_chunk is last_chunk else prepared[i]
            output = self.forward(model_chunk, mb, prepared=inputs)
            if i >= self.num_micro_batches:  # a fill-in
                return output, lambda out: self.loss(
                    i, self.gather(out, mb["tree"], mb["rows"]), mb
                )
            return output, lambda out: loss_of(i, mb, out)

        return forward_step

    @property
    def report(self) -> bool:
        """Whether this rank reports loss-token counts (CP rank 0)."""
        return self.prepare.cp_rank == 0

    def gather(self, output: torch.Tensor, tree: PackedTree, rows) -> dict[str, torch.Tensor]:
        """The head's per-token outputs [T] of ``tree``'s sequences from this rank's rows."""
        self.gather_head.check_output(output, self.tp_group, self.max_token_id)
        return self.gather_head.gather(output, tree, self.tp_group, rows)

    def loss(self, i: int, outputs: dict, mb: dict):
        """Megatron's ``(loss, num_tokens, logs)`` of micro-batch ``i`` (a fill-in: nothing)."""
        real = i < self.num_micro_batches
        weights = self.weights[i] if real else torch.zeros(0, device=mb["input_ids"].device)
        collect = None
        if self.collected is not None and real:
            collect = lambda out: self.collected.__setitem__(i, out)  # noqa: E731
        loss, num_tokens, logs = micro_batch_loss(
            outputs,
            mb,
            weights,
            self.counts[i] if real else 0.0,
            self.scale,
            self.loss_fn,
            collect,
            self.report,
        )
        if self.extra_tokens and self.report:
            num_tokens, self.extra_tokens = num_tokens + self.extra_tokens, 0
        return loss, num_tokens, logs

    def schedule(
        self,
        items: list[tuple[int, dict]],
        forward_step,
        *,
        forward_only: bool,
        count: int = 0,
        template: dict | None = None,
    ) -> list[dict]:
        """One call of Megatron's schedule over ``items`` ((index, micro-batch) pairs), padded with
        all-padding fill-ins (shaped like ``template``, default the first item) to ``count`` items
        (expert-parallel ranks run as many), then to the multiple of the pipeline size the
        interleaved schedule needs."""
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        count = max(count, len(items))
        if len(self.chunks) > 1:
            count = -(-count // pp_size) * pp_size
        if count == 0:
            return []
        first = items[0][1] if items else template
        for k in range(count - len(items)):
            rows = first["rows"]  # a fill-in of the same rows per rank, split like the others
            tree = PackedTree.all_padding(
                rows.num_rows * rows.cp_size, 0, first["input_ids"].device
            )
            split = None
            if rows.cp_size > 1:
                split = context_parallel_split(tree, rows.cp_size, rows.cp_rank, rows.cp_group)
            mb = micro_batch(tree, split)
            mb.update({key: v[:0] for key, v in first.items() if key not in mb})
            items = items + [(self.num_micro_batches + k, mb)]
        chunks = self.chunks
        self.num_scheduled = len(
            items
        )  # the call's micro-batch count (Megatron divides 2-tuple losses by it)
        iterator = [iter(items) for _ in chunks] if len(chunks) > 1 else iter(items)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterator,
            model=chunks,
            num_microbatches=len(items),
            # Megatron divides the sequence length by the CP size (and by TP under SP) for its p2p
            # shapes.
            seq_length=max(mb["rows"].num_rows * mb["rows"].cp_size for _, mb in items),
            micro_batch_size=1,
            forward_only=forward_only,
        )


def plain_forward_step(step: StepRunner):
    """Megatron's ``forward_step_func`` over (index, micro-batch) pairs of whole trees or CP shares.

    The loss function returns Megatron's ``(loss, num_tokens, logs)``: ``loss`` is the micro-batch's
    weighted loss sum times ``scale`` (1 when Megatron divides by the global count itself),
    ``num_tokens`` its count, and ``logs["loss"]`` the unscaled (sum, count) pair. Under context
    parallelism every CP rank computes the whole loss (its gradient reaching only its own rows) and
    CP rank 0 reports the count, so that Megatron's sums over the CP group count each token once.
    """
    return step.forward_step(
        lambda i, mb, output: step.loss(i, step.gather(output, mb["tree"], mb["rows"]), mb)
    )
