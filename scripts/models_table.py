"""The supported-models table, from the parity tests' results.

The HuggingFace parity tests append one JSON line per result to ``$MEGATRON_TREE_PARITY_LOG``
(:func:`harness.models.record_parity`); ``scripts/test_matrix.sh`` sets it for every
stack. This script groups the lines by model type, engine ("megatron": a bridged Megatron model;
"hf": HF's own modeling code through ``megatron_tree.integrations.transformers``) and bridge, and
prints a Markdown table (the stacks and layouts tested, the worst log-prob error over them),
followed by the families tree training refuses and why, and the HF engine's log-prob and gradient
errors per family and transformers version. With ``--readme docs/models.md`` it replaces the table
between that page's markers; ``--update`` keeps the page's rows that the logs do not cover (a run
of some stacks or tests only); ``--summary README.md`` then writes the README's one-row-per-family
summary of the page's table between its own markers.

Usage: python3 scripts/models_table.py PARITY_LOG [PARITY_LOG ...]
    [--readme docs/models.md [--update] [--summary README.md]]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

START, END = "<!-- models-table:start -->", "<!-- models-table:end -->"
SUMMARY_START, SUMMARY_END = "<!-- models-summary:start -->", "<!-- models-summary:end -->"

# What each HF model type exercises (the tiny checkpoints of harness.models).
FAMILY = {
    "qwen2": "Qwen2 / Qwen2.5 (dense, QKV bias)",
    "qwen3": "Qwen3 (dense, q/k norms)",
    "llama": "Llama 3 (dense)",
    "qwen3_moe": "Qwen3-MoE (routed experts)",
    "qwen2_moe": "Qwen2-MoE (routed + gated shared expert)",
    "qwen3_next": "Qwen3-Next (gated delta-net hybrid, MoE)",
    "qwen3_5_text": "Qwen3.5 (gated delta-net hybrid)",
    "qwen3_5": "Qwen3.5 vision-language model on text (gated delta-net hybrid)",
    "qwen3_5_moe_text": "Qwen3.5-MoE (gated delta-net hybrid, MoE)",
    "deepseek_v3": "DeepSeek-V3 (MLA + YaRN, routed + shared experts, expert bias)",
    "kimi_k2": "Kimi-K2 (DeepSeek-V3 architecture, its own bridge)",
    "glm4_moe": "GLM-4.5 (partial rotary, routed + shared experts)",
    "gpt_oss": "gpt-oss (sinks, sliding / full layers, biased experts)",
    "nemotron_h": "Nemotron-H (Mamba-2 hybrid, HybridModel `M*M-`)",
    "nemotron_h_moe": "Nemotron 3 Nano style (Mamba-2 + MoE hybrid, HybridModel `ME*ME`)",
    "qwen3_as_hybrid": "Qwen3 built as a HybridModel (`*-*-`, GPTModel's successor)",
}

REFUSED = [
    (
        "DeepSeek-V3.2, GLM-5 (DeepSeek sparse attention, DSAttention; `D` in a hybrid pattern)",
        "its indexer selects keys by content, which a tree mask cannot express; refused by name",
    ),
    (
        "Multi-token prediction layers (DeepSeek-V3's num_nextn_predict_layers)",
        "the token after the next is not unique at a branch point; refused until "
        "mtp_num_layers=None (the main head, which RL trains, is unaffected)",
    ),
    ("Encoder-decoder / cross attention", "not a tree operation; refused by the spec rewrite"),
    (
        "Router losses seq_aux_loss / global_aux_loss, a capacity factor",
        "per-sequence, cross-step or rank-dependent statistics; refused at the first training step "
        "(aux_loss and z-loss are computed as if unpacked)",
    ),
]


HEADER = [
    "| model type | family | engine | bridge | megatron-core (python, transformers) | layouts "
    "| max abs log-prob error vs HF (fp32) |",
    "|---|---|---|---|---|---|---|",
]
ENGINES = ("megatron", "hf")


def _order(key: tuple[str, str, str]) -> tuple:
    """Sort key of a (model type, engine, bridge) row: the families' order, then engine, bridge."""
    order = {name: i for i, name in enumerate(FAMILY)}
    model_type, engine, bridge = key
    rank = ENGINES.index(engine) if engine in ENGINES else len(ENGINES)
    return order.get(model_type, 99), model_type, rank, bridge


def render_rows(rows: list[dict]) -> dict[tuple[str, str, str], str]:
    """{(model type, engine, bridge): its Markdown line}: one per group of results, with its stacks
    and layouts and the worst error over them. Rows without an engine are Megatron's."""
    groups: dict[tuple, dict] = defaultdict(lambda: {"stacks": set(), "layouts": set(), "err": 0.0})
    for row in rows:
        stack, engine = row["stack"], row.get("engine", "megatron")
        bridge = "—" if engine == "hf" else f"{row['bridge']} {stack.get('bridge') or ''}".strip()
        group = groups[(row["model_type"], engine, bridge)]
        mcore = "—" if engine == "hf" else stack["megatron-core"]  # HF's code runs without it
        group["stacks"].add((mcore, stack["python"], stack["transformers"]))
        group["layouts"].add(row["layout"])
        group["err"] = max(group["err"], row["max_logprob_err"])
    lines = {}
    for (model_type, engine, bridge), group in groups.items():
        stacks = ", ".join(
            f"{m} ({'.'.join(p.split('.')[:2])}, {t})" for m, p, t in sorted(group["stacks"])
        )
        lines[(model_type, engine, bridge)] = (
            f"| `{model_type}` | {FAMILY.get(model_type, '')} | {engine} | {bridge} | {stacks} | "
            f"{', '.join(sorted(group['layouts']))} | {group['err']:.1e} |"
        )
    return lines


def table_rows(text: str) -> dict[tuple[str, str, str], str]:
    """The model rows of the table between the markers of ``text``, keyed like
    :func:`render_rows`; a row of the table before the engine column (six cells) is Megatron's and
    gets that column."""
    if START not in text or END not in text:
        return {}
    lines = {}
    for line in text.split(START, 1)[1].split(END, 1)[0].splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(HEADER[1].strip("|").split("|")) - 1:
            cells.insert(2, "megatron")
            line = "| " + " | ".join(cells) + " |"
        lines[(cells[0].strip("`"), cells[2], cells[3])] = line
    return lines


def render(rows: list[dict], keep: dict[tuple[str, str, str], str] | None = None) -> str:
    """Markdown: one line per (model type, engine, bridge), its stacks and layouts, the worst
    error; then the refused families. ``keep`` ({key: line}, :func:`table_rows` of the current
    table) adds the rows that ``rows`` do not cover."""
    lines = {**(keep or {}), **render_rows(rows)}
    out = list(HEADER) + [lines[key] for key in sorted(lines, key=_order)]
    out += [
        "",
        "Refused (a clear `ValueError` naming the module or setting and the fix):",
        "",
        "| family / setting | why |",
        "|---|---|",
    ]
    out += [f"| {name} | {why} |" for name, why in REFUSED]
    return "\n".join(out)


def render_summary(lines: dict[tuple[str, str, str], str]) -> str:
    """Markdown: one row per model type of the full table (``lines``, :func:`table_rows` of the
    models page): its family, the Megatron bridges and layouts tested, whether HF's own code runs it
    (``hf`` engine) and the worst log-prob error over every row of it."""
    groups: dict[str, dict] = {}
    for key in sorted(lines, key=_order):
        cells = [c.strip() for c in lines[key].strip().strip("|").split("|")]
        model_type, family, engine, bridge, _, layouts, err = cells
        group = groups.setdefault(
            key[0], {"family": family, "bridges": [], "layouts": set(), "hf": False, "err": 0.0}
        )
        if engine == "hf":
            group["hf"] = True
        else:
            group["bridges"].append(bridge.split(" ")[0])
            group["layouts"].update(layout.strip() for layout in layouts.split(","))
        group["err"] = max(group["err"], float(err))
    out = [
        "| family | Megatron engine: bridges | layouts | HF engine | max log-prob error vs HF |",
        "|---|---|---|---|---|",
    ]
    for group in groups.values():
        bridges = ", ".join(group["bridges"]) or "—"
        layouts = ", ".join(sorted(group["layouts"])) or "—"
        hf = "yes" if group["hf"] else "—"
        out.append(f"| {group['family']} | {bridges} | {layouts} | {hf} | {group['err']:.1e} |")
    return "\n".join(out)


def replace_between(text: str, start: str, end: str, block: str, name: Path) -> str:
    """``text`` with what lies between its one ``start`` ... ``end`` pair replaced by ``block``."""
    if text.count(start) != 1 or text.count(end) != 1:
        raise SystemExit(f"{name} needs exactly one {start} ... {end} pair")
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{start}\n{block}\n{end}", text)


def render_hf_parity(rows: list[dict]) -> str:
    """Markdown: the HF engine's worst log-prob error and gradient error (relative, per parameter)
    per family and transformers version, for docs/huggingface.md's "Parity and speed"."""
    worst: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        if row.get("engine") == "hf" and "max_grad_rel" in row:
            entry = worst[(row["model_type"], row["stack"]["transformers"])]
            entry[0] = max(entry[0], row["max_logprob_err"])
            entry[1] = max(entry[1], row["max_grad_rel"])
    lines = [
        "| family | transformers | max abs log-prob error | max gradient error (relative) |",
        "|---|---|---|---|",
    ]
    for (model_type, version), (err, grad) in sorted(
        worst.items(), key=lambda kv: (_order((kv[0][0], "hf", "")), kv[0][1])
    ):
        lines.append(f"| `{model_type}` | {version} | {err:.1e} | {grad:.1e} |")
    return "\n".join(lines) if worst else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument(
        "--readme", type=Path, help="replace the table between the markers of this file"
    )
    parser.add_argument(
        "--summary",
        type=Path,
        help="write the one-row-per-family summary of the --readme table into this file",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the page's rows (model type, engine, bridge) that the logs do not cover",
    )
    args = parser.parse_args()
    rows = [
        json.loads(line)
        for log in args.logs
        for line in log.read_text().splitlines()
        if line.strip()
    ]
    if not rows:
        raise SystemExit(
            f"no parity results in {[str(p) for p in args.logs]}: run the parity tests with "
            "MEGATRON_TREE_PARITY_LOG set (scripts/test_matrix.sh does)"
        )
    if args.update and args.readme is None:
        raise SystemExit("--update keeps rows of a table: pass --readme docs/models.md too")
    if args.summary and args.readme is None:
        raise SystemExit("--summary summarizes a table: pass --readme docs/models.md too")
    hf_parity = render_hf_parity(rows)
    if args.readme is None:
        print(render(rows))
        if hf_parity:
            print(f"\nHF engine, log-prob and gradient errors:\n\n{hf_parity}")
        return
    text = args.readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{args.readme} has no {START} ... {END} markers")
    table = render(rows, table_rows(text) if args.update else None)
    text = replace_between(text, START, END, table, args.readme)
    args.readme.write_text(text)
    print(f"[models_table] {len(rows)} results -> {args.readme}")
    if args.summary:
        summary = render_summary(table_rows(text))
        old = args.summary.read_text()
        new = replace_between(old, SUMMARY_START, SUMMARY_END, summary, args.summary)
        args.summary.write_text(new)
        print(f"[models_table] one row per family -> {args.summary}")
    if hf_parity:
        print(f"HF engine, log-prob and gradient errors:\n\n{hf_parity}")


if __name__ == "__main__":
    main()
