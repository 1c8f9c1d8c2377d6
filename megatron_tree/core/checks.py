"""Argument checks shared by the core, and the debug switch for checks that cost a host sync.

Checks that read tensor values on the device (token and position ranges) run once at packing time,
on the host. With ``MEGATRON_TREE_DEBUG=1`` in the environment (or :func:`set_debug_checks`) they
also run inside the forward, where they would otherwise synchronize the host with the GPU.
"""

from __future__ import annotations

import math
import numbers
import operator
import os

import numpy as np
import torch

_DEBUG = [os.environ.get("MEGATRON_TREE_DEBUG", "0") not in ("", "0")]


def set_debug_checks(enabled: bool) -> None:
    """Switch the in-forward value checks on or off for this process."""
    _DEBUG[0] = bool(enabled)


def debug_checks() -> bool:
    """Whether the in-forward value checks run (``MEGATRON_TREE_DEBUG=1``)."""
    return _DEBUG[0]


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """``value`` as an int; ValueError naming ``name`` for bools, floats and other non-integers."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer, got the bool {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {value!r} ({type(value).__name__})"
        ) from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {result}")
    return result


def check_positive_number(name: str, value) -> float:
    """A finite real > 0 (Python, numpy or one-element torch number) as a float; not a bool."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(
                f"{name} must be a finite number > 0, got a tensor of shape {tuple(value.shape)} "
                f"and dtype {value.dtype}"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{name} must be a finite number > 0, got {value!r} ({type(value).__name__})"
        )
    result = float(value)
    if not (math.isfinite(result) and result > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return result


def check_bool(name: str, value, *, optional: bool = False) -> bool | None:
    """``value`` as a bool: ``True`` / ``False`` (or a numpy bool), and None only when ``optional``
    (a parameter whose default is None). ValueError naming ``name`` for anything else: a string
    such as ``"no"``, an int, a tensor (``bool("no")`` would silently be True)."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    allowed = "True or False (or None for the default)" if optional else "True or False"
    raise ValueError(
        f"{name} must be {allowed}, got {value!r} ({type(value).__name__}); pass a Python bool"
    )


def check_weights(name: str, weights: torch.Tensor) -> None:
    """ValueError naming ``name`` unless every entry of ``weights`` (a loss mask) is finite and
    >= 0. One reduction and a host read: call it where the weights are read on the host, not in
    the forward."""
    if weights.is_complex():
        raise ValueError(f"{name} must be real (0/1 or non-negative weights), got {weights.dtype}")
    if weights.dtype == torch.bool or bool(((weights >= 0) & (weights < math.inf)).all()):
        return
    finite = torch.isfinite(weights)
    if not bool(finite.all()):
        where = (~finite).nonzero().flatten()[:4].tolist()
        raise ValueError(
            f"{name} holds NaN or inf (at entries {where}); it must be finite and >= 0 (0/1 or "
            "non-negative weights): replace them, e.g. torch.nan_to_num(loss_mask, nan=0.0)"
        )
    raise ValueError(
        f"{name} must be >= 0 (0/1 or non-negative weights), got {float(weights.min()):g}; a "
        "negative weight cancels other tokens' and can zero the loss normalization"
    )


def as_tensor(name: str, value):
    """A padded-layout input as a tensor: a tensor as is, a numpy array through ``torch.as_tensor``
    (no copy on the CPU when it can be avoided), a rectangular (nested) list or tuple of numbers
    or of equal-shape tensors stacked. ValueError naming ``name`` for a ragged list (rows of
    different lengths) or an object array; any other value is returned as is, for the caller's
    own check to name."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype != object:
        array = np.ascontiguousarray(value)  # torch refuses negative strides
        return torch.as_tensor(array if array.flags.writeable else array.copy())
    if not isinstance(value, (list, tuple, np.ndarray)):
        return value
    try:
        if len(value) and all(isinstance(v, torch.Tensor) for v in value):
            if len({v.shape for v in value}) > 1:
                raise ValueError("tensors of different shapes")
            return torch.stack(list(value))
        return torch.as_tensor(value.tolist() if isinstance(value, np.ndarray) else value)
    except (ValueError, TypeError, RuntimeError) as error:
        raise ValueError(
            f"{name} is a {type(value).__name__} whose rows have different lengths (or that holds "
            f"non-numbers: {error}); pass a right-padded [B, L] tensor or array, e.g. "
            "torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r) for r in rows], "
            "batch_first=True), with attention_mask 1 on the real tokens"
        ) from None
