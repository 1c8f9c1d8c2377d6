#!/usr/bin/env bash
# Run the test suite on every supported stack and print one table:
#   default interpreter (Python 3.10/3.11: megatron-core 0.16.1), and, when a Python 3.12 interpreter
#   is present, Python 3.12 with megatron-core 0.17.0 and with 0.19.2 (mbridge 0.15.1 everywhere), and
#   the Megatron-Bridge stack (Python 3.12, megatron-core 0.19.2, megatron-bridge 0.6.2, transformers
#   5: mbridge does not work there, so it runs the Megatron-Bridge tests); the AReaL stack (the default
#   interpreter with AReaL 1.0.4) runs the AReaL tests, the TRL stack (with TRL 1.16.0) the TRL tests.
# Each stack has its own venv (scripts/_env.sh); logs go to a temporary folder. Extra arguments go
# to pytest. Exit status 0 iff every stack passed. The HF parity results of all stacks become the
# supported-models table of docs/models.md and the README's summary (scripts/models_table.py).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/_python312.sh
LOGS="$(mktemp -d)"
# The HF parity tests append their results here; the supported-models table is built from them.
export MEGATRON_TREE_PARITY_LOG="$LOGS/parity.jsonl"
py312="$(find_python312)"
stacks=("default|python3||" "default + AReaL|python3||areal" "default + TRL|python3||trl")
if [ -n "$py312" ]; then
  stacks+=("py3.12 + megatron-core 0.17.0|$py312|megatron-core==0.17.0|")
  stacks+=("py3.12 + megatron-core 0.19.2|$py312|megatron-core==0.19.2|")
  stacks+=("py3.12 + 0.19.2 + Megatron-Bridge|$py312|megatron-core==0.19.2|megatron-bridge")
  stacks+=("py3.12 + 0.19.2 + verl|$py312|megatron-core==0.19.2|verl")
  stacks+=("py3.12 + 0.19.2 + verl + MB|$py312|megatron-core==0.19.2|verl-megatron-bridge")
else
  echo "[matrix] no Python 3.12 interpreter found: only the default stack runs"
fi
rows=() status=0 i=0
for stack in "${stacks[@]}"; do
  IFS="|" read -r name python mcore bridge <<<"$stack"
  i=$((i + 1)); log="$LOGS/stack$i.log"; t0=$SECONDS
  echo "[matrix] $name (log: $log)"
  if [ -z "$mcore" ] && [ -z "$bridge" ]; then
    bash scripts/test.sh -q "$@" >"$log" 2>&1
  elif [ -n "$bridge" ]; then
    case "$bridge" in
      verl-megatron-bridge) tests=("${VERL_MEGATRON_BRIDGE_TESTS[@]}") ;;
      verl) tests=("${VERL_TESTS[@]}") ;;
      areal) tests=("${AREAL_TESTS[@]}") ;;
      trl) tests=("${TRL_TESTS[@]}") ;;
      *) tests=("${MEGATRON_BRIDGE_TESTS[@]}") ;;
    esac
    vars=(MEGATRON_TREE_BRIDGE="$bridge")
    if [ -n "$mcore" ]; then vars+=(MEGATRON_TREE_PYTHON="$python" MEGATRON_TREE_MCORE="$mcore"); fi
    env "${vars[@]}" bash scripts/test.sh -q "${tests[@]}" "$@" >"$log" 2>&1
  else
    MEGATRON_TREE_PYTHON="$python" MEGATRON_TREE_MCORE="$mcore" bash scripts/test.sh -q "$@" >"$log" 2>&1
  fi
  rc=$?; [ $rc = 0 ] || status=1
  summary="$(grep -E '^=*\s*[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1)"
  count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE '[0-9]+' || echo 0; }
  venv="$(MEGATRON_TREE_PYTHON="${mcore:+$python}" MEGATRON_TREE_MCORE="$mcore" MEGATRON_TREE_BRIDGE="$bridge" \
    bash -c 'source scripts/_env.sh; echo "$VENV"')"
  version="$("$venv/bin/python" -c 'import sys, torch, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "mcore", m.__version__)' 2>/dev/null)"
  rows+=("$name|${version:-?}|$(count passed)|$(count failed)|$(count skipped)|$((SECONDS - t0))|$rc")
done
printf '\n%-32s %-50s %7s %7s %8s %8s %3s\n' stack versions passed failed skipped seconds rc
for row in "${rows[@]}"; do
  IFS="|" read -r a b c d e f g <<<"$row"
  printf '%-32s %-50s %7s %7s %8s %8s %3s\n' "$a" "$b" "$c" "$d" "$e" "$f" "$g"
done
if [ -s "$MEGATRON_TREE_PARITY_LOG" ]; then
  python3 scripts/models_table.py "$MEGATRON_TREE_PARITY_LOG" >"$LOGS/models_table.md" \
    && echo "[matrix] supported-models table: $LOGS/models_table.md (docs/models.md and README.md: python3" \
            "scripts/models_table.py $MEGATRON_TREE_PARITY_LOG --readme docs/models.md --summary README.md)"
fi
exit $status
