"""The step's loop for a batch packed with trunk reuse (``build_packed_tree_batch(share_trunks=True)``).

A trunk group's micro-batches depend on each other (branches attend to the trunk's keys and values,
and the trunk's backward needs the gradients every branch leaves on them), so they cannot run through
Megatron's pipeline schedules. This loop does what ``forward_backward_no_pipelining`` does for one
model chunk (gradient sync held back until the last backward, ``grad_scale_func``,
``finalize_model_grads_func`` with the token count) in this order:

1. trunk forward: its attention records every layer's keys and values; its head outputs for the
   whole group (the entries its rows predict, for every sequence of the group) are kept with their
   graph, and continue as leaves;
2. per branch: forward over [trunk keys/values ; own], outputs = own + the trunk's leaves, the loss
   of the sequences ending in it, backward (which leaves gradients on the trunk's key/value and
   output leaves);
3. the loss of the sequences ending inside the trunk (read from the leaves) joins the first
   backward of the group; then one trunk backward with the leaves' gradients.

Peak activation memory: the trunk's, plus one branch's, plus the trunk's keys and values.
Legend: T_G tokens of the group's sequences, T a micro-batch's.
"""

from __future__ import annotations

import contextlib

import torch

from ..core.mask import tree_attention_mask
from ..core.trunk import TrunkKeyValues, part_attention_mask


class _Trunk:
    """A running trunk: its key/value store, its outputs for the group [T_G] (with their graph)
    and the leaves the group's losses read."""

    def __init__(self, requires_grad: bool):
        self.store = TrunkKeyValues(requires_grad)
        self.outputs: dict[str, torch.Tensor] = {}
        self.leaves: dict[str, torch.Tensor] = {}

    def keep(self, outputs: dict[str, torch.Tensor]) -> None:
        self.outputs = outputs
        self.leaves = {k: v.detach().requires_grad_(v.requires_grad) for k, v in outputs.items()}

    def read(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[tokens] for k, v in self.leaves.items()}

    def backward_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(outputs, their gradients) for the trunk's one backward."""
        tensors, grads = [], []
        for name, out in self.outputs.items():
            grad = self.leaves[name].grad
            if out.requires_grad and grad is not None:
                tensors.append(out)
                grads.append(grad)
        return tensors, grads


def _no_sync(config):
    no_sync = config.no_sync_func
    if isinstance(no_sync, list):
        no_sync = no_sync[0]
    return contextlib.nullcontext() if no_sync is None else no_sync()


def check_trunk_parts(packed) -> bool:
    """Whether ``packed`` holds trunk-reuse parts; raises if a group's parts are out of order."""
    expected = None
    found = False
    for i, mb in enumerate(packed):
        part = mb.get("part")
        if part is None:
            if expected is not None:
                raise ValueError(f"micro-batch {i} interrupts trunk group {expected[0]}; keep a group's parts together")
            continue
        found = True
        if (part.group, part.index) != (expected or (part.group, 0)):
            raise ValueError(
                f"micro-batch {i} is part {part.index} of trunk group {part.group}, expected "
                f"{expected or (part.group, 0)}: a group's parts must run in order, trunk first"
            )
        expected = None if part.index == part.num_parts - 1 else (part.group, part.index + 1)
    if expected is not None:
        raise ValueError(f"trunk group {expected[0]} ends before its part {expected[1]}")
    return found


def run_with_trunks(model, packed, *, config, gather, tp_group, forward_only: bool, loss_of) -> list[dict]:
    """Forward (and backward) every micro-batch of ``packed`` in order; returns Megatron-style logs.

    Args:
        model: the model (one chunk, one pipeline stage).
        packed: the micro-batches on the model's device.
        gather: the head reading per-token outputs; tp_group: its vocab-parallel group.
        loss_of: ``loss_of(i, outputs, micro_batch) -> (loss, num_tokens, logs)``, Megatron's loss
            protocol for micro-batch ``i`` (the step's weighting and scale).
    """
    logs: list[dict] = []
    total_tokens = 0
    last = len(packed) - 1
    trunk: _Trunk | None = None
    with contextlib.ExitStack() as sync, torch.set_grad_enabled(torch.is_grad_enabled() and not forward_only):
        if not forward_only:
            sync.enter_context(_no_sync(config))

        def backward(tensors, grads=None, final=False):
            if final:
                sync.close()  # the last backward of the step lets gradient sync run
            torch.autograd.backward(tensors, grads)

        for i, mb in enumerate(packed):
            part = mb.get("part")
            if part is None:
                mask = tree_attention_mask(mb["tree"])
            else:
                if part.is_trunk:
                    trunk = _Trunk(requires_grad=not forward_only)
                mask = part_attention_mask(part, trunk.store)
            output = model(mb["input_ids"], mb["position_ids"], attention_mask=mask)
            if part is None:
                outputs = gather.gather(output, mb["tree"], tp_group)
            elif part.is_trunk:
                trunk.keep(gather.gather(output, part.tree, tp_group, part))
                outputs = trunk.read(part.group_tokens)
            else:
                own = gather.gather(output, mb["tree"], tp_group, part)
                from_trunk = trunk.read(part.group_tokens)
                outputs = {k: v + from_trunk[k] for k, v in own.items()}
            loss, num_tokens, log = loss_of(i, outputs, mb)
            logs.append(log)
            total_tokens = total_tokens + num_tokens  # a tensor: no host sync per micro-batch
            ends_group = part is not None and part.index == part.num_parts - 1
            if not forward_only:
                if config.grad_scale_func is not None:
                    loss = config.grad_scale_func(loss)
                if loss.requires_grad:
                    backward(loss, final=i == last and not ends_group)
                if ends_group:
                    tensors, grads = trunk.backward_args()
                    if tensors:
                        backward(tensors, grads, final=i == last)
            if ends_group:
                trunk.store.clear()
                trunk = None
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], total_tokens if config.calculate_per_token_loss else None)
    return logs
