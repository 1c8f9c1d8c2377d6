"""The supported-models table, from the parity tests' results.

The HuggingFace parity tests append one JSON line per result to ``$MEGATRON_TREE_PARITY_LOG``
(:func:`megatron_tree.testing.models.record_parity`); ``scripts/test_matrix.sh`` sets it for every
stack. This script groups the lines by model type and bridge, and prints a Markdown table (the
stacks and layouts tested, the worst log-prob error over them), followed by the families tree
training refuses and why. With ``--readme README.md`` it replaces the table between the README's
markers.

Usage: python3 scripts/models_table.py PARITY_LOG [PARITY_LOG ...] [--readme README.md]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

START, END = "<!-- models-table:start -->", "<!-- models-table:end -->"

# What each HF model type exercises (the tiny checkpoints of megatron_tree.testing.models).
FAMILY = {
    "qwen2": "Qwen2 / Qwen2.5 (dense, QKV bias)",
    "qwen3": "Qwen3 (dense, q/k norms)",
    "llama": "Llama 3 (dense)",
    "qwen3_moe": "Qwen3-MoE (routed experts)",
    "qwen2_moe": "Qwen2-MoE (routed + gated shared expert)",
    "qwen3_next": "Qwen3-Next (gated delta-net hybrid, MoE)",
    "qwen3_5_text": "Qwen3.5 (gated delta-net hybrid)",
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


def render(rows: list[dict]) -> str:
    """Markdown: one line per (model type, bridge), its stacks and layouts, the worst error."""
    groups: dict[tuple, dict] = defaultdict(lambda: {"stacks": set(), "layouts": set(), "err": 0.0})
    for row in rows:
        stack = row["stack"]
        group = groups[(row["model_type"], f"{row['bridge']} {stack.get('bridge') or ''}".strip())]
        group["stacks"].add((stack["megatron-core"], stack["python"], stack["transformers"]))
        group["layouts"].add(row["layout"])
        group["err"] = max(group["err"], row["max_logprob_err"])
    order = {name: i for i, name in enumerate(FAMILY)}
    lines = [
        "| model type | family | bridge | megatron-core (python, transformers) | layouts | max abs "
        "log-prob error vs HF (fp32) |",
        "|---|---|---|---|---|---|",
    ]
    for (model_type, bridge), group in sorted(
        groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0])
    ):
        stacks = ", ".join(
            f"{m} ({'.'.join(p.split('.')[:2])}, {t})" for m, p, t in sorted(group["stacks"])
        )
        lines.append(
            f"| `{model_type}` | {FAMILY.get(model_type, '')} | {bridge} | {stacks} | "
            f"{', '.join(sorted(group['layouts']))} | {group['err']:.1e} |"
        )
    lines += [
        "",
        "Refused (a clear `ValueError` naming the module or setting and the fix):",
        "",
        "| family / setting | why |",
        "|---|---|",
    ]
    lines += [f"| {name} | {why} |" for name, why in REFUSED]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument(
        "--readme", type=Path, help="replace the table between the markers of this file"
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
    table = render(rows)
    if args.readme is None:
        print(table)
        return
    text = args.readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{args.readme} has no {START} ... {END} markers")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    args.readme.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text))
    print(f"[models_table] {len(rows)} results -> {args.readme}")


if __name__ == "__main__":
    main()
