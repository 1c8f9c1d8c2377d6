"""AReaL 1.0.4's own FSDP engine (``FSDPPPOActor``, FSDP2 on a 1-rank gloo world), made by AReaL's
trainer code (``PPOTrainer._create_train_engine`` -> ``initialize``) and driven by its PPO actor
(``compute_logp``, ``compute_advantages``, ``ppo_update`` with ``grpo_loss_fn``), tiny random Qwen3
on the CPU in fp32: AReaL's stock engine (its packed varlen forward on the CPU stand-in
``packed_sdpa``) and megatron_tree's ``TreeFSDPPPOActor`` in its place, on the branching sequences.
References: HF eager on each sequence alone, and the stock engine on the same batch. Runs on the
AReaL stack (``MEGATRON_TREE_BRIDGE=areal``); skipped elsewhere."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time

import pytest
import torch

from harness.areal import assert_same_update, dp_shards
from harness.dist import run_spawned
from harness.models import max_err
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL

ON_AREAL_STACK = os.environ.get("MEGATRON_TREE_BRIDGE") == "areal"
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("areal") is None and not ON_AREAL_STACK,
        reason="AReaL is not installed (the AReaL stack: MEGATRON_TREE_BRIDGE=areal)",
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines",
    ),
]


def _run(path: str, seqs: list, hf: dict, tree: bool, **engine) -> dict:
    """compute_logp on the batch, then PPOTrainer's compute_advantages and ppo_update (on-policy:
    the rollout log-probs are HF's; lr 0) with the gradients as the backward left them."""
    from areal.utils import stats_tracker

    from harness.areal import areal_batch, areal_trajectories, per_sequence
    from harness.areal_fsdp import build_fsdp_engine, captured_grads, packed_sdpa
    from megatron_tree.integrations.areal_fsdp import TreeFSDPPPOActor

    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if tree:
            eng = build_fsdp_engine(path, tree=True, engine_cls=TreeFSDPPPOActor, **engine)
        else:
            stack.enter_context(packed_sdpa())
            eng = build_fsdp_engine(path, **engine)
        logp = eng.compute_logp([areal_batch(seqs)])[0]
        trajectories = areal_trajectories(
            seqs, prompt_lens=[4] * len(seqs), logprobs=[hf[i] for i in range(len(seqs))]
        )
        batch = eng.compute_advantages(trajectories)
        stats_tracker.export_all()  # drop what compute_logp / advantages logged
        with captured_grads(eng) as grads:
            eng.ppo_update(batch)
        out = {
            "engine": type(eng).__name__,
            "attention": eng.model.config._attn_implementation,
            "checkpointing": eng.model.is_gradient_checkpointing,
            "logp": per_sequence(logp, seqs),
            "grads": grads,
            "stats": stats_tracker.export_all(),
            "tree_stats": getattr(eng, "tree_stats", None),
            "seconds": time.perf_counter() - start,
        }
        eng.destroy()
    return out


def _critic_run(path: str, seqs: list, tree: bool) -> dict:
    """A critic's compute_values, then its ppo_update (AReaL's value loss) on returns drawn with a
    fixed seed, lr 0; the value head is initialized from seed 0 for both engines."""
    from harness.areal import areal_trajectories
    from harness.areal_fsdp import build_fsdp_engine, captured_grads, packed_sdpa
    from megatron_tree.integrations.areal_fsdp import TreeFSDPPPOCritic

    with contextlib.ExitStack() as stack:
        torch.manual_seed(0)
        if tree:
            eng = build_fsdp_engine(path, critic=True, tree=True, engine_cls=TreeFSDPPPOCritic)
        else:
            stack.enter_context(packed_sdpa())
            eng = build_fsdp_engine(path, critic=True)
        trajectories = areal_trajectories(seqs, prompt_lens=[4] * len(seqs))
        values = eng.compute_values(trajectories)
        g = torch.Generator().manual_seed(7)
        for trajectory, value in zip(trajectories, values):
            trajectory["values"] = value.reshape(1, -1).float()
            trajectory["returns"] = torch.randn(trajectory["values"].shape, generator=g)
        with captured_grads(eng) as grads:
            eng.ppo_update(trajectories)
        out = {
            "engine": type(eng).__name__,
            "values": {i: v.reshape(-1).float() for i, v in enumerate(values)},
            "grads": grads,
        }
        eng.destroy()
    return out


def _fsdp_worker(rank: int, path: str, seqs: list) -> dict:
    from harness.areal_fsdp import setup_fsdp_cpu
    from harness.models import hf_logprobs

    setup_fsdp_cpu()  # AReaL imports only with its stand-ins
    hf = hf_logprobs(path, seqs)
    return {
        "hf": hf,
        "stock": _run(path, seqs, hf, False),
        "ours": _run(path, seqs, hf, True),
        "critic_stock": _critic_run(path, seqs, False),
        "critic_ours": _critic_run(path, seqs, True),
        "non_finite": _non_finite_run(path, seqs),
    }


def _non_finite_run(path: str, seqs: list) -> str:
    """compute_logp of the tree engine with one embedding row NaN (a token of some sequences):
    what it raises."""
    from harness.areal import areal_batch
    from harness.areal_fsdp import build_fsdp_engine
    from megatron_tree.integrations.areal_fsdp import TreeFSDPPPOActor

    eng = build_fsdp_engine(path, tree=True, engine_cls=TreeFSDPPPOActor)
    with torch.no_grad():
        weight = eng.model.get_input_embeddings().weight
        (weight.to_local() if hasattr(weight, "to_local") else weight)[int(seqs[0][-1])] = float(
            "nan"
        )
    try:
        eng.compute_logp([areal_batch(seqs)])
        return "ran"
    except FloatingPointError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        eng.destroy()


def _dp_worker(rank: int, path: str, seqs: list) -> dict:
    """Data parallel 2 (FSDP2 shards every parameter over the two ranks), HF gradient
    checkpointing on in both engines: each rank its share of the sequences
    (:func:`~harness.areal.dp_shards`);
    ours with 48-token micro-batches of 16-token blocks (rank 0 needs more than rank 1, which gets
    an all-padding fill-in so that both run as many forwards), the stock engine with one."""
    from harness.areal_fsdp import setup_fsdp_cpu
    from harness.models import hf_logprobs

    setup_fsdp_cpu()  # AReaL imports only with its stand-ins
    from megatron_tree.integrations.areal_fsdp import TreeFSDPPPOActor

    mine = dp_shards(seqs)[rank]
    hf = hf_logprobs(path, mine)
    stock = _run(path, mine, hf, False, gradient_checkpointing=True)
    TreeFSDPPPOActor.tree_block_size = 16  # this process only
    ours = _run(path, mine, hf, True, mb_tokens=48, gradient_checkpointing=True)
    return {"hf": hf, "stock": stock, "ours": ours}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from harness.models import make_hf_checkpoint

    path = str(tmp_path_factory.mktemp("areal_fsdp") / "qwen3")
    make_hf_checkpoint("qwen3", path)
    return path


@pytest.fixture(scope="module")
def fsdp_runs(checkpoint):
    from harness.models import branching_sequences

    seqs = branching_sequences()
    out = run_spawned(_fsdp_worker, 1, checkpoint, seqs, megatron=False)[0]
    out["seqs"] = seqs
    return out


def test_stock_fsdp_engine_compute_logp_equals_hf(fsdp_runs):
    """AReaL's stock FSDP engine (packed, non-tree) in fp32 on the CPU stand-in gives each
    sequence HF's log-probs: the reference below is sound."""
    assert fsdp_runs["stock"]["engine"] == "FSDPPPOActor"
    assert max_err(fsdp_runs["stock"]["logp"], fsdp_runs["hf"]) <= LOGP_TOL


def test_tree_fsdp_engine_compute_logp(fsdp_runs):
    """The switch gives megatron_tree's engine (tree attention on the HF model); its log-probs
    equal HF's per sequence and the stock engine's on the same batch."""
    ours = fsdp_runs["ours"]
    assert ours["engine"] == "TreeFSDPPPOActor" and ours["attention"] == "megatron_tree"
    assert ours["tree_stats"]["tokens_computed"] < ours["tree_stats"]["tokens_unpacked"]
    assert max_err(ours["logp"], fsdp_runs["hf"]) <= LOGP_TOL
    assert max_err(ours["logp"], fsdp_runs["stock"]["logp"]) <= LOGP_TOL


def test_tree_fsdp_engine_ppo_update(fsdp_runs):
    """AReaL's ppo_update (grpo_loss_fn): the same gradients and loss statistics as the stock
    engine on the same batch."""
    assert_same_update(fsdp_runs["ours"], fsdp_runs["stock"])


def test_tree_fsdp_critic(fsdp_runs):
    """The critic (AReaL's own FSDP tree path raises NotImplementedError for it): compute_values
    and the value-loss gradients equal AReaL's stock critic's on the same batch."""
    from megatron_tree.testing.reference import gradient_errors

    stock, ours = fsdp_runs["critic_stock"], fsdp_runs["critic_ours"]
    assert (stock["engine"], ours["engine"]) == ("FSDPPPOCritic", "TreeFSDPPPOCritic")
    assert max_err(ours["values"], stock["values"]) <= LOGP_TOL
    assert len(stock["grads"]) == len(ours["grads"]) > 1  # one per PPO minibatch
    for got, want in zip(ours["grads"], stock["grads"]):
        errors = gradient_errors(got, want)
        assert max(errors.values()) <= GRAD_RTOL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_tree_fsdp_engine_data_parallel(checkpoint):
    """DP=2 with FSDP2 sharding and gradient checkpointing: per rank, log-probs equal HF's and the
    stock engine's; the reduced gradients equal the stock engine's; both ranks ran as many tree
    micro-batches."""
    from harness.models import branching_sequences
    from megatron_tree import build_packed_tree_batch
    from megatron_tree.testing.reference import gradient_errors

    seqs = branching_sequences()
    packing = dict(max_tokens_per_mb=48, block_size=16, share_trunks=False)  # as the engine's
    alone = [len(build_packed_tree_batch({"input_ids": s}, **packing)) for s in dp_shards(seqs)]
    assert alone == [3, 2]  # rank 1 alone would run one forward fewer
    ranks = run_spawned(_dp_worker, 2, checkpoint, seqs, megatron=False)
    assert [r["ours"]["tree_stats"]["micro_batches"] for r in ranks] == [3, 3]
    for r in ranks:
        assert r["ours"]["checkpointing"] and r["stock"]["checkpointing"]
        assert max_err(r["ours"]["logp"], r["hf"]) <= LOGP_TOL
        assert max_err(r["ours"]["logp"], r["stock"]["logp"]) <= LOGP_TOL
        errors = gradient_errors(r["ours"]["grads"][0], r["stock"]["grads"][0])
        assert max(errors.values()) <= GRAD_RTOL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_tree_fsdp_engine_raises_on_non_finite_log_probs(fsdp_runs):
    """One NaN embedding row (the last token of sequence 0): compute_logp raises, naming the
    micro-batch and sequence 0's row, instead of returning NaN log-probs."""
    error = fsdp_runs["non_finite"]
    assert error.startswith("NonFiniteOutputError: AReaL FSDP tree engine"), error
    assert "logprobs" in error and "batch rows) [" in error
    rows = {int(r) for r in error.split("batch rows) [")[1].split("]")[0].split(",")}
    assert 0 in rows, error
