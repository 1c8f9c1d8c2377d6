"""pytest marks that several test files share (imports pytest: for tests only)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# The CPU suites: on a CUDA machine Megatron places some tensors on the GPU while these models live
# on the CPU; run them there with CUDA_VISIBLE_DEVICES= (scripts/gpu_check.sh does).
CPU_SUITE = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines"
)
# The tests of the Megatron-Bridge stack (MEGATRON_TREE_BRIDGE=megatron-bridge, Python 3.12).
MEGATRON_BRIDGE_STACK = [
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.bridge") is None,
        reason="megatron-bridge is not installed (MEGATRON_TREE_BRIDGE=megatron-bridge stack)",
    ),
    CPU_SUITE,
]
