"""Where ``LocalSGD``'s state lives on the mesh (``LocalSGD(..., fsdp=..., shard_outer=...)``).

Every worker's values (params, inner optimizer state, the rule's per-worker state, the detectors)
are stacked [N, ...] and split over ``replica``: worker i's on replica row i. θ̄ and the outer
optimizer state have no worker axis.

- ``fsdp``: each worker's leaves are also split over the worker's own devices (the mesh's other
  axes), 1/S per device: FSDP within the worker. The workers then run under ``shard_map``, manual
  over ``replica`` only (``manual_workers``): GSPMD gathers a worker's shards among that worker's
  devices, and cannot move anything between replicas outside the sync. (Under the ``vmap`` the
  API otherwise runs, GSPMD did move activations between replicas in local steps once the params
  were split: tried 2026-11-29.) Without it each of a worker's devices holds the worker's whole
  copy, and the other axes split only the batch (data parallelism).
- ``shard_outer``: θ̄ and the outer state split over every device of the mesh, 1/(N·S) per
  device, as the harness lays out its outer state. A local step does not touch them; the sync's
  program gathers what it needs. Without it each device holds a whole copy.
- ``offload_outer``: θ̄ and the outer state in pinned host memory (either layout above), brought
  to the devices by the sync's programs only (``on_host`` / ``on_device``).

A leaf is split on the dimension the trainer's FSDP picks (``sharding.fsdp_dim``: the largest the
devices divide, never the worker axis nor the layer axis of stacked layers, each layer's slice
being a unit of the sync); a leaf none of whose dimensions they divide (a scalar, a small bias)
stays whole on each device, where the trainer would refuse it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from edit_jax.localsgd.sharding import REPLICA, MeshError, fsdp_dim


def _in_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def leaf_spec(shape: tuple[int, ...], skip: int, over: tuple[str, ...], devices: int) -> P:
    """The spec of one leaf: ``over`` on the FSDP dimension of its dimensions from ``skip`` on
    (``sharding.fsdp_dim``); none that ``devices`` divides (P()): whole on every device."""
    if not over or devices == 1:
        return P()
    try:
        d = skip + fsdp_dim(shape[skip:], devices, stacked=False)
    except MeshError:
        return P()
    spec = [None] * len(shape)
    spec[d] = over if len(over) > 1 else over[0]
    return P(*spec)


def _inner_axes(mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a != REPLICA and mesh.shape[a] > 1)


def state_shardings(mesh: Mesh, state: Any, shard_outer: bool, layerwise: bool, fsdp: bool = False,
                    offload: bool = False) -> Any:
    """``state`` (a ``LocalSGDState`` of arrays or shapes) with each leaf's ``NamedSharding``;
    ``offload``: θ̄ and the outer optimizer state in the host's memory (``on_host``)."""
    over = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1) if shard_outer else ()
    devices = math.prod(mesh.shape[a] for a in over)
    inner = _inner_axes(mesh) if fsdp else ()
    inner_devices = math.prod(mesh.shape[a] for a in inner)

    def shared(tree):
        def one(path, x):
            skip = int(layerwise and _in_layers(path))
            return NamedSharding(mesh, leaf_spec(tuple(getattr(x, "shape", ())), skip, over, devices))
        return jax.tree_util.tree_map_with_path(one, tree)

    def per_worker(tree):  # [N, ...]: replica on the worker axis; with fsdp a dimension split within the worker
        def one(path, x):
            skip = 1 + int(layerwise and _in_layers(path))
            spec = leaf_spec(tuple(getattr(x, "shape", ())), skip, inner, inner_devices)
            return NamedSharding(mesh, P(REPLICA, *tuple(spec)[1:]))
        return jax.tree_util.tree_map_with_path(one, tree)

    home = on_host if offload else (lambda t: t)
    return state._replace(params=per_worker(state.params), opt_state=per_worker(state.opt_state),
                          outer_params=home(shared(state.outer_params)),
                          outer_opt_state=home(shared(state.outer_opt_state)),
                          detector=per_worker(state.detector), step=None, extra=per_worker(state.extra))


def on_host(shardings: Any) -> Any:
    """The same layout in pinned host memory: where an offloaded θ̄ waits between syncs (the
    trainer's ``sync.cpu_offload``), taking no accelerator memory in the local steps."""
    return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)


def on_device(tree: Any, shardings: Any) -> Any:
    """``tree`` (inside jit) moved to the devices' memory in ``shardings``' layout: an offloaded θ̄
    brought in for a sync (XLA moves it back to the host as the program's output sharding says)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind("device")), tree, shardings)


def worker_unit_specs(mesh: Mesh, unit: Any, fsdp: bool) -> Any:
    """One worker's unit (the root, or one layer's slice) laid out as ``fsdp`` lays out the worker's
    params (inside the workers' map: no ``replica``)."""
    inner = _inner_axes(mesh) if fsdp else ()
    devices = math.prod(mesh.shape[a] for a in inner)
    return jax.tree.map(lambda x: leaf_spec(tuple(x.shape), 0, inner, devices), unit)


def manual_workers(mesh: Mesh, fn, args: tuple, in_axes: Any, out_axes: Any):
    """``fn`` run per worker under ``shard_map``, manual over ``replica`` only (the other axes are
    GSPMD's: FSDP within the worker): what ``jax.vmap(fn, in_axes, out_axes, axis_name=REPLICA)``
    computes, but XLA cannot move a worker's values to another replica's devices between syncs.
    ``in_axes`` / ``out_axes``: 0 (stacked per worker) or None (one value for all), per argument and
    per output (a tuple, or one entry for all of them), as ``vmap`` takes them."""
    in_axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
    outs = out_axes if isinstance(out_axes, tuple) else (out_axes,)

    def body(*local):
        mine = [jax.tree.map(lambda x: x[0], v) if a == 0 else v for v, a in zip(local, in_axes, strict=True)]
        out = fn(*mine)
        out = out if isinstance(out_axes, tuple) else (out,)
        out = tuple(jax.tree.map(lambda x: x[None], o) if a == 0 else o for o, a in zip(out, outs, strict=True))
        return out if isinstance(out_axes, tuple) else out[0]

    in_specs = tuple(P(REPLICA) if a == 0 else P() for a in in_axes)
    out_specs = tuple(P(REPLICA) if a == 0 else P() for a in outs)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs if isinstance(out_axes, tuple) else out_specs[0],
                         axis_names={REPLICA}, check_vma=False)(*args)


__all__ = ["leaf_spec", "manual_workers", "state_shardings", "worker_unit_specs"]
