"""AReaL 1.0.4's Archon engine (``ArchonPPOActor`` / ``ArchonPPOCritic``: AReaL's own Qwen3 and
Qwen2 models under FSDP2 on gloo), made by AReaL's trainer code (``PPOTrainer._create_train_engine``
-> ``initialize``) and driven by its PPO actor (``compute_logp``, ``compute_advantages``,
``ppo_update`` with ``grpo_loss_fn``) on the CPU in fp32: Archon's stock non-tree engine
(``attn_type="sdpa"``) and megatron_tree's ``TreeArchonPPOActor`` / ``TreeArchonPPOCritic`` in its
place, on the branching sequences. References: HF eager on each sequence alone (log-probs) and the
stock engine on the same batch and weights (log-probs, gradients, loss statistics, values). Runs on
the AReaL stack (``MEGATRON_TREE_BRIDGE=areal``); skipped elsewhere."""

from __future__ import annotations

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

ARCHS = ("qwen3", "qwen2", "qwen3_moe")
# ParallelStrategy fields of the two-rank layouts other than data parallel.
LAYOUTS = {
    "cp2": {"context_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}
# Archon's pipeline runner trains neither engine here: torch's schedule calls the last stage's
# loss function once more than there are micro-batches (3 calls for 2 under 1F1B), and Archon's
# runner then runs out of contexts (``StopIteration`` in ``archon_runner.pp_loss_fn``; the stock
# engine's Interleaved1F1B default fails the same way). Forward only, both run.
FORWARD_ONLY = ("pp2",)


def _run(path: str, seqs: list, hf: dict, tree: bool, train: bool = True, **engine) -> dict:
    """compute_logp on the batch, then (``train``) PPOTrainer's compute_advantages and ppo_update
    (on-policy: the rollout log-probs are HF's; lr 0) with the gradients as the backward left
    them."""
    from areal.utils import stats_tracker

    from harness.areal import areal_batch, areal_trajectories, per_sequence
    from harness.areal_archon import build_archon_engine, captured_grads
    from megatron_tree.integrations.areal_archon import TreeArchonAttention, TreeArchonPPOActor

    start = time.perf_counter()
    if tree:
        eng = build_archon_engine(path, tree=True, engine_cls=TreeArchonPPOActor, **engine)
    else:
        eng = build_archon_engine(path, **engine)
    slots = {
        type(m.packed_attn).__name__
        for part in eng.model_parts
        for m in part.modules()
        if hasattr(m, "packed_attn")
    }
    logp = eng.compute_logp([areal_batch(seqs)])[0]
    grads, refusal = [], None
    trajectories = areal_trajectories(
        seqs, prompt_lens=[4] * len(seqs), logprobs=[hf[i] for i in range(len(seqs))]
    )
    batch = eng.compute_advantages(trajectories)
    stats_tracker.export_all()  # drop what compute_logp / advantages logged
    if train:
        with captured_grads(eng) as grads:
            eng.ppo_update(batch)
    elif tree:  # our engine refuses to train here, naming why
        try:
            eng.ppo_update(batch)
        except NotImplementedError as error:
            refusal = str(error)
    out = {
        "engine": type(eng).__name__,
        "attention": slots,
        "tree_attention": slots == {TreeArchonAttention.__name__},
        "logp": per_sequence(logp, seqs),
        "grads": grads,
        "stats": stats_tracker.export_all(),
        "tree_stats": getattr(eng, "tree_stats", None),
        "refusal": refusal,
        "seconds": time.perf_counter() - start,
    }
    eng.destroy()
    return out


def _critic_run(path: str, seqs: list, tree: bool) -> dict:
    """A critic's compute_values, then its ppo_update (AReaL's value loss) on returns drawn with a
    fixed seed, lr 0; the value head (the causal LM checkpoint has none) drawn from seed 0 in both
    engines."""
    from harness.areal import areal_trajectories
    from harness.areal_archon import build_archon_engine, captured_grads
    from megatron_tree.integrations.areal_archon import TreeArchonPPOCritic, init_value_head

    if tree:  # draws the value head the checkpoint lacks
        eng = build_archon_engine(path, critic=True, tree=True, engine_cls=TreeArchonPPOCritic)
    else:  # left as allocated by Archon: drawn the same for the reference
        eng = build_archon_engine(path, critic=True)
        init_value_head(eng.model_parts[0])
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


def _non_finite_run(path: str, seqs: list) -> str:
    """compute_logp of the tree engine with one embedding row NaN (the last token of sequence 0):
    what it raises."""
    from harness.areal import areal_batch
    from harness.areal_archon import build_archon_engine
    from megatron_tree.integrations.areal_archon import TreeArchonPPOActor

    eng = build_archon_engine(path, tree=True, engine_cls=TreeArchonPPOActor)
    with torch.no_grad():
        weight = eng.model_parts[0].tok_embeddings.weight
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


def _worker(rank: int, paths: dict, seqs: list) -> dict:
    from harness.areal_archon import setup_archon_cpu
    from harness.models import hf_logprobs

    setup_archon_cpu()  # AReaL imports only with its stand-ins
    out = {}
    for arch, path in paths.items():
        hf = hf_logprobs(path, seqs)
        out[arch] = {
            "hf": hf,
            "stock": _run(path, seqs, hf, False),
            "ours": _run(path, seqs, hf, True),
        }
    path = paths["qwen3"]
    out["critic_stock"] = _critic_run(path, seqs, False)
    out["critic_ours"] = _critic_run(path, seqs, True)
    out["non_finite"] = _non_finite_run(path, seqs)
    return out


def _parallel_worker(rank: int, path: str, seqs: list, layout: str) -> dict:
    """``dp2``: FSDP2 over two ranks, each its share of the sequences
    (:func:`~harness.areal.dp_shards`; ours
    with 48-token micro-batches of 16-token blocks: rank 1 gets an all-padding fill-in so that
    both run as many forwards). ``cp2``: Archon's Ulysses context parallelism over two ranks, the
    whole batch on both (each rank computes a contiguous half of every micro-batch's rows)."""
    from harness.areal_archon import setup_archon_cpu
    from harness.models import hf_logprobs

    setup_archon_cpu()
    from megatron_tree.integrations.areal_archon import TreeArchonPPOActor

    if layout == "dp2":
        mine, engine = dp_shards(seqs)[rank], {}
        TreeArchonPPOActor.tree_block_size = 16  # this process only
        ours_engine = {"mb_tokens": 48}
    else:
        mine, ours_engine = seqs, {}
        engine = {"parallel": dict(LAYOUTS[layout], data_parallel_size=1)}
    hf = hf_logprobs(path, mine)
    train = layout not in FORWARD_ONLY
    return {
        "hf": hf,
        "stock": _run(path, mine, hf, False, train, **engine),
        "ours": _run(path, mine, hf, True, train, **engine, **ours_engine),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from harness.models import make_hf_checkpoint

    root = tmp_path_factory.mktemp("areal_archon")
    paths = {}
    for arch in ARCHS:
        paths[arch] = str(root / arch)
        make_hf_checkpoint(arch, paths[arch])
    return paths


@pytest.fixture(scope="module")
def archon_runs(checkpoints):
    from harness.models import branching_sequences

    seqs = branching_sequences()
    out = run_spawned(_worker, 1, checkpoints, seqs, megatron=False)[0]
    out["seqs"] = seqs
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_stock_archon_engine_compute_logp_equals_hf(archon_runs, arch):
    """Archon's stock engine (packed SDPA, non-tree) in fp32 gives each sequence HF's log-probs:
    the reference below is sound."""
    run = archon_runs[arch]
    assert run["stock"]["engine"] == "ArchonPPOActor" and run["stock"]["attention"] == {
        "SDPAWrapper"
    }
    assert max_err(run["stock"]["logp"], run["hf"]) <= LOGP_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_archon_engine_compute_logp(archon_runs, arch):
    """The switch gives megatron_tree's engine (tree attention in every Archon attention slot);
    its log-probs equal HF's per sequence and the stock engine's on the same batch."""
    run = archon_runs[arch]
    ours = run["ours"]
    assert ours["engine"] == "TreeArchonPPOActor" and ours["tree_attention"]
    assert ours["tree_stats"]["tokens_computed"] < ours["tree_stats"]["tokens_unpacked"]
    assert max_err(ours["logp"], run["hf"]) <= LOGP_TOL
    assert max_err(ours["logp"], run["stock"]["logp"]) <= LOGP_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_archon_engine_ppo_update(archon_runs, arch):
    """AReaL's ppo_update (grpo_loss_fn): the same gradients and loss statistics as the stock
    engine on the same batch."""
    run = archon_runs[arch]
    assert_same_update(run["ours"], run["stock"])


def test_tree_archon_critic(archon_runs):
    """The critic (AReaL's Archon tree path raises NotImplementedError for it): compute_values and
    the value-loss gradients equal Archon's stock critic's on the same batch."""
    from megatron_tree.testing.reference import gradient_errors

    stock, ours = archon_runs["critic_stock"], archon_runs["critic_ours"]
    assert (stock["engine"], ours["engine"]) == ("ArchonPPOCritic", "TreeArchonPPOCritic")
    assert max_err(ours["values"], stock["values"]) <= LOGP_TOL
    assert len(stock["grads"]) == len(ours["grads"]) >= 1
    for got, want in zip(ours["grads"], stock["grads"]):
        errors = gradient_errors(got, want)
        assert max(errors.values()) <= GRAD_RTOL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_tree_archon_engine_raises_on_non_finite_log_probs(archon_runs):
    """One NaN embedding row (the last token of sequence 0): compute_logp raises, naming the
    micro-batch and sequence 0's row, instead of returning NaN log-probs."""
    error = archon_runs["non_finite"]
    assert error.startswith("NonFiniteOutputError: AReaL Archon tree engine"), error
    assert "logprobs" in error and "batch rows) [" in error
    rows = {int(r) for r in error.split("batch rows) [")[1].split("]")[0].split(",")}
    assert 0 in rows, error


@pytest.mark.parametrize("layout", ["dp2", "cp2", "tp2", "pp2"])
def test_tree_archon_engine_parallel(checkpoints, layout):
    """Data parallel 2 (FSDP2 shards every parameter; ranks with different shares, a fill-in on
    rank 1), Ulysses context parallel 2 and pipeline parallel 2 (AReaL's Archon tree path refuses
    both), tensor parallel 2: per rank, log-probs equal HF's and the stock engine's; the reduced
    gradients and the loss statistics equal the stock engine's on the same layout (pipeline
    parallel: forward only, see FORWARD_ONLY)."""
    from harness.models import branching_sequences

    seqs = branching_sequences()
    ranks = run_spawned(_parallel_worker, 2, checkpoints["qwen3"], seqs, layout, megatron=False)
    if layout == "dp2":
        assert [r["ours"]["tree_stats"]["micro_batches"] for r in ranks] == [3, 3]
    for r in ranks:
        assert r["ours"]["tree_attention"]
        assert max_err(r["ours"]["logp"], r["hf"]) <= LOGP_TOL
        assert max_err(r["ours"]["logp"], r["stock"]["logp"]) <= LOGP_TOL
        if layout not in FORWARD_ONLY:
            assert_same_update(r["ours"], r["stock"])
        else:
            assert "StopIteration" in (r["ours"]["refusal"] or ""), r["ours"]["refusal"]
