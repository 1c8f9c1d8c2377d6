"""AReaL 1.0.4's Megatron engine on Megatron-Bridge models (``megatron.bridge_type:
megatron-bridge``), which AReaL's own tree training refuses ("Tree training is not supported with
bridge_type='megatron-bridge'") and megatron_tree's engines build inside
``patch_megatron_bridge_for_tree_training``. Driven by AReaL's own code as in
``tests/test_areal.py`` (``PPOTrainer._create_train_engine``, ``initialize``, ``compute_logp``,
``compute_advantages``, ``ppo_update``), tiny random checkpoints, fp32 on the CPU:

* Qwen3 (dense): log-probs vs HF and the PPO update vs AReaL's stock engine on the same batch
  (Megatron-Bridge's provider with its local layer spec);
* Nemotron-H (Mamba-2 hybrid, Megatron-Core's ``HybridModel``) and Qwen3.5 (gated delta-net
  hybrid), on tries with one- and two-token segments between branch points
  (``recurrent_sequences``): log-probs vs HF (Nemotron-H's reference scan in one chunk per
  sequence, ``testing.reference.one_mamba_chunk``) and the PPO update vs the same engine with
  prefix sharing off (``tree_share_prefixes = False``: every sequence its own chain, the unpacked
  computation on the same model, as ``tests/test_mamba_parallel.py``'s reference). AReaL's stock
  engine cannot run them here: Megatron-Core's ``MambaMixer`` raises ``ImportError: MambaSSM is
  not installed`` and its ``GatedDeltaNet`` ``ImportError: FLA is not installed`` when built
  without those CUDA / Triton kernel packages (and before that, without transformer-engine, the
  providers' specs and fusions are TE-only: ``NameError: name 'TESpecProvider' is not defined``,
  ``ValueError: apply_rope_fusion is not available``).

Runs on the Megatron-Bridge stack (``MEGATRON_TREE_BRIDGE=megatron-bridge``, which installs AReaL
with ``--no-deps``; AReaL declares transformers 5.0-5.3, its engine runs with the stack's
5.12.1); skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from harness.areal import logp_run, train_run
from harness.dist import run_spawned
from harness.marks import MEGATRON_BRIDGE_STACK
from megatron_tree.testing.tolerances import GRAD_RTOL, HF_HYBRID_LOGP_TOL, LOGP_TOL, LOSS_RTOL

ON_STACK = os.environ.get("MEGATRON_TREE_BRIDGE") == "megatron-bridge"
pytestmark = [
    *MEGATRON_BRIDGE_STACK,
    # ``import areal`` needs the fixture's stand-ins, so presence is checked by spec; on the
    # Megatron-Bridge stack a missing AReaL is a failure, not a skip.
    pytest.mark.skipif(
        importlib.util.find_spec("areal") is None and not ON_STACK,
        reason="AReaL is not installed (the Megatron-Bridge stack installs it: "
        "MEGATRON_TREE_BRIDGE=megatron-bridge)",
    ),
]

HYBRIDS = ("nemotron_h", "qwen3_5_text")
# HF's gated delta rule stays fp32 in any model dtype (see HF_HYBRID_LOGP_TOL); the others: fp32
# summation order only.
HF_TOL = {"qwen3": LOGP_TOL, "nemotron_h": LOGP_TOL, "qwen3_5_text": HF_HYBRID_LOGP_TOL}


def _worker(rank: int, paths: dict) -> dict:
    from harness import areal_platform
    from harness.models import branching_sequences, hf_logprobs, recurrent_sequences

    areal_platform.setup_cpu()
    from harness.areal import build_areal_engine
    from megatron_tree.integrations.areal import TreeMegatronPPOActor

    stock = dict(bridge_type="megatron-bridge")
    ours = dict(tree=True, engine_cls=TreeMegatronPPOActor, **stock)
    out = {}
    seqs = branching_sequences()
    path = paths["qwen3"]
    hf = hf_logprobs(path, seqs)
    out["qwen3"] = {
        "seqs": seqs,
        "hf": hf,
        "stock": logp_run(path, seqs, **stock),
        "ours": logp_run(path, seqs, **ours),
        "stock_train": train_run(path, seqs, hf, **stock),
        "ours_train": train_run(path, seqs, hf, **ours),
    }
    try:  # AReaL's own tree path on Megatron-Bridge
        build_areal_engine(path, tree=True, **stock)
        out["areal_tree"] = None
    except NotImplementedError as e:
        out["areal_tree"] = str(e)
    seqs = recurrent_sequences()
    for arch in HYBRIDS:
        path = paths[arch]
        hf = hf_logprobs(path, seqs)
        run = {"seqs": seqs, "hf": hf, "ours": logp_run(path, seqs, **ours)}
        run["ours_train"] = train_run(path, seqs, hf, **ours)
        TreeMegatronPPOActor.tree_share_prefixes = False
        try:
            run["chains_train"] = train_run(path, seqs, hf, **ours)
        finally:
            TreeMegatronPPOActor.tree_share_prefixes = True
        out[arch] = run
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from harness.models import make_hf_checkpoint

    root = tmp_path_factory.mktemp("areal_megatron_bridge")
    paths = {arch: str(root / arch) for arch in ("qwen3", *HYBRIDS)}
    for arch, path in paths.items():
        make_hf_checkpoint(arch, path)
    start = time.perf_counter()
    out = run_spawned(_worker, 1, paths, megatron=False)[0]
    print(f"AReaL on Megatron-Bridge: {time.perf_counter() - start:.1f} s")
    return out


def _grad_rel(got: dict, want: dict) -> float:
    from megatron_tree.testing.reference import gradient_errors

    return max(gradient_errors(got, want).values())


def test_areal_refuses_megatron_bridge_trees(runs):
    """AReaL's own tree path on a Megatron-Bridge model stops at the bridge build (documented, so
    that a change shows up here); ours builds it (below)."""
    assert "bridge_type='megatron-bridge'" in runs["areal_tree"]


@pytest.mark.parametrize("arch", ["qwen3", *HYBRIDS])
def test_compute_logp_equals_hf(runs, arch):
    """AReaL's compute_logp through our engine on a Megatron-Bridge model: HF's log-probs at every
    trie depth, fp32 parameters; for Qwen3 AReaL's stock engine equals HF too."""
    from harness.areal import error_by_depth

    run = runs[arch]
    ours = run["ours"]
    assert ours["engine"] == "TreeMegatronPPOActor" and ours["dtypes"] == {torch.float32}
    errors = error_by_depth(ours["logp"], run["hf"], run["seqs"])
    print(f"{arch} through Megatron-Bridge vs HF by trie depth: {errors}")
    assert len(errors) >= 4 and max(errors.values()) <= HF_TOL[arch]
    if "stock" in run:
        stock = error_by_depth(run["stock"]["logp"], run["hf"], run["seqs"])
        print(f"{arch}: AReaL stock vs HF {stock}")
        assert run["stock"]["engine"] == "MegatronPPOActor"
        assert max(stock.values()) <= LOGP_TOL


def test_qwen3_ppo_update_equals_the_stock_engine(runs):
    """AReaL's ppo_update through our engine on Megatron-Bridge's Qwen3: the stock engine's loss
    statistics and gradients (same batch, same AReaL loss)."""
    ours, stock = runs["qwen3"]["ours_train"], runs["qwen3"]["stock_train"]
    key = "ppo_actor/update/actor_loss/avg"
    assert ours["stats"][key] == pytest.approx(stock["stats"][key], rel=LOSS_RTOL)
    rel = _grad_rel(ours["grads"][0], stock["grads"][0])
    print(f"Qwen3 through Megatron-Bridge: gradients rel {rel:.2e} vs AReaL's stock engine")
    assert rel <= GRAD_RTOL
    assert ours["tree_stats"]["tree_token_ratio"] < 0.5 and ours["unchanged"]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_ppo_update_equals_the_unshared_chains(runs, arch):
    """The hybrids' PPO update with prefix sharing (each Mamba / gated delta-net state and
    convolution window carried across branch points) equals the same engine with every sequence
    its own chain: loss statistics and every gradient, the token mixers' included."""
    ours, chains = runs[arch]["ours_train"], runs[arch]["chains_train"]
    key = "ppo_actor/update/actor_loss/avg"
    assert ours["stats"][key] == pytest.approx(chains["stats"][key], rel=LOSS_RTOL)
    from megatron_tree.testing.reference import gradient_errors

    errors = gradient_errors(ours["grads"][0], chains["grads"][0])
    mixer = "mixer.A_log" if arch == "nemotron_h" else "self_attention.A_log"
    assert any(mixer in n for n in errors), sorted(errors)[:8]
    print(
        f"{arch}: gradients rel {max(errors.values()):.2e} vs unshared chains; shared "
        f"{ours['tree_stats']['tree_token_ratio']:.3f}, chains "
        f"{chains['tree_stats']['tree_token_ratio']:.3f} of the tokens"
    )
    assert max(errors.values()) <= GRAD_RTOL
    assert ours["tree_stats"]["tree_token_ratio"] < chains["tree_stats"]["tree_token_ratio"]
