#!/usr/bin/env bash
# GPU check for tree attention (run on a CUDA machine; about 5-8 minutes on one GPU).
#
#   1. the CPU test suite of the attention/bridge code, with CUDA hidden (it must pass there too);
#   2. tests/test_gpu.py (pytest -m gpu): tiny Qwen2/Qwen3/Llama HF checkpoints through
#      patch_bridge_for_tree_training + mbridge against HF fp32 (bf16 per backend: <= 2x the error
#      of the same model on each sequence alone; fp32 flex: <= 1e-4), the flex kernel forward and
#      backward against an fp64 brute force, and packed-vs-unpacked gradients with flex in fp32;
#   3. scripts/bench_model.py at a larger size (bf16, flex);
#   4. the end-to-end GRPO step (examples/tree_vs_baseline.py) on qwen3_small (hidden 1024, 8 layers),
#      bf16, flex, 16K-token trees, tree vs. unshared baseline (bar: >= 85% of the ideal speed-up);
# then prints one summary table (one row per test case from the junit XML files, plus the timing
# bars of 3 and 4). Exit status 0 iff every check passed (skips count only in the CPU suite).
#
# Needs a Python environment with CUDA torch, megatron-core 0.16.x, mbridge 0.15.1, transformers<5
# and this package (scripts/setup_env.sh with MEGATRON_TREE_TORCH set to a CUDA torch, or "skip" to
# keep the torch already installed). Set PYTHON to use another interpreter than .venv/bin/python.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="$(mktemp -d)"
T0=$SECONDS
: >"$OUT/rows.txt"
# xunit1: the family that keeps record_property's per-test properties (value, bar) without a warning.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o junit_family=xunit1)

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch.cuda.is_available() is False; run this on a CUDA machine" >&2
  exit 2
fi
"$PY" -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'megatron-core', m.__version__, torch.cuda.get_device_name(0))"

echo "== [1/4] CPU suite with CUDA hidden"
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 timeout 240 "${PYTEST[@]}" -W ignore \
  tests/test_attention.py tests/test_attention_model.py tests/test_bridge.py tests/test_cpu_patch.py \
  --junitxml "$OUT/cpu.xml" >"$OUT/cpu_suite.txt" 2>&1
RC=$?
tail -n 3 "$OUT/cpu_suite.txt"
[ $RC = 0 ] || echo "CPU suite (pytest)|exit status $RC|0|FAIL" >>"$OUT/rows.txt"

echo "== [2/4] CUDA parity, flex kernel and gradients (tests/test_gpu.py)"
timeout 300 "${PYTEST[@]}" -m gpu tests/test_gpu.py --junitxml "$OUT/gpu.xml" >"$OUT/gpu_suite.txt" 2>&1
RC=$?
tail -n 15 "$OUT/gpu_suite.txt"
[ $RC = 0 ] || echo "GPU tests (pytest)|exit status $RC|0|FAIL" >>"$OUT/rows.txt"

echo "== [3/4] benchmark (bf16, flex, larger model)"
timeout 240 "$PY" scripts/bench_model.py --device cuda --dtype bf16 --backend flex \
  --hidden 1024 --layers 8 --heads 16 --groups 4 --ffn 4096 --vocab 32000 \
  --prompt 4096 --responses 8 --response-len 1024 --reps 5 2>&1 | grep -v -i warn | tee "$OUT/bench.txt"
BENCH_RC=${PIPESTATUS[0]}
if [ "$BENCH_RC" = 0 ]; then
  "$PY" - "$OUT/bench.txt" "$OUT/rows.txt" <<'PYEOF'
import re, sys
text, rows = open(sys.argv[1]).read(), open(sys.argv[2], "a")
for line in text.splitlines():
    m = re.match(r"(shared \(GRPO\)|nothing shared)\s.*?([\d.]+)x\s+([\d.]+)x\s+(\d+)%", line)
    if m:
        name, speed, ideal, frac = m.group(1), float(m.group(2)), float(m.group(3)), int(m.group(4))
        bar = ">= 80% of ideal" if name.startswith("shared") else ">= 0.95x"
        ok = frac >= 80 if name.startswith("shared") else speed >= 0.95
        rows.write(f"bench {name}|{speed:.2f}x (ideal {ideal:.2f}x, {frac}%)|{bar}|{'PASS' if ok else 'FAIL'}\n")
PYEOF
else
  echo "benchmark|exit status $BENCH_RC|0|FAIL" >>"$OUT/rows.txt"
fi

echo "== [4/4] end-to-end GRPO step, tree vs. unshared (qwen3_small, bf16, flex, 16K-token trees)"
timeout 240 "$PY" examples/tree_vs_baseline.py --device cuda --bf16 --backend flex \
  --config examples/configs/qwen3_small --max-tokens 16384 --prompts 8 --samples 8 \
  --prompt-len 2048 --response-len 256 512 --reps 3 --parity-sequences 2 --out "$OUT" 2>&1 \
  | grep -v -i warn | tee "$OUT/e2e.txt"
E2E_RC=${PIPESTATUS[0]}
if [ "$E2E_RC" = 0 ]; then
  "$PY" - "$OUT/e2e.txt" "$OUT/rows.txt" <<'PYEOF'
import re, sys
text, rows = open(sys.argv[1]).read(), open(sys.argv[2], "a")
speed = float(re.search(r"^speed-up\s+([\d.]+)x", text, re.M).group(1))
ideal = float(re.search(r"^ideal speed-up \(FLOP model\)\s+([\d.]+)x", text, re.M).group(1))
ok = speed >= 0.85 * ideal
rows.write(f"e2e GRPO step speed-up|{speed:.2f}x (ideal {ideal:.2f}x, {speed / ideal:.0%})|>= 85% of ideal|{'PASS' if ok else 'FAIL'}\n")
PYEOF
else
  echo "e2e GRPO step|exit status $E2E_RC|0|FAIL" >>"$OUT/rows.txt"
fi

echo
echo "== summary ($((SECONDS - T0)) s; logs in $OUT)"
"$PY" - "$OUT" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

out, rows = sys.argv[1], []  # rows: (check, value, bar, result, a skip is fine)
for xml, skip_ok in (("cpu.xml", True), ("gpu.xml", False)):
    try:
        cases = list(ET.parse(f"{out}/{xml}").getroot().iter("testcase"))
    except (OSError, ET.ParseError) as exc:
        rows.append((xml, f"unreadable: {type(exc).__name__}", "written by pytest", "FAIL", False))
        continue
    for case in cases:
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        skipped = case.find("skipped")
        result = ("FAIL" if case.find("failure") is not None or case.find("error") is not None
                  else "SKIP" if skipped is not None else "PASS")
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        value = props.get("value", f"{float(case.get('time') or 0):.1f} s" if skipped is None
                          else (skipped.get("message") or "")[:60])
        rows.append((name, value, props.get("bar", "passes"), result, skip_ok))
for line in open(f"{out}/rows.txt"):
    if line.strip():
        rows.append((*line.rstrip("\n").split("|")[:4], False))
table = [("check", "value", "bar", "result")] + [r[:4] for r in rows]
widths = [max(len(r[i]) for r in table) for i in range(4)]
for r in table:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
ok = bool(rows) and all(r[3] == "PASS" or (r[3] == "SKIP" and r[4]) for r in rows)
print(f"{sum(r[3] == 'PASS' for r in rows)} passed, {sum(r[3] == 'SKIP' for r in rows)} skipped, "
      f"{sum(r[3] == 'FAIL' for r in rows)} failed: {'OK' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PYEOF
