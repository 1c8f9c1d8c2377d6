#!/usr/bin/env bash
# Tree step vs. unpacked reference under torchrun: TP=2, PP=2 (actor and critic), TP=2 x PP=2,
# CP=2 (actor and critic), CP=2 x TP=2, CP=2 x DP=2, CP=2 x PP=2, PP=2 x VPP=2, TP=2 + SP (actor and critic),
# trunk reuse at TP=2 (actor and critic), DP=2, TP=2 x DP=2, TP=2 + SP, CP=2, CP=2 x TP=2, CP=2 x DP=2,
# PP=2 (actor and critic), PP=2 x VPP=2, CP=2 x PP=2, and trunk chains (a shared history and a sequence
# longer than a micro-batch) at TP=2, CP=2, PP=2 and PP=2 x VPP=2.
# gloo + the CPU patch on a CPU machine, NCCL on a CUDA machine (one GPU per rank), unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/_env.sh
TORCHRUN="$VENV/bin/torchrun"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
for layout in "2 --tp 2" "2 --pp 2" "2 --pp 2 --critic" "2 --tp 2 --critic" "4 --tp 2 --pp 2" \
    "2 --cp 2" "2 --cp 2 --critic" "4 --cp 2 --tp 2" "4 --cp 2" "4 --cp 2 --pp 2" "2 --pp 2 --vpp 2" \
    "2 --tp 2 --sp" "2 --tp 2 --sp --critic" "2 --tp 2 --trunk" "2 --tp 2 --trunk --critic" \
    "2 --trunk" "4 --tp 2 --trunk" "2 --tp 2 --sp --trunk" "2 --cp 2 --trunk" "4 --cp 2 --tp 2 --trunk" \
    "4 --cp 2 --trunk" "2 --pp 2 --trunk" "2 --pp 2 --trunk --critic" "2 --pp 2 --vpp 2 --trunk" \
    "4 --cp 2 --pp 2 --trunk" "2 --tp 2 --chains" "2 --cp 2 --chains" "2 --pp 2 --chains" \
    "2 --pp 2 --vpp 2 --chains --critic"; do
  set -- $layout
  n=$1; shift
  echo "== torchrun --nproc-per-node $n scripts/torchrun_parity.py $*"
  "$TORCHRUN" --nproc-per-node "$n" --master-port "${MASTER_PORT:-29511}" scripts/torchrun_parity.py "$@" 2>&1 \
    | grep -E "^rank|^torchrun parity|Error"
done
