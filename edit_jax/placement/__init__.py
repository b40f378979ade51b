"""Placement on heterogeneous networks: DT-FM's scheduler, reproduced, and its use for EDiT meshes.

* ``topology``: devices, symmetrised delay/bandwidth matrices, the paper's five scenarios, files.
* ``cost``: DT-FM's cost model (DP cost, bottleneck matchings, open-loop TSP; total = DP + 2 PP).
* ``edit_cost``: the (replica, shard) mesh objective for EDiT / A-EDiT.
* ``partitions``: balanced partitions as labels, and the structured layouts from link-cost clusters.
* ``local_search``: the GA's gain-driven local search (balance-preserving cyclic moves).
* ``search``: the hybrid genetic algorithm, the Kernighan-Lin baseline and random baselines.
* ``report``: running the searches against the baselines, the report, the convergence plot.
* ``cli``: ``edit-jax placement ...`` (arguments only; the work is in ``report``).

The training side only needs ``load_device_order``: it reads the ``--json`` file written by
``edit-jax placement`` and returns the device order for ``Mesh(devices[order].reshape(shape))``;
``validate`` checks ``mesh.placement`` with the rest of the config, before any device exists.
"""

from __future__ import annotations

import json
import os

from edit_jax.config import Config, require
from edit_jax.placement.topology import PlacementError

__all__ = ["PlacementError", "load_device_order", "validate"]


def load_device_order(path: str, num_devices: int, mesh_shape: tuple[int, int]) -> list[int]:
    """Read and validate a placement file; return its ``device_order``.

    ``device_order[r * S + s]`` is the index (into ``jax.devices()``) of the device at mesh
    position (r, s) of a mesh of shape ``mesh_shape = (N, S)``, rows = replicas. The file must be
    JSON with a ``device_order`` that is a permutation of range(num_devices); when the file also
    records ``mesh_shape`` it must equal the requested one. Any problem raises ``PlacementError``
    naming the file and what is wrong."""
    where = f"placement file {path!r}"
    if not os.path.isfile(path):
        raise PlacementError(f"{where}: not found")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlacementError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "device_order" not in data:
        raise PlacementError(f"{where}: missing field 'device_order'")
    order = data["device_order"]
    if not isinstance(order, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in order):
        raise PlacementError(f"{where}: device_order must be a list of integers")
    shape = tuple(int(x) for x in mesh_shape)
    if len(shape) != 2 or shape[0] * shape[1] != num_devices:
        raise PlacementError(f"{where}: requested mesh_shape {shape} does not hold {num_devices} devices")
    if len(order) != num_devices:
        raise PlacementError(f"{where}: device_order has {len(order)} entries, the mesh needs {num_devices}")
    if sorted(order) != list(range(num_devices)):
        bad = sorted(set(d for d in order if not 0 <= d < num_devices)) or sorted(
            d for d in set(order) if order.count(d) > 1)
        raise PlacementError(f"{where}: device_order is not a permutation of 0..{num_devices - 1} "
                             f"(offending values: {bad[:10]})")
    if "mesh_shape" in data:
        recorded = data["mesh_shape"]
        if not isinstance(recorded, list) or tuple(recorded) != shape:
            raise PlacementError(f"{where}: mesh_shape {recorded} does not match the requested {list(shape)}")
    return list(order)


def validate(cfg: Config) -> None:
    """``mesh.placement``, when set, is an existing file (``load_device_order`` reads it once the
    devices are known)."""
    if cfg.mesh.placement:
        require(os.path.isfile(cfg.mesh.placement), "mesh.placement", f"file {cfg.mesh.placement!r} not found")
