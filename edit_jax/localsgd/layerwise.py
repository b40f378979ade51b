"""EDiT's layer-wise sync inside the forward (``LayerwiseSync``; EDIT.md, Algorithm 1).

At a sync step every unit (the root first, then each layer inside the model's scan) is synced
across ``replica`` on its way into compute, just before its FSDP gather, so a layer's sync can
overlap the previous layer's compute. The model reaches the sync only through its family's hook
(``models/family.py``, the ``ModelFamily`` contract):

- ``forward_inputs`` lays the outer state out as the forward's per-unit hook inputs;
- ``sync_in_forward`` is the hook's sync of one unit: the forward sees θ̄ after the outer step,
  the backward passes the gradient to the unit unchanged (the sync is the identity there);
- ``assemble_forward`` writes the units' results (the forward's ``ys``) back into the state.

With a fragment group's ``span`` (streaming sync) only that group's units sync: the layer stack
is cut into segments [before, group, after] (the family's ``layer_segments``). A whole-model sync
of a state (evaluation, ``flush``) is the whole-model rule's (``whole_model.sync_whole``): the same
per-unit numerics.
"""

from __future__ import annotations

import jax

from edit_jax.config import SyncConfig
from edit_jax.localsgd.outer import sync_unit
from edit_jax.localsgd.rule import Span, SyncSpec
from edit_jax.localsgd.sync import as_varying, assemble_group_sync, assemble_sync, local_blocks, \
    reset_nonfinite_workers, with_value
from edit_jax.localsgd.whole_model import WholeModelSync


def forward_inputs(outer, spec: SyncSpec, span: Span | None = None, residual=None):
    """The forward's hook inputs for a sync inside it (``family.forward``'s ``hook_xs`` and
    ``layer_segments``): per unit, its θ̄ block, outer optimizer state, this worker's detector
    (and error-feedback ``residual``, [1, ...]), laid out like the params. With ``span``: the
    root's inputs only if the root is in the group (else None: it is only gathered), and the layer
    stack cut into the segments [before, group, after], the group's with its slice of the
    per-layer inputs."""
    det = local_blocks(outer.detector)  # this replica's detectors: [U, ...]
    hook_xs = {"root": (outer.params["root"], outer.opt_state["root"], jax.tree.map(lambda x: x[0], det)),
               "layers": (outer.params["layers"], outer.opt_state["layers"], jax.tree.map(lambda x: x[1:], det))}
    if residual is not None:
        res = local_blocks(residual)
        hook_xs = {k: v + (res[k],) for k, v in hook_xs.items()}
    if span is None:
        return hook_xs, None
    return _group_xs(hook_xs, span, spec.n_layers)


def _group_xs(hook_xs, span: Span, n_layers: int):
    root_in, lo, hi = span
    layer_xs = jax.tree.map(lambda x: x[lo:hi], hook_xs["layers"])
    segments = [(lo, None), (hi - lo, layer_xs if hi > lo else None), (n_layers - hi, None)]
    return {"root": hook_xs["root"] if root_in else None, "layers": None}, segments


def sync_in_forward(unit, xs, which: str, spec: SyncSpec, shares: jax.Array | None = None):
    """The hook's sync of one unit (``which``: "root" | "layer") on its way into compute: returns
    (the unit's params to gather, its ``UnitSync``)."""
    outer_p, opt_st, det, *residual = xs
    res = sync_unit(jax.lax.stop_gradient(unit), outer_p, opt_st, det, spec.penalty, spec.opt,
                    spec.dims(which), shares, spec.codec, residual[0] if residual else None,
                    reduction=spec.reduction)
    synced = jax.tree.map(lambda s, u: s.astype(u.dtype), res.params, unit)  # (the API's bf16 params)
    return with_value(unit, as_varying(synced)), res


def assemble_forward(params, outer, ys, span: Span | None = None, residual=None):
    """The state after a sync in the forward, from the hook's per-unit results ``ys`` (the
    forward's ``{"root": UnitSync, "layers": ...}``; with ``span``, the layers' are per segment):
    (params, outer, metrics, residual)."""
    if span is None:
        return assemble_sync(outer, ys["root"], ys["layers"])
    _, lo, hi = span
    return assemble_group_sync(params, outer, ys["root"], ys["layers"][1] if hi > lo else None, lo, hi, residual)


class LayerwiseSync(WholeModelSync):
    """EDiT: pseudo gradients layer by layer inside the forward, penalised, every tau steps. The
    same per-unit sync also runs after a step (``after_step``, ``flush``: the whole-model rule's),
    e.g. to evaluate a fresh θ̄."""

    name = "layerwise"
    in_forward = True

    @classmethod
    def build(cls, sync: SyncConfig) -> WholeModelSync:
        """EDiT's sync; with ``sync.layerwise=false``, the same per-unit sync after the step, unit
        by unit over the whole model at once (``WholeModelSync``, the penalty as configured)."""
        return cls() if sync.layerwise else WholeModelSync()

    def forward_inputs(self, outer, spec: SyncSpec, span: Span | None = None, residual=None):
        return forward_inputs(outer, spec, span, residual)

    def in_forward_sync(self, unit, xs, which: str, spec: SyncSpec, shares=None):
        return sync_in_forward(unit, xs, which, spec, shares)

    def assemble(self, params, outer, opt_state, ys, spec: SyncSpec, span: Span | None = None, residual=None):
        """(params, outer, opt_state, metrics, residual) after the forward's sync: the synced
        units' params are θ̄ (the inner update then applies to them); a worker that went
        non-finite has its inner optimizer state zeroed."""
        params, outer, metrics, residual = assemble_forward(params, outer, ys, span, residual)
        opt_state, metrics["inner_reset"] = reset_nonfinite_workers(opt_state, metrics, spec.inner_opt_specs,
                                                                    spec.reduction.norm_axes)
        return params, outer, opt_state, metrics, residual


__all__ = ["LayerwiseSync", "forward_inputs", "sync_in_forward", "assemble_forward"]
