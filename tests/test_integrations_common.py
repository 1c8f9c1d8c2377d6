"""The adapters' shared decisions (megatron_tree.integrations.common): a tree's token capacity, the
packing report and the Ulysses refusal, each decided once for verl (Megatron, FSDP), AReaL
(Megatron, FSDP) and the FSDP2 helper."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.integrations.common import log_packing, refuse_ulysses, tree_capacity

ROOT = Path(__file__).resolve().parents[1]


def _smallest_multiple_at_least(tokens: int, *units: int) -> int:
    """Brute force: the first n >= tokens that every unit divides."""
    n = tokens
    while any(n % u for u in units):
        n += 1
    return n


@pytest.mark.parametrize(
    "tokens, block_size, align",
    [(1, 128, 1), (128, 128, 1), (129, 128, 1), (100, 16, 6), (96, 16, 6), (250, 64, 4), (7, 3, 5)],
)
def test_capacity_is_the_smallest_common_multiple_at_least_the_budget(tokens, block_size, align):
    got = tree_capacity(tokens, block_size=block_size, align=align, setting="x")
    assert got == _smallest_multiple_at_least(tokens, block_size, align)


def test_capacity_logs_only_when_rounded(caplog):
    with caplog.at_level(logging.INFO, logger="megatron_tree.integrations.common"):
        tree_capacity(256, block_size=128, setting="x")
        assert caplog.records == []
        tree_capacity(200, block_size=128, align=3, setting="x")
    assert [r.getMessage() for r in caplog.records] == [
        "megatron_tree: token capacity 200 rounded up to 384 (a multiple of the block size 128 "
        "and the CP x SP alignment 3)"
    ]


def test_missing_capacity_names_where_to_set_it():
    with pytest.raises(ValueError, match="token capacity .*: set mb_spec.max_tokens_per_mb$"):
        tree_capacity(None, block_size=128, setting="mb_spec.max_tokens_per_mb")


@pytest.mark.parametrize("size", [0, 2, 4])
def test_ulysses_other_than_one_is_refused_by_name(size):
    with pytest.raises(ValueError, match=f"^sp_size={size}: .*set sp_size=1"):
        refuse_ulysses("sp_size", size)
    refuse_ulysses("sp_size", 1)


def test_log_packing_reports_the_batch_summary(caplog):
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0], [3, 4, 0, 0]])
    mask = (ids != 0).long()
    packed = build_packed_tree_batch(
        {"input_ids": ids, "attention_mask": mask}, max_tokens_per_mb=16, block_size=8
    )
    with caplog.at_level(logging.INFO, logger="megatron_tree.integrations.common"):
        stats = log_packing(packed)
    # 9 real tokens; [5, 6, 7, 8] and [5, 6, 9] share 2, [3, 4] nothing: 4 + 1 + 2 = 7 in the tries
    assert stats["sequences"] == 3 and stats["tokens_unpacked"] == 9
    assert stats["tree_token_ratio"] == pytest.approx(7 / 9)
    assert [r.getMessage() for r in caplog.records] == [f"megatron_tree: {packed.summary_line()}"]


def test_shared_adapter_modules_import_no_megatron():
    """The FSDP / HF adapters import these; Megatron must stay off their import path."""
    code = (
        "import sys, megatron_tree.integrations.common\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'mbridge')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
