"""The main job's table (examples/tree_vs_baseline.py) explains itself: every line says its unit
and what a ratio is against, the loss line says it is the relative difference of a near-zero loss
and gives the absolute one, a speed-up above the FLOP ideal and a tree using more activation memory
than the baseline each get a line saying why. Checked on made-up rows (no model runs here)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


@pytest.fixture(scope="module")
def job():
    spec = importlib.util.spec_from_file_location(
        "tree_vs_baseline", ROOT / "examples" / "tree_vs_baseline.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_row(**changes) -> dict:
    """The main job's row as it reads on the CPU (numbers of a 2-core run, rounded)."""
    row = {
        "parity_max_abs_logprob_err": 3.81e-6,
        "baseline_parity_max_abs_logprob_err": 9.54e-7,
        "parity_sequences": 8,
        "tree_loss": 2.65367e-4,
        "baseline_loss": 2.65365e-4,
        "tree_vs_baseline_loss_abs_err": 2.2e-9,
        "tree_vs_baseline_loss_rel_err": 8.2e-6,
        "tree_token_ratio": 0.260,
        "tree_tokens": 20103,
        "real_tokens": 77447,
        "trees": 3,
        "baseline_micro_batches": 11,
        "max_tokens_per_mb": 8192,
        "tree_rows": 7808,
        "baseline_rows": 8192,
        "tree_rows_total": 20224,
        "baseline_rows_total": 78208,
        "baseline_s": 30.5,
        "tree_s": 9.5,
        "baseline_s_runs": [30.1, 30.5, 31.0],
        "tree_s_runs": [9.4, 9.5, 9.7],
        "speedup": 30.5 / 9.5,
        "speedup_per_rep": [30.1 / 9.4, 30.5 / 9.5, 31.0 / 9.7],
        "ideal_speedup": 3.50,
        "fraction_of_ideal": 30.5 / 9.5 / 3.50,
        "tree_gflops": 40.0,
        "baseline_gflops": 43.6,
        "tree_memory_bytes": 1489 * MIB,
        "baseline_memory_bytes": 1115 * MIB,
        "tree_attention_memory_bytes": 503 * MIB,
        "baseline_attention_memory_bytes": 80 * MIB,
        "tree_attention_kernel": "block_sparse",
    }
    row.update(changes)
    return row


def test_table_lines_say_units_and_references(job, capsys):
    job.report(make_row(), "peak activation memory", "outputs/tree_mask.png")
    out = capsys.readouterr().out
    # the lines the tests and scripts/gpu_check.sh parse keep their labels
    assert re.search(r"parity: max \|logp tree - logp HF\| \(unpacked\)\s+3\.81e-06 \(nats", out)
    assert re.search(r"^speed-up\s+3\.21x \(baseline step / tree step", out, re.M)
    assert re.search(
        r"^ideal speed-up \(FLOP model\)\s+3\.50x \(baseline FLOPs / tree FLOPs", out, re.M
    )
    loss = re.search(r"tree vs baseline loss, relative difference\s+(\S+) (.*)", out)
    assert loss.group(1) == "8.20e-06"
    assert "absolute difference 2.2e-09" in loss.group(2)
    assert "losses: tree / baseline" in out
    assert re.search(r"baseline step \(median\)\s+30\.500 s \(3 runs: 30\.100-31\.000 s\)", out)
    assert re.search(r"model FLOP rate: tree / baseline\s+40\.0 / 43\.6 GFLOP/s", out)
    assert "20224 / 78208 rows computed" in out
    assert re.search(r"peak activation memory: tree / baseline\s+1489 / 1115 MiB", out)
    assert re.search(r"of which attention kernels: tree / baseline\s+503 / 80 MiB", out)


def test_memory_above_baseline_says_why(job):
    note = job.memory_note(make_row())
    assert "attention only" in note and "block_sparse" in note and "986 / 1035 MiB" in note
    assert job.memory_note(make_row(tree_memory_bytes=1000 * MIB)) is None
    assert job.memory_note(make_row(tree_attention_memory_bytes=None)) is None  # CUDA: no split


def test_speedup_above_ideal_says_why(job):
    assert job.speedup_note(make_row()) is None  # 92% of the ideal: nothing to explain
    noisy = make_row(speedup_per_rep=[3.4, 3.55, 3.7], fraction_of_ideal=3.55 / 3.5)
    assert "timing noise" in job.speedup_note(noisy)
    above = make_row(speedup_per_rep=[3.6, 3.7, 3.8], fraction_of_ideal=3.7 / 3.5)
    assert "lower FLOP rate" in job.speedup_note(above) and "11 micro-batches" in job.speedup_note(
        above
    )
    single = make_row(speedup_per_rep=[3.7], fraction_of_ideal=3.7 / 3.5)
    assert "single timed run" in job.speedup_note(single)


def test_tree_vs_baseline_gaps_fail_on_nan(job):
    """The main job's parity, log-prob and gradient comparisons read a NaN as an infinite error
    (Python's max() would drop it), so every ``<= tol`` on them fails."""
    import math

    import torch

    good = torch.zeros(2, 5)
    bad = good.clone()
    bad[1, 2] = float("nan")
    mask = torch.ones(2, 5, dtype=torch.long)
    assert job.logprob_gap(good, good, mask) == 0.0
    assert math.isinf(job.logprob_gap(bad, good, mask))
    reference = {0: torch.zeros(4), 1: torch.zeros(4)}
    assert job.parity(None, None, good, [0, 1], reference)[0] == 0.0
    assert math.isinf(job.parity(None, None, bad, [0, 1], reference)[0])
    grads = {"a": torch.ones(3), "b": torch.ones(2)}
    assert job.gradient_gap(grads, grads) == (0.0, 0.0)
    poisoned = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")])}
    assert all(math.isinf(x) for x in job.gradient_gap(poisoned, grads))
