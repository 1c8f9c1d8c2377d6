"""Import Megatron-Bridge without transformer-engine: an explicit, reversible, version-gated patch.

Upstream symptom (megatron-bridge 0.6.2, ``TARGET_MEGATRON_BRIDGE``): ``from megatron.bridge import
AutoBridge`` raises ``ModuleNotFoundError: No module named 'transformer_engine'`` on machines
without transformer-engine (every CPU machine): ``megatron/bridge/peft/lora_layers.py`` imports
``transformer_engine.pytorch`` unguarded, and the package imports it on the way to ``AutoBridge``
(through the PEFT bridges). Every other transformer-engine import in Megatron-Bridge and
megatron-core is guarded.

The patch loads that one module with its import line bound to a local stand-in whose attributes
resolve (class-like names are empty classes, so ``isinstance`` checks are False): TE-based LoRA
layers stay unusable, nothing else changes. Nothing named ``transformer_engine`` enters
``sys.modules``, so every guarded import still sees transformer-engine as absent. A no-op where
transformer-engine is installed. If the expected import line is not there (another Megatron-Bridge
version), the import fails with an ``ImportError`` naming this patch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from ._scoped import scoped

TARGET_MEGATRON_BRIDGE = "0.6.2"
_MODULE = "megatron.bridge.peft.lora_layers"
_LINE = "import transformer_engine.pytorch as te"
_STAND_IN = "__megatron_tree_te_stand_in__"


class _StandIn(types.ModuleType):
    """Any attribute chain resolves; names starting upper-case are distinct empty classes."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {}) if name[:1].isupper() else _StandIn(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Loader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        source = self.get_data(self.path).decode()
        if _LINE not in source:
            raise ImportError(
                "megatron_tree.patches.megatron_bridge_te targets megatron-bridge "
                f"{TARGET_MEGATRON_BRIDGE}: {_MODULE} no longer has the line {_LINE!r}; update the "
                "patch"
            )
        return compile(
            source.replace(_LINE, f"te = {_STAND_IN}", 1), self.path, "exec", dont_inherit=True
        )

    def exec_module(self, module):
        module.__dict__[_STAND_IN] = _StandIn("transformer_engine.pytorch (megatron_tree stand-in)")
        super().exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = _Loader(fullname, spec.origin)
        return spec


_finder = _Finder()


def is_applied() -> bool:
    return _finder in sys.meta_path


def apply() -> bool:
    """Install the import hook where transformer-engine is missing; returns whether it is in effect.

    Apply it before the first ``import megatron.bridge`` of the process (spawned workers and
    torchrun ranks included): a module imported before keeps its failed state.
    """
    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    if not is_applied():
        sys.meta_path.insert(0, _finder)
    return True


def undo() -> None:
    """Remove the import hook (modules already imported through it keep the stand-in)."""
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def megatron_bridge_te():
    """:func:`apply` for the duration of the block; yields whether it is in effect."""
    return scoped(apply, undo, is_applied)
