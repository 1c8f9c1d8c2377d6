"""AReaL 1.0.4's Archon engine (``ArchonPPOActor`` / ``ArchonPPOCritic``, its torchtitan-style
models under FSDP2) as a test fixture on the CPU: an engine builder through AReaL's own creation
path and the parameter gradients of a ``train_batch``.

Run inside a gloo world (``harness.dist.run_spawned(..., megatron=False)``), after
:func:`setup_archon_cpu`. The stock engine runs Archon's ``attn_type="sdpa"`` (its varlen default
calls flash-attention, CUDA only). The batches and configs are :mod:`harness.areal`'s.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from .areal import MB_TOKENS, engine_class, make_config

# Archon pads a stock micro-batch to a multiple of one 2 MiB page of hidden states
# (DEFAULT_PAGE_SIZE_BYTES // hidden // dtype bytes: 8192 rows for the tiny models' hidden 64 in
# fp32). Here a page is 64 such rows, so the stock reference runs 448 rows, not 8192; the padding
# rows are a sequence of their own, so how many there are changes no real token's result.
TEST_PAGE_BYTES = 64 * 64 * 4


def setup_archon_cpu() -> None:
    """The AReaL harness's stand-ins (:func:`~harness.areal_platform.setup_cpu`), Archon's
    tokenizer made optional, and its page padding at :data:`TEST_PAGE_BYTES`."""
    from .areal_fsdp import optional_tokenizer
    from .areal_platform import setup_cpu

    setup_cpu()  # before AReaL's first import
    from areal.experimental.engine import archon_engine

    optional_tokenizer(archon_engine)
    archon_engine.DEFAULT_PAGE_SIZE_BYTES = TEST_PAGE_BYTES
    from areal.experimental.models.archon.moe import router, token_reorderer

    router.torch = token_reorderer.torch = _TorchWithIntegerHistc()


class _TorchWithIntegerHistc:
    """Archon's MoE router and token reorderer count tokens per expert with ``torch.histc`` on
    int64 expert indices, which CUDA runs and the CPU refuses ("histogram_cpu" not implemented for
    'Long'): here the counts are taken in float64 (exact for any token count) and given back in
    the input's dtype, as CUDA does. Everything else is torch itself."""

    @staticmethod
    def histc(input, *args, **kwargs):
        if input.is_floating_point():
            return torch.histc(input, *args, **kwargs)
        return torch.histc(input.double(), *args, **kwargs).to(input.dtype)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def build_archon_engine(
    path: str,
    *,
    critic: bool = False,
    tree: bool = False,
    engine_cls: type | None = None,
    mb_tokens: int = MB_TOKENS,
    parallel: dict | None = None,
    archon: dict | None = None,
    total_train_steps: int = 10,
    **config,
):
    """AReaL's Archon PPO actor (``critic``: critic) for the HF checkpoint at ``path``, made the
    way AReaL's trainer makes it (``PPOTrainer._create_train_engine`` / ``_create_critic`` with a
    ``ModelAllocation("archon", ...)``) and initialized.

    Args:
        tree: ``enable_tree_training``.
        engine_cls: a subclass to build instead of AReaL's class, put in ``archon_engine``'s place
            for the call.
        mb_tokens: ``mb_spec.max_tokens_per_mb``.
        parallel: ``ParallelStrategy`` fields (default: data parallel over the world).
        archon: ``ArchonEngineConfig`` fields (default ``attn_type="sdpa"``).
        config: :func:`~harness.areal.make_config`'s fields (fp32, lr 0, dropout off, no
            gradient checkpointing); ``pad_to_maximum`` defaults to False (Archon's default;
            AReaL's own tree path forces it on).
    """
    import torch.distributed as dist
    from areal.api import FinetuneSpec
    from areal.api.alloc_mode import ModelAllocation, ParallelStrategy
    from areal.api.cli_args import ArchonEngineConfig, SchedulingStrategy
    from areal.trainer.rl_trainer import PPOTrainer

    for name, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size())):
        os.environ[name] = str(value)
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    os.environ["AREAL_SPMD_MODE"] = "1"  # not single-controller: the trainer builds in-process
    config.setdefault("pad_to_maximum", False)
    cfg = make_config(
        path,
        critic=critic,
        tree=tree,
        mb_tokens=mb_tokens,
        archon=ArchonEngineConfig(**{"attn_type": "sdpa", **(archon or {})}),
        **config,
    )
    alloc = ModelAllocation(
        backend="archon",
        name="critic" if critic else "actor",
        parallel=ParallelStrategy(**(parallel or {"data_parallel_size": dist.get_world_size()})),
        scheduling_strategy=SchedulingStrategy(),
    )
    trainer = SimpleNamespace(scheduler=None)  # read only in single-controller mode
    create = PPOTrainer._create_critic if critic else PPOTrainer._create_train_engine
    from areal.experimental.engine import archon_engine

    name = "ArchonPPOCritic" if critic else "ArchonPPOActor"
    with engine_class(archon_engine, name, engine_cls):
        engine = create(trainer, cfg, alloc)
    engine.initialize(
        None,
        FinetuneSpec(total_train_epochs=1, dataset_size=total_train_steps, train_batch_size=1),
    )
    return engine


def captured_grads(engine):
    """:func:`harness.areal_fsdp.captured_grads` by Archon's parameter names (every model part)."""
    from .areal_fsdp import captured_grads as captured

    return captured(engine, engine._get_model_name_parameters)
