"""The sync of a model across replicas, as pure functions of (params, outer state, layout), run
per device under ``shard_map`` over the (replica, shard) mesh.

``outer.py`` syncs one unit (EDIT.md, Algorithm 2); this module decides which units sync, in
which order, and how their results go back into the state and the per-sync figures:

- ``sync_whole``: every unit after the step, the root first, then the layers (DiLoCo, Post Local
  SGD, EDiT with ``sync.layerwise=false``); with a fragment group's ``span``, only its units.
- the layer-wise sync inside the forward (EDiT): ``forward_inputs`` lays the outer state out as
  the forward's per-unit hook inputs, ``sync_in_forward`` is the hook's sync of one unit, and
  ``assemble_forward`` writes the units' results back (``span``: one fragment group's units).
- ``sync_stale``: CO2's one-round-stale sync (CO2.md).
- ``reset_nonfinite_workers``: after a sync, the inner optimizer state of a worker that went
  non-finite is zeroed.
- ``sync_metrics``: the per-sync figures (``SYNC_METRICS``) from the per-unit ones.

Every function takes the state as arrays (this device's blocks: per-replica leaves with their
local replica dim of size 1) and the static facts from the ``state.StateLayout`` (its ``plan``,
outer optimizer and where θ̄ lives), and returns ``(params, outer, metrics)`` or the like: no
object holds state between calls. ``programs.StepPrograms`` compiles them into steps; tests call them
under ``jax.shard_map`` directly.

A ``span`` is the units of one fragment group (``fragments.fragment_layers``): (the root is in
the group, first layer, end layer). ``None`` means every unit, one group.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from edit_jax.localsgd.outer import UnitSync, sgd_trace, stale_outer_step, sync_unit
from edit_jax.localsgd.sharding import REPLICA, SHARD, replica_gather
from edit_jax.localsgd.state import OuterState, StateLayout

# Sync figures (identical on every device); "loss" and "grad_norm" come back per replica, [N].
# The jax.named_scope of the sync's ops (this module's and outer.py's, as programs.py calls them):
# the profiler (tools/profile.py) and the HLO tests find the sync by it.
SYNC_SCOPE = "edit_sync"

SYNC_METRICS = ("pseudo_grad_norm", "unit_pseudo_grad_norm", "weight", "unit_weight", "flagged", "unit_flagged",
                "clip_factor", "unit_clip_factor", "outer_update_norm", "inner_reset")

Span = tuple[bool, int, int]  # (root in the group, first layer, end layer): fragments.fragment_layers


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _local(tree):
    """This device's per-replica values without their local replica dim (size 1)."""
    return jax.tree.map(lambda x: x[0], tree)


def _with_replica_dim(tree):
    return jax.tree.map(lambda x: x[None], tree)


@jax.custom_vjp
def _with_value(x, value):
    """Returns ``value`` in the forward pass and passes the cotangent to ``x`` unchanged: the sync
    acts as the identity in the backward pass, so the gradient is taken at the synced point."""
    return value


def _with_value_fwd(x, value):
    return value, None


def _with_value_bwd(_, g):
    return g, jax.tree.map(jnp.zeros_like, g)


_with_value.defvjp(_with_value_fwd, _with_value_bwd)


def _varying(x):
    """Marks values computed identically on every replica (θ̄) as per-replica, as local params are."""
    def one(v):
        aval = jax.typeof(v)  # the varying-axes set is `.mat.varying` in recent JAX, `.vma` before
        mat = getattr(aval, "mat", None)
        varying = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
        return v if REPLICA in varying else jax.lax.pcast(v, REPLICA, to="varying")

    return jax.tree.map(one, x)


def _replica_dims(layout: StateLayout, which: str):
    """The FSDP dim of each leaf of a unit ("root" | "layer") when θ̄ is split over ``replica``
    too (outer.sync_unit's ``replica_dims``), else None."""
    return layout.unit_dims[which] if layout.outer_over_replica else None


# ----------------------------------------------------------------------------- whole model


def sync_whole(params, outer: OuterState, layout: StateLayout, shares: jax.Array | None = None,
               span: Span | None = None) -> tuple[Any, OuterState, dict]:
    """Syncs every unit after the step: the root, then the layers one by one (a scan, so that
    the per-unit numerics are those of the layer-wise sync). With ``span``: only the units of
    that fragment group (streaming sync); the others keep their params and outer state.

    ``params`` are the per-replica params (``[1, ...]`` blocks), ``shares`` ([N], A-EDiT) each
    worker's share of the steps since the last sync. Returns (params, outer, metrics); every
    synced unit's params are the new θ̄ on every worker."""
    local, det = _local(params), _local(outer.detector)
    one = partial(sync_unit, p=layout.plan.penalty, opt=layout.outer_opt, shares=shares,
                  compress=layout.cfg.sync.compress)
    res = _local(outer.residual) if outer.residual is not None else None
    root_in, lo, hi = span if span is not None else (True, 0, layout.cfg.model.n_layers)
    root = None
    if root_in:
        root = one(local["root"], outer.params["root"], outer.opt_state["root"], jax.tree.map(lambda x: x[0], det),
                   replica_dims=_replica_dims(layout, "root"), residual=res["root"] if res is not None else None)

    def body(_, xs):
        *xs, r = xs
        return None, one(*xs, replica_dims=_replica_dims(layout, "layer"), residual=r)

    cut = (lambda x: x[lo:hi]) if span is not None else (lambda x: x)  # noqa: E731
    layers = None
    if hi > lo:
        _, layers = jax.lax.scan(body, None, jax.tree.map(cut, (
            local["layers"], outer.params["layers"], outer.opt_state["layers"], jax.tree.map(lambda x: x[1:], det),
            res["layers"] if res is not None else None)))
    if span is not None:
        return _assemble_group_sync(params, outer, root, layers, lo, hi)
    return _assemble_sync(outer, root, layers)


# ----------------------------------------------------------------------------- layer-wise, in the forward


def forward_inputs(outer: OuterState, layout: StateLayout, span: Span | None = None):
    """The forward's hook inputs for a sync inside it (``family.forward``'s ``hook_xs`` and
    ``layer_segments``): per unit, its θ̄ block, outer optimizer state, this worker's detector
    (and error-feedback residual), laid out like the params. With ``span``: the root's inputs only
    if the root is in the group (else None: it is only gathered), and the layer stack cut into
    the segments [before, group, after], the group's with its slice of the per-layer inputs."""
    det = _local(outer.detector)  # this replica's detectors: [U, ...]
    hook_xs = {"root": (outer.params["root"], outer.opt_state["root"], jax.tree.map(lambda x: x[0], det)),
               "layers": (outer.params["layers"], outer.opt_state["layers"], jax.tree.map(lambda x: x[1:], det))}
    if outer.residual is not None:
        res = _local(outer.residual)
        hook_xs = {k: v + (res[k],) for k, v in hook_xs.items()}
    if span is None:
        return hook_xs, None
    return _group_xs(hook_xs, span, layout.cfg.model.n_layers)


def _group_xs(hook_xs, span: Span, n_layers: int):
    root_in, lo, hi = span
    layer_xs = jax.tree.map(lambda x: x[lo:hi], hook_xs["layers"])
    segments = [(lo, None), (hi - lo, layer_xs if hi > lo else None), (n_layers - hi, None)]
    return {"root": hook_xs["root"] if root_in else None, "layers": None}, segments


def sync_in_forward(unit, xs, which: str, layout: StateLayout, shares: jax.Array | None = None):
    """The hook's sync of one unit (``which``: "root" | "layer") on its way into compute: returns
    (the unit's params to gather, its ``UnitSync``). The forward sees θ̄ after the outer step; the
    backward passes the gradient to ``unit`` unchanged (the sync is the identity there)."""
    outer_p, opt_st, det, *residual = xs
    res = sync_unit(jax.lax.stop_gradient(unit), outer_p, opt_st, det, layout.plan.penalty, layout.outer_opt,
                    _replica_dims(layout, which), shares, layout.cfg.sync.compress,
                    residual[0] if residual else None)
    return _with_value(unit, _varying(res.params)), res


def assemble_forward(params, outer: OuterState, ys, span: Span | None = None) -> tuple[Any, OuterState, dict]:
    """The state after a sync in the forward, from the hook's per-unit results ``ys`` (the
    forward's ``{"root": UnitSync, "layers": ...}``; with ``span``, the layers' are per segment)."""
    if span is None:
        return _assemble_sync(outer, ys["root"], ys["layers"])
    _, lo, hi = span
    return _assemble_group_sync(params, outer, ys["root"], ys["layers"][1] if hi > lo else None, lo, hi)


# ----------------------------------------------------------------------------- assembly


def _assemble_sync(outer: OuterState, root: UnitSync, layers: UnitSync):
    """Reassembles per-unit sync results (root + scanned layers) into state and metrics."""
    cat = lambda r, l: jnp.concatenate([r[None], l], axis=0)  # noqa: E731  (unit axis first)
    params = _varying({"root": root.params, "layers": layers.params})
    params = _with_replica_dim(params)  # restore the local replica dim
    det = jax.tree.map(cat, root.detector, layers.detector)
    det = _with_replica_dim(det)
    residual = None
    if root.residual is not None:
        residual = _with_replica_dim(_varying({"root": root.residual, "layers": layers.residual}))
    new_outer = OuterState({"root": root.outer_params, "layers": layers.outer_params},
                           {"root": root.opt_state, "layers": layers.opt_state}, det, outer.syncs + 1, residual)
    unit_metrics = jax.tree.map(cat, root.metrics, layers.metrics)
    return params, new_outer, sync_metrics(unit_metrics)


def _assemble_group_sync(params, outer: OuterState, root: UnitSync | None, layers: UnitSync | None, lo: int, hi: int):
    """Like ``_assemble_sync`` for a sync of one fragment: the root's result (or None when the
    root is not in the group) and the stacked results of layers [lo, hi) (None if no layer) are
    written over the state's values; every other unit keeps its local params and outer state."""
    def put(full, part):  # [L, ...] with rows [lo, hi) replaced
        return full if part is None else full.at[lo:hi].set(part.astype(full.dtype))

    def merge(full, root_new, layers_new):
        return {"root": full["root"] if root is None else root_new,
                "layers": jax.tree.map(put, full["layers"], layers_new) if layers is not None else full["layers"]}

    pick = lambda r, name: getattr(r, name) if r is not None else None  # noqa: E731
    local = _local(params)
    new_params = _with_replica_dim(_varying(merge(local, pick(root, "params"), pick(layers, "params"))))
    det = _local(outer.detector)  # [U, ...]
    if root is not None:
        det = jax.tree.map(lambda full, r: full.at[0].set(r), det, root.detector)
    if layers is not None:
        det = jax.tree.map(lambda full, l: full.at[1 + lo:1 + hi].set(l), det, layers.detector)
    residual = outer.residual
    if residual is not None:
        residual = _with_replica_dim(_varying(merge(_local(residual), pick(root, "residual"),
                                                    pick(layers, "residual"))))
    new_outer = OuterState(merge(outer.params, pick(root, "outer_params"), pick(layers, "outer_params")),
                           merge(outer.opt_state, pick(root, "opt_state"), pick(layers, "opt_state")),
                           _with_replica_dim(det), outer.syncs + (1 if root is not None else 0), residual)
    parts = [r.metrics for r in (root, layers) if r is not None]
    if root is not None:
        parts[0] = _with_replica_dim(parts[0])
    unit_metrics = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)
    return new_params, new_outer, sync_metrics(unit_metrics)


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


def reset_nonfinite_workers(opt_state, metrics: dict, layout: StateLayout):
    """After a sync: a worker whose pseudo gradient (any unit) or inner optimizer state is
    non-finite was flagged and rolled back to θ̄, but its AdamW moments would stay NaN and make
    every later local step NaN. Its per-worker optimizer leaves are zeroed (the shared step
    count is kept, so the learning-rate schedule and bias correction go on); see BUILD_NOTES,
    decisions. ``metrics``: the sync's (``unit_pseudo_grad_norm``). Returns (opt_state, [N] bool:
    which workers were reset, identical everywhere)."""
    g_ok = jnp.all(jnp.isfinite(metrics["unit_pseudo_grad_norm"][:, jax.lax.axis_index(REPLICA)]))
    specs = layout.state_specs.opt_state

    def per_worker(spec, x) -> bool:  # a leaf with the worker axis (AdamW's μ, ν), not the shared count
        return bool(spec) and spec[0] == REPLICA and jnp.issubdtype(x.dtype, jnp.inexact)
    leaves = [x for spec, x in zip(jax.tree.leaves(specs, is_leaf=_is_spec), jax.tree.leaves(opt_state))
              if per_worker(spec, x)]
    n_bad = sum((jnp.sum(~jnp.isfinite(x)) for x in leaves), jnp.int32(0))
    bad = ~g_ok | (jax.lax.psum(n_bad, SHARD) > 0)
    opt_state = jax.tree.map(lambda spec, x: jnp.where(bad, jnp.zeros_like(x), x) if per_worker(spec, x) else x,
                             specs, opt_state, is_leaf=_is_spec)
    return opt_state, replica_gather(bad) > 0.5


# ----------------------------------------------------------------------------- CO2


def sync_stale(params, outer: OuterState, layout: StateLayout, flush: bool = False) -> tuple[Any, OuterState, dict]:
    """CO2's sync after the round's last step (CO2.md section 1): the outer update consumes the
    pseudo gradients every worker sent at the *previous* sync (``outer.pending``), so their
    all-reduce does not depend on this round's steps and a GPU can run it while they compute;
    then each worker's new pending is a_t - x^i_t, and every worker restarts from a_{t+1}.
    The inner optimizer states stay local (CO2 never averages or resets them).

    ``flush``: the update of the last round's pending only (for evaluation: the model after
    the final all-reduce lands); the pending is kept as it was.

    Unit by unit like the other syncs (root; layers vmapped with their per-unit outer state),
    so the figures are per unit; one all-reduce of the whole pending tree first."""
    plan = layout.plan
    n, opt, lam = layout.n, layout.outer_opt, plan.gap_penalty
    local = _local(params)
    pending = _local(outer.pending)
    # The exchange, one all-reduce over `replica`: the pending pseudo gradients and, in slot r
    # of an [N, U] table, worker r's per-unit squared norms of its block. It reads only what
    # the last sync left in the state. Nothing else crosses `replica` in this program, so XLA's
    # all-reduce combiner cannot tie it to a value of this round (it once merged the norms'
    # psum over `shard` with the step's gradient norm, making the exchange wait for the step).
    slot = jax.nn.one_hot(jax.lax.axis_index(REPLICA), n, dtype=jnp.float32)[:, None] > 0
    table = jnp.where(slot, _unit_sq_sums(pending)[None, :], 0.0)  # where: NaN * 0 is NaN
    pending_sum, table = jax.lax.psum((pending, table), REPLICA)
    sent = jnp.sqrt(jax.lax.psum(table, SHARD)).T  # [U, N]: each worker's stale pseudo gradient
    one = lambda ps, lo, op, st: stale_outer_step(ps, n, lo, op, st, opt, lam)  # noqa: E731
    root = one(pending_sum["root"], local["root"], outer.params["root"], outer.opt_state["root"])
    layers = jax.vmap(one)(pending_sum["layers"], local["layers"], outer.params["layers"],
                           outer.opt_state["layers"])
    new_outer = {"root": root[0], "layers": layers[0]}
    new_opt = {"root": root[1], "layers": layers[1]}

    unit_norms = lambda tree: jnp.sqrt(jax.lax.psum(_unit_sq_sums(tree), SHARD))  # noqa: E731
    clip = jnp.ones(sent.shape[0], jnp.float32)
    if plan.outer.momentum_clip > 0:  # how much of the momentum survived the clamp, per unit
        beta = plan.outer.momentum
        old_m = {u: sgd_trace(outer.opt_state[u]) for u in ("root", "layers")}
        g = {"root": root[3], "layers": layers[3]}  # Delta_{t-1} / Lambda_t
        raw = jax.tree.map(lambda g, m: g + beta * m, g, old_m)
        new_m = {u: sgd_trace(new_opt[u]) for u in ("root", "layers")}
        raw_norm = unit_norms(raw)
        clip = jnp.where(raw_norm > 0, unit_norms(new_m) / jnp.where(raw_norm > 0, raw_norm, 1.0), 1.0)
    unit = {"pseudo_grad_norm": sent, "weight": jnp.full_like(sent, 1.0 / n),
            "flagged": jnp.zeros(sent.shape, bool), "clip_factor": clip,
            "update_norm": unit_norms(jax.tree.map(lambda a, b: a - b, new_outer, outer.params))}
    new_pending = outer.pending if flush else _with_replica_dim({"root": root[2], "layers": layers[2]})
    new_params = _with_replica_dim(_varying(new_outer))
    new_state = outer.replace(params=new_outer, opt_state=new_opt, syncs=outer.syncs + 1, pending=new_pending)
    metrics = sync_metrics(unit)
    # CO2 has no anomaly handling, so nothing to roll back (and no flag exchange over `replica`).
    metrics["inner_reset"] = jnp.zeros((n,), bool)
    return new_params, new_state, metrics


def _unit_sq_sums(tree) -> jax.Array:
    """[U]: this device's sum of squares of the root unit's blocks, then of each layer's."""
    root = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree["root"]))
    layers = sum(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
                 for x in jax.tree.leaves(tree["layers"]))
    return jnp.concatenate([jnp.reshape(root, (1,)), layers])


__all__ = ["SYNC_METRICS", "SYNC_SCOPE", "Span", "sync_whole", "forward_inputs", "sync_in_forward", "assemble_forward",
           "sync_stale", "reset_nonfinite_workers", "sync_metrics"]
