"""How the workers' values meet at a sync: the reduction a sync rule is given.

A sync rule (the penalty, the weighted mean, the outer step; ``outer.sync_unit``) is written once
over the four things it asks of the workers, and a ``Reduction`` answers them:

- ``per_worker(fn, *args)``: runs ``fn`` on one worker's values (its pseudo gradient, its detector);
- ``gather(x)``: every worker's scalar ``x`` as an ``[N]`` vector, identical everywhere;
- ``mine(x_all)``: this worker's entry of an ``[N]`` vector (the stacked form keeps all N);
- ``weighted_sum(w_all, tree)``: Σ_i w_all[i]·tree_i, the one exchange of bulk data;
- ``sq_norm(tree)``: the squared norm of one worker's whole unit (a psum over the FSDP blocks);
- ``pseudo_gradient(outer_params, local)``: one worker's Δ = θ̄ − θ_i in float32 and its norm. A
  reduction whose workers send something else in place of their params (the exchange's packed
  posts: ``elastic/packed.PackedPosts``) answers it from what they sent.

Two reductions exist:

- ``ReplicaPsum``: each worker's values live on its own devices (``shard_map`` over the mesh's
  ``replica`` axis, or ``vmap(..., axis_name="replica")``); ``gather`` and ``weighted_sum`` are
  collectives over that axis. What the training harness runs.
- ``Stacked``: the workers' values are stacked on a leading axis ``[N, ...]`` of one program;
  ``per_worker`` is a ``vmap`` and the sums are sums over that axis. For an exchange outside JAX
  collectives (a store, workers that come and go): the same penalty and outer step run on the
  pseudo gradients once they are stacked in one place.

``tests/test_reduction.py`` shows both give the same θ̄ and outer state on the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from edit_jax.localsgd.sharding import REPLICA, SHARD, replica_gather


def sq_sum(tree: Any) -> jax.Array:
    """Σ x² over every leaf of ``tree``, in float32 (a squared L2 norm)."""
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def _pseudo_gradient(red, outer_params: Any, local: Any) -> tuple[Any, jax.Array]:
    """(Δ = θ̄ − θ_i in float32, ‖Δ‖ over the worker's whole unit): steps 1 and 2 of the sync."""
    delta = jax.tree.map(lambda o, x: o - x.astype(jnp.float32), outer_params, local)
    return delta, jnp.sqrt(red.sq_norm(delta))


@dataclass(frozen=True)
class ReplicaPsum:
    """Workers are the positions along the named axis ``axis`` (one worker's values per position);
    a unit's blocks are summed over ``norm_axes`` for its norm (``shard``: FSDP blocks; ``()``:
    each position holds its whole unit)."""

    axis: str = REPLICA
    norm_axes: Any = SHARD

    stacked = False

    def per_worker(self, fn: Callable, *args):
        return fn(*args)

    def gather(self, x: jax.Array) -> jax.Array:
        if self.axis == REPLICA:
            return replica_gather(x)
        return _gather_axis(x, self.axis)

    def gather_flags(self, flags: jax.Array) -> jax.Array:
        return self.gather(flags) > 0.5

    def mine(self, x_all: jax.Array) -> jax.Array:
        return x_all[jax.lax.axis_index(self.axis)]

    def weighted_sum(self, w_all: jax.Array, tree: Any) -> Any:
        w = self.mine(w_all)
        return jax.tree.map(lambda d: jax.lax.psum(w * d, self.axis), tree)

    def sq_norm(self, tree: Any) -> jax.Array:
        local = sq_sum(tree)
        return jax.lax.psum(local, self.norm_axes) if self.norm_axes else local

    def pseudo_gradient(self, outer_params: Any, local: Any) -> tuple[Any, jax.Array]:
        return _pseudo_gradient(self, outer_params, local)


@dataclass(frozen=True)
class Stacked:
    """Workers are the leading axis ``[N, ...]`` of every per-worker value, in one program. Under
    ``shard_map`` over ``shard`` (FSDP blocks) pass ``norm_axes=SHARD``; on whole arrays ``()``."""

    norm_axes: Any = ()

    stacked = True

    def per_worker(self, fn: Callable, *args):
        return jax.vmap(fn)(*args)

    def gather(self, x: jax.Array) -> jax.Array:
        return jnp.asarray(x, jnp.float32)

    def gather_flags(self, flags: jax.Array) -> jax.Array:
        return jnp.asarray(flags, bool)

    def mine(self, x_all: jax.Array) -> jax.Array:
        return x_all

    def weighted_sum(self, w_all: jax.Array, tree: Any) -> Any:
        def one(d):
            return jnp.sum(w_all.reshape((-1,) + (1,) * (d.ndim - 1)) * d, axis=0)
        return jax.tree.map(one, tree)

    def sq_norm(self, tree: Any) -> jax.Array:  # one worker's (called inside per_worker)
        local = sq_sum(tree)
        return jax.lax.psum(local, self.norm_axes) if self.norm_axes else local

    def pseudo_gradient(self, outer_params: Any, local: Any) -> tuple[Any, jax.Array]:
        return _pseudo_gradient(self, outer_params, local)


Reduction = ReplicaPsum | Stacked


def _gather_axis(x: jax.Array, axis: str) -> jax.Array:
    """``replica_gather`` over another named axis: one-hot slots summed, NaN-safe."""
    n = jax.lax.axis_size(axis)
    slot = jax.nn.one_hot(jax.lax.axis_index(axis), n, dtype=jnp.float32)
    slot = slot.reshape((n,) + (1,) * jnp.ndim(x))
    return jax.lax.psum(jnp.where(slot > 0, jnp.asarray(x, jnp.float32)[None], 0.0), axis)


__all__ = ["ReplicaPsum", "Stacked", "Reduction", "sq_sum"]
