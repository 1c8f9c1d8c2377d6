"""verl's ``verl.plugins`` entry point: registers megatron_tree's verl engines, loudly.

verl imports every entry point of that group at ``import verl`` and swallows any exception (it logs
at debug level); its engine lookup then falls back to its own engine when the vendor key is missing.
So a failed import here would leave ``VERL_ENGINE_VENDOR=megatron_tree`` running verl's stock engine
without a word. Instead, the failure is logged as an error and, in the adapter's place, an engine is
registered under the same keys whose construction raises it. The two adapters import separately
(:mod:`.verl`, the Megatron engines; :mod:`.verl_fsdp`, the FSDP engines), each refused on its own
keys when it fails.
"""

from __future__ import annotations

import importlib
import logging
import traceback

# verl imports this module at the end of ``import verl``, so its engine registry is importable.
from verl.workers.engine import EngineRegistry
from verl.workers.engine.base import BaseEngine

logger = logging.getLogger(__name__)


class MegatronTreeUnavailable(BaseEngine):
    """Registered under megatron_tree's engine keys when its engines failed to import: building it
    raises the reason (``reason``, set at registration)."""

    reason = "unknown"

    def __init__(self, *args, **kwargs):
        raise ValueError(
            "VERL_ENGINE_VENDOR=megatron_tree, but megatron_tree's verl engines failed to "
            f"import ({self.reason}); fix that (see the error logged at 'import verl') or unset "
            "VERL_ENGINE_VENDOR"
        )


# adapter module -> the (backends, devices) its engines register (repeated here: a module that
# failed to import cannot say)
ADAPTERS = {
    "verl": (["megatron"], ["cuda", "cpu"]),
    "verl_fsdp": (["fsdp", "fsdp2"], ["cuda", "npu", "cpu"]),
}


class MegatronTreeUnsupported(BaseEngine):
    """Registered under the vendor key of every verl backend megatron_tree has no engine for (verl
    0.9.1's ``fsdp_turbo``): building it raises, instead of verl's silent fallback to its own
    engine without trees."""

    def __init__(self, *args, **kwargs):
        raise ValueError(
            "VERL_ENGINE_VENDOR=megatron_tree has engines for the strategies "
            f"{sorted(b for backends, _ in ADAPTERS.values() for b in backends)} only; use one "
            "of them or unset VERL_ENGINE_VENDOR"
        )


def _refuse_other_backends() -> None:
    """Register :class:`MegatronTreeUnsupported` on the vendor key of every (model type, backend,
    device) verl has an engine for and megatron_tree none."""
    for model_type, backends in EngineRegistry._engines.items():
        for backend, engines in backends.items():
            devices = [d for d in engines if isinstance(d, str)]
            missing = [d for d in devices if (d, "megatron_tree") not in engines]
            if missing:
                EngineRegistry.register(
                    model_type=model_type, backend=backend, device=missing, vendor="megatron_tree"
                )(MegatronTreeUnsupported)


def _register() -> None:
    try:  # the prompt-group balancing hook (either engine), before the engines' own imports
        importlib.import_module(f"{__package__}.verl_balance")
    except Exception:
        logger.exception("megatron_tree: verl's prompt-group balancing could not be installed")
    for module, (backends, devices) in ADAPTERS.items():
        try:
            importlib.import_module(f"{__package__}.{module}")  # registers the engines
        except Exception as error:
            reason = f"{module}: {type(error).__name__}: {error}"
            logger.error(
                "megatron_tree's verl engines could not be registered (%s):\n%s",
                reason,
                traceback.format_exc(),
            )
            _register_refusal(reason, backends, devices)
    _refuse_other_backends()


def _register_refusal(reason: str, backends: list[str], devices: list[str]) -> None:
    if MegatronTreeUnavailable.reason == "unknown":
        MegatronTreeUnavailable.reason = reason
    else:
        MegatronTreeUnavailable.reason += f"; {reason}"
    for model_type in ("language_model", "value_model"):
        EngineRegistry.register(
            model_type=model_type, backend=backends, device=devices, vendor="megatron_tree"
        )(MegatronTreeUnavailable)


_register()
