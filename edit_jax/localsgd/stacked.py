"""The sync of N workers stacked on a leading axis [N, ...] in one program (the ``Stacked``
reduction: a sum over the worker axis), unit by unit: what ``LocalSGD.sync`` runs after the step,
and what the exchange's round runs on the host (``elastic/outer_round.py``, ``elastic/packed.py``).
Split from ``api.py``, whose programs call it; the trainer's rules run the same ``outer.sync_unit``
under ``shard_map`` instead."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from edit_jax.localsgd.outer import Detector, sync_unit
from edit_jax.localsgd.outer_spec import Penalty
from edit_jax.localsgd.reduction import Stacked


def cat_units(root, layers, axis: int = 0):
    """The root's values and the layers' (stacked on ``axis``) as one unit axis ``axis``: [.., U, ..]."""
    return jax.tree.map(lambda r, l: jnp.concatenate([jnp.expand_dims(r, axis), l], axis=axis), root, layers)


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


def stacked_sync(params: Any, outer_params: Any, outer_opt_state: Any, detector: Detector, penalty: Penalty,
                 outer_opt: optax.GradientTransformation, layerwise: bool, shares: jax.Array | None = None):
    """One sync of N workers whose params are stacked [N, ...] in one program (the ``Stacked``
    reduction), unit by unit: the root and each layer of ``{"root", "layers"}`` params when
    ``layerwise``, else the whole pytree as one unit. ``detector``: every worker's, [N, U];
    ``shares`` ([N], A-EDiT): each worker's share of the steps. Returns (every worker's new params
    [N, ...] (θ̄ broadcast, float32), θ̄, the outer state, the detectors, the sync's figures).
    What ``LocalSGD.sync`` runs, and the exchange's round (``elastic/outer_round.py``)."""
    red = Stacked()
    if not layerwise:
        res = sync_unit(params, outer_params, outer_opt_state, unit_detector(detector, 0), penalty, outer_opt,
                        shares=shares, reduction=red)
        det = jax.tree.map(lambda x: x[:, None], res.detector)
        return res.params, res.outer_params, res.opt_state, det, sync_figures(jax.tree.map(lambda x: x[None],
                                                                                            res.metrics))

    def one(local, outer, outer_state, det):
        r = sync_unit(local, outer, outer_state, det, penalty, outer_opt, shares=shares, reduction=red)
        return r.params, r.outer_params, r.opt_state, r.detector, r.metrics
    root = one(params["root"], outer_params["root"], outer_opt_state["root"], unit_detector(detector, 0))
    layers = jax.vmap(one, in_axes=(1, 0, 0, 1), out_axes=(1, 0, 0, 1, 0))(
        params["layers"], outer_params["layers"], outer_opt_state["layers"], unit_detector(detector, slice(1, None)))
    new_params, outer, outer_state = ({"root": r, "layers": l} for r, l in zip(root[:3], layers[:3]))
    return new_params, outer, outer_state, cat_units(root[3], layers[3], axis=1), sync_figures(
        cat_units(root[4], layers[4]))


__all__ = ["stacked_sync", "sync_figures", "cat_units", "unit_detector"]
