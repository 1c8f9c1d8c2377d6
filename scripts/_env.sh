# Which interpreter, megatron-core and virtual environment the scripts use. Sourced by
# setup_env.sh, test.sh and demo.sh, so all three agree.
#   MEGATRON_TREE_PYTHON  interpreter the venv is built from (default: python3)
#   MEGATRON_TREE_MCORE   a megatron-core requirement to pin, e.g. megatron-core==0.17.0 (default: the
#                         newest that setup.py allows for that Python: 0.16.x on 3.10/3.11, 0.19.x on 3.12)
#   MEGATRON_TREE_BRIDGE  "megatron-bridge" adds NVIDIA's Megatron-Bridge (Python 3.12; it needs
#                         transformers >= 5.8, so mbridge does not work in that venv) and AReaL 1.0.4
#                         (--no-deps: its engine on Megatron-Bridge models); "verl" adds
#                         verl 0.9.1 (Python 3.12, with mbridge and transformers 4.57); "areal" adds
#                         AReaL 1.0.4 (the default interpreter's stack); "trl" adds TRL 1.16.0 (the
#                         default interpreter's stack, Python >= 3.11)
#   MEGATRON_TREE_VENV    the venv folder (default: .venv for the default stack, otherwise
#                         .venv-<python>[-<megatron-core version>][-megatron-bridge])
PYTHON="${MEGATRON_TREE_PYTHON:-python3}"
MCORE_REQ="${MEGATRON_TREE_MCORE:-}"
BRIDGE="${MEGATRON_TREE_BRIDGE:-}"
if [ -n "${MEGATRON_TREE_VENV:-}" ]; then
  VENV="$MEGATRON_TREE_VENV"
elif [ -z "${MEGATRON_TREE_PYTHON:-}" ] && [ -z "$MCORE_REQ" ] && [ -z "$BRIDGE" ]; then
  VENV=.venv
else
  VENV=".venv-$(basename "$PYTHON")"
  if [ -n "$MCORE_REQ" ]; then VENV="$VENV-$(echo "$MCORE_REQ" | tr -cd '0-9.')"; fi
  if [ -n "$BRIDGE" ]; then VENV="$VENV-$BRIDGE"; fi
fi
