#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron_tree with the
# Megatron stack and the test tools. Safe to run repeatedly: a stamp file skips the install when
# setup.py has not changed since the last successful run.
#
# torch is installed first and pinned, so pip never resolves an unpinned `torch` to a multi-GB CUDA
# build on a CPU machine. On a GPU machine set MEGATRON_TREE_TORCH to the torch requirement you want
# (e.g. "torch==2.13.0" from a CUDA index) or to "skip" to keep the torch already in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${MEGATRON_TREE_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_REQ="${MEGATRON_TREE_TORCH:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

stamp="$VENV/.megatron_tree_stamp"
want="$(cat setup.py scripts/setup_env.sh | sha256sum | cut -d' ' -f1) $TORCH_REQ"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import megatron_tree" 2>/dev/null; then
  echo "[setup] $VENV is up to date"
  exit 0
fi

"$PY" -m pip install --quiet --upgrade pip
if [ "$TORCH_REQ" != "skip" ]; then
  echo "[setup] installing $TORCH_REQ"
  "$PY" -m pip install --quiet "$TORCH_REQ"
fi
echo "[setup] installing megatron_tree[megatron,test] (editable)"
"$PY" -m pip install --quiet -e ".[megatron,test]"
echo "$want" > "$stamp"
echo "[setup] done: $("$PY" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)')"
