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
    if isinstance(value, bool) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer, got the bool {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {result}")
    return result


def check_positive_number(name: str, value) -> float:
    """A finite real > 0 (Python, numpy or one-element torch number) as a float; not a bool."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{name} must be a finite number > 0, got a tensor of shape "
                             f"{tuple(value.shape)} and dtype {value.dtype}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r} ({type(value).__name__})")
    result = float(value)
    if not (math.isfinite(result) and result > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return result
