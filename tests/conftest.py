"""Tests run on CPU-emulated devices: 64 of them, so that both 8-device meshes (2 x 4, 4 x 2)
and the 8 x 8 mesh can be built in one process. Must run before jax is imported."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=64").strip()
