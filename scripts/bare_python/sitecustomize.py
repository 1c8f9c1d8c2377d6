"""The bare GPU machine's imports, simulated on a CPU (scripts/gpu_check.sh --dry-run).

gpu_check.sh --dry-run installs gpu_wheels/ into a fresh --target folder and puts this folder first
on PYTHONPATH, so Python imports this file at start-up (``site`` imports ``sitecustomize``), in
every process of the check, subprocesses included. The venv it runs in has megatron-core, mbridge
and transformers 4.57 installed already; without this guard a wheel missing from gpu_wheels/ would
go unnoticed. It puts an import finder first on ``sys.meta_path`` that

* finds the top-level modules of every wheel named in gpu_wheels/MANIFEST only in the --target
  folder, and otherwise raises ModuleNotFoundError naming the missing wheel;
* with ``MEGATRON_TREE_BARE_STRICT=1`` (the dry run's default), also refuses a module that exists
  only in the venv's site-packages unless it is in BARE_MACHINE below: what the bare machine is
  known to have. A dependency that neither gpu_wheels.sh carries nor the machine has then fails
  the dry run too.

``importlib.util.find_spec`` (how libraries probe optional packages) answers None for a refused
module, as it would on the machine; an ``import`` raises. Every refusal is appended to
``MEGATRON_TREE_BARE_LOG`` (the dry run prints them), since a library may catch the ImportError.

Environment: MEGATRON_TREE_BARE_TARGET (the --target folder; the guard is off without it),
MEGATRON_TREE_BARE_MANIFEST (default <target>/../MANIFEST), MEGATRON_TREE_BARE_STRICT,
MEGATRON_TREE_BARE_LOG.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import site
import sys

# Top-level modules on the bare machine (docs/gpu.md), by the distribution that brings them. Its
# exact package list is not known; this is what Python 3.12 + torch 2.11 (CUDA) + transformers 5 +
# accelerate + einops + safetensors + pytest + hypothesis install. Wheels carried in gpu_wheels/
# are found in the --target folder first anyway.
BARE_MACHINE = {
    "pip/setuptools": "pip setuptools pkg_resources _distutils_hack wheel",
    "torch": "torch torchgen functorch triton nvidia cuda numpy",
    "torch's dependencies": "sympy mpmath isympy networkx jinja2 markupsafe filelock fsspec "
    "typing_extensions",
    "transformers 5 / huggingface-hub >= 1": "regex yaml _yaml safetensors tqdm typer click rich "
    "shellingham markdown_it mdurl pygments hf_xet httpx httpcore h11 anyio sniffio certifi idna "
    "packaging",
    "accelerate, einops": "accelerate psutil einops",
    "pytest, hypothesis": "pytest _pytest py pluggy iniconfig hypothesis _hypothesis_pytestplugin "
    "_hypothesis_globals _hypothesis_ftz_detector attr attrs sortedcontainers",
}


class Refused(ModuleNotFoundError):
    """A module the bare machine would not find where the dry run looks."""


class BareMachineFinder:
    """First on sys.meta_path: carried modules from the target only, the rest as on the machine."""

    def __init__(self, target: str, carried: dict[str, str], strict: bool, log: str | None):
        self.target, self.carried, self.strict, self.log = target, carried, strict, log
        self.allowed = {m for mods in BARE_MACHINE.values() for m in mods.split()}
        self.allowed |= set(sys.stdlib_module_names) | set(sys.builtin_module_names)
        sites = [*site.getsitepackages(), site.getusersitepackages()]
        self.sites = [os.path.realpath(p) for p in sites]

    def _in_site(self, entry: str) -> bool:
        # Only site-packages itself: a folder inside it on sys.path (setuptools/_vendor) belongs
        # to an allowed package.
        return os.path.realpath(entry or ".") in self.sites

    def _refuse(self, name: str, kind: str, message: str):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{kind} {name}: {message}\n")
        raise Refused(message, name=name)

    def find_spec(self, name, path=None, target=None):
        if path is not None or "." in name:  # submodules follow their top-level package
            return None
        if name in self.carried:
            spec = importlib.machinery.PathFinder.find_spec(name, [self.target])
            if spec is None:
                self._refuse(
                    name,
                    "missing-wheel",
                    f"bare-machine guard: {name!r} must come from the wheel {self.carried[name]}, "
                    f"which is not installed in {self.target} (missing from gpu_wheels/?  run "
                    "scripts/gpu_wheels.sh)",
                )
            return spec
        if not self.strict or name in self.allowed:
            return None
        own = [p for p in sys.path if not self._in_site(p)]
        if importlib.machinery.PathFinder.find_spec(name, own) is not None:
            return None  # the target, the repository, the standard library
        if importlib.machinery.PathFinder.find_spec(name) is None:
            return None  # not installed anywhere: the ordinary ModuleNotFoundError follows
        self._refuse(
            name,
            "not-on-machine",
            f"bare-machine guard: {name!r} is installed only in this venv, and the bare GPU "
            "machine does not have it: carry its wheel (scripts/gpu_wheels.sh) or, if the machine "
            "has it, add it to BARE_MACHINE in scripts/bare_python/sitecustomize.py",
        )


def _probe(find_spec):
    def find_spec_or_none(name, package=None):
        try:
            return find_spec(name, package)
        except Refused:
            return None

    return find_spec_or_none


def install() -> None:
    target = os.environ.get("MEGATRON_TREE_BARE_TARGET")
    if not target:
        return
    manifest = os.environ.get("MEGATRON_TREE_BARE_MANIFEST") or os.path.join(
        target, os.pardir, "MANIFEST"
    )
    carried = {}
    with open(manifest) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                wheel, modules = line.split()
                carried.update(dict.fromkeys(modules.split(","), wheel))
    strict = os.environ.get("MEGATRON_TREE_BARE_STRICT") == "1"
    finder = BareMachineFinder(target, carried, strict, os.environ.get("MEGATRON_TREE_BARE_LOG"))
    sys.meta_path.insert(0, finder)
    importlib.util.find_spec = _probe(importlib.util.find_spec)


install()
