"""What every sync rule shares: the per-sync figures, the reassembly of per-unit results into the
state, the identity-in-the-backward of a sync inside the forward, and the reset of a worker that
went non-finite. The rules themselves (which units sync, where, with which outer step) are one
module each (``rule.py`` lists them); ``outer.sync_unit`` syncs one unit.

Every function takes the state as arrays (this device's blocks: per-replica leaves with their
local replica dim of size 1) and returns new arrays: no object holds state between calls.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from edit_jax.localsgd.outer import UnitSync
from edit_jax.localsgd.sharding import REPLICA, SHARD, replica_gather, replica_is_manual

# Sync figures (identical on every device); "loss" and "grad_norm" come back per replica, [N].
# The jax.named_scope of the sync's ops (this module's and outer.py's, as programs.py calls them):
# the profiler (tools/profile.py) and the HLO tests find the sync by it.
SYNC_SCOPE = "edit_sync"

SYNC_METRICS = ("pseudo_grad_norm", "unit_pseudo_grad_norm", "weight", "unit_weight", "flagged", "unit_flagged",
                "clip_factor", "unit_clip_factor", "outer_update_norm", "inner_reset")


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def local_blocks(tree):
    """This device's per-replica values without their local replica dim (size 1)."""
    return jax.tree.map(lambda x: x[0], tree)


def with_replica_dim(tree):
    return jax.tree.map(lambda x: x[None], tree)


@jax.custom_vjp
def with_value(x, value):
    """Returns ``value`` in the forward pass and passes the cotangent to ``x`` unchanged: the sync
    acts as the identity in the backward pass, so the gradient is taken at the synced point."""
    return value


def _with_value_fwd(x, value):
    return value, None


def _with_value_bwd(_, g):
    return g, jax.tree.map(jnp.zeros_like, g)


with_value.defvjp(_with_value_fwd, _with_value_bwd)


def as_varying(x):
    """Marks values computed identically on every replica (θ̄) as per-replica, as local params are.
    Under ``shard_map`` only: where the workers are a ``vmap`` over ``replica`` (the public API),
    there is no such type and the values are returned as they are."""
    if not replica_is_manual():
        return x

    def one(v):
        aval = jax.typeof(v)  # the varying-axes set is `.mat.varying` in recent JAX, `.vma` before
        mat = getattr(aval, "mat", None)
        varying = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
        return v if REPLICA in varying else jax.lax.pcast(v, REPLICA, to="varying")

    return jax.tree.map(one, x)


# ----------------------------------------------------------------------------- assembly


def assemble_sync(outer, root: UnitSync, layers: UnitSync | None):
    """Reassembles per-unit sync results (root + scanned layers) into (params, outer, metrics,
    residual): the residual is the per-worker error-feedback tree ([1, ...]) or None. ``layers``
    None: a model without layers (the public API's whole-model rules: any pytree is the root)."""
    if layers is None:
        none = outer.params["layers"]  # an empty tree
        no_units = lambda t: jax.tree.map(lambda x: jnp.zeros((0,) + jnp.shape(x), x.dtype), t)
        layers = UnitSync(none, none, outer.opt_state["layers"], no_units(root.detector), no_units(root.metrics),
                          None if root.residual is None else none)
    cat = lambda r, lay: jnp.concatenate([r[None], lay], axis=0)  # (unit axis first)
    params = as_varying({"root": root.params, "layers": layers.params})
    params = with_replica_dim(params)  # restore the local replica dim
    det = jax.tree.map(cat, root.detector, layers.detector)
    det = with_replica_dim(det)
    residual = None
    if root.residual is not None:
        residual = with_replica_dim(as_varying({"root": root.residual, "layers": layers.residual}))
    new_outer = outer.replace(params={"root": root.outer_params, "layers": layers.outer_params},
                              opt_state={"root": root.opt_state, "layers": layers.opt_state}, detector=det,
                              syncs=outer.syncs + 1)
    unit_metrics = jax.tree.map(cat, root.metrics, layers.metrics)
    return params, new_outer, sync_metrics(unit_metrics), residual


def assemble_group_sync(params, outer, root: UnitSync | None, layers: UnitSync | None, lo: int, hi: int,
                        residual=None):
    """Like ``assemble_sync`` for a sync of one fragment: the root's result (or None when the
    root is not in the group) and the stacked results of layers [lo, hi) (None if no layer) are
    written over the state's values; every other unit keeps its local params, outer state and
    ``residual`` (the per-worker error-feedback tree, or None)."""
    def put(full, part):  # [L, ...] with rows [lo, hi) replaced
        return full if part is None else full.at[lo:hi].set(part.astype(full.dtype))

    def merge(full, root_new, layers_new):
        return {"root": full["root"] if root is None else root_new,
                "layers": jax.tree.map(put, full["layers"], layers_new) if layers is not None else full["layers"]}

    pick = lambda r, name: getattr(r, name) if r is not None else None
    local = local_blocks(params)
    new_params = with_replica_dim(as_varying(merge(local, pick(root, "params"), pick(layers, "params"))))
    det = local_blocks(outer.detector)  # [U, ...]
    if root is not None:
        det = jax.tree.map(lambda full, r: full.at[0].set(r), det, root.detector)
    if layers is not None:
        det = jax.tree.map(lambda full, lay: full.at[1 + lo:1 + hi].set(lay), det, layers.detector)
    if residual is not None:
        residual = with_replica_dim(as_varying(merge(local_blocks(residual), pick(root, "residual"),
                                                     pick(layers, "residual"))))
    new_outer = outer.replace(params=merge(outer.params, pick(root, "outer_params"), pick(layers, "outer_params")),
                              opt_state=merge(outer.opt_state, pick(root, "opt_state"), pick(layers, "opt_state")),
                              detector=with_replica_dim(det), syncs=outer.syncs + (1 if root is not None else 0))
    parts = [r.metrics for r in (root, layers) if r is not None]
    if root is not None:
        parts[0] = with_replica_dim(parts[0])
    unit_metrics = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)
    return new_params, new_outer, sync_metrics(unit_metrics), residual


def sync_metrics(unit: dict) -> dict:  # keys: SYNC_METRICS but "inner_reset" (reset_nonfinite_workers)
    """Per-sync figures from the per-unit ones (leading unit axis): per-worker norms over the whole
    model and per unit, weights, flags."""
    g_units = unit["pseudo_grad_norm"]  # [U, N]
    return {
        "pseudo_grad_norm": jnp.sqrt(jnp.sum(jnp.square(g_units), axis=0)),  # [N] whole-model norm
        "unit_pseudo_grad_norm": g_units,
        "weight": jnp.mean(unit["weight"], axis=0),  # [N] mean over units
        "unit_weight": unit["weight"],
        "flagged": jnp.sum(unit["flagged"].astype(jnp.int32), axis=0),  # [N] units flagged
        "unit_flagged": unit["flagged"],
        "clip_factor": jnp.min(unit["clip_factor"]),
        "unit_clip_factor": unit["clip_factor"],
        "outer_update_norm": jnp.sqrt(jnp.sum(jnp.square(unit["update_norm"]))),
    }


# ----------------------------------------------------------------------------- after a sync


def reset_nonfinite_workers(opt_state, metrics: dict, opt_specs, norm_axes=SHARD):
    """After a sync: a worker whose pseudo gradient (any unit) or inner optimizer state is
    non-finite was flagged and rolled back to θ̄, but its AdamW moments would stay NaN and make
    every later local step NaN. Its per-worker optimizer leaves are zeroed (the shared step
    count is kept, so the learning-rate schedule and bias correction go on); see
    docs/developer/decisions.md. ``metrics``: the sync's (``unit_pseudo_grad_norm``). Returns (opt_state, [N] bool:
    which workers were reset, identical everywhere). ``opt_specs``: the inner optimizer state's
    specs (a leaf whose first axis is ``replica`` is per worker)."""
    g_ok = jnp.all(jnp.isfinite(metrics["unit_pseudo_grad_norm"][:, jax.lax.axis_index(REPLICA)]))
    specs = opt_specs  # ``norm_axes``: the axes a worker's blocks are split over (the reduction's)

    def per_worker(spec, x) -> bool:  # a leaf with the worker axis (AdamW's μ, ν), not the shared count
        return bool(spec) and spec[0] == REPLICA and jnp.issubdtype(x.dtype, jnp.inexact)
    leaves = [x for spec, x in zip(jax.tree.leaves(specs, is_leaf=_is_spec), jax.tree.leaves(opt_state), strict=True)
              if per_worker(spec, x)]
    n_bad = sum((jnp.sum(~jnp.isfinite(x)) for x in leaves), jnp.int32(0))
    bad = ~g_ok | ((jax.lax.psum(n_bad, norm_axes) if norm_axes else n_bad) > 0)
    opt_state = jax.tree.map(lambda spec, x: jnp.where(bad, jnp.zeros_like(x), x) if per_worker(spec, x) else x,
                             specs, opt_state, is_leaf=_is_spec)
    return opt_state, replica_gather(bad) > 0.5


def unit_sq_sums(tree) -> jax.Array:
    """[U]: this device's sum of squares of the root unit's blocks, then of each layer's."""
    root = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree["root"]))
    layers = [jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
              for x in jax.tree.leaves(tree["layers"])]
    return jnp.concatenate([jnp.reshape(root, (1,))] + ([sum(layers)] if layers else []))


__all__ = ["SYNC_METRICS", "SYNC_SCOPE", "local_blocks", "with_replica_dim", "with_value", "as_varying",
           "assemble_sync", "assemble_group_sync", "sync_metrics", "reset_nonfinite_workers", "unit_sq_sums"]
