"""AReaL 1.0.4's own Megatron engine (``MegatronPPOActor`` / ``MegatronPPOCritic``) as a test
fixture: an engine builder through AReaL's own creation path, an AReaL-format batch, and the
parameter gradients of a ``train_batch``.

Run inside a gloo world (``harness.dist.run_spawned``), after
:func:`~harness.areal_platform.setup_cpu` on a CPU machine.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from megatron_tree.patches._scoped import swapped

# Tokens per micro-batch of the test engines: the whole test batch (384 tokens of
# branching_sequences) in one; AReaL's tree path pads every tree to it (pad_to_maximum).
MB_TOKENS = 512


def _ensure_parallel_state(tp: int, cp: int) -> None:
    """AReaL's create_process_group initializes Megatron's parallel_state only when it creates the
    world itself; in a world made by the test harness it uses the layout already there, so make it
    TP=``tp`` x CP=``cp`` first."""
    from megatron.core import parallel_state as mpu

    from .dist import reinitialize_model_parallel

    if (
        mpu.model_parallel_is_initialized()
        and mpu.get_tensor_model_parallel_world_size() == tp
        and mpu.get_context_parallel_world_size() == cp
    ):
        return
    reinitialize_model_parallel(tp=tp, cp=cp)


def _rank_env() -> None:
    """``initialize`` reads RANK / LOCAL_RANK / WORLD_SIZE from the environment (torchrun's)."""
    import torch.distributed as dist

    os.environ["RANK"] = str(dist.get_rank())
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())


def engine_class(module, name: str, engine_cls: type | None):
    """AReaL's trainer looks its engine classes up at call time (``PPOTrainer
    ._create_train_engine`` / ``_create_critic``: ``areal.engine.MegatronPPOActor``,
    ``FSDPPPOActor``, ``archon_engine.ArchonPPOActor``, ...): ``engine_cls`` takes
    ``module.name``'s place for the block (the documented switch); None leaves AReaL's."""
    getattr(module, name)  # resolves a lazy import
    if engine_cls is None:
        return contextlib.nullcontext()
    return swapped(module, **{name: engine_cls})


def dp_shards(seqs: list) -> list[list]:
    """Two data-parallel ranks' shares of :func:`~harness.models.branching_sequences`: rank 0
    every other sequence (3 micro-batches of 48 tokens), rank 1 two sequences (2)."""
    return [seqs[0::2], seqs[1:10:8]]


def assert_same_update(ours: dict, stock: dict) -> None:
    """One ``ppo_update`` (AReaL's ``grpo_loss_fn``) of two engines: the same gradients and the
    same loss and importance-weight statistics (``grads``, ``stats`` as the runs record them)."""
    from megatron_tree.testing.reference import gradient_errors
    from megatron_tree.testing.tolerances import GRAD_RTOL, LOSS_RTOL

    assert len(stock["grads"]) == len(ours["grads"]) == 1
    errors = gradient_errors(ours["grads"][0], stock["grads"][0])
    assert max(errors.values()) <= GRAD_RTOL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    keys = [k for k in stock["stats"] if "loss" in k or "importance_weight" in k]
    assert keys
    for key in keys:
        want, got = stock["stats"][key], ours["stats"][key]
        assert abs(got - want) <= LOSS_RTOL * max(abs(want), 1e-6), (key, got, want)


def make_config(
    path: str,
    *,
    critic: bool = False,
    tree: bool = False,
    dtype: str = "float32",
    mb_tokens: int = MB_TOKENS,
    bridge_type: str = "mbridge",
    **config,
):
    """AReaL's ``PPOActorConfig`` (``critic``: ``PPOCriticConfig``) for the HF checkpoint at
    ``path`` with the Megatron engine config: ``enable_tree_training=tree``,
    ``mb_spec.max_tokens_per_mb=mb_tokens``, ``pad_to_maximum=tree`` (AReaL's tree path refuses
    False: "No padding is not supported for tree training"), ``gradient_checkpointing=False``,
    ``dtype``, an Adam optimizer at lr 0 without warmup (clipping at 1.0), dropout off, Megatron's
    non-distributed optimizer, ``megatron.bridge_type=bridge_type``; ``config`` replaces any field
    (an ``optimizer`` dict updates the optimizer's fields)."""
    from areal.api.cli_args import (
        DistributedDataParallelConfig,
        MegatronEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        PPOActorConfig,
        PPOCriticConfig,
    )

    optimizer = dict(lr=0.0, warmup_steps_proportion=0.0, gradient_clipping=1.0)
    optimizer.update(config.pop("optimizer", {}))
    fields = dict(
        experiment_name="megatron_tree",
        trial_name="test",
        path=path,
        enable_tree_training=tree,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=mb_tokens),
        pad_to_maximum=tree,
        gradient_checkpointing=False,
        disable_dropout=True,
        dtype=dtype,
        optimizer=OptimizerConfig(**optimizer),
        # Megatron's DistributedOptimizer accepts only torch.cuda tensor types ("Wrapped parameters
        # must be one of torch.cuda.FloatTensor, ..."): the plain one on a CPU.
        megatron=MegatronEngineConfig(
            ddp=DistributedDataParallelConfig(use_distributed_optimizer=False),
            bridge_type=bridge_type,
        ),
    )
    if critic:
        fields["is_critic"] = True  # AReaL's critic YAMLs set it; its config defaults to False
    else:
        fields["ppo_n_minibatches"] = 1
    fields.update(config)
    return (PPOCriticConfig if critic else PPOActorConfig)(**fields)


def build_areal_engine(
    path: str,
    *,
    critic: bool = False,
    tree: bool = False,
    tp: int = 1,
    cp: int = 1,
    dtype: str = "float32",
    mb_tokens: int = MB_TOKENS,
    engine_cls: type | None = None,
    fp32_params: bool = False,
    bridge_args: dict | None = None,
    bridge_type: str = "mbridge",
    total_train_steps: int = 10,
    **config,
):
    """AReaL's Megatron PPO actor (``critic``: critic) for the HF checkpoint at ``path``, made the
    way AReaL's trainer makes it and initialized.

    The config is :func:`make_config`'s. The engine comes from ``PPOTrainer._create_train_engine``
    (``_create_critic``), called without a trainer (it reads nothing of the trainer outside
    single-controller mode, which is switched off with ``AREAL_SPMD_MODE=1``), with a
    ``ModelAllocation("megatron", ..., ParallelStrategy(tp, cp, dp = the rest))``; that calls
    ``create_process_group``. Then ``initialize(None, FinetuneSpec(...))``.

    Args:
        engine_cls: a subclass to build instead of AReaL's class (e.g. an adapter's); it is put in
            ``areal.engine``'s place for the call, where AReaL's trainer looks it up.
        tp, cp: the Megatron layout; the world's parallel_state is set to it first.
        dtype: the engine's ``dtype``. Note: with ``gradient_checkpointing=False`` AReaL's
            mbridge path builds bf16 parameters even for "float32" (mbridge's config is made in
            bf16 at ``from_pretrained``); nothing here changes that. For an fp32 reference, use
            ``fp32_params``.
        fp32_params: for AReaL's own stock engine only (not ``tree``, no ``engine_cls``), as the
            fp32 reference: the bridge's Megatron config is rebuilt after AReaL sets
            ``bridge.dtype`` (what its ``set_extra_args`` does when gradient checkpointing is on),
            so the parameters are fp32. Test-side only; the engine under test gets no such help.
        bridge_type: AReaL's ``megatron.bridge_type``: "mbridge" or "megatron-bridge" (AReaL builds
            the model from Megatron-Bridge's provider; its stock engine there gets the provider's
            local layer spec, TE's being unbuildable on a CPU).
        bridge_args: Megatron config fields set on the engine's mbridge bridge once it is built
            (``bridge.set_extra_args``), for any engine: e.g. the router losses, which mbridge's
            MoE bridges (and so AReaL) leave off (``moe_router_load_balancing_type="none"``).
    """
    import torch.distributed as dist
    from areal.api import FinetuneSpec
    from areal.api.alloc_mode import ModelAllocation, ParallelStrategy
    from areal.api.cli_args import SchedulingStrategy
    from areal.trainer.rl_trainer import PPOTrainer

    from .areal_platform import packed_sequences_in_local_attention, stock_megatron_bridge_on_cpu

    _ensure_parallel_state(tp, cp)
    _rank_env()
    os.environ["AREAL_SPMD_MODE"] = "1"  # not single-controller: the trainer builds in-process
    cfg = make_config(
        path,
        critic=critic,
        tree=tree,
        dtype=dtype,
        mb_tokens=mb_tokens,
        bridge_type=bridge_type,
        **config,
    )
    world = dist.get_world_size()
    alloc = ModelAllocation(
        backend="megatron",
        name="critic" if critic else "actor",
        parallel=ParallelStrategy(
            tensor_parallel_size=tp,
            context_parallel_size=cp,
            data_parallel_size=world // (tp * cp),
        ),
        scheduling_strategy=SchedulingStrategy(),
    )
    trainer = SimpleNamespace(scheduler=None)  # _create_* read self.scheduler only when remote
    create = PPOTrainer._create_critic if critic else PPOTrainer._create_train_engine
    if fp32_params and (tree or engine_cls is not None):
        raise ValueError("fp32_params is for AReaL's own stock (non-tree) reference engine only")
    import areal.engine as engines

    name = "MegatronPPOCritic" if critic else "MegatronPPOActor"
    with engine_class(engines, name, engine_cls):
        engine = create(trainer, cfg, alloc)
    if fp32_params and bridge_type == "mbridge":  # Megatron-Bridge builds in the asked dtype
        _rebuild_bridge_config_after_dtype(engine)
    if bridge_args:
        _set_bridge_args(engine, bridge_args)
    # AReaL's THD forward on Megatron's local attention, for every engine but the package's trees
    ours = tree and getattr(engine, "tree_training", False)
    with contextlib.ExitStack() as stack:
        if not ours:
            stack.enter_context(packed_sequences_in_local_attention())
            if bridge_type == "megatron-bridge":
                stack.enter_context(stock_megatron_bridge_on_cpu())
        engine.initialize(
            None,
            FinetuneSpec(total_train_epochs=1, dataset_size=total_train_steps, train_batch_size=1),
        )
    return engine


def _rebuild_bridge_config_after_dtype(engine) -> None:
    """mbridge builds ``bridge.config`` (params_dtype, bf16) in ``from_pretrained`` with its
    default bf16; AReaL's ``_build_hf_mcore_bridge`` then sets ``bridge.dtype = engine.dtype`` but
    rebuilds the config only through ``set_extra_args`` (gradient checkpointing on). Rebuild it
    here for this engine, on the instance."""
    build = engine._build_hf_mcore_bridge

    def build_hf_mcore_bridge():
        bridge = build()
        bridge.config = bridge._build_config()
        return bridge

    engine._build_hf_mcore_bridge = build_hf_mcore_bridge


def _set_bridge_args(engine, args: dict) -> None:
    """``bridge.set_extra_args(**args)`` after the engine's ``_build_hf_mcore_bridge`` (on the
    instance), before AReaL reads ``bridge.config``."""
    if engine.bridge_cls != "mbridge":
        raise ValueError(
            f"bridge_args are set on an mbridge bridge; this engine's bridge_type is "
            f"{engine.bridge_cls!r}: leave bridge_args unset"
        )
    build = engine._build_hf_mcore_bridge

    def build_hf_mcore_bridge():
        bridge = build()
        bridge.set_extra_args(**args)
        return bridge

    engine._build_hf_mcore_bridge = build_hf_mcore_bridge


@contextlib.contextmanager
def unpadded_micro_batches() -> Iterator[None]:
    """AReaL's stock engine pads each micro-batch to a multiple of 256 tokens
    (``areal.utils.data.N_TOKENS_PER_PAGE``, GPU memory pages) with extra tokens that pass through
    the model; an MoE model's routers count them in the router losses (load balancing, z-loss).
    Inside the block it pads nothing (at TP = CP = 1), so its router losses are those of the
    unpacked batch: the reference for the tree engine's."""
    from areal.utils import data

    from megatron_tree.patches._scoped import swapped

    with swapped(data, N_TOKENS_PER_PAGE=1):
        yield


def parameter_dtypes(engine) -> set[torch.dtype]:
    """The dtypes of the engine's model parameters."""
    return {p.dtype for model in engine.model for p in model.parameters()}


def areal_trajectories(
    seqs: list[torch.Tensor],
    *,
    prompt_lens: list[int] | None = None,
    logprobs: list[torch.Tensor] | None = None,
    rewards: list[float] | None = None,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Per-trajectory dicts as AReaL's RLVR workflow returns them (each tensor ``[1, L_i]``, the
    reward ``[1]``): ``input_ids`` (int32), ``attention_mask`` (bool, all True), ``loss_mask``
    (int32, 0 on the prompt, 1 on the response), ``logprobs`` (float32, the rollout's log-prob of
    token t at position t, 0 on the prompt), ``versions`` (int32, -1 on the prompt, 0 on the
    response), ``rewards`` (float32). This list is what ``PPOTrainer`` hands to
    ``actor.compute_logp``, ``compute_advantages`` and ``ppo_update``.

    Args:
        seqs: 1-D token tensors.
        prompt_lens: prompt tokens of each sequence (default 1: every later token is a response
            token).
        logprobs: the rollout log-probs of each sequence in HF order (``L_i - 1`` values, of tokens
            1 .. L_i - 1, e.g. :func:`~harness.models.hf_logprobs`); default 0.
        rewards: one per sequence; default drawn from N(0, 1) with ``seed``.
    """
    g = torch.Generator().manual_seed(seed)
    if rewards is None:
        rewards = torch.randn(len(seqs), generator=g).tolist()
    out = []
    for i, s in enumerate(seqs):
        n, p = len(s), 1 if prompt_lens is None else prompt_lens[i]
        logp = torch.zeros(n)
        if logprobs is not None:
            logp[1:] = logprobs[i].float()
        response = torch.arange(n) >= p
        traj = {
            "input_ids": s.to(torch.int32),
            "loss_mask": response.to(torch.int32),
            "logprobs": logp * response,
            "versions": torch.where(response, 0, -1).to(torch.int32),
            "attention_mask": torch.ones(n, dtype=torch.bool),
            "rewards": torch.tensor(float(rewards[i])),
        }
        out.append({k: v.unsqueeze(0) for k, v in traj.items()})
    return out


def areal_batch(seqs: list[torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
    """:func:`areal_trajectories` concatenated the way AReaL's engines do it (its own
    ``concat_padded_tensors``): ``[B, L]`` tensors, right-padded (``attention_mask`` False on the
    padding), ``rewards`` ``[B]``."""
    from areal.utils.data import concat_padded_tensors

    return concat_padded_tensors(areal_trajectories(seqs, **kwargs))


def per_sequence(batch_values: torch.Tensor, seqs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """AReaL's per-token outputs ``[B, L]`` (``compute_logp``: position t holds the log-prob of
    token t + 1) as ``{sequence: L_i - 1 values}``, the order of
    :func:`~harness.models.hf_logprobs`."""
    return {i: batch_values[i, : len(s) - 1].float() for i, s in enumerate(seqs)}


@contextlib.contextmanager
def captured_grads(engine) -> Iterator[list[dict[str, torch.Tensor]]]:
    """The parameter gradients of each ``train_batch`` in the block, as AReaL's backward left them.

    ``train_batch`` zeroes the gradients first (``optimizer_zero_grad``), runs the forward-backward
    into Megatron DDP's ``main_grad`` buffers, then calls ``engine.optimizer_step()``, whose
    Megatron ``optimizer.step()`` clips the gradients in place (the fp32 optimizer's ``.grad`` is
    the ``main_grad`` buffer) before stepping. So the engine's ``optimizer_step`` is wrapped, on the
    instance, to copy every ``main_grad`` (by the unwrapped model's parameter names) before it
    runs: raw, unclipped, unscaled, one dict per ``optimizer_step``. The step itself still runs (at
    the builder's lr 0 it leaves the weights unchanged). A critic's value head, which AReaL puts in
    place of the output layer after DDP has laid out its buffers, has no ``main_grad``: its
    ``.grad`` is read."""
    from megatron_tree.testing.reference import parameter_grads

    grads: list[dict[str, torch.Tensor]] = []
    step = engine.optimizer_step

    def optimizer_step():
        merged: dict[str, torch.Tensor] = {}
        for chunk in engine.model:
            merged.update(parameter_grads(chunk, prefix="module."))
            merged.update(parameter_grads(chunk, prefix="module.", main_grad=True))
            missing = {n.removeprefix("module.") for n, _ in chunk.named_parameters()} - set(merged)
            if missing:
                raise ValueError(f"parameters without a gradient: {sorted(missing)}")
        grads.append(merged)
        return step()

    engine.optimizer_step = optimizer_step
    try:
        yield grads
    finally:
        del engine.optimizer_step  # the class's method again


@contextlib.contextmanager
def captured_expert_tokens(engine) -> Iterator[list[dict[str, torch.Tensor]]]:
    """The routers' expert-bias token counts (``router.local_tokens_per_expert``, by buffer name)
    of each ``train_batch`` in the block, as the forward passes left them: copied when the step
    calls its config's ``finalize_model_grads_func``, which updates the expert bias from them and
    zeroes them. Nothing for routers without expert bias."""
    from megatron.core.utils import get_model_config

    counts: list[dict[str, torch.Tensor]] = []
    config = get_model_config(engine.model[0])
    finalize = config.finalize_model_grads_func

    def finalize_model_grads(*args, **kwargs):
        counts.append(
            {
                name: buffer.detach().clone()
                for chunk in engine.model
                for name, buffer in chunk.named_buffers()
                if name.endswith("router.local_tokens_per_expert")
            }
        )
        return finalize(*args, **kwargs)

    config.finalize_model_grads_func = finalize_model_grads
    try:
        yield counts
    finally:
        config.finalize_model_grads_func = finalize


def trie_depths(seqs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """For each sequence, the trie depth of each predicted token (tokens 1 .. L_i - 1, the order of
    :func:`per_sequence`): the number of branch points on its path from the root, a branch point
    being a prefix that more than one distinct continuation (or a sequence's end) follows. Depth 0
    is the root's unbranched trunk."""
    followers: dict[tuple, set] = {}
    for s in seqs:
        t = s.tolist()
        for j in range(1, len(t) + 1):
            followers.setdefault(tuple(t[:j]), set()).add(t[j] if j < len(t) else None)
    out = {}
    for i, s in enumerate(seqs):
        t = s.tolist()
        depth, depths = 0, []
        for j in range(1, len(t)):
            if len(followers[tuple(t[:j])]) > 1:
                depth += 1
            depths.append(depth)
        out[i] = torch.tensor(depths)
    return out


def error_by_depth(
    got: dict[int, torch.Tensor], want: dict[int, torch.Tensor], seqs: list[torch.Tensor]
) -> dict[int, float]:
    """Largest ``|got - want|`` over the tokens at each :func:`trie_depths` depth; ``inf`` at a
    depth where either holds a NaN or inf."""
    from megatron_tree.testing.tolerances import max_abs_error

    depths = trie_depths(seqs)
    out: dict[int, float] = {}
    for i in want:
        for d in depths[i].unique().tolist():
            at = depths[i] == d
            out[d] = max(out.get(d, 0.0), max_abs_error(got[i].float()[at], want[i].float()[at]))
    return dict(sorted(out.items()))


def logp_run(path: str, seqs: list, **engine) -> dict:
    """AReaL's ``compute_logp`` on :func:`areal_batch` of ``seqs`` with an engine of
    :func:`build_areal_engine` (``engine``: its options): the engine class's name, its parameter
    dtypes, the log-probs :func:`per_sequence` and the seconds it took."""
    start = time.perf_counter()
    eng = build_areal_engine(path, **engine)
    logp = eng.compute_logp([areal_batch(seqs)])[0]
    out = {
        "engine": type(eng).__name__,
        "dtypes": parameter_dtypes(eng),
        "logp": per_sequence(logp, seqs),
        "seconds": time.perf_counter() - start,
    }
    eng.destroy()
    return out


def train_run(path: str, seqs: list, hf: dict, **engine) -> dict:
    """PPOTrainer's order on one rollout: compute_advantages, then ppo_update (one train_batch),
    on-policy (the rollout log-probs are HF's), lr 0; the gradients as the backward left them.
    ``engine``: :func:`build_areal_engine`'s options (default: the stock engine in fp32). The
    prompts are the first 4 tokens. Returns the gradients (:func:`captured_grads`), AReaL's
    exported stats, whether the step left the weights unchanged, the routers' expert-bias token
    counts (:func:`captured_expert_tokens`) and expert bias after the step, the tree engine's
    ``tree_stats`` and the seconds it took."""
    from areal.utils import stats_tracker

    start = time.perf_counter()
    eng = build_areal_engine(path, **(engine or {"fp32_params": True}))
    before = {n: p.detach().clone() for n, p in eng.model[0].named_parameters()}
    trajectories = areal_trajectories(
        seqs, prompt_lens=[4] * len(seqs), logprobs=[hf[i] for i in range(len(seqs))]
    )
    batch = eng.compute_advantages(trajectories)
    with captured_grads(eng) as grads, captured_expert_tokens(eng) as expert_tokens:
        eng.ppo_update(batch)
    stats = stats_tracker.export_all()
    unchanged = all(torch.equal(p, before[n]) for n, p in eng.model[0].named_parameters())
    out = {
        "grads": grads,
        "stats": stats,
        "unchanged": unchanged,
        # aux-loss-free balancing: the routed token counts and the bias the step moved by them
        "expert_tokens": expert_tokens,
        "expert_bias": {
            n: b.detach().clone()
            for n, b in eng.model[0].named_buffers()
            if n.endswith("router.expert_bias")
        },
        "tree_stats": getattr(eng, "tree_stats", None),
        "seconds": time.perf_counter() - start,
    }
    eng.destroy()
    return out
