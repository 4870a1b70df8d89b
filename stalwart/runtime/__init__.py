"""The one runtime every role runs on: which device, which collective backend, process groups
(with a store bound to one address) and device meshes.

Training, serving (engine and KV cache), the controller's actors, RL's generator, trainer and reward
roles, and the benchmarks all get their device here (``resolve_device``) and create their process
groups and meshes here (``stalwart.runtime.group``). No other module names a backend or a device type:
``tests/test_runtime.py`` walks the source and fails on one.
"""

import importlib

# name -> the module that defines it, imported on first use: `stalwart.runtime.settings` (what a command
# line checks) stays free of torch, so a bad flag is refused before torch loads.
_EXPORTS = {
    "DEVICES": "settings",
    "HOST": "device",
    "DeviceUnavailable": "device",
    "accelerator_name": "device",
    "backend_for": "device",
    "is_accelerator": "device",
    "max_memory_allocated": "device",
    "resolve_device": "device",
    "synchronize": "device",
    "DistEnv": "env",
}

__all__ = ["DEVICES", "DistEnv", "HOST", "DeviceUnavailable", "accelerator_name", "backend_for",
           "is_accelerator", "max_memory_allocated", "resolve_device", "synchronize"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
