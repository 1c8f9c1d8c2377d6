#!/usr/bin/env bash
# The main job: set up (or reuse) the venv (scripts/_env.sh), then run one GRPO training step
# tree-packed vs. the unshared baseline on the bundled tiny Qwen3 (built through mbridge), printing
# parity, speed-up and memory, and writing outputs/tree_mask.png. Arguments go to the job (e.g.
# --small, --tp 2 under torchrun: see scripts/torchrun_demo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/_env.sh
exec "$VENV/bin/python" examples/tree_vs_baseline.py "$@"
