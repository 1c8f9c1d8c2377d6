"""Tree modules for HF's recurrent mixers (gated delta-nets, Mamba-2), over core.recurrent."""

from __future__ import annotations

import torch


def swap_recurrent_modules(model: torch.nn.Module) -> int:
    """Swap every recurrent mixer of ``model`` that has a tree module; returns how many."""
    return 0
