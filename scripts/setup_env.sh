#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install megatron_tree with the Megatron
# stack, the test tools and matplotlib. Safe to run repeatedly: a stamp file skips the install
# when nothing it depends on has changed. The stack follows the interpreter (see scripts/_env.sh):
#   Python 3.10/3.11: megatron-core 0.16.1;  Python 3.12: megatron-core 0.17-0.19 (newest by default).
# Both with mbridge 0.15.1 and transformers < 5. MEGATRON_TREE_BRIDGE adds a framework:
# megatron-bridge (with AReaL 1.0.4, for its engine on Megatron-Bridge models), verl,
# verl-megatron-bridge or areal (AReaL 1.0.4, on the Python 3.10/3.11 one); trl adds TRL 1.16.0
# (on the Python 3.11 one); kernels adds mamba-ssm and fla-core (their Triton kernels, run in the
# interpreter by the CPU tests).
#
# torch is installed first and pinned, so pip never resolves an unpinned `torch` again later. Where
# pip finds a CPU wheel (as on our CPU machines for Python 3.11) that is what it installs; PyPI's
# default Linux wheel is the CUDA build (several GB; it runs on a CPU too), which is what Python 3.12
# gets. Set MEGATRON_TREE_TORCH to the torch requirement you want (e.g. "torch==2.13.0" from a CUDA
# index) or to "skip" to keep the torch already in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
TORCH_REQ="${MEGATRON_TREE_TORCH:-torch==2.13.0}"

# A framework stack (MEGATRON_TREE_MCORE or MEGATRON_TREE_BRIDGE set) starts as a copy of its
# interpreter's base stack (.venv, or .venv-<python>), whose site-packages are hard-linked, not
# installed again: torch (the CUDA build on 3.12 is ~5 GB) and the Megatron stack are unpacked once
# per interpreter, and the stack's own packages are then installed on top. pip unlinks a file before
# it writes or removes it, so installing into the copy leaves the base's files as they were.
# MEGATRON_TREE_BASE_VENV=none installs every stack from scratch instead (the old way).
BASE_VENV=""
if [ -z "${MEGATRON_TREE_VENV:-}" ] && { [ -n "$MCORE_REQ" ] || [ -n "$BRIDGE" ]; } \
  && [ "${MEGATRON_TREE_BASE_VENV:-}" != "none" ]; then
  if [ -z "${MEGATRON_TREE_PYTHON:-}" ]; then BASE_VENV=.venv; else BASE_VENV=".venv-$(basename "$PYTHON")"; fi
fi
layered=0
if [ ! -x "$VENV/bin/python" ] && [ -n "$BASE_VENV" ]; then
  MEGATRON_TREE_MCORE="" MEGATRON_TREE_BRIDGE="" bash scripts/setup_env.sh
  echo "[setup] creating virtual environment $VENV as a hard-linked copy of $BASE_VENV"
  "$PYTHON" -m venv --without-pip "$VENV"
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  base_site="$("$BASE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  cp -al "$base_site/." "$site/"
  # Console scripts name their venv's python in their first line: copied with it rewritten. Other
  # files there (ruff's binary) are copied as they are.
  base_abs="$(cd "$BASE_VENV" && pwd)" venv_abs="$(cd "$VENV" && pwd)"
  for script in "$BASE_VENV"/bin/*; do
    name="$(basename "$script")"
    [ -e "$VENV/bin/$name" ] && continue
    if [ "$(head -c 2 "$script")" = "#!" ]; then
      sed "1s|^#!$base_abs/bin/|#!$venv_abs/bin/|" "$script" >"$VENV/bin/$name"
      chmod +x "$VENV/bin/$name"
    else
      cp -p "$script" "$VENV/bin/$name"
    fi
  done
  layered=1
elif [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV from $PYTHON ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# pip resumes an interrupted download only a few times; a flaky network can still drop a large
# wheel (the CUDA torch build of Python 3.12), so each install gets up to three attempts.
pip_install() {
  local attempt
  for attempt in 1 2 3; do
    "$PY" -m pip install --quiet "$@" && return 0
    echo "[setup] pip install failed (attempt $attempt of 3)" >&2
    sleep $((attempt * 10))
  done
  return 1
}

stamp="$VENV/.megatron_tree_stamp"
want="$(cat setup.py scripts/setup_env.sh scripts/_env.sh | sha256sum | cut -d' ' -f1) $TORCH_REQ $MCORE_REQ $BRIDGE ${MEGATRON_TREE_TRITON:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import megatron_tree" 2>/dev/null; then
  echo "[setup] $VENV is up to date"
  exit 0
fi

# A copy of the base stack already has pip, torch and megatron_tree[megatron,test,examples]
# (editable, from this checkout); it installs them again only for a megatron-core pin the base's
# version does not meet.
satisfied() {
  "$PY" -c 'import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
r = Requirement(sys.argv[1])
try:
    sys.exit(0 if r.specifier.contains(version(r.name), prereleases=True) else 1)
except PackageNotFoundError:
    sys.exit(1)' "$1"
}
if [ "$layered" = 1 ] && { [ -z "$MCORE_REQ" ] || satisfied "$MCORE_REQ"; }; then
  echo "[setup] torch, megatron_tree and ${MCORE_REQ:-megatron-core} as in $BASE_VENV"
else
  pip_install --upgrade pip
  if [ "$TORCH_REQ" != "skip" ]; then
    echo "[setup] installing $TORCH_REQ"
    pip_install "$TORCH_REQ"
  fi
  echo "[setup] installing megatron_tree[megatron,test,examples] (editable) ${MCORE_REQ}"
  pip_install -e ".[megatron,test,examples]" $MCORE_REQ
fi
install_without_deps() {
  # $1 with --no-deps, then the requirements after it with the installed versions of the packages
  # named by the regex $2 kept (pip must not resolve torch / megatron-core / transformers again).
  local package="$1" keep="$2" constraints
  shift 2
  constraints="$(mktemp)"
  "$PY" -m pip freeze | grep -iE "^($keep)==" >"$constraints" || true
  pip_install --no-deps "$package"
  pip_install -c "$constraints" "$@"
  rm -f "$constraints"
}
install_megatron_bridge() {
  # Megatron-Bridge 0.6.2 declares a large GPU dependency set (flashinfer, nvidia-resiliency-ext,
  # wandb, ...); building, loading and exporting GPT models imports only these. Keep torch and
  # megatron-core as installed.
  echo "[setup] installing megatron-bridge 0.6.2 (--no-deps), transformers 5.8-5.12, omegaconf"
  install_without_deps "megatron-bridge==0.6.2" "torch|megatron-core" "transformers>=5.8,<=5.12.1" omegaconf
}
install_verl() {
  # verl 0.9.1 without its declared dependencies, then what its Megatron engine imports, with
  # torch / megatron-core / transformers kept as installed (extra requirements: "$@").
  echo "[setup] installing verl 0.9.1 (--no-deps) and what its Megatron engine imports"
  install_without_deps "verl==0.9.1" "torch|megatron-core|transformers" ray "tensordict==0.10.0" omegaconf \
    codetiming peft accelerate datasets pandas pyarrow pillow pydantic fastapi uvicorn psutil dill "$@"
}
install_areal() {
  # AReaL 1.0.4 without its declared dependencies (vLLM/SGLang clients, ray, wandb, datasets, ...
  # and transformers 5, torch < 2.11), then what its Megatron engine, PPO actor and PPOTrainer
  # import at module level, found by importing them: all small. Its engine runs with the default
  # stack as installed (megatron-core 0.16.1, mbridge 0.15.1, transformers 4.57, torch 2.13) and
  # with the Megatron-Bridge one (megatron-core 0.19.2, transformers 5.12.1, outside AReaL's
  # declared 5.0-5.3; tests/test_areal_megatron_bridge.py runs its engine there). What
  # they import but never use on that path and is large or GPU-only (ray, numba, datasets, wandb,
  # swanlab, trackio, megatron.bridge, the FP8 Triton kernels) is stood in for by
  # tests/harness/areal_platform.py, never installed.
  echo "[setup] installing areal 1.0.4 (--no-deps) and what its Megatron engine imports"
  install_without_deps "areal==1.0.4" "torch|megatron-core|transformers" \
    "hydra-core==1.4.0.dev1" omegaconf colorlog uvloop lark aiohttp aiofiles httpx flask openai \
    orjson psutil pydantic tenacity torchdata tabulate pybase64 tensorboardX "$@"
}
install_trl() {
  # TRL 1.16.0 without its declared dependencies, then what its GRPOTrainer imports (it declares
  # transformers >= 4.56.2: the default stack's 4.57 is kept, as are torch, megatron-core and
  # huggingface-hub < 1, which transformers 4.57 needs).
  echo "[setup] installing trl 1.16.0 (--no-deps) and what its GRPOTrainer imports"
  install_without_deps "trl==1.16.0" "torch|megatron-core|transformers|huggingface[-_]hub" \
    "accelerate>=1.10.1" "datasets>=4.7.0" pandas "pyarrow>=21.0.0" psutil pyyaml jinja2
}
# Triton for backend="triton" (core/triton_attention.py); the CPU suite runs its kernels in Triton's
# interpreter (tests/test_triton_attention.py). PyPI's CUDA torch wheels bring the Triton they were
# built with; the CPU wheel brings none, so the default stack gets the one torch 2.13's CUDA wheel
# pins (--no-deps: Triton requires nothing, and torch stays as pinned above). The framework stacks
# are left as they are (AReaL's CPU platform stands in for its Triton FP8 kernels while triton is
# absent). MEGATRON_TREE_TRITON overrides the requirement, "skip" installs none.
TRITON_REQ="${MEGATRON_TREE_TRITON:-triton==3.7.1}"
if { [ -z "$BRIDGE" ] || [ "$BRIDGE" = "kernels" ]; } && [ "$TRITON_REQ" != "skip" ] && ! "$PY" -c "import triton" 2>/dev/null; then
  echo "[setup] installing $TRITON_REQ (backend='triton'; its tests use Triton's interpreter)"
  pip_install --no-deps "$TRITON_REQ"
fi
# A framework stack copied from a base that got Triton this way (not as a torch dependency) drops
# it again, as that stack never had it.
if [ "$layered" = 1 ] && [ -n "$BRIDGE" ] && [ "$BRIDGE" != "kernels" ] \
  && "$PY" -c "import triton" 2>/dev/null \
  && ! "$PY" -m pip show torch 2>/dev/null | grep -qE '^Requires:.*\btriton\b'; then
  echo "[setup] removing triton (copied from $BASE_VENV; not a dependency of this torch)"
  "$PY" -m pip uninstall --quiet -y triton
fi
if [ "$BRIDGE" = "megatron-bridge" ]; then
  install_megatron_bridge
  # AReaL's Megatron engine on Megatron-Bridge models (bridge_type="megatron-bridge"), the path its
  # own tree training refuses and megatron_tree's AReaL engines build.
  install_areal
elif [ "$BRIDGE" = "verl" ]; then
  # verl 0.9.1 declares transformers >= 5.5.3, which mbridge 0.15.1 (verl's vanilla_mbridge path)
  # cannot read; its Megatron engine runs with transformers 4.57.
  install_verl "huggingface-hub==0.36.2"
elif [ "$BRIDGE" = "verl-megatron-bridge" ]; then
  # verl on its default model-building path (Megatron-Bridge, vanilla_mbridge=False): the
  # Megatron-Bridge stack above (transformers 5.12.1, outside verl's declared < 5.11; its Megatron
  # engine and tests/test_verl.py run with it), then verl, and megatron-energon, which
  # megatron.bridge.training.config imports when verl builds the DDP config (not declared by
  # megatron-bridge 0.6.2).
  install_megatron_bridge
  install_verl megatron-energon
elif [ "$BRIDGE" = "areal" ]; then
  # and peft (AReaL declares <= 0.18.1), which AReaL's FSDP engine imports at module level
  # (tests/test_areal_fsdp.py runs it)
  install_areal "peft==0.18.1"
elif [ "$BRIDGE" = "trl" ]; then
  install_trl
elif [ "$BRIDGE" = "kernels" ]; then
  # The recurrent layers' GPU kernels, for their interpreter tests on the CPU
  # (tests/test_recurrent_kernels.py): mamba-ssm 2.3.2.post1 built from source without its CUDA
  # extensions (MAMBA_FORCE_BUILD: else its setup downloads a prebuilt CUDA wheel; its Triton SSD
  # kernels are plain Python) and fla-core 0.6.0 (fla's Triton kernels, pure Python), both
  # --no-deps with the small packages they import; torch and triton stay as installed above.
  echo "[setup] installing mamba-ssm 2.3.2.post1 (source, no CUDA build) and fla-core 0.6.0"
  pip_install einops ninja packaging setuptools wheel
  MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE pip_install --no-deps --no-build-isolation \
    "mamba-ssm==2.3.2.post1"
  pip_install --no-deps "fla-core==0.6.0"
elif [ -n "$BRIDGE" ]; then
  echo "[setup] MEGATRON_TREE_BRIDGE=$BRIDGE is not known; use megatron-bridge, verl, verl-megatron-bridge, areal, trl or kernels" >&2
  exit 2
fi
echo "$want" > "$stamp"
echo "[setup] done: $("$PY" -c 'import sys, torch, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", m.__version__)' 2>/dev/null)"
