"""AReaL 1.0.4's own FSDP engine (``FSDPPPOActor`` / ``FSDPPPOCritic``) as a test fixture on the
CPU: an engine builder through AReaL's own creation path, a CPU stand-in for its packed (varlen
flash-attention) forward, and the parameter gradients of a ``train_batch``.

Run inside a gloo world (``harness.dist.run_spawned(..., megatron=False)``), after
:func:`setup_fsdp_cpu`. The batches and configs are :mod:`harness.areal`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from .areal import MB_TOKENS, engine_class, make_config


def setup_fsdp_cpu() -> None:
    """The AReaL harness's stand-ins (:func:`~harness.areal_platform.setup_cpu`),
    and the FSDP engine's tokenizer made optional (:func:`optional_tokenizer`)."""
    from .areal_platform import setup_cpu

    setup_cpu()  # before AReaL's first import
    from areal.engine import fsdp_engine

    optional_tokenizer(fsdp_engine)


def optional_tokenizer(engine_module) -> None:
    """An engine module's ``load_hf_tokenizer`` gives None for a checkpoint without tokenizer
    files: ``_create_device_model`` loads the tokenizer (used only to save HF checkpoints), and
    the tiny test checkpoints have none."""
    original = engine_module.load_hf_tokenizer

    def load_hf_tokenizer(path, *args, **kwargs):
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        if not any(os.path.exists(os.path.join(path, f)) for f in names):
            return None
        return original(path, *args, **kwargs)

    engine_module.load_hf_tokenizer = load_hf_tokenizer


def _segments(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """[n] the packed sequence of each row (rows past ``cu_seqlens[-1]``, the padding, one more)."""
    return torch.searchsorted(cu_seqlens[1:].to(torch.long), torch.arange(n), right=True)


@contextlib.contextmanager
def packed_sdpa() -> Iterator[None]:
    """AReaL's stock FSDP forward packs a micro-batch's sequences into one row and hands HF
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` for flash-attention's varlen kernel (its default
    ``attn_impl``), which needs CUDA. Inside the block HF's ``"sdpa"`` attention reads them the same
    way: a causal block-diagonal mask ([1, 1, n, n], one block per sequence) over torch's SDPA, so
    the stock engine runs with ``attn_impl="sdpa"`` on a CPU. Without them it is HF's own."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def packed(module, query, key, value, attention_mask, **kwargs):
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if attention_mask is not None or query.shape[0] != 1 or not torch.equal(cu_q, cu_k):
            raise ValueError("packed_sdpa: expected one packed row, no mask, cu_q == cu_k")
        n = query.shape[2]
        seg = _segments(cu_q.cpu(), n)
        rows = torch.arange(n)
        allowed = (seg[:, None] == seg[None, :]) & (rows[None, :] <= rows[:, None])  # [n, n]
        kwargs = {k: v for k, v in kwargs.items() if k != "is_causal"}
        mask = allowed.to(query.device)[None, None]
        return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)

    AttentionInterface.register("sdpa", packed)
    try:
        yield
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)


def build_fsdp_engine(
    path: str,
    *,
    critic: bool = False,
    tree: bool = False,
    engine_cls: type | None = None,
    mb_tokens: int = MB_TOKENS,
    total_train_steps: int = 10,
    **config,
):
    """AReaL's FSDP PPO actor (``critic``: critic) for the HF checkpoint at ``path``, made the way
    AReaL's trainer makes it (``PPOTrainer._create_train_engine`` / ``_create_critic`` with a
    ``ModelAllocation("fsdp", ...)``, data parallel over the world) and initialized (FSDP2
    ``fully_shard`` on gloo). A critic's value head is initialized from torch's global RNG: seed it
    the same before building two critics to compare.

    Args:
        tree: ``enable_tree_training``.
        engine_cls: a subclass to build instead of AReaL's class, put in ``areal.engine``'s place
            for the call.
        mb_tokens: ``mb_spec.max_tokens_per_mb``.
        config: :func:`~harness.areal.make_config`'s fields (fp32, lr 0, dropout off,
            no gradient checkpointing); ``attn_impl`` defaults to ``"sdpa"`` (flash-attention
            needs CUDA; run AReaL's stock engine inside :func:`packed_sdpa`).
    """
    import torch.distributed as dist
    from areal.api import FinetuneSpec
    from areal.api.alloc_mode import ModelAllocation, ParallelStrategy
    from areal.api.cli_args import SchedulingStrategy
    from areal.trainer.rl_trainer import PPOTrainer

    for name, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size())):
        os.environ[name] = str(value)
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    os.environ["AREAL_SPMD_MODE"] = "1"  # not single-controller: the trainer builds in-process
    config.setdefault("attn_impl", "sdpa")
    cfg = make_config(path, critic=critic, tree=tree, mb_tokens=mb_tokens, **config)
    alloc = ModelAllocation(
        backend="fsdp",
        name="critic" if critic else "actor",
        parallel=ParallelStrategy(data_parallel_size=dist.get_world_size()),
        scheduling_strategy=SchedulingStrategy(),
    )
    trainer = SimpleNamespace(scheduler=None)  # read only in single-controller mode
    create = PPOTrainer._create_critic if critic else PPOTrainer._create_train_engine
    import areal.engine as engines

    name = "FSDPPPOCritic" if critic else "FSDPPPOActor"
    with engine_class(engines, name, engine_cls):
        engine = create(trainer, cfg, alloc)
    engine.initialize(
        None,
        FinetuneSpec(total_train_epochs=1, dataset_size=total_train_steps, train_batch_size=1),
    )
    return engine


@contextlib.contextmanager
def captured_grads(engine, named_parameters=None) -> Iterator[list[dict[str, torch.Tensor]]]:
    """The parameter gradients of each ``train_batch`` in the block, as the backward left them:
    ``engine.optimizer_step`` (which clips them in place, then steps) is wrapped on the instance to
    copy every parameter's full ``.grad`` (FSDP2 DTensors gathered) by name first.
    ``named_parameters``: what lists them (default ``engine.model.named_parameters``)."""
    named_parameters = named_parameters or engine.model.named_parameters
    grads: list[dict[str, torch.Tensor]] = []
    step = engine.optimizer_step

    def optimizer_step():
        merged = {}
        for name, param in named_parameters():
            if param.grad is None:
                raise ValueError(f"parameter {name} has no gradient")
            grad = param.grad
            merged[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
        grads.append(merged)
        return step()

    engine.optimizer_step = optimizer_step
    try:
        yield grads
    finally:
        del engine.optimizer_step  # the class's method again
