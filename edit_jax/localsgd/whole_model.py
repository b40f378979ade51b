"""The whole-model sync after the step: DiLoCo, Post Local SGD, and EDiT with
``sync.layerwise=false`` (``WholeModelSync``).

After the step's inner update every unit syncs, the root first, then the layers one by one (a
scan, so that the per-unit numerics are those of the layer-wise sync). With a fragment group's
``span`` (streaming sync), only that group's units sync; the others keep their params and outer
state. Every synced unit's params are the new θ̄ on every worker.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from edit_jax.localsgd.outer import sync_unit
from edit_jax.localsgd.rule import Span, SyncRule, SyncSpec
from edit_jax.localsgd.sync import assemble_group_sync, assemble_sync, local_blocks, reset_nonfinite_workers


def sync_whole(params, outer, spec: SyncSpec, shares: jax.Array | None = None, span: Span | None = None,
               residual: Any = None):
    """Syncs every unit (or the units of ``span``) after the step.

    ``params`` are the per-replica params (``[1, ...]`` blocks), ``shares`` ([N], A-EDiT) each
    worker's share of the steps since the last sync, ``residual`` this worker's error-feedback
    tree (``[1, ...]``, with ``spec.codec``) or None. Returns (params, outer, metrics, residual)."""
    local, det = local_blocks(params), local_blocks(outer.detector)
    one = partial(sync_unit, p=spec.penalty, opt=spec.opt, shares=shares, codec=spec.codec,
                  reduction=spec.reduction)
    res = local_blocks(residual) if residual is not None else None
    root_in, lo, hi = span if span is not None else (True, 0, spec.n_layers)
    root = None
    if root_in:
        root = one(local["root"], outer.params["root"], outer.opt_state["root"], jax.tree.map(lambda x: x[0], det),
                   replica_dims=spec.dims("root"), residual=res["root"] if res is not None else None)

    def body(_, xs):
        *xs, r = xs
        return None, one(*xs, replica_dims=spec.dims("layer"), residual=r)

    cut = (lambda x: x[lo:hi]) if span is not None else (lambda x: x)
    layers = None
    if hi > lo:
        _, layers = jax.lax.scan(body, None, jax.tree.map(cut, (
            local["layers"], outer.params["layers"], outer.opt_state["layers"], jax.tree.map(lambda x: x[1:], det),
            res["layers"] if res is not None else None)))
    if span is not None:
        return assemble_group_sync(params, outer, root, layers, lo, hi, residual)
    return assemble_sync(outer, root, layers)


class WholeModelSync(SyncRule):
    """Pseudo gradients of every unit after the step, penalised (when the method's penalty is
    on), averaged over ``replica`` and applied by the outer optimizer; every tau steps."""

    name = "whole_model"

    def after_step(self, params, outer, opt_state, spec: SyncSpec, shares=None, span: Span | None = None,
                   residual=None):
        params, outer, metrics, residual = sync_whole(params, outer, spec, shares, span, residual)
        opt_state, metrics["inner_reset"] = reset_nonfinite_workers(opt_state, metrics, spec.inner_opt_specs,
                                                                    spec.reduction.norm_axes)
        return params, outer, opt_state, metrics, residual

    def flush(self, params, outer, spec: SyncSpec, residual=None):
        return sync_whole(params, outer, spec, residual=residual)


__all__ = ["WholeModelSync", "sync_whole"]
