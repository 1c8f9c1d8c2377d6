"""mbridge 0.15.1 on megatron-core >= 0.17: an explicit, reversible, version-gated runtime patch.

Upstream symptom: ``bridge.get_model()`` raises ``AttributeError: type object 'ModelType' has no
attribute 'encoder_and_decoder'`` (``mbridge/core/util.py``, ``build_model`` and
``get_model``). mbridge compares the model type with ``ModelType.encoder_and_decoder``; in
megatron-core 0.16.1 that name is a deprecated class-body ``property`` of
``megatron.core.transformer.enums.ModelType`` (so on the class it is the property object, and the
comparison is simply False); megatron-core 0.17 removed it. (``megatron.core.enums.ModelType`` is a
different class; mbridge reads the one in ``megatron.core.transformer.enums``.)

The patch puts 0.16.1's property back on that class, which restores 0.16.1's behaviour exactly.
:func:`mbridge_compat` is the scoped form that ``patch_bridge_for_tree_training`` wraps around every
bound bridge's ``get_model`` (so it holds in every process that builds a model: spawned workers and
torchrun ranks included); :func:`apply` / :func:`undo` are the process-wide form. Applied only where
needed: megatron-core >= 0.17 with mbridge 0.15.x (``TARGET_MBRIDGE``) and the name missing; a no-op
elsewhere.
"""

from __future__ import annotations

import importlib.metadata

from ._scoped import scoped

TARGET_MBRIDGE = "0.15"
_NAME = "encoder_and_decoder"
_applied: list[type] = []


def _deprecated(self):
    raise ValueError(
        "ModelType.encoder_and_decoder is deprecated. Please use ModelType.encoder_or_decoder "
        "instead."
    )


def _version(package: str) -> tuple[int, ...]:
    text = importlib.metadata.version(package)
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def needed() -> bool:
    """True where mbridge 0.15.x meets a megatron-core that lacks
    ``ModelType.encoder_and_decoder``."""
    from megatron.core.transformer.enums import ModelType

    if hasattr(ModelType, _NAME):
        return False
    return _version("megatron-core") >= (0, 17) and _version("mbridge")[:2] == (0, 15)


def apply() -> bool:
    """Add the property process-wide where :func:`needed`; returns whether it is in effect."""
    from megatron.core.transformer.enums import ModelType

    if _applied:
        return True
    if not needed():
        return False
    setattr(ModelType, _NAME, property(_deprecated))
    _applied.append(ModelType)
    return True


def undo() -> None:
    """Remove what :func:`apply` added. Idempotent."""
    while _applied:
        delattr(_applied.pop(), _NAME)


def is_applied() -> bool:
    """True while :func:`apply` is in effect."""
    return bool(_applied)


def mbridge_compat():
    """:func:`apply` for the duration of the block (only the block that applied it undoes it)."""
    return scoped(apply, undo, is_applied)
