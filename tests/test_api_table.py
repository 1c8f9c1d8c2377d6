"""docs/api.md's API table (scripts/api_table.py) is current: one line per public name."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import megatron_tree

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "api_table.py"
PAGE = ROOT / "docs" / "api.md"


def _script():
    spec = importlib.util.spec_from_file_location("api_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_table_is_current():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, (
        "docs/api.md's API table is stale (or a name failed to import): run python "
        f"scripts/api_table.py\n{run.stdout}{run.stderr[-4000:]}"
    )


def test_every_public_name_has_a_line():
    text = PAGE.read_text(encoding="utf-8")
    table = text.split("<!-- api-table:start -->")[1].split("<!-- api-table:end -->")[0]
    for name in megatron_tree.__all__:
        assert f"| [`{name}`](../megatron_tree/" in table, name


def test_a_stale_table_is_caught(tmp_path):
    text = PAGE.read_text(encoding="utf-8")
    stale = text.replace("| [`tree_depth`]", "| [`tree_depth_old`]")
    assert stale != text
    page = tmp_path / "api.md"
    page.write_text(stale, encoding="utf-8")
    check = [sys.executable, str(SCRIPT), "--page", str(page), "--check"]
    assert subprocess.run(check, cwd=ROOT, capture_output=True).returncode == 1
    module = _script()
    assert module.replace(stale, module.render(PAGE)) == text  # rewriting restores the table


def test_source_links_are_relative_to_the_page():
    module = _script()
    assert "](../megatron_tree/core/tree.py)" in module.render(ROOT / "docs" / "api.md")
    assert "](megatron_tree/core/tree.py)" in module.render(ROOT / "README.md")
