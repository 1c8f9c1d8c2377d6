#!/usr/bin/env bash
# GPU check for tree attention: one command on the bare GPU machine (docs/gpu.md).
#
#   bash scripts/gpu_check.sh               on the GPU machine, gpu_wheels/ carried (scripts/gpu_wheels.sh)
#   bash scripts/gpu_check.sh --dry-run     on a CPU: the same recipe, its CPU-runnable part
#   bash scripts/gpu_check.sh --no-install  in a prepared environment (megatron-core importable)
#
# Installs gpu_wheels/*.whl with `pip install --no-index --no-deps --target <tmp>` (the machine's
# own torch stays) and runs, with PYTHONPATH=<tmp>:<repository>:
#   [0] imports and versions (torch, CUDA, megatron-core, mbridge, transformers, ...);
#   [1] the CPU suite of the attention/bridge code with CUDA hidden (it must pass there too; on the
#       GPU it runs on the CPU cores while [2] runs, before the timed steps);
#   [2] tests/test_gpu.py (pytest -m gpu): the CUDA tests, each row with its value and bar;
#   [3] attention throughput: scripts/bench_attention.py (tree flex attention vs. causal flash),
#       then (on the GPU only) the same with backend="triton", our kernel, reported without a bar
#       until a first GPU run has measured it (read it against [3]'s flex rows);
#   [4] log-prob gather bandwidth: scripts/bench_logprobs.py;
#   [5] the end-to-end GRPO step, examples/tree_vs_baseline.py, tree vs. unshared baseline on
#       qwen3_0p5b (Qwen3-0.6B's layers: hidden 1024, 28 layers, head dim 128; a 32K vocabulary:
#       0.51B parameters, random weights), bf16, flex, 16K-token trees (bar: >= 85% of the
#       ideal speed-up of the FLOP model);
# then prints one table (one row per test case from the junit XML files, plus the rows of [0],
# [3]-[5]) and writes it, with every log, under $OUT (the device tool's output folder; a new
# temporary folder when unset). Exit status 0 iff every row passed (a SKIP passes only in the CPU
# suite, and in the dry run for the GPU tests). Per-step timeouts keep the whole run under 8
# minutes on the GPU machine.
#
# --dry-run proves the recipe on a CPU machine: a CPU Python 3.12 with torch (default: the
# project's Python 3.12 venv, `MEGATRON_TREE_PYTHON=python3.12 bash scripts/setup_env.sh`) installs
# the wheels into a fresh --target folder and runs [0], [1], [2] (tests/test_gpu.py collected: its
# tests skip without CUDA) and the --small CPU runs of [3], [4] and [5] (their timing bars are not
# judged on a CPU). scripts/bare_python/sitecustomize.py makes it see what the bare machine would:
# the carried modules only from the --target folder, and from the venv only what the bare machine
# has, so a missing wheel fails it.
#
#   PYTHON                     interpreter (default: python3; --dry-run: the Python 3.12 venv)
#   MEGATRON_TREE_GPU_WHEELS   the wheel folder (default: gpu_wheels)
#   OUT                        where the table and the logs go (default: a new temporary folder)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

MODE=gpu
INSTALL=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) MODE=dry ;;
    --no-install) INSTALL=0 ;;
    -h | --help)
      sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "gpu_check: unknown argument $arg (--dry-run, --no-install, --help)" >&2
      exit 2
      ;;
  esac
done
WHEELS="${MEGATRON_TREE_GPU_WHEELS:-gpu_wheels}"
[ ! -d "$WHEELS" ] || WHEELS="$(cd "$WHEELS" && pwd)"
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ "$MODE" = dry ]; then
  PY="$(MEGATRON_TREE_PYTHON=python3.12 bash -c 'source scripts/_env.sh && echo "$VENV"')/bin/python"
else
  PY=python3
fi
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
T0=$SECONDS

# Timeouts in seconds. On the GPU: install + imports + max(cpu, gpu) + attention + logprobs + e2e
# = 40 + 25 + 170 + 75 + 60 (triton) + 40 + 120 = 530 s, under 9 minutes. The dry run runs [1] and [2] one
# after the other and its [3]-[5] are small.
if [ "$MODE" = gpu ]; then
  T_INSTALL=40 T_IMPORTS=25 T_CPU=170 T_GPU=170 T_ATTN=75 T_TRITON=60 T_LOGP=40 T_E2E=120
else
  T_INSTALL=120 T_IMPORTS=90 T_CPU=240 T_GPU=120 T_ATTN=90 T_LOGP=90 T_E2E=150
fi
ROWS="$OUT/rows.txt"
: >"$ROWS"
row() { echo "$1|$2|$3|$4" >>"$ROWS"; }
# xunit1: the family that keeps record_property's per-test properties (value, bar) without a warning.
# -p no:xdist: one process (the suite's workers are scripts/test.sh's); the bare machine has no
# pytest-xdist, and the dry run's guard refuses the venv's.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -p no:xdist -p no:xdist.looponfail -o junit_family=xunit1)

echo "== gpu_check ($MODE run): python $PY, logs in $OUT"
if ! "$PY" -c "import sys, torch; assert sys.version_info[:2] == (3, 12), sys.version" >"$OUT/python.txt" 2>&1; then
  echo "gpu_check: $PY is not a Python 3.12 with torch:" >&2
  tail -n 3 "$OUT/python.txt" >&2
  if [ "$MODE" = dry ]; then
    echo "  create it with: MEGATRON_TREE_PYTHON=python3.12 bash scripts/setup_env.sh" >&2
  fi
  exit 2
fi
if [ "$MODE" = gpu ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch.cuda.is_available() is False; run this on a CUDA machine (or --dry-run)" >&2
  exit 2
fi

# ---- install the wheels into a fresh --target folder
if [ "$INSTALL" = 1 ]; then
  TARGET="$WORK/site"
  echo "== installing $WHEELS/*.whl into $TARGET"
  if [ ! -f "$WHEELS/MANIFEST" ]; then
    echo "gpu_check: no $WHEELS/MANIFEST: run scripts/gpu_wheels.sh (on a machine with network) and carry $WHEELS" >&2
    exit 2
  fi
  # Every wheel of the manifest must be there; a missing one is a FAIL row (and, in the dry run,
  # the guard then shows which step needed it).
  while read -r wheel _; do
    case "$wheel" in "" | "#"*) continue ;; esac
    if [ ! -f "$WHEELS/$wheel" ]; then
      echo "gpu_check: missing wheel $WHEELS/$wheel (run scripts/gpu_wheels.sh)" >&2
      row "wheel $wheel" "missing" "in $WHEELS (scripts/gpu_wheels.sh)" FAIL
    fi
  done <"$WHEELS/MANIFEST"
  # --no-compile: Python compiles what it imports; compiling all of transformers costs ~40 s.
  timeout -k 5 "$T_INSTALL" "$PY" -m pip install --no-index --no-deps --no-compile \
    --disable-pip-version-check --target "$TARGET" "$WHEELS"/*.whl >"$OUT/install.txt" 2>&1
  RC=$?
  if [ $RC != 0 ]; then
    # No pip, or pip refused: a wheel is a zip file that unpacks as is (none here has scripts).
    echo "gpu_check: pip install failed (exit status $RC, $OUT/install.txt); unpacking the wheels instead"
    rm -rf "$TARGET"
    timeout -k 5 "$T_INSTALL" "$PY" -c "
import sys, zipfile
for whl in sys.argv[2:]:
    zipfile.ZipFile(whl).extractall(sys.argv[1])
print('unpacked', len(sys.argv) - 2, 'wheels')" "$TARGET" "$WHEELS"/*.whl >>"$OUT/install.txt" 2>&1
    RC=$?
  fi
  tail -n 1 "$OUT/install.txt"
  if [ $RC != 0 ]; then
    echo "gpu_check: installing the wheels failed (exit status $RC):" >&2
    tail -n 5 "$OUT/install.txt" >&2
    exit 2
  fi
  export PYTHONPATH="$TARGET:$ROOT"
  if [ "$MODE" = dry ]; then
    export PYTHONPATH="$ROOT/scripts/bare_python:$PYTHONPATH"
    export MEGATRON_TREE_BARE_TARGET="$TARGET" MEGATRON_TREE_BARE_MANIFEST="$WHEELS/MANIFEST"
    export MEGATRON_TREE_BARE_STRICT=1 MEGATRON_TREE_BARE_LOG="$OUT/bare_guard.txt"
    : >"$MEGATRON_TREE_BARE_LOG"
  fi
else
  if ! "$PY" -c "import megatron.core" 2>/dev/null; then
    echo "gpu_check: --no-install, but megatron.core does not import with $PY" >&2
    exit 2
  fi
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

# Runs a step that appends check|value|bar|result rows to the file $2 (arguments: a name for its
# FAIL row, that file, the timeout, the log, the command), then adds the rows to the table, and a
# FAIL row with the exit status when the command fails or writes no row. In
# the dry run the rows' bars are not judged when the script succeeds (a CPU says nothing about
# GPU timings).
rows_step() {
  local name="$1" rows="$2" limit="$3" log="$4" rc
  shift 4
  : >"$rows"
  timeout -k 10 "$limit" "$@" 2>&1 | grep -v -i warn | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$MODE" = dry ] && [ "$rc" = 0 ]; then  # check|value|bar|result -> check|value|runs (...: bar)|PASS
    sed -E 's/^(.*)\|([^|]*)\|[^|]*$/\1|runs (dry run; on the GPU: \2)|PASS/' "$rows" >>"$ROWS"
  else
    cat "$rows" >>"$ROWS"
  fi
  if [ "$rc" != 0 ]; then
    row "$name" "exit status $rc$([ "$rc" = 124 ] && echo " (timeout ${limit} s)")" "exits 0" FAIL
  elif [ ! -s "$rows" ]; then
    row "$name" "wrote no rows" "one row or more" FAIL
  fi
}

echo "== [0] imports and versions"
timeout -k 5 "$T_IMPORTS" "$PY" - "$OUT/imports_rows.txt" "$OUT/versions.txt" >"$OUT/imports.txt" 2>&1 <<'PYEOF'
import importlib
import os
import sys

import torch

mods = ["megatron.core", "mbridge", "transformers", "huggingface_hub", "tokenizers", "matplotlib"]
lines = [
    f"python {sys.version.split()[0]} ({sys.executable})",
    f"torch {torch.__version__} cuda {torch.version.cuda} "
    + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(no GPU)"),
]
for name in mods:
    mod = importlib.import_module(name)
    lines.append(f"{name} {getattr(mod, '__version__', '?')} from {os.path.dirname(mod.__file__)}")
import megatron_tree
from mbridge import AutoBridge  # what the GPU tests and the end-to-end step import
from megatron_tree import patch_bridge_for_tree_training

lines.append(f"megatron_tree from {os.path.dirname(megatron_tree.__file__)}")
with open(sys.argv[2], "w") as f:
    f.write("\n".join(lines) + "\n")
with open(sys.argv[1], "w") as f:
    f.write(f"imports|torch {torch.__version__}, megatron-core "
            f"{importlib.import_module('megatron.core').__version__}, transformers "
            f"{importlib.import_module('transformers').__version__}|all import|PASS\n")
# Every flex, fused log-prob and benchmark step compiles (Triton on the GPU needs a C compiler and
# Python's headers for its launcher): one tiny compile, so a missing toolchain shows here, named.
device = "cuda" if torch.cuda.is_available() else "cpu"
try:
    value = torch.compile(lambda x: x * 2 + 1)(torch.ones(4, device=device))
    ok, what = bool((value == 3).all()), f"torch.compile on {device} works"
except Exception as exc:  # the toolchain, reported as a row rather than a crash
    ok, what = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}".replace("|", "/")
with open(sys.argv[1], "a") as f:
    f.write(f"compile|{what}|compiles|{'PASS' if ok else 'FAIL'}\n")
PYEOF
RC=$?
if [ $RC = 0 ]; then
  cat "$OUT/versions.txt"
  cat "$OUT/imports_rows.txt" >>"$ROWS"
else
  tail -n 5 "$OUT/imports.txt"
  row imports "exit status $RC" "all import" FAIL
fi

echo "== [1] CPU suite with CUDA hidden$([ "$MODE" = gpu ] && echo " (on the CPU cores, while [2] runs)")"
CPU_SUITE=(tests/test_attention.py tests/test_attention_model.py tests/test_bridge.py tests/test_cpu_patch.py)
if [ "$MODE" = dry ]; then
  # On a 2-core CPU the spawned multi-process worlds, the MoE models and the flex compile-count
  # tests are 80% of these files' time (~4 min); the Python 3.12 stack's suite runs them in CI.
  CPU_SUITE+=(-k "not parallel and not tp2 and not moe and not compiles_once and not recompile_limit")
fi
cpu_suite() {
  # SIGINT, not SIGTERM: an interrupted pytest still finishes its session and writes the junit
  # XML of the tests that ran.
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS="$1" timeout -s INT -k 20 "$T_CPU" "${PYTEST[@]}" -W ignore \
    "${CPU_SUITE[@]}" --junitxml "$OUT/cpu.xml" >"$OUT/cpu_suite.txt" 2>&1
  echo $? >"$OUT/cpu_suite.rc"
}
if [ "$MODE" = gpu ]; then
  cpu_suite 8 &
  CPU_PID=$!
else
  cpu_suite 2
  tail -n 3 "$OUT/cpu_suite.txt"
fi

echo "== [2] CUDA parity, flex kernel and gradients (tests/test_gpu.py)"
timeout -s INT -k 20 "$T_GPU" "${PYTEST[@]}" -m gpu tests/test_gpu.py --junitxml "$OUT/gpu.xml" \
  >"$OUT/gpu_suite.txt" 2>&1
RC=$?
tail -n 15 "$OUT/gpu_suite.txt"
[ $RC = 0 ] || row "GPU tests (pytest)" "exit status $RC" "exits 0" FAIL

if [ "$MODE" = gpu ]; then
  echo "== [1] waiting for the CPU suite"
  wait "$CPU_PID"
  tail -n 3 "$OUT/cpu_suite.txt"
fi
RC="$(cat "$OUT/cpu_suite.rc" 2>/dev/null || echo '?')"
[ "$RC" = 0 ] || row "CPU suite (pytest)" "exit status $RC" "exits 0" FAIL

# The benchmarks' options: --device cuda on the GPU (where a script has no --device option, its
# default, the GPU, without it), --small (the CPU smoke run) in the dry run.
bench_args() {
  if [ "$MODE" = dry ]; then
    echo --small
  elif grep -q -- '"--device"' "$1"; then
    echo --device cuda
  fi
}
ATTN_ARGS=($(bench_args scripts/bench_attention.py))
echo "== [3] attention throughput (scripts/bench_attention.py ${ATTN_ARGS[*]})"
rows_step "attention benchmark" "$OUT/rows_attention.txt" "$T_ATTN" "$OUT/attention.txt" \
  "$PY" scripts/bench_attention.py "${ATTN_ARGS[@]}" --rows "$OUT/rows_attention.txt"
if [ "$MODE" = gpu ]; then
  # --bar 0: the triton kernel is reported, not judged, until a GPU run has measured it (docs/gpu.md)
  echo "== [3b] attention throughput, backend triton (scripts/bench_attention.py --backend triton)"
  rows_step "attention benchmark (triton)" "$OUT/rows_attention_triton.txt" "$T_TRITON" \
    "$OUT/attention_triton.txt" "$PY" scripts/bench_attention.py "${ATTN_ARGS[@]}" \
    --backend triton --bar 0 --rows "$OUT/rows_attention_triton.txt"
  # What backend="auto" should try first on this GPU: the faster of flex and triton per useful
  # pair at each length (docs/gpu.md, "A work model"); reported, not judged.
  "$PY" - "$OUT/rows_attention.txt" "$OUT/rows_attention_triton.txt" "$ROWS" <<'PYEOF'
import re
import sys

def tflops(path):
    out = {}
    for line in open(path):
        check, value = line.split("|")[:2]
        length = re.search(r"fwd\+bwd (\S+)$", check)
        rate = re.match(r"([\d.]+) TFLOP/s", value)
        if length and rate:
            out[length.group(1)] = float(rate.group(1))
    return out

flex, triton = tflops(sys.argv[1]), tflops(sys.argv[2])
both = [n for n in flex if n in triton]
ratios = ", ".join(f"{n} {triton[n] / flex[n]:.2f}x" for n in both) or "no length measured by both"
faster = "triton" if both and all(triton[n] > flex[n] for n in both) else "flex"
with open(sys.argv[3], "a") as rows:
    rows.write(f"auto's first choice on this GPU|{faster} (triton / flex per useful pair: {ratios})|"
               f"reported (auto keeps flex until set from a run)|PASS\n")
print(f"auto's first choice on this GPU: {faster} (triton / flex: {ratios})")
PYEOF
fi

LOGP_ARGS=($(bench_args scripts/bench_logprobs.py))
echo "== [4] log-prob gather bandwidth (scripts/bench_logprobs.py ${LOGP_ARGS[*]})"
rows_step "log-prob benchmark" "$OUT/rows_logprobs.txt" "$T_LOGP" "$OUT/logprobs.txt" \
  "$PY" scripts/bench_logprobs.py "${LOGP_ARGS[@]}" --rows "$OUT/rows_logprobs.txt"

if [ "$MODE" = gpu ]; then
  echo "== [5] end-to-end GRPO step, tree vs. unshared (qwen3_0p5b, bf16, flex, 16K-token trees)"
  E2E=(--model qwen3_tiny --device cuda --bf16 --backend flex --config examples/configs/qwen3_0p5b --max-tokens 16384
    --prompts 8 --samples 8 --prompt-len 2048 --response-len 256 512 --reps 3 --parity-sequences 2)
else
  echo "== [5] end-to-end GRPO step, tree vs. unshared (--small, CPU)"
  E2E=(--model qwen3_tiny --device cpu --small --reps 1 --parity-sequences 2)
fi
timeout -k 10 "$T_E2E" "$PY" examples/tree_vs_baseline.py "${E2E[@]}" --out "$OUT" 2>&1 \
  | grep -v -i warn | tee "$OUT/e2e.txt"
E2E_RC=${PIPESTATUS[0]}
if [ "$E2E_RC" = 0 ]; then
  "$PY" - "$OUT/e2e.txt" "$ROWS" "$MODE" <<'PYEOF'
import re
import sys

text, rows, mode = open(sys.argv[1]).read(), open(sys.argv[2], "a"), sys.argv[3]
speed = float(re.search(r"^speed-up\s+([\d.]+)x", text, re.M).group(1))
ideal = float(re.search(r"^ideal speed-up \(FLOP model\)\s+([\d.]+)x", text, re.M).group(1))
ok = speed >= 0.85 * ideal or mode == "dry"
bar = ">= 85% of ideal" if mode == "gpu" else "runs (dry run; on the GPU: >= 85% of ideal)"
value = f"{speed:.2f}x (ideal {ideal:.2f}x, {speed / ideal:.0%})"
rows.write(f"e2e GRPO step speed-up|{value}|{bar}|{'PASS' if ok else 'FAIL'}\n")
PYEOF
  [ $? = 0 ] || row "e2e GRPO step" "no speed-up line in its output" "prints its table" FAIL
else
  row "e2e GRPO step" "exit status $E2E_RC$([ "$E2E_RC" = 124 ] && echo " (timeout ${T_E2E} s)")" "exits 0" FAIL
fi

if [ "$MODE" = dry ] && [ -s "$OUT/bare_guard.txt" ]; then
  echo "== imports the bare-machine guard refused (a library may have caught some):"
  sort -u "$OUT/bare_guard.txt" | cut -c1-200
fi

echo
echo "== summary ($MODE run, $((SECONDS - T0)) s; logs in $OUT)"
"$PY" - "$OUT" "$MODE" <<'PYEOF' | tee "$OUT/summary.txt"
import sys
import xml.etree.ElementTree as ET

out, mode, rows = sys.argv[1], sys.argv[2], []  # rows: (check, value, bar, result, a skip is fine)
for xml, skip_ok in (("cpu.xml", True), ("gpu.xml", mode == "dry")):
    try:
        cases = list(ET.parse(f"{out}/{xml}").getroot().iter("testcase"))
    except (OSError, ET.ParseError) as exc:
        rows.append((xml, f"unreadable: {type(exc).__name__}", "written by pytest", "FAIL", False))
        continue
    for case in cases:
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        result = "FAIL" if failed else "SKIP" if skipped is not None else "PASS"
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if skipped is None:
            value = props.get("value", f"{float(case.get('time') or 0):.1f} s")
        else:
            value = (skipped.get("message") or "")[:60]
        rows.append((name, value, props.get("bar", "passes"), result, skip_ok))
for line in open(f"{out}/rows.txt"):
    if line.strip():  # check|value|bar|result; a value may hold a "|" (max |diff|)
        check, rest = line.rstrip("\n").split("|", 1)
        value, bar, result = rest.rsplit("|", 2) if rest.count("|") >= 2 else (rest, "?", "FAIL")
        rows.append((check, value, bar, result, False))
table = [("check", "value", "bar", "result")] + [r[:4] for r in rows]
widths = [max(len(r[i]) for r in table) for i in range(4)]
for r in table:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
ok = bool(rows) and all(r[3] == "PASS" or (r[3] == "SKIP" and r[4]) for r in rows)
print(
    f"{sum(r[3] == 'PASS' for r in rows)} passed, {sum(r[3] == 'SKIP' for r in rows)} skipped, "
    f"{sum(r[3] == 'FAIL' for r in rows)} failed: {'OK' if ok else 'FAILED'}"
)
sys.exit(0 if ok else 1)
PYEOF
exit "${PIPESTATUS[0]}"
