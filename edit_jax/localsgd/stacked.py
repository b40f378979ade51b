"""A rule's sync of N workers stacked on a leading axis [N, ...] in one program: what ``LocalSGD``
runs (``api.py``) and what the exchange's round runs on the host (``elastic/outer_round.py``).

It is the rule itself, not a copy: ``jax.vmap`` over the workers with ``axis_name="replica"``, so a
rule written for the trainer's ``shard_map`` (one worker's values with their local replica dim,
``[1, ...]``, collectives over ``replica``) runs unchanged, each worker holding its whole units
(``ReplicaPsum(norm_axes=())``). A model laid out for a layer-wise rule is its units
(``{"root", "layers"}``); any other pytree is one unit, the root of a model without layers
(``as_units``), so a whole-model sync of it has one norm and one detector per worker.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from edit_jax.localsgd.outer import Detector
from edit_jax.localsgd.reduction import ReplicaPsum
from edit_jax.localsgd.rule import SyncRule, SyncSpec
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.localsgd.sync import local_blocks, with_replica_dim

WORKERS = ReplicaPsum(axis=REPLICA, norm_axes=())  # each worker holds its whole units


def as_units(tree: Any, layerwise: bool) -> Any:
    """``tree`` as a rule's units: layer-wise, its own ``{"root", "layers"}``; else one unit."""
    return tree if layerwise else {"root": tree, "layers": {}}


def of_units(tree: Any, layerwise: bool) -> Any:
    return tree if layerwise else tree["root"]


def workers_sync(rule: SyncRule, spec: SyncSpec, params: Any, opt_state: Any, outer: Any, shares=None,
                 flush: bool = False, spmd: bool = False, span=None):
    """``rule``'s sync of N workers whose ``params`` (laid out as units) and inner ``opt_state`` (or
    None) are stacked [N, ...]; ``outer`` an ``OuterState`` whose ``params`` / ``opt_state`` are one
    copy and whose ``detector`` / ``extra`` are per worker [N, ...]. ``rule.after_step`` (with the
    step ``shares`` of A-EDiT), or ``rule.flush`` (what is in flight, no new round; no inner reset).
    ``spmd``: the worker axis is the mesh's ``replica`` axis (``vmap``'s ``spmd_axis_name``).
    ``span``: the units of one staggered group only (``fragments.fragment_layers``; None: every unit).
    Returns (params [N], opt_state [N], the new ``OuterState`` (per-worker parts [N]), figures)."""
    def worker(params, opt_state, det, extra):
        view = outer.replace(detector=with_replica_dim(det), extra=with_replica_dim(extra))
        units = with_replica_dim(params)
        if flush:
            units, view, figures, _ = rule.flush(units, view, spec)
            figures["inner_reset"] = jnp.zeros((spec.n_workers,), bool)
        else:
            units, view, opt_state, figures, _ = rule.after_step(units, view, with_replica_dim(opt_state), spec,
                                                                 shares, span)
            opt_state = local_blocks(opt_state)
        mine = (local_blocks(units), opt_state, local_blocks(view.detector), local_blocks(view.extra))
        return mine, (view.params, view.opt_state, view.syncs), figures

    (params, opt_state, det, extra), (theta, outer_opt, syncs), figures = jax.vmap(
        worker, axis_name=REPLICA, spmd_axis_name=REPLICA if spmd else None, out_axes=(0, None, None))(
        params, opt_state, outer.detector, outer.extra)
    return params, opt_state, outer.replace(params=theta, opt_state=outer_opt, detector=det, syncs=syncs,
                                            extra=extra), figures


def cat_units(root, layers, axis: int = 0):
    """The root's values and the layers' (stacked on ``axis``) as one unit axis ``axis``: [.., U, ..]."""
    return jax.tree.map(lambda r, lay: jnp.concatenate([jnp.expand_dims(r, axis), lay], axis=axis), root, layers)


def unit_detector(det: Detector, u) -> Detector:
    """Every worker's detector of unit(s) ``u`` (from the [N, U] detectors)."""
    return jax.tree.map(lambda x: x[:, u], det)


def sync_figures(unit: dict) -> dict:
    """A sync's figures from its per-unit ones (leading unit axis U; [U, N] per worker)."""
    g = unit["pseudo_grad_norm"]
    return {"pseudo_grad_norm": jnp.sqrt(jnp.sum(jnp.square(g), axis=0)),  # [N]: whole-model norm
            "unit_pseudo_grad_norm": g, "weight": jnp.mean(unit["weight"], axis=0),
            "flagged": jnp.sum(unit["flagged"].astype(jnp.int32), axis=0),  # [N]: units flagged
            "clip_factor": jnp.min(unit["clip_factor"]),
            "outer_update_norm": jnp.sqrt(jnp.sum(jnp.square(unit["update_norm"])))}


__all__ = ["WORKERS", "as_units", "of_units", "workers_sync", "sync_figures", "cat_units", "unit_detector"]
