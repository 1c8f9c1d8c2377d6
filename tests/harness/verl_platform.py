"""A verl platform whose device is the CPU, for tests (:func:`~.verl.register_cpu_platform`).

verl's classes are subclassed here at module level, so this module imports verl at its top; it is
imported (and the platform registered as "cpu") only when a test sets the platform up.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


def _cpu_device_module() -> ModuleType:
    """The ``torch.cuda``-like module verl's code calls through ``get_torch_device()``: no-ops
    and zeros on the CPU."""
    module = ModuleType("verl_cpu_device")
    module.empty_cache = lambda: None
    module.synchronize = lambda *a, **k: None
    module.device_count = lambda: 0
    module.is_available = lambda: True
    module.manual_seed = lambda seed: None
    module.manual_seed_all = lambda seed: None
    module.current_device = lambda: torch.device("cpu")
    module.memory_allocated = lambda *a, **k: 0
    module.memory_reserved = lambda *a, **k: 0
    module.max_memory_allocated = lambda *a, **k: 0
    module.max_memory_reserved = lambda *a, **k: 0
    module.mem_get_info = lambda *a, **k: (0, 0)
    return module


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """get_device_name() == "cpu", get_device_id() == torch.device("cpu"), get_torch_device() a
    small CPU module; gloo for communication, no profiler, no IPC."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _cpu_device_module()

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return True

    def current_device(self):
        return torch.device("cpu")

    def device_count(self):
        return 0

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None
