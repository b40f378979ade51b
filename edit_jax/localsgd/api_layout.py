"""Where ``LocalSGD``'s state lives on the mesh (``LocalSGD(..., shard_outer=...)``).

Every worker's values (params, inner optimizer state, the rule's per-worker state, the detectors)
are stacked [N, ...] and split over ``replica``: worker i's on replica row i; within a worker every
device holds the worker's whole copy (the mesh's other axes split the batch: data parallelism).
θ̄ and the outer optimizer state have no worker axis:

- ``shard_outer=False`` (the default): a whole copy on every device;
- ``shard_outer=True``: split over every device of the mesh, as the harness lays out its outer
  state, 1/(N·S) per device. A local step does not touch them; the sync's program gathers what it
  needs (XLA picks the collectives).

A leaf is split on its largest dimension that the N·S devices divide (not the layer axis of stacked
layers: each layer's slice is a unit of the sync); a leaf none of whose dimensions they divide (a
scalar, a small bias) stays whole on each device.

(Splitting each worker's own params over its devices, FSDP within a worker, is not offered: under
the workers' ``vmap`` GSPMD then moved activations between replicas in local steps, tried
2026-11-29.)
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from edit_jax.localsgd.sharding import REPLICA


def _in_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def leaf_spec(shape: tuple[int, ...], skip: int, over: tuple[str, ...], devices: int) -> P:
    """The spec of one leaf: ``over`` on its largest dimension from ``skip`` on that ``devices``
    divides (ties: the first); none (P()): whole on every device."""
    dims = [d for d in range(skip, len(shape)) if shape[d] >= devices and shape[d] % devices == 0]
    if not over or devices == 1 or not dims:
        return P()
    d = max(dims, key=lambda i: (shape[i], -i))
    spec = [None] * len(shape)
    spec[d] = over if len(over) > 1 else over[0]
    return P(*spec)


def state_shardings(mesh: Mesh, state: Any, shard_outer: bool, layerwise: bool) -> Any:
    """``state`` (a ``LocalSGDState`` of arrays or shapes) with each leaf's ``NamedSharding``."""
    over = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1) if shard_outer else ()
    devices = math.prod(mesh.shape[a] for a in over)
    per_worker = lambda t: jax.tree.map(lambda _: NamedSharding(mesh, P(REPLICA)), t)  # noqa: E731

    def shared(tree):
        def one(path, x):
            skip = int(layerwise and _in_layers(path))
            return NamedSharding(mesh, leaf_spec(tuple(getattr(x, "shape", ())), skip, over, devices))
        return jax.tree_util.tree_map_with_path(one, tree)

    return state._replace(params=per_worker(state.params), opt_state=per_worker(state.opt_state),
                          outer_params=shared(state.outer_params), outer_opt_state=shared(state.outer_opt_state),
                          detector=per_worker(state.detector), step=None, extra=per_worker(state.extra))


__all__ = ["leaf_spec", "state_shardings"]
