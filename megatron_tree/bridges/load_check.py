"""Refuse a checkpoint load that would leave a Megatron parameter without a source.

Megatron-Bridge skips a parameter whose HF key is not in the checkpoint with a log line
(``WARNING: Can't find ... in hf_keys``), and the parameter keeps what it was allocated with:
garbage or NaN log-probs, no error (mbridge raises, naming the HF key only). Under our bridge
patches every load is checked first, before any weight is read: each
Megatron parameter (and persistent buffer) of the models must map to HF keys the checkpoint holds.
:func:`raise_unsourced` names every parameter that does not, the keys it needs and the
checkpoint's nearest keys (a renamed key is then one look away).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from glob import glob

__all__ = ["UnsourcedParametersError", "raise_unsourced", "safetensors_keys"]

_SHOWN = 12  # parameters listed in the message; the rest are counted


class UnsourcedParametersError(ValueError):
    """A load would leave Megatron parameters without a source in the checkpoint."""


def safetensors_keys(hf_dir: str) -> set[str]:
    """The tensor names of a HF checkpoint folder: its ``model.safetensors.index.json`` weight
    map, else the headers of its ``*.safetensors`` files (no tensor is read)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    from safetensors import safe_open

    keys: set[str] = set()
    for path in sorted(glob(os.path.join(hf_dir, "*.safetensors"))):
        with safe_open(path, framework="pt", device="cpu") as f:
            keys.update(f.keys())
    return keys


def raise_unsourced(
    where: str, unsourced: Mapping[str, Iterable[str] | None], file_keys: Iterable[str]
) -> None:
    """Raise :class:`UnsourcedParametersError` if ``unsourced`` is not empty.

    Args:
        where: the bridge and checkpoint, for the message.
        unsourced: {Megatron parameter name: the HF keys it needs that the checkpoint lacks, or
            None when the bridge maps the parameter to no HF key at all}.
        file_keys: the checkpoint's keys (for the near matches).
    """
    if not unsourced:
        return
    file_keys = sorted(file_keys)
    lines = []
    for name, missing in list(unsourced.items())[:_SHOWN]:
        if missing is None:
            lines.append(f"  {name}: the bridge maps it to no HF key")
            continue
        for key in missing:
            near = difflib.get_close_matches(key, file_keys, n=3, cutoff=0.6)
            hint = f"; the checkpoint's nearest: {', '.join(near)}" if near else ""
            lines.append(f"  {name} <- {key}: not in the checkpoint{hint}")
    more = len(unsourced) - _SHOWN
    if more > 0:
        lines.append(f"  ... and {more} more")
    raise UnsourcedParametersError(
        f"{where}: {len(unsourced)} Megatron parameter(s) would keep their initial values (no "
        "source in the checkpoint), which gives wrong or NaN log-probs:\n"
        + "\n".join(lines)
        + "\nRename the checkpoint's keys to the bridge's names (or convert it with the HF "
        "version the bridge expects); nothing was loaded."
    )
