#!/usr/bin/env bash
# The main job: set up (or reuse) the venv (scripts/_env.sh), then run one GRPO training step
# tree-packed vs. the unshared baseline on the bundled tiny Qwen3 (built through mbridge), printing
# parity, speed-up and memory, and writing outputs/tree_mask.png. Arguments go to the job (e.g.
# --small, --tp 2 under torchrun: see scripts/torchrun_demo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# Known set-up noise (pip's "Location ... is ignored", setuptools' editable-install notice) becomes one
# line; everything else from set-up, errors included, still shows. MEGATRON_TREE_VERBOSE=1 shows all.
if [[ "${MEGATRON_TREE_VERBOSE:-0}" =~ ^(|0|false|no)$ ]]; then
  bash scripts/setup_env.sh 2>&1 | awk '
    /^WARNING: Location .* is ignored: it is neither a file nor a directory/ { hidden++; next }
    /BuildBackendWarning: Editable installation/ { hidden++; skip = 1; next }
    skip && /with strategy, WheelFile|^[^ ]/ { skip = 0; if (/with strategy, WheelFile/) next }
    skip { next }
    { print; fflush() }
    END { if (hidden) printf "[setup] %d known pip/setuptools notices hidden; set MEGATRON_TREE_VERBOSE=1 to show them\n", hidden }'
else
  bash scripts/setup_env.sh
fi
source scripts/_env.sh
exec "$VENV/bin/python" examples/tree_vs_baseline.py "$@"
