"""How every array is laid out on the (replica, shard) mesh: the axes, the FSDP rule, the specs,
the FSDP hook (``runtime/mesh.py`` builds the mesh itself from devices).

Layout (EDIT.md, "State and where it lives"):
- Per-replica values (a replica's params, its AdamW state, its anomaly detectors) carry an explicit
  leading replica dimension of size N sharded over ``replica``: they may differ across replicas,
  and no spec ever claims they are replicated over ``replica``.
- Within a replica every parameter is FSDP-sharded over ``shard`` along one dimension (the largest
  one divisible by S; never the stacked-layer axis, which the forward scans over).
- Outer values (θ̄, the Nesterov trace) have no replica dimension: they are identical on every
  replica and sharded over ``shard`` like the params (optionally over ``replica`` too).
- A batch is split over both axes: replica r's rows are [r*B/N, (r+1)*B/N).

All compute runs under ``jax.shard_map`` on local blocks; ``gather_unit`` is the FSDP hook: an
all-gather over ``shard`` whose transpose (a reduce-scatter) sums the gradient over the replica.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


REPLICA, SHARD = "replica", "shard"


class MeshError(ValueError):
    """The devices cannot form the requested (replica, shard) mesh."""


# ----------------------------------------------------------------------------- FSDP rule


def fsdp_dim(shape: tuple[int, ...], num_shards: int, stacked: bool) -> int:
    """The dimension of a parameter that FSDP splits over ``shard``: the largest one divisible by
    S (the last of equals), never the stacked-layer axis 0 of a layer param."""
    first = 1 if stacked else 0
    candidates = [d for d in range(first, len(shape)) if shape[d] % num_shards == 0]
    if not candidates:
        raise MeshError(f"parameter of shape {shape} has no dimension divisible by mesh.shard={num_shards}")
    return max(candidates, key=lambda d: (shape[d], d))


def _is_stacked(path) -> bool:
    return len(path) > 0 and getattr(path[0], "key", None) == "layers"


def param_shard_dims(params: Any, num_shards: int) -> Any:
    """Pytree of ints: the FSDP dim of each param leaf (in the unstacked-replica layout)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fsdp_dim(tuple(x.shape), num_shards, _is_stacked(p)), params)


def spec_for(ndim: int, shard_dim: int, leading_replica: bool, outer_over_replica: bool = False) -> P:
    """PartitionSpec of a param-shaped array; ``leading_replica`` adds the replica dim in front."""
    axes: list[Any] = [None] * ndim
    axes[shard_dim] = (SHARD, REPLICA) if outer_over_replica else SHARD
    return P(REPLICA, *axes) if leading_replica else P(*axes)


def replica_specs(params: Any, shard_dims: Any) -> Any:
    """Specs of per-replica param-shaped values ([N, ...] leaves)."""
    return jax.tree.map(lambda x, d: spec_for(x.ndim, d, True), params, shard_dims)


def outer_specs(params: Any, shard_dims: Any, over_replica: bool = False) -> Any:
    """Specs of outer (θ̄-shaped, no replica dim) values."""
    return jax.tree.map(lambda x, d: spec_for(x.ndim, d, False, over_replica), params, shard_dims)


BATCH_SPEC = P((REPLICA, SHARD))


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------- the FSDP hook


def unit_dims(shard_dims: Any, stacked: bool) -> Any:
    """Shard dims as seen inside the scan body, where a layer param has lost its layer axis."""
    return jax.tree.map(lambda d: d - 1 if stacked else d, shard_dims)


def gather_unit(local: Any, dims: Any, dtype: Any = None, fused: bool = False) -> Any:
    """All-gathers a unit's FSDP shards over ``shard`` (cast first so the gather moves ``dtype``).

    ``fused``: one all-gather for the whole unit instead of one per leaf (a decoder layer has 9),
    so its transpose in the backward is one reduce-scatter too. Each leaf's block is laid out with
    its FSDP dim first and flattened, the blocks are concatenated, gathered as [S, total], then
    cut back and each leaf's S blocks joined along its FSDP dim. It moves the same bytes as the
    per-leaf gathers plus a local relayout; it pays where each collective has a fixed cost (XLA:CPU
    does not combine all-gathers: every one is a rendezvous of the shard's threads; measured in
    docs/benchmarks/step-time.md). GPU backends combine collectives themselves."""
    leaves, treedef = jax.tree.flatten(local)
    dim_list = treedef.flatten_up_to(dims)
    if dtype is not None:
        leaves = [x.astype(dtype) for x in leaves]
    if not fused or len(leaves) < 2 or len({x.dtype for x in leaves}) > 1:
        return treedef.unflatten([jax.lax.all_gather(x, SHARD, axis=d, tiled=True)
                                  for x, d in zip(leaves, dim_list, strict=True)])
    moved = [jnp.moveaxis(x, d, 0) for x, d in zip(leaves, dim_list, strict=True)]  # FSDP dim first: [D/S, rest...]
    full = jax.lax.all_gather(jnp.concatenate([m.reshape(-1) for m in moved]), SHARD, axis=0)  # [S, total]
    out, start = [], 0
    for m, d in zip(moved, dim_list, strict=True):
        piece = full[:, start:start + m.size].reshape((-1,) + m.shape[1:])  # shard-major: [D, rest...]
        out.append(jnp.moveaxis(piece, 0, d))
        start += m.size
    return treedef.unflatten(out)


def shard_sq_norm(tree: Any, axes: Any = SHARD) -> jax.Array:
    """Squared L2 norm over a whole pytree of sharded local blocks: a psum over ``axes`` (default
    ``shard``: FSDP blocks; ``(shard, replica)`` for blocks split over both axes)."""
    local = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))
    return jax.lax.psum(local, axes)


def replica_is_manual() -> bool:
    """The workers are ``shard_map``'s manual ``replica`` axis (the trainer), not a ``vmap`` over it
    (the public API): only there do values carry shard_map's varying / invariant types."""
    return REPLICA in jax.sharding.get_abstract_mesh().manual_axes


def gather_workers(x: jax.Array, axis: int = 0, tiled: bool = False) -> jax.Array:
    """Every worker's ``x`` (an all-gather over ``replica``), typed identical on every worker."""
    typed = {"to": "invarying"} if replica_is_manual() else {}
    return jax.lax.all_gather(x, REPLICA, axis=axis, tiled=tiled, **typed)


def replica_gather(x: jax.Array) -> jax.Array:
    """[N, ...] of every replica's ``x``, identical on all devices. A psum of one-hot slots rather
    than an all-gather, so the result is typed as replicated over ``replica`` (shard_map's check)."""
    n = jax.lax.axis_size(REPLICA)
    slot = jax.nn.one_hot(jax.lax.axis_index(REPLICA), n, dtype=jnp.float32)
    slot = slot.reshape((n,) + (1,) * jnp.ndim(x))
    x = jnp.asarray(x, jnp.float32)[None]
    return jax.lax.psum(jnp.where(slot > 0, x, 0.0), REPLICA)  # where, not *: 0 * NaN would poison every slot
