#!/usr/bin/env bash
# Set up (or reuse) the venv and run the test suite. Extra arguments go to pytest, e.g.
#   scripts/test.sh tests/test_packing.py -x
#   scripts/test.sh -m gpu          # the GPU tests (skipped without CUDA; see scripts/gpu_check.sh)
#   MEGATRON_TREE_PYTHON=python3.12 scripts/test.sh     # the Python 3.12 stack (scripts/_env.sh)
# Fails when pytest fails or when it collected no test (pytest exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/_env.sh
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
