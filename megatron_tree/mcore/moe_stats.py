"""Per-expert token counts of Megatron MoE layers, read by forward hooks on their routers.

Megatron's ``TopKRouter.forward`` returns ``(probs, routing_map)``, ``routing_map`` a bool
``[tokens, num_experts]`` over this rank's tokens (all experts, before dispatch): summing it over
tokens gives the tokens each expert receives from this rank. The counter hooks every router of the
model chunks while its block is open and accumulates those sums per layer, so a training step (or
any forward) reports the expert load it caused::

    with ExpertTokenCounter(model) as counter:
        result = tree_forward_backward(model, packed, loss_fn)
    counter.per_layer      # {"decoder.layers.0.mlp.router": tensor([n_0, ..., n_{E-1}]), ...}
    counter.totals()       # [E] summed over layers; counter.all_reduce(group) sums over ranks

What is counted: every routed token of every forward, the packed layout's padding tokens
included (the experts compute them too). In a tree a shared prefix token is routed once, so the
counts are the experts' actual work, not the unpacked batch's. Under activation recompute the
router runs again in the backward; those calls are not counted (the hook skips calls made while
autograd runs a backward). With sequence parallelism each tensor-parallel rank routes its shard
(sum over TP to get the whole); without it every TP rank routes every token (do not sum).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import Router


def _in_backward() -> bool:
    # A graph task id is set while autograd executes a backward (e.g. a recomputed forward).
    return torch._C._current_graph_task_id() != -1


class ExpertTokenCounter:
    """Context manager: tokens routed to each expert, per MoE layer, while the block is open.

    Args:
        models: a model or a list of model chunks (Megatron GPTModel, possibly wrapped).

    Raises:
        ValueError: the models hold no MoE router.
    """

    def __init__(self, models: torch.nn.Module | Iterable[torch.nn.Module]):
        chunks = [models] if isinstance(models, torch.nn.Module) else list(models)
        self._routers = [
            (f"{c}." * (len(chunks) > 1) + name, m)
            for c, chunk in enumerate(chunks)
            for name, m in chunk.named_modules()
            if isinstance(m, Router)
        ]
        if not self._routers:
            raise ValueError(
                "ExpertTokenCounter needs a model with MoE layers (no Megatron Router found)"
            )
        self.per_layer: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, name: str):
        def hook(module, args, output):
            if _in_backward():
                return
            routing_map = output[1]  # [tokens, num_experts], bool
            counts = (
                routing_map.reshape(-1, routing_map.shape[-1]).sum(0).to(torch.int64).detach().cpu()
            )
            self.per_layer[name] = self.per_layer.get(name, torch.zeros_like(counts)) + counts

        return hook

    def __enter__(self) -> ExpertTokenCounter:
        self.per_layer = {}
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in self._routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def totals(self) -> torch.Tensor:
        """[num_experts] int64: tokens per expert summed over the MoE layers."""
        if not self.per_layer:
            raise ValueError("no routed tokens counted yet: run a forward inside the block")
        return torch.stack(list(self.per_layer.values())).sum(0)

    def all_reduce(self, group=None) -> ExpertTokenCounter:
        """Sum the counts over the ranks of ``group`` (e.g. the data-parallel group), in place."""
        for counts in self.per_layer.values():
            dist.all_reduce(counts, group=group)
        return self

    def log_line(self) -> str:
        """``expert tokens: [n_0, ..., n_{E-1}] (max/mean 1.23)`` over all MoE layers."""
        totals = self.totals()
        imbalance = float(totals.max()) / max(float(totals.float().mean()), 1e-30)
        return f"expert tokens: {totals.tolist()} (max/mean {imbalance:.2f})"
