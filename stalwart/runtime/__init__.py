"""The one runtime every role runs on: which device, which collective backend, process groups
(with a store bound to one address) and device meshes.

Training, serving (engine and KV cache), the controller's actors, RL's generator, trainer and reward
roles, and the benchmarks all get their device here (``resolve_device``) and create their process
groups and meshes here (``stalwart.runtime.group``). No other module names a backend or a device type:
``tests/test_runtime.py`` walks the source and fails on one.
"""

from stalwart.runtime.device import (
    DEVICES,
    HOST,
    DeviceUnavailable,
    accelerator_name,
    backend_for,
    is_accelerator,
    max_memory_allocated,
    resolve_device,
    synchronize,
)
from stalwart.runtime.env import DistEnv

__all__ = ["DEVICES", "DistEnv", "HOST", "DeviceUnavailable", "accelerator_name", "backend_for",
           "is_accelerator", "max_memory_allocated", "resolve_device", "synchronize"]
