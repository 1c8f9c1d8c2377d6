"""Our Triton kernels in Triton's interpreter, for the CPU tests of ``backend="triton"``."""

from __future__ import annotations

import importlib
import os
import sys

MODULE = "megatron_tree.core.triton_attention"
KERNELS = "megatron_tree.core.triton_kernels"  # decorated at import: re-imported with MODULE


def interpreted_kernels():
    """Generator for a fixture: yields the kernel module imported with ``TRITON_INTERPRET=1`` (read
    when the kernels are decorated), then puts back whatever modules were imported before, so a GPU
    run of the suite keeps its compiled kernels."""
    before = {name: sys.modules.pop(name, None) for name in (MODULE, KERNELS)}
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(MODULE)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    assert module.interpreted()
    yield module
    for name, old in before.items():
        sys.modules.pop(name, None)
        if old is not None:
            sys.modules[name] = old
