#!/usr/bin/env bash
# Set up (or reuse) .venv and run the main job. Arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python scripts/bench_packing.py "$@"
