"""The one way a tree step runs its micro-batches: Megatron schedule calls over phases.

Every caller (the package's own step, verl's engine, an AReaL engine) hands :func:`run_phases` the
step's :class:`StepContext`, the packed micro-batches (this rank's rows), a :class:`Head` that
reads per-token outputs from the model's output and a :class:`Loss` that reduces them in
Megatron's protocol. The phases a batch needs are decided once, from the packed batch
(:meth:`Phases.of`):

1. ``first``: every trunk part without grad (its attention records its keys and values); its head
   outputs for the group kept as leaves. With router statistics (an MoE model with router losses,
   training) every other part of a group runs here too, so that the routers sum their statistics
   over the group. A forward-only step takes the losses of the sequences ending in trunk parts here.
2. ``main``: every other micro-batch (whole trees, CP shares, branches) forward and backward:
   branches attend to the recorded keys and values and add the kept outputs, leaving gradients
   on both. A batch without trunk groups runs only this phase: one Megatron schedule call.
3. ``last``: the trunk parts again, last part of each group first, forward and backward: the loss
   of the sequences ending in a part, plus a term whose gradient is what the later micro-batches
   left on its kept outputs; its attention adds the gradients left on its recorded keys and values.

Empty phases are skipped; gradient sync and ``finalize_model_grads_func`` are held back while a
later phase follows, and the last call reports the earlier calls' loss tokens. Under expert
parallelism every rank runs as many micro-batches per call (all-padding fill-ins, which take no
loss), as the interleaved schedule needs a multiple of the pipeline size.

Cost of trunk reuse here: one more forward of the trunk parts (with router statistics, of every
part of a group); memory: the trunk's keys and values and the kept outputs, and one micro-batch's
activations at a time per stage.

Legend: T a micro-batch's sequence tokens, T_G a trunk group's, n a micro-batch's rows here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..core.batch import MicroBatch, micro_batch
from ..core.context_parallel import context_parallel_split
from ..core.finite import FiniteCheck
from ..core.mask import tree_attention_mask
from ..core.rows import KeyValueStore, TreeRows
from ..core.tree import PackedTree
from .moe import RouterInputs, token_multiplicity


class Head(Protocol):
    """Reads per-token outputs from the last stage's output: ``head(output, tree, rows)`` ->
    ``{name: [T]}`` for ``tree``'s sequence tokens computed by ``rows`` (this rank's rows).
    Implementations: the step's log-probs / values head, verl's logits processor."""

    def __call__(
        self, output: torch.Tensor, tree: PackedTree, rows: TreeRows
    ) -> dict[str, torch.Tensor]: ...


class Loss(Protocol):
    """Reduces a micro-batch's outputs in Megatron's protocol: ``loss(index, micro_batch,
    outputs, num_micro_batches=k)`` -> ``(loss, num_tokens, logs)`` (per-token mode) or
    ``(loss, logs)`` (Megatron divides it by ``k``, the schedule call's micro-batch count)."""

    def __call__(
        self,
        index: int,
        mb: MicroBatch,
        outputs: dict[str, torch.Tensor],
        *,
        num_micro_batches: int,
    ) -> tuple: ...


@dataclass(frozen=True)
class StepContext:
    """What every micro-batch of one step shares; built once per step.

    Attributes:
        chunks: the model chunks (one per virtual pipeline stage).
        config: their TransformerConfig.
        moe: whether the model routes tokens (its routers get :class:`RouterInputs`).
        loss_scale: the factor each loss token gets, for the routers' losses (None: Megatron's
            mean per micro-batch; see :class:`~megatron_tree.mcore.moe.RouterInputs`).
        routes: per micro-batch, the routes its rows replay [n, layers, topk], or None.
        router_stats: sum a trunk group's routing statistics first (router losses, training).
        ep_group: expert parallelism's group: its ranks run as many micro-batches per call.
        per_token: run the calls in Megatron's per-token mode (the loss returns ``(loss,
            num_tokens, logs)`` and Megatron divides by nothing); False keeps the config's mode
            (verl's ``(loss, logs)`` protocol).
    """

    chunks: Sequence[torch.nn.Module]
    config: Any
    moe: bool = False
    loss_scale: float | None = None
    routes: Sequence[torch.Tensor] | None = None
    router_stats: bool = False
    ep_group: dist.ProcessGroup | None = None
    per_token: bool = True

    def model_inputs(self, index: int, mb: MicroBatch, store: KeyValueStore | None) -> tuple:
        """(input_ids [1, n], position_ids [1, n], the tree mask carrying the micro-batch's
        context: its rows, the trunk group's store and, for MoE models, :class:`RouterInputs`)."""
        rows = mb.rows
        tokens = None
        if self.moe:
            weights = token_multiplicity(rows.tree, None if rows.is_whole else rows.positions)[0]
            routes = None
            if self.routes is not None:
                routes = (
                    self.routes[index]
                    if index < len(self.routes)
                    else _padding_routes(self.routes[0], rows.num_rows)
                )
            tokens = RouterInputs(weights, self.loss_scale, routes)
        mask = tree_attention_mask(rows, store=store, tokens=tokens)
        return mb.input_ids, mb.position_ids, mask


def _padding_routes(like: torch.Tensor, num_rows: int) -> torch.Tensor:
    experts = torch.arange(like.shape[-1], dtype=like.dtype, device=like.device)
    return experts.expand(num_rows, *like.shape[1:]).contiguous()


@dataclass(frozen=True)
class Phases:
    """Micro-batch indices per phase (see the module docstring); decided once per batch."""

    first: list[int] = field(default_factory=list)
    main: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, micro_batches: Sequence[MicroBatch], *, router_stats: bool = False) -> Phases:
        """The phases of ``micro_batches``; raises if a trunk group's parts are out of order."""
        _check_group_order(micro_batches)
        rows = [mb.rows for mb in micro_batches]
        first = [
            i for i, r in enumerate(rows) if r.records or (router_stats and r.group is not None)
        ]
        main = [i for i, r in enumerate(rows) if not r.records]
        last = sorted(
            (i for i, r in enumerate(rows) if r.records),
            key=lambda i: (rows[i].group, -rows[i].index),
        )
        return cls(first, main, last)

    @property
    def trunks(self) -> bool:
        return bool(self.last)


def _check_group_order(micro_batches: Sequence[MicroBatch]) -> None:
    expected = None
    for i, mb in enumerate(micro_batches):
        rows = mb.rows
        if rows.group is None:
            if expected is not None:
                raise ValueError(
                    f"micro-batch {i} interrupts trunk group {expected[0]}; keep a group's parts "
                    "together"
                )
            continue
        if (rows.group, rows.index) != (expected or (rows.group, 0)):
            raise ValueError(
                f"micro-batch {i} is part {rows.index} of trunk group {rows.group}, expected "
                f"{expected or (rows.group, 0)}: a group's parts must run in order, trunk parts "
                "first"
            )
        expected = None if rows.ends_group else (rows.group, rows.index + 1)
    if expected is not None:
        raise ValueError(f"trunk group {expected[0]} ends before its part {expected[1]}")


class _KeptOutputs:
    """Per trunk part (group, index): its head outputs for the group [T_G], kept as leaves that
    the group's later losses read (their gradients accumulate there)."""

    def __init__(self, requires_grad: bool):
        self.requires_grad = requires_grad
        self.leaves: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def keep(self, rows: TreeRows, outputs: dict[str, torch.Tensor]) -> None:
        self.leaves[(rows.group, rows.index)] = {
            k: v.detach().requires_grad_(self.requires_grad and v.is_floating_point())
            for k, v in outputs.items()
        }

    def read(self, rows: TreeRows, num_parts: int) -> dict[str, torch.Tensor] | None:
        """Trunk parts 0 .. num_parts - 1 of ``rows``'s group, summed, at its ``group_tokens``."""
        if not num_parts:
            return None
        parts = [self.leaves[(rows.group, p)] for p in range(num_parts)]
        return {k: sum(p[k] for p in parts)[rows.group_tokens] for k in parts[0]}


class _SendLeafGrad(torch.autograd.Function):
    """0 in forward; in backward, sends ``outputs`` the gradient accumulated on ``leaf`` (its
    detached copy) by then. The incoming gradient only triggers it: ``leaf.grad`` already carries
    the loss scale of the losses that read the leaf."""

    @staticmethod
    def forward(ctx, outputs, leaf):
        ctx.leaf = leaf
        return outputs.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        leaf_grad = ctx.leaf.grad
        return (torch.zeros_like(ctx.leaf) if leaf_grad is None else leaf_grad), None


def _no_loss(output: torch.Tensor) -> tuple:
    """A zero loss that keeps the output in the graph (fill-ins, passes that take no loss)."""
    zero = output.flatten()[:0].float().sum()
    return zero, torch.zeros((), dtype=torch.int, device=output.device), {}


@contextlib.contextmanager
def schedule_settings(config, interleaved: bool, per_token: bool, hold_grad_sync: bool = False):
    """The config a tree schedule call runs with, restored after it (Megatron's schedules read
    these only from the model's config):

    * ``per_token``: Megatron's per-token mode (``calculate_per_token_loss``): trees hold
      different numbers of tokens, so Megatron must not divide a micro-batch's loss by its tokens
      or by the micro-batch count;
    * for the interleaved schedule on gloo, unbatched p2p: with PP = 2 both pipeline neighbours are
      the same rank, and Megatron's batched p2p posts (send prev, send next) against (recv prev,
      recv next), which gloo matches in posting order, silently swapping activations and
      gradients;
    * ``hold_grad_sync``: a later phase follows, so its backward passes must not start gradient
      sync or finalize: the real ``no_sync`` held around the call, the schedule given none.
    """
    names = (
        "calculate_per_token_loss",
        "batch_p2p_comm",
        "finalize_model_grads_func",
        "no_sync_func",
        "grad_sync_func",
    )
    saved = {name: getattr(config, name) for name in names}
    no_sync = saved["no_sync_func"]
    no_sync = no_sync if isinstance(no_sync, list) else [no_sync] if no_sync is not None else []
    with contextlib.ExitStack() as stack:
        config.calculate_per_token_loss = per_token or config.calculate_per_token_loss
        if (
            interleaved
            and dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) == "gloo"
        ):
            config.batch_p2p_comm = False
        if hold_grad_sync:
            for enter in no_sync:
                stack.enter_context(enter())
            config.finalize_model_grads_func = config.no_sync_func = config.grad_sync_func = None
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(config, name, value)


@dataclass
class PhaseRun:
    """What :func:`run_phases` returns: Megatron's logs of every loss, in call order, and the
    loss-token count this rank reported (a device tensor: no host read)."""

    logs: list[dict]
    num_tokens: torch.Tensor | int = 0


def run_phases(
    ctx: StepContext,
    micro_batches: Sequence[MicroBatch],
    head: Head,
    loss: Loss,
    *,
    forward_only: bool,
    phases: Phases | None = None,
) -> PhaseRun:
    """Run ``micro_batches`` (this rank's rows, on the model's device) through Megatron's schedules
    phase by phase (see the module docstring); ``phases`` default :meth:`Phases.of`."""
    phases = phases or Phases.of(micro_batches, router_stats=ctx.router_stats and not forward_only)
    return _PhaseRunner(ctx, micro_batches, head, loss, forward_only).run(phases)


class _PhaseRunner:
    """The state of one :func:`run_phases` call: trunk stores, kept outputs, reported tokens."""

    def __init__(self, ctx, micro_batches, head, loss, forward_only: bool):
        self.ctx, self.micro_batches, self.head, self.loss = ctx, micro_batches, head, loss
        self.forward_only = forward_only
        self.stores: dict[int, KeyValueStore] = {}
        self.kept = _KeptOutputs(requires_grad=not forward_only)
        self.collecting = False
        self.num_tokens: torch.Tensor | int = 0
        self.pending_tokens: torch.Tensor | int = 0  # reported by held calls, for the last one
        self.finite = FiniteCheck()

    def run(self, phases: Phases) -> PhaseRun:
        counts = _equal_counts(
            [len(phases.first), len(phases.main), len(phases.last)], self.ctx.ep_group
        )
        calls = []  # (the phase's micro-batches, its loss, count, forward only, first pass)
        if counts[0]:
            calls.append((phases.first, self._first, counts[0], True, True))
        if counts[1]:
            calls.append((phases.main, self._main, counts[1], self.forward_only, False))
        if counts[2] and not self.forward_only:
            calls.append((phases.last, self._last, counts[2], False, False))
        last_trained = max((k for k, call in enumerate(calls) if not call[3]), default=-1)
        logs: list[dict] = []
        for k, (indices, loss_of, count, forward_only, first) in enumerate(calls):
            hold = k < last_trained  # a later call runs backward: sync and finalize wait for it
            self.collecting = first
            with torch.no_grad() if first else contextlib.nullcontext():
                logs += self._call(indices, loss_of, count, forward_only, hold)
            if hold:
                self.pending_tokens, self.num_tokens = self.pending_tokens + self.num_tokens, 0
        for store in self.stores.values():
            store.clear()
        self.finite.raise_if_any()
        return PhaseRun(logs, self.num_tokens + self.pending_tokens)

    def _store(self, rows: TreeRows) -> KeyValueStore | None:
        if rows.group is None:
            return None
        store = self.stores.setdefault(rows.group, KeyValueStore(not self.forward_only))
        store.collecting = self.collecting
        return store

    def _call(self, indices, loss_of, count: int, forward_only: bool, hold: bool) -> list[dict]:
        """One Megatron schedule call over ``indices``, padded with all-padding fill-ins to
        ``count`` (and to the multiple of the pipeline size the interleaved schedule needs)."""
        ctx = self.ctx
        items = [(i, self.micro_batches[i]) for i in indices]
        if len(ctx.chunks) > 1:
            pp = parallel_state.get_pipeline_model_parallel_world_size()
            count = -(-count // pp) * pp
        template = self.micro_batches[0]
        n = len(self.micro_batches)
        items += [(n + k, _fill_in(template)) for k in range(count - len(items))]
        prepared: dict[int, tuple] = {}
        last_chunk = ctx.chunks[-1]

        def forward_step(data_iterator, model_chunk):
            i, mb = next(data_iterator)
            if i not in prepared:
                prepared[i] = ctx.model_inputs(i, mb, self._store(mb.rows))
            input_ids, position_ids, mask = (
                prepared.pop(i) if model_chunk is last_chunk else prepared[i]
            )
            output = model_chunk(input_ids, position_ids, attention_mask=mask)
            if i >= n:
                return output, _no_loss
            return output, lambda out: self._reported(loss_of(i, mb, out, len(items)))

        iterator = [iter(items) for _ in ctx.chunks] if len(ctx.chunks) > 1 else iter(items)
        with schedule_settings(ctx.config, len(ctx.chunks) > 1, ctx.per_token, hold_grad_sync=hold):
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterator,
                model=list(ctx.chunks),
                num_microbatches=len(items),
                # Megatron divides the sequence length by the CP size (and by TP under SP) for its
                # p2p shapes.
                seq_length=max(mb.rows.num_rows * mb.rows.cp_size for _, mb in items),
                micro_batch_size=1,
                forward_only=forward_only,
            )

    def _reported(self, result: tuple) -> tuple:
        """Count the tokens a loss reports; the first loss after held calls reports theirs too
        (the last call's ``finalize_model_grads_func`` divides by its own count)."""
        if len(result) != 3:
            return result
        loss, num_tokens, logs = result
        if not isinstance(self.pending_tokens, int) or self.pending_tokens:
            num_tokens, self.pending_tokens = num_tokens + self.pending_tokens, 0
        self.num_tokens = self.num_tokens + num_tokens
        return loss, num_tokens, logs

    def _loss(self, i: int, mb: MicroBatch, outputs: dict, calls: int) -> tuple:
        """``self.loss`` on a micro-batch's complete outputs, both recorded for the step's one
        finiteness check (device flags; read once at the end of :meth:`run`)."""
        self.finite.add(i, mb.tree, outputs)
        result = self.loss(i, mb, outputs, num_micro_batches=calls)
        self.finite.add_loss(i, result[0].detach())
        return result

    def _first(self, i: int, mb: MicroBatch, output: torch.Tensor, calls: int) -> tuple:
        rows = mb.rows
        if not rows.records:  # a branch collecting router statistics
            return _no_loss(output)
        self.kept.keep(rows, self.head(output, rows.tree, rows))
        if self.forward_only:
            return self._loss(i, mb, self.kept.read(rows, rows.index + 1), calls)
        return _no_loss(output)

    def _main(self, i: int, mb: MicroBatch, output: torch.Tensor, calls: int) -> tuple:
        rows = mb.rows
        outputs = self.head(output, mb.tree, rows)
        before = None if rows.group is None else self.kept.read(rows, rows.stored_parts)
        if before is not None:
            outputs = {k: v + before[k] for k, v in outputs.items()}
        return self._loss(i, mb, outputs, calls)

    def _last(self, i: int, mb: MicroBatch, output: torch.Tensor, calls: int) -> tuple:
        rows = mb.rows
        full = self.head(output, rows.tree, rows)
        before = self.kept.read(rows, rows.index)
        outputs = {
            k: v[rows.group_tokens] + (0 if before is None else before[k]) for k, v in full.items()
        }
        loss, *rest = self._loss(i, mb, outputs, calls)
        leaves = self.kept.leaves[(rows.group, rows.index)]
        for k, v in full.items():
            if v.requires_grad:
                loss = loss + _SendLeafGrad.apply(v, leaves[k])
        return (loss, *rest)


def _fill_in(template: MicroBatch) -> MicroBatch:
    """An all-padding micro-batch with ``template``'s rows per rank, split like it under CP."""
    rows = template.rows
    tree = PackedTree.all_padding(rows.num_rows * rows.cp_size, 0, template.input_ids.device)
    split = None
    if rows.cp_size > 1:
        split = context_parallel_split(tree, rows.cp_size, rows.cp_rank, rows.cp_group)
    return micro_batch(tree, split)


def _equal_counts(counts: list[int], group) -> list[int]:
    """The largest of each count over ``group`` (the counts themselves without one)."""
    if group is None:
        return counts
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    values = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values.tolist()
