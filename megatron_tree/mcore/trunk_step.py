"""Running a batch packed with trunk reuse: two ways, one for each constraint.

A trunk group's micro-batches depend on each other: later parts attend to the trunk parts' keys and
values, and a trunk part's backward needs the gradients every later part leaves on them.

* :func:`run_with_trunks` (one pipeline stage and model chunk, a one-part trunk, no expert
  parallelism or router losses): the step's own loop, doing what ``forward_backward_no_pipelining``
  does (gradient sync held back until the last backward, ``grad_scale_func``,
  ``finalize_model_grads_func`` with the token count). Per group: each trunk part forward (it
  records its keys and values; its head outputs for the whole group are kept with their graph and
  continue as leaves); each branch forward over [trunk keys/values ; own] and backward; then each
  trunk part's backward, last part first, with its leaves' gradients. Peak activation memory: the
  trunk parts' activations, one branch's, and the trunk's keys and values.
* :func:`run_trunks_scheduled` (everything else, or ``recompute_trunks=True``): Megatron's own
  schedules, called three times, with the trunk parts run twice.

Both take every micro-batch's inputs from the step's one preparation (``StepRunner.forward``: rows,
mask, MoE multiplicities, routing replay; context parallelism included).
Legend: T_G tokens of the group's sequences, L layers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..core.rows import KeyValueStore


def _no_sync(config):
    no_sync = config.no_sync_func
    if isinstance(no_sync, list):
        no_sync = no_sync[0]
    return contextlib.nullcontext() if no_sync is None else no_sync()


class _KeptOutputs:
    """Per trunk part (group, index): its head outputs for the group [T_G], kept as leaves that
    the group's later losses read (their gradients accumulate there), and, in the one-stage loop,
    with their graph for the part's own backward."""

    def __init__(self, requires_grad: bool):
        self.requires_grad = requires_grad
        self.leaves: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.graphs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def keep(self, rows, outputs: dict[str, torch.Tensor], graph: bool = False) -> None:
        key = (rows.group, rows.index)
        self.leaves[key] = {
            k: v.detach().requires_grad_(self.requires_grad and v.is_floating_point())
            for k, v in outputs.items()
        }
        if graph:
            self.graphs[key] = outputs

    def read(self, rows, num_parts: int) -> dict[str, torch.Tensor] | None:
        """Trunk parts 0 .. num_parts - 1 of ``rows``'s group, summed, at its ``group_tokens``."""
        if not num_parts:
            return None
        parts = [self.leaves[(rows.group, p)] for p in range(num_parts)]
        return {k: sum(p[k] for p in parts)[rows.group_tokens] for k in parts[0]}

    def backward_args(self, group: int, part: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(outputs, their gradients) for a kept part's own backward: every output that needs one
        (a zero gradient where no loss read it, so that its keys' gradients still flow)."""
        tensors, grads = [], []
        for name, out in self.graphs[(group, part)].items():
            if out.requires_grad:
                grad = self.leaves[(group, part)][name].grad
                tensors.append(out)
                grads.append(torch.zeros_like(out) if grad is None else grad)
        return tensors, grads

    def drop(self, group: int) -> None:
        for kept in (self.leaves, self.graphs):
            for key in [k for k in kept if k[0] == group]:
                del kept[key]


def check_trunk_parts(packed) -> bool:
    """Whether ``packed`` holds trunk-reuse parts; raises if a group's parts are out of order."""
    expected = None
    found = False
    for i, mb in enumerate(packed):
        rows = mb["rows"]
        if rows.group is None:
            if expected is not None:
                raise ValueError(
                    f"micro-batch {i} interrupts trunk group {expected[0]}; keep a group's parts "
                    "together"
                )
            continue
        found = True
        if (rows.group, rows.index) != (expected or (rows.group, 0)):
            raise ValueError(
                f"micro-batch {i} is part {rows.index} of trunk group {rows.group}, expected "
                f"{expected or (rows.group, 0)}: a group's parts must run in order, trunk parts "
                "first"
            )
        expected = None if rows.ends_group else (rows.group, rows.index + 1)
    if expected is not None:
        raise ValueError(f"trunk group {expected[0]} ends before its part {expected[1]}")
    return found


def run_with_trunks(step, packed, *, forward_only: bool) -> list[dict]:
    """Forward (and backward) every micro-batch of ``packed`` in order, on one pipeline stage and
    model chunk; returns Megatron-style logs.

    Args:
        step: the step's shared state (``megatron_tree.mcore.runner.StepRunner``: preparation, head,
        loss).
        packed: the micro-batches on the model's device (this CP rank's rows).
    """
    model, config = step.chunks[0], step.config
    logs: list[dict] = []
    total_tokens = 0
    last = len(packed) - 1
    kept = _KeptOutputs(requires_grad=not forward_only)
    store: KeyValueStore | None = None
    with (
        contextlib.ExitStack() as sync,
        torch.set_grad_enabled(torch.is_grad_enabled() and not forward_only),
    ):
        if not forward_only:
            sync.enter_context(_no_sync(config))

        def backward(tensors, grads=None, final=False):
            if final:
                sync.close()  # the last backward of the step lets gradient sync run
            torch.autograd.backward(tensors, grads)

        for i, mb in enumerate(packed):
            rows = mb["rows"]
            grouped = rows.group is not None
            if grouped and rows.index == 0:
                store = KeyValueStore(requires_grad=not forward_only)
            output = step.forward(model, mb, store if grouped else None)
            if rows.records:  # a trunk part: its outputs for every sequence of the group
                kept.keep(rows, step.gather(output, rows.tree, rows), graph=True)
                outputs = kept.read(rows, rows.index + 1)
            else:
                outputs = step.gather(output, mb["tree"], rows)
                before = kept.read(rows, rows.stored_parts) if grouped else None
                if before is not None:
                    outputs = {k: v + before[k] for k, v in outputs.items()}
            loss, num_tokens, log = step.loss(i, outputs, mb)
            logs.append(log)
            total_tokens = total_tokens + num_tokens  # a tensor: no host sync per micro-batch
            if not forward_only:
                if config.grad_scale_func is not None:
                    loss = config.grad_scale_func(loss)
                if loss.requires_grad:
                    backward(loss, final=i == last and not rows.ends_group)
                if rows.ends_group:
                    for part in reversed(range(rows.stored_parts)):
                        tensors, grads = kept.backward_args(rows.group, part)
                        if tensors:
                            backward(tensors, grads, final=i == last and part == 0)
            if rows.ends_group:
                store.clear()
                kept.drop(rows.group)
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            [model], total_tokens if config.calculate_per_token_loss else None
        )
    return logs


# ---------------------------------------------------------------------------------------------
# Through Megatron's schedules: the trunk parts run twice
# ---------------------------------------------------------------------------------------------


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


@contextlib.contextmanager
def _held_grad_sync(config):
    """A schedule call whose backward passes must not start gradient sync or finalize: the real
    ``no_sync`` held around it, the schedule given none, no finalize."""
    saved = config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func
    no_sync = saved[1] if isinstance(saved[1], list) else [saved[1]] if saved[1] is not None else []
    with contextlib.ExitStack() as stack:
        for enter in no_sync:
            stack.enter_context(enter())
        config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func = (
            None,
            None,
            None,
        )
        try:
            yield
        finally:
            config.finalize_model_grads_func, config.no_sync_func, config.grad_sync_func = saved


def run_trunks_scheduled(
    step, packed, *, forward_only: bool, ep_group=None, router_stats: bool = False
) -> list[dict]:
    """Run a batch with trunk groups through Megatron's schedules (any pipeline layout).

    Megatron's schedules run the backward passes in forward order, but a trunk part's backward
    must follow its later parts'. So the trunk parts run twice:

    1. every trunk part forward without grad (its attention records its keys and values, which
       later parts extend as leaves); its head outputs for the group kept as leaves. With
       ``router_stats`` (an MoE model with router losses) every other part of the group runs here
       too, so that the routers sum their statistics over the group. Forward-only steps take the
       losses of the sequences ending in a trunk part here, and stop after 2.
    2. every other micro-batch (branches, ordinary trees) forward and backward: branches attend to
       the recorded keys and values and add the kept outputs, leaving gradients on both;
    3. every trunk part again, last part of each group first, forward and backward: the loss of the
       sequences ending in it, plus a term whose gradient is what the later micro-batches left on
       its kept outputs; its attention adds the gradients left on its recorded keys and values.

    Cost: one more forward of the trunk parts (a third of their forward + backward FLOPs; with
    ``router_stats``, of every part of a group). Memory: the trunk's keys and values
    (2 x L x [n_trunk, b, ng, hn] on each stage for its layers) and the kept outputs; activations
    are the schedule's own, one micro-batch's at a time per stage (not the trunk's on top of a
    branch's). Gradient sync and finalize wait for the last call, which also reports the earlier
    calls' loss tokens. With ``ep_group`` (expert parallelism: tokens cross the data-parallel
    ranks inside every forward and backward) every call runs as many micro-batches on every rank.
    """
    requires_grad = not forward_only
    stores: dict[int, KeyValueStore] = {}
    kept = _KeptOutputs(requires_grad)
    items = list(enumerate(packed))
    first_items = [
        (i, mb)
        for i, mb in items
        if mb["rows"].records or (router_stats and mb["rows"].group is not None)
    ]
    others = [(i, mb) for i, mb in items if not mb["rows"].records]
    last_first = sorted(
        [(i, mb) for i, mb in items if mb["rows"].records],
        key=lambda item: (item[1]["rows"].group, -item[1]["rows"].index),
    )
    phase = {"collect": False}

    def store_of(rows):
        if rows.group is None:
            return None
        store = stores.setdefault(rows.group, KeyValueStore(requires_grad))
        store.collecting = phase["collect"]
        return store

    def forward_step_of(loss_of):
        return step.forward_step(loss_of, store_of)

    def no_loss(output):
        return output.new_zeros(()), torch.zeros((), dtype=torch.int, device=output.device), {}

    def first_pass(i, mb, output):
        rows = mb["rows"]
        if not rows.records:  # a branch collecting router statistics
            return no_loss(output)
        kept.keep(rows, step.gather(output, rows.tree, rows))
        if forward_only:
            return step.loss(i, kept.read(rows, rows.index + 1), mb)
        return no_loss(output)

    def branch(i, mb, output):
        rows = mb["rows"]
        outputs = step.gather(output, mb["tree"], rows)
        before = None if rows.group is None else kept.read(rows, rows.stored_parts)
        if before is not None:
            outputs = {k: v + before[k] for k, v in outputs.items()}
        return step.loss(i, outputs, mb)

    def recompute(i, mb, output):
        rows = mb["rows"]
        full = step.gather(output, rows.tree, rows)
        before = kept.read(rows, rows.index)
        outputs = {
            k: v[rows.group_tokens] + (0 if before is None else before[k]) for k, v in full.items()
        }
        loss, *rest = step.loss(
            i, outputs, mb
        )  # Megatron's (loss, num_tokens, logs) or (loss, logs)
        leaves = kept.leaves[(rows.group, rows.index)]
        for k, v in full.items():
            if v.requires_grad:
                loss = loss + _SendLeafGrad.apply(v, leaves[k])
        return (loss, *rest)

    counts = _equal_counts([len(first_items), len(others), len(last_first)], ep_group)
    template = packed[0]
    phase["collect"] = True
    with torch.no_grad():
        logs = step.schedule(
            first_items,
            forward_step_of(first_pass),
            forward_only=True,
            count=counts[0],
            template=template,
        )
    phase["collect"] = False
    if forward_only:
        return logs + step.schedule(
            others, forward_step_of(branch), forward_only=True, count=counts[1], template=template
        )
    with _held_grad_sync(step.config):
        logs += step.schedule(
            others, forward_step_of(branch), forward_only=False, count=counts[1], template=template
        )
    if step.config.calculate_per_token_loss and step.config.finalize_model_grads_func is not None:
        step.extra_tokens = sum(round(step.counts[i]) for i, _ in others)
    logs += step.schedule(
        last_first,
        forward_step_of(recompute),
        forward_only=False,
        count=counts[2],
        template=template,
    )
    for store in stores.values():
        store.clear()
    return logs


def _equal_counts(counts: list[int], group) -> list[int]:
    """The largest of each count over ``group`` (the counts themselves without one)."""
    if group is None:
        return counts
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    values = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values.tolist()
