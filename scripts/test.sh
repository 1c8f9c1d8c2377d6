#!/usr/bin/env bash
# Set up (or reuse) .venv and run the test suite. Extra arguments go to pytest, e.g.
#   scripts/test.sh tests/test_packing.py -x
#   scripts/test.sh -m gpu          # the GPU tests (skipped without CUDA; see scripts/gpu_check.sh)
# Fails when pytest fails or when it collected no test (pytest exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
