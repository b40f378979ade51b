"""The (replica, shard) mesh built from devices: the device count, an optional placement order
(``placement.load_device_order``), and the CPU emulation flag ``edit-jax train`` sets before JAX
starts. How arrays are laid out on the mesh is ``localsgd/sharding.py``."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from edit_jax.config import MeshConfig
from edit_jax.localsgd.sharding import REPLICA, SHARD, MeshError
from edit_jax.placement import load_device_order


def make_mesh(mesh_cfg: MeshConfig, devices: list | None = None, device_order: list[int] | None = None) -> Mesh:
    """Builds the (replica, shard) mesh from ``devices`` (default: all), optionally reordered.

    ``device_order[r * S + s]`` is the index (into ``devices``) of replica r's shard s: the
    placement scheduler's output. Without it, consecutive devices form a replica.
    """
    n, s = mesh_cfg.replica, mesh_cfg.shard
    devices = list(jax.devices() if devices is None else devices)
    if device_order is None and mesh_cfg.placement:
        device_order = load_device_order(mesh_cfg.placement, len(devices), (n, s))
    if len(devices) != n * s:
        platform = devices[0].platform if devices else "none"
        hint = ""
        if platform == "cpu":
            hint = (f" On CPU, emulate devices by setting XLA_FLAGS=--xla_force_host_platform_device_count={n * s}"
                    " before JAX starts (`edit-jax train` does this itself when the flag is unset).")
        raise MeshError(f"mesh.replica x mesh.shard = {n} x {s} = {n * s} devices expected, found {len(devices)} "
                        f"{platform} device(s).{hint}")
    if device_order is not None:
        order = [int(i) for i in device_order]
        if sorted(order) != list(range(n * s)):
            raise MeshError(f"device order must be a permutation of 0..{n * s - 1}, got {order}")
        devices = [devices[i] for i in order]
    grid = np.array(devices, dtype=object).reshape(n, s)
    return Mesh(grid, (REPLICA, SHARD), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def set_cpu_device_count(count: int) -> None:
    """Asks XLA for ``count`` CPU devices unless the user set the flag; must run before JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


__all__ = ["make_mesh", "set_cpu_device_count", "MeshError"]
