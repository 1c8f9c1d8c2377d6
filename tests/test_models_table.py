"""The README's supported-models table is built from what the parity tests record."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from harness.models import PARITY_LOG_ENV, record_parity


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "models_table.py"
    spec = importlib.util.spec_from_file_location("models_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recorded_results_become_one_row_per_family_and_bridge(tmp_path, monkeypatch):
    log = tmp_path / "parity.jsonl"
    monkeypatch.delenv(
        PARITY_LOG_ENV, raising=False
    )  # (test_matrix.sh sets it for the real results)
    record_parity("qwen3", "mbridge", 1e-6)  # no log set: nothing written
    assert not log.exists()
    monkeypatch.setenv(PARITY_LOG_ENV, str(log))
    record_parity("deepseek_v3", "megatron-bridge", 2e-6)
    record_parity("deepseek_v3", "megatron-bridge", 3e-6, layout="TP=2")
    record_parity("qwen3", "mbridge", 1e-6)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["layout"] for r in rows] == ["TP=1", "TP=2", "TP=1"] and rows[0]["stack"][
        "megatron-core"
    ]
    table = _script().render(rows)
    lines = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(lines) == 2 and lines[0].startswith("| `qwen3`")  # families in the table's order
    assert "TP=1, TP=2" in lines[1] and lines[1].endswith("| 3.0e-06 |")  # the worst over layouts
    assert "DSAttention" in table and "Multi-token prediction" in table


def test_readme_table_is_replaced_between_its_markers(tmp_path, monkeypatch):
    module = _script()
    log, readme = tmp_path / "parity.jsonl", tmp_path / "README.md"
    monkeypatch.setenv(PARITY_LOG_ENV, str(log))
    record_parity("gpt_oss", "megatron-bridge", 2e-6)
    readme.write_text(f"intro\n{module.START}\nold table\n{module.END}\noutro\n")
    monkeypatch.setattr("sys.argv", ["models_table.py", str(log), "--readme", str(readme)])
    module.main()
    text = readme.read_text()
    assert "old table" not in text and "| `gpt_oss` |" in text and text.endswith("outro\n")


def test_hf_engine_rows_and_an_update_keeps_the_rows_the_logs_do_not_cover(tmp_path, monkeypatch):
    module = _script()
    log, readme = tmp_path / "parity.jsonl", tmp_path / "README.md"
    monkeypatch.setenv(PARITY_LOG_ENV, str(log))
    record_parity("qwen3", "transformers", 2e-6, engine="hf", max_grad_rel=1.5e-6)
    record_parity("qwen3", "mbridge", 1e-6)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["hf", "megatron"] and "max_grad_rel" not in rows[1]
    lines = [line for line in module.render(rows).splitlines() if line.startswith("| `")]
    assert [line.split(" | ")[2] for line in lines] == ["megatron", "hf"]  # Megatron's row first
    assert "| 1.5e-06 |" in module.render_hf_parity(rows)  # the gradient error, HF rows only
    # A README table from before the engine column: its rows are Megatron's; --update keeps the
    # ones the log does not cover (llama) and replaces the ones it does (qwen3 mbridge).
    old = [
        "| `llama` | Llama 3 (dense) | mbridge 0.15.1 | 0.16.1 (3.11, 4.57.6) | TP=1 | 3.3e-06 |",
        "| `qwen3` | Qwen3 | mbridge 0.15.1 | 0.16.1 (3.11, 4.57.6) | TP=1 | 9.9e-06 |",
    ]
    readme.write_text(f"{module.START}\n" + "\n".join(old) + f"\n{module.END}\n")
    monkeypatch.setattr(
        "sys.argv", ["models_table.py", str(log), "--readme", str(readme), "--update"]
    )
    module.main()
    lines = [line for line in readme.read_text().splitlines() if line.startswith("| `")]
    assert [line.split(" | ")[0] + " " + line.split(" | ")[2] for line in lines] == [
        "| `qwen3` megatron",
        "| `qwen3` hf",
        "| `llama` megatron",
    ]
    assert "9.9e-06" not in readme.read_text() and "| 3.3e-06 |" in lines[2]


def test_readme_summary_is_docs_models_table_one_row_per_family():
    """README.md's models table is the summary of docs/models.md's full table."""
    module, root = _script(), Path(__file__).resolve().parents[1]
    full = module.table_rows((root / "docs" / "models.md").read_text())
    readme = (root / "README.md").read_text()
    current = readme.split(module.SUMMARY_START)[1].split(module.SUMMARY_END)[0].strip()
    assert current == module.render_summary(full), (
        "README.md's models summary is stale: run python3 scripts/models_table.py <parity log> "
        "--readme docs/models.md --summary README.md"
    )
    families = {key[0] for key in full}
    assert len(current.splitlines()) == 2 + len(families)


def test_summary_merges_engines_and_bridges_into_one_row(tmp_path, monkeypatch):
    module = _script()
    log, page, readme = tmp_path / "parity.jsonl", tmp_path / "models.md", tmp_path / "README.md"
    monkeypatch.setenv(PARITY_LOG_ENV, str(log))
    record_parity("qwen3", "mbridge", 1e-6, layout="TP=2")
    record_parity("qwen3", "megatron-bridge", 4e-6)
    record_parity("qwen3", "transformers", 2e-6, engine="hf", max_grad_rel=1e-6)
    record_parity("kimi_k2", "megatron-bridge", 3e-6)
    page.write_text(f"{module.START}\n{module.END}\n")
    readme.write_text(f"intro\n{module.SUMMARY_START}\nold\n{module.SUMMARY_END}\noutro\n")
    argv = ["models_table.py", str(log), "--readme", str(page), "--summary", str(readme)]
    monkeypatch.setattr("sys.argv", argv)
    module.main()
    rows = [line for line in readme.read_text().splitlines() if line.startswith("| ")][1:]
    assert rows == [
        "| Qwen3 (dense, q/k norms) | mbridge, megatron-bridge | TP=1, TP=2 | yes | 4.0e-06 |",
        "| Kimi-K2 (DeepSeek-V3 architecture, its own bridge) | megatron-bridge | TP=1 | — "
        "| 3.0e-06 |",
    ]
    assert "old" not in readme.read_text() and readme.read_text().endswith("outro\n")
