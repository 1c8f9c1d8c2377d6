"""The README's API table (scripts/api_table.py) is current: one line per public name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import megatron_tree

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "api_table.py"


def test_readme_api_table_is_current():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, (
        "README.md's API table is stale (or a name failed to import): run python "
        f"scripts/api_table.py\n{run.stdout}{run.stderr[-4000:]}"
    )


def test_every_public_name_has_a_line():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("<!-- api-table:start -->")[1].split("<!-- api-table:end -->")[0]
    for name in megatron_tree.__all__:
        assert f"| [`{name}`](" in table, name


def test_a_stale_table_is_caught(tmp_path):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    readme.write_text(text.replace("| [`tree_depth`]", "| [`tree_depth_old`]"), encoding="utf-8")
    check = [sys.executable, str(SCRIPT), "--readme", str(readme), "--check"]
    assert subprocess.run(check, cwd=ROOT, capture_output=True).returncode == 1
    subprocess.run(
        [sys.executable, str(SCRIPT), "--readme", str(readme)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    assert readme.read_text(encoding="utf-8") == text
