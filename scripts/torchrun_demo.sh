#!/usr/bin/env bash
# The main job (tree vs. baseline GRPO step) under torchrun with tensor parallelism.
#   scripts/torchrun_demo.sh 2            # TP=2 on 2 processes (gloo on CPU, NCCL on GPU)
#   scripts/torchrun_demo.sh 2 --small    # extra arguments go to examples/tree_vs_baseline.py
# The model is the random tiny Qwen3 (--model qwen3_tiny: 4 heads) unless the arguments name
# another: SmolLM2-135M's 9 heads in 3 groups split over --tp 3, not 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/_env.sh
tp="${1:-2}"; shift || true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/torchrun" --nproc-per-node "$tp" --master-port "${MASTER_PORT:-29512}" \
  examples/tree_vs_baseline.py --model qwen3_tiny --tp "$tp" "$@"
