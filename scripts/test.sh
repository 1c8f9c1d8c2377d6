#!/usr/bin/env bash
# Set up (or reuse) the venv and run the test suite. Extra arguments go to pytest, e.g.
#   scripts/test.sh tests/test_packing.py -x
#   scripts/test.sh -m gpu          # the GPU tests (skipped without CUDA; see scripts/gpu_check.sh)
#   MEGATRON_TREE_PYTHON=python3.12 scripts/test.sh     # the Python 3.12 stack (scripts/_env.sh)
# Lint and format (ruff, settings in ruff.toml) are checked first. Fails when ruff finds anything,
# when pytest fails or when it collected no test (pytest exit code 5).
# pytest runs in MEGATRON_TREE_TEST_WORKERS processes (pytest-xdist; default: the CPU count, at
# most 4; 1 runs in this process), each with OMP_NUM_THREADS = CPUs / workers unless it is set:
# the tests are small models whose steps are mostly Python, so two processes on two cores finish
# the default stack in ~0.8x the time of one process with two threads.
set -euo pipefail
cd "$(dirname "$0")/.."
t_setup=$SECONDS
bash scripts/setup_env.sh
source scripts/_env.sh
t_tests=$SECONDS
echo "[test] set-up: $((t_tests - t_setup)) s"
echo "[test] ruff check and ruff format --check (ruff.toml)"
"$VENV/bin/ruff" check --quiet .
"$VENV/bin/ruff" format --check --quiet .
cpus="$(nproc 2>/dev/null || echo 1)"
workers="${MEGATRON_TREE_TEST_WORKERS:-$((cpus < 4 ? cpus : 4))}"
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "[test] MEGATRON_TREE_TEST_WORKERS=$workers: give a whole number >= 1 (1: no worker processes)" >&2
  exit 2
fi
# No more workers than the test files named (a one-file stack would only pay a second start-up).
files=0
for arg in "$@"; do [[ "$arg" == *.py && -f "$arg" ]] && files=$((files + 1)); done
if [ "$files" -gt 0 ] && [ "$files" -lt "$workers" ]; then workers=$files; fi
xdist=()
if [ "$workers" -gt 1 ]; then
  # loadgroup: tests one by one, except those sharing a module-scoped fixture of their file, which
  # go to one worker together (tests/conftest.py), so no fixture is built twice.
  xdist=(-n "$workers" --dist loadgroup)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((cpus / workers > 1 ? cpus / workers : 1))}"
fi
echo "[test] pytest in $workers process(es), OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}"
set +e
"$VENV/bin/python" -m pytest "${xdist[@]}" "$@"
rc=$?
set -e
echo "[test] set-up $((t_tests - t_setup)) s, ruff + pytest $((SECONDS - t_tests)) s"
# .ci/run's per-stack table reads the two numbers from here.
if [ -n "${MEGATRON_TREE_CI_TIMES:-}" ]; then
  echo "$((t_tests - t_setup)) $((SECONDS - t_tests))" >"$MEGATRON_TREE_CI_TIMES"
fi
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
