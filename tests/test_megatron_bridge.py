"""NVIDIA Megatron-Bridge + ``patch_megatron_bridge_for_tree_training``: HF checkpoints load into
tree models that give every sequence of a branching trie the log-probs HuggingFace gives it alone,
at TP=1 and TP=2. Runs in the Megatron-Bridge stack (``MEGATRON_TREE_BRIDGE=megatron-bridge``,
Python
3.12); skipped elsewhere, with the reason shown."""

from __future__ import annotations

import pytest
import torch

from harness.dist import run_spawned
from harness.marks import MEGATRON_BRIDGE_STACK
from harness.models import (
    ARCHS,
    branching_sequences,
    max_err,
    megatron_bridge_tree_model,
    record_parity,
    step_logprobs,
    tree_logprobs,
)
from megatron_tree.testing.tolerances import LOGP_TOL, LOSS_RTOL

pytestmark = [
    *MEGATRON_BRIDGE_STACK,
    pytest.mark.usefixtures("world"),
]


@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_bridge_tree_logprobs_match_hf(arch, checkpoints, references):
    from megatron_tree.mcore.core_attention import TreeCoreAttention
    from megatron_tree.mcore.model import TreeGPTModel

    model = megatron_bridge_tree_model(checkpoints[arch], backend="block_sparse").eval()
    assert isinstance(model, TreeGPTModel)
    assert all(
        isinstance(layer.self_attention.core_attention, TreeCoreAttention)
        for layer in model.decoder.layers
    )
    err = max_err(tree_logprobs(model, branching_sequences()), references[arch])
    assert err <= LOGP_TOL
    record_parity(arch, "megatron-bridge", err)


def test_patch_restores_init_and_binds_instances(checkpoints):
    from megatron_tree.bridges.megatron_bridge import (
        is_tree_training_bridge,
        patch_megatron_bridge_for_tree_training,
    )
    from megatron_tree.patches import megatron_bridge_te

    # Megatron-Bridge imports only with it where transformer-engine is missing
    megatron_bridge_te.apply()
    from megatron.bridge import AutoBridge

    init = AutoBridge.__init__
    with pytest.raises(RuntimeError, match="inside"):
        with patch_megatron_bridge_for_tree_training(backend="sdpa"):
            inside = AutoBridge.from_hf_pretrained(checkpoints["qwen3"], dtype=torch.float32)
            raise RuntimeError("inside")
    assert AutoBridge.__init__ is init
    outside = AutoBridge.from_hf_pretrained(checkpoints["qwen3"], dtype=torch.float32)
    assert is_tree_training_bridge(inside) and not is_tree_training_bridge(outside)
    provider = inside.to_megatron_provider(load_weights=False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, bf16=False, fp16=False)[0]
    assert {layer.self_attention.core_attention.backend for layer in model.decoder.layers} == {
        "sdpa"
    }
    with pytest.raises(ValueError, match="backend='nope'"):
        with patch_megatron_bridge_for_tree_training(backend="nope"):
            pass


def _tp2_worker(rank: int, checkpoints: dict) -> dict:
    out = {}
    for arch in ARCHS:
        model = megatron_bridge_tree_model(checkpoints[arch], tp=2).eval()
        assert (
            model.decoder.layers[0].self_attention.core_attention.config.tensor_model_parallel_size
            == 2
        )
        out[arch] = tree_logprobs(model, branching_sequences())
    return out


def test_megatron_bridge_tp2_matches_hf(checkpoints, references):
    for rank in run_spawned(_tp2_worker, 2, checkpoints):
        for arch, logprobs in rank.items():
            assert max_err(logprobs, references[arch]) <= LOGP_TOL, arch


def _cp2_worker(rank: int, path: str) -> dict:
    model = megatron_bridge_tree_model(path, cp=2)
    assert model.config.context_parallel_size == 2
    return step_logprobs(model, branching_sequences(), max_tokens_per_mb=64, block_size=16)


def test_megatron_bridge_context_parallel_2_matches_hf(checkpoints, references):
    """CP=2: the provider builds a tree model with context_parallel_size=2; the step splits each
    64-token tree across the two ranks; every rank gets HF's log-probs."""
    for rank in run_spawned(_cp2_worker, 2, checkpoints["qwen3"], cp=2, tp=1):
        assert max_err(rank, references["qwen3"]) <= LOGP_TOL


@pytest.mark.slow
def test_main_job_through_megatron_bridge(tmp_path):
    """The README's main job, reduced, with the model built through Megatron-Bridge."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "examples" / "tree_vs_baseline.py"),
            "--small",
            *("--model", "qwen3_tiny"),
            "--bridge",
            "megatron-bridge",
            "--parity-sequences",
            "3",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "through megatron-bridge" in proc.stdout
    parity = float(
        re.search(r"parity: max \|logp tree - logp HF\| \(unpacked\)\s+(\S+)", proc.stdout).group(1)
    )
    assert parity <= LOGP_TOL
    loss_gap = float(
        re.search(r"tree vs baseline loss, relative difference\s+(\S+)", proc.stdout).group(1)
    )
    assert loss_gap <= LOSS_RTOL
