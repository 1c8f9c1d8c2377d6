#!/usr/bin/env bash
# Download, on a CPU machine with network, every wheel that scripts/gpu_check.sh needs on the bare
# GPU machine (docs/gpu.md) into the git-ignored folder gpu_wheels/, which then travels with the
# repository (64 MiB in all, so the folder may hold at most 48 MiB).
#
# The bare machine has Python 3.12 with its own CUDA torch 2.11, Triton, numpy, transformers 5.x
# (with huggingface-hub >= 1 and tokenizers >= 0.23), accelerate, einops, safetensors, pytest and
# hypothesis, and no network. gpu_check.sh installs these wheels with
# `pip install --no-index --no-deps --target <tmp>` and puts <tmp> first on PYTHONPATH, so a wheel
# here shadows the machine's own copy of that package (the machine's torch is never shadowed).
#
# Idempotent: a wheel already in the folder is not downloaded again; a wheel that is no longer
# listed is removed. Writes gpu_wheels/MANIFEST (wheel file, top-level modules), which
# gpu_check.sh uses to check that every listed wheel is there.
#   PYTHON               interpreter whose pip downloads (default python3; any version: the target
#                        platform is given explicitly)
#   MEGATRON_TREE_GPU_WHEELS  the folder (default gpu_wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${MEGATRON_TREE_GPU_WHEELS:-gpu_wheels}"
MAX_MIB=48

# What is carried, and why. Each line's Requires-Dist was read from the wheel's METADATA; the
# dependencies that are NOT carried are listed after this array with the reason.
WHEELS=(
  # Not on the bare machine. setup.py allows megatron-core 0.17-0.19 on Python 3.12; 0.19.2 is the
  # version CI tests on 3.12 (.ci/run). cp312 manylinux_2_28 x86_64 wheel, 2.4 MB.
  # Requires-Dist: torch>=2.6 (the machine's 2.11), numpy (the machine's), packaging>=24.2 (below).
  "megatron-core==0.19.2"
  # Not on the bare machine; the bridge the GPU tests and the end-to-end step use. Pure Python, no
  # Requires-Dist; imports megatron, torch, transformers, safetensors, einops, packaging.
  "mbridge==0.15.1"
  # The machine has transformers 5.x, which dropped hf_config.rope_theta that mbridge 0.15.1 reads
  # (setup.py: transformers>=4.51,<5). 4.57.6 is the 4.x the CPU stacks use.
  "transformers==4.57.6"
  # transformers 4.57 needs huggingface-hub >=0.34,<1.0; the machine's is >= 1 (transformers 5
  # needs it). An unpinned hub breaks transformers 4.57, so the exact one the CPU stacks use.
  "huggingface-hub==0.36.2"
  # transformers 4.57 needs tokenizers >=0.22,<=0.23.0 (checked at import); transformers 5.24
  # needs >= 0.23.1, so the machine's is out of range. abi3 wheel, 3.3 MB.
  "tokenizers==0.22.2"
  # megatron-core needs packaging >= 24.2; the machine's version is unknown. Pure Python, 0.1 MB.
  "packaging==26.4"
  # huggingface-hub 0.36 and transformers 4.57 import requests at import time (and transformers
  # checks its version); hub >= 1 and transformers 5 use httpx, so the machine need not have it.
  # requests' own Requires-Dist: charset_normalizer, idna, urllib3, certifi (carried with it).
  "requests==2.34.2"
  "urllib3==2.8.0"
  "idna==3.20"
  "charset-normalizer==3.5.3"
  "certifi==2026.10.19.post1"
  # examples/tree_vs_baseline.py (the end-to-end step) always writes its mask picture with
  # matplotlib, which the machine is not known to have. matplotlib's Requires-Dist: contourpy,
  # cycler, fonttools, kiwisolver, numpy (the machine's), packaging, pillow, pyparsing,
  # python-dateutil (2.9 needs six; 4.0 would need tzdata). About 24 MB of the folder: drop these
  # nine when the example can skip the picture without matplotlib.
  "matplotlib==3.11.2"
  "pillow==13.0.0"
  "fonttools==4.68.0"
  "kiwisolver==1.5.1"
  "contourpy==1.4.0"
  "cycler==0.12.1"
  "pyparsing==3.3.3"
  "python-dateutil==2.9.0.post0"
  "six==1.17.0"
)
# Not carried (on the bare machine already, in a version these wheels accept):
#   torch, triton, numpy        the machine's own CUDA build; never shadowed.
#   safetensors (>=0.4.3)       transformers 4.57 / mbridge; transformers 5.24 needs >= 0.8.
#   einops                      mbridge / megatron_tree; on the machine.
#   regex, pyyaml, tqdm         transformers 4.57 (regex!=2019.12.17, pyyaml>=5.1, tqdm>=4.27);
#                               transformers 5 needs them too (regex >= 2025.10, tqdm >= 4.60).
#   filelock, fsspec, typing-extensions
#                               huggingface-hub 0.36; torch needs all three.
#   hf-xet                      huggingface-hub 0.36 imports it only to download (no network
#                               there); hub >= 1 needs it anyway.
#   accelerate                  optional for transformers (version-checked only if present: the
#                               machine's recent one passes >= 0.26).
#   pytest, hypothesis          the test tools; on the machine.
# scripts/gpu_check.sh --dry-run checks these assumptions on a CPU: it lets the check import, from
# outside the installed wheels, only the modules of this list (scripts/bare_python/).

mkdir -p "$DEST"
# A requirement's wheel file starts with "<name, - and . as _>-<version>-" (PEP 427).
wheel_prefix() {
  local name="${1%%==*}" version="${1##*==}"
  name="$(echo "$name" | tr 'A-Z.-' 'a-z__')"
  echo "$name-$version-"
}
missing=()
for req in "${WHEELS[@]}"; do
  if compgen -G "$DEST/$(wheel_prefix "$req")*.whl" >/dev/null; then
    echo "[gpu_wheels] have $req"
  else
    missing+=("$req")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "[gpu_wheels] downloading ${missing[*]}"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --dest "$DEST" "${missing[@]}"
fi
for req in "${WHEELS[@]}"; do
  if ! compgen -G "$DEST/$(wheel_prefix "$req")*.whl" >/dev/null; then
    echo "[gpu_wheels] no wheel for $req in $DEST after the download" >&2
    exit 1
  fi
done
# Wheels of earlier versions of this list would be installed too: remove them.
for whl in "$DEST"/*.whl; do
  keep=0
  for req in "${WHEELS[@]}"; do
    case "$(basename "$whl")" in "$(wheel_prefix "$req")"*) keep=1 ;; esac
  done
  if [ "$keep" = 0 ]; then
    echo "[gpu_wheels] removing $whl (not in the list)"
    rm -f "$whl"
  fi
done

# MANIFEST: one line per wheel, "<file> <top-level modules, comma-separated>" (from its RECORD).
"$PY" - "$DEST" "$MAX_MIB" <<'PYEOF'
import sys
import zipfile
from pathlib import Path

dest, max_mib = Path(sys.argv[1]), float(sys.argv[2])
lines, total = [], 0
for whl in sorted(dest.glob("*.whl")):
    with zipfile.ZipFile(whl) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        modules = set()
        for row in zf.read(record).decode().splitlines():
            path = row.split(",", 1)[0]
            top = path.split("/", 1)[0]
            if "/" not in path and top.endswith((".py", ".so")):
                top = top.split(".", 1)[0]  # a top-level module file (six.py, _x.cpython-312-...so)
            if top.isidentifier():  # not foo.dist-info, foo.data, pillow.libs, foo.pth
                modules.add(top)
    size = whl.stat().st_size
    total += size
    lines.append(f"{whl.name} {','.join(sorted(modules))}")
    print(f"  {size / 2**20:7.2f} MiB  {whl.name}  ({', '.join(sorted(modules))})")
(dest / "MANIFEST").write_text(
    "# written by scripts/gpu_wheels.sh: <wheel> <its top-level modules>\n" + "\n".join(lines) + "\n"
)
print(f"[gpu_wheels] {len(lines)} wheels, {total / 2**20:.1f} MiB in {dest} (limit {max_mib:g} MiB)")
if total > max_mib * 2**20:
    sys.exit(f"[gpu_wheels] {dest} is over {max_mib:g} MiB: it must fit in the 64 MiB transfer")
PYEOF
