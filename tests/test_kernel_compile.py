"""Our Triton tree-attention kernels compiled for sm_80 and sm_90 on the CPU
(``scripts/compile_kernels.py``): every configuration the package launches compiles within the
architecture's shared memory, spills at most the script's stated bound and uses tensor cores; a
configuration too large for the GPU fails the check.

Triton compiles for a named GPU target without a GPU (its wheel ships ptxas and cuobjdump). The
script runs in a fresh process: the kernels must be compiled, not the interpreter's (which another
test file of this session may have switched on). Stack-independent (torch's Triton 3.7.1 on every
stack with Triton), so it runs on the default stack only (STACK_INDEPENDENT_TESTS).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed (the default stack has it)")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compile_kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=ROOT,
    )


def _rows(table: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[1].startswith("sm_"):
            rows[(cells[0], cells[1])] = cells
    return rows


def _expected_labels() -> set[str]:
    """CI's set, spelled as the table's rows: per kernel, head dims and dtype, the plain launch
    (GQA; MLA: a key-value head per query head) and the heaviest (a query subset, window and sink)
    in GQA and MHA. ``--all`` compiles every combination (docs/gpu.md has that table)."""
    labels = set()
    for kernel, dims, dtype in itertools.product(
        ("fwd", "dq", "dkdv"), ("hd64", "hd128", "hd256", "mla"), ("bf16", "fp16")
    ):
        sink = [] if kernel == "dkdv" else ["sink"]  # the dK / dV kernel takes no sink
        for heads in ("gqa", "mha"):
            if dims == "mla" and heads == "gqa":
                continue
            labels.add(" ".join([kernel, dims, dtype, heads, "subset", "window", *sink]))
        labels.add(" ".join([kernel, dims, dtype, "mha" if dims == "mla" else "gqa", "all"]))
    return labels


def test_every_kernel_configuration_compiles_for_sm80_and_sm90(tmp_path):
    table = tmp_path / "table.md"
    run = _run("--markdown", str(table))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = _rows(table.read_text())
    want = {(label, f"sm_{arch}") for label in _expected_labels() for arch in (80, 90)}
    assert set(rows) == want, (sorted(want - set(rows))[:5], sorted(set(rows) - want)[:5])
    for (label, arch), cells in rows.items():
        assert cells[3] == "ok", (label, arch, cells)
        shared, limit = (float(x) for x in cells[6].split("/"))
        assert 0 < shared <= limit, (label, arch, cells)
        assert cells[7] != "none", (label, arch, cells)
    # Hopper's tensor-core instruction where the tile is 64 rows (head dims up to 128)
    assert all(
        "wgmma" in rows[(label, "sm_90")][7] for label in _expected_labels() if "hd128" in label
    )


@pytest.mark.parametrize(
    "only, launch, why",
    [
        # 128-token tiles at head dim 256: dK/dV needs 288 KB of shared memory, over sm_80's 163 KB
        ("dkdv hd256 bf16 gqa all sm_80", "128,8,2", r"shared memory \d+ B over sm_80's 166912 B"),
        # 16 warps leave 128 registers a thread: dK/dV under a window spills about 3 KB
        ("dkdv hd64 bf16 gqa all window sm_80", "64,16,2", r"spills \d+ B over the bound"),
    ],
    ids=["tile-too-large", "too-many-warps"],
)
def test_a_configuration_too_large_for_the_gpu_fails(only, launch, why):
    run = _run("--all", "--only", only, "--launch", launch)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.search(why, run.stderr), run.stderr[-2000:]
    assert "0 of 1 ok" in run.stdout


def test_launch_config_rows_and_refusals():
    """sm_86 / sm_89 take sm_80's rows and sm_100 sm_90's; head dims over 256 and GPUs before
    sm_80 are refused naming the way out; the interpreter has one fixed pick."""
    from megatron_tree.core.triton_tiles import INTERPRETER, launch_config

    assert launch_config(86, 128, 128) == launch_config(80, 128, 128)
    assert launch_config(100, 64, 64) == launch_config(90, 64, 64)
    assert launch_config(90, 192, 128) == launch_config(90, 256, 256)  # MLA: the wider head dim
    assert launch_config(None, 256, 256) == INTERPRETER
    with pytest.raises(ValueError, match="head dims up to 256.*backend='flex'"):
        launch_config(90, 512, 512)
    with pytest.raises(ValueError, match="compute capability 8.0 or newer.*got 7.5"):
        launch_config(75, 64, 64)
