"""What ``LocalSGD`` checks of a user's own code and params, with one message each that names the
argument and what was expected (``api.py`` calls them; they hold no state), and the warning it
gives when a sync leaves θ̄ non-finite (``NonFiniteWatch``).

A user's ``inner_step`` runs inside ``jax.vmap`` under ``jax.jit``: what it returns wrong would
surface as a bare unpacking error, or as JAX's pjit message about ``out_shardings`` many lines
long, far from the cause. These checks run while tracing (once per program), on structures only.
"""

from __future__ import annotations

from typing import Any

import warnings

import jax
import numpy as np


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _difference(given: Any, returned: Any) -> str:
    """How ``returned``'s structure differs from ``given``'s, in leaf paths."""
    a, b = _paths(given), _paths(returned)
    extra, missing = sorted(set(b) - set(a)), sorted(set(a) - set(b))
    parts = ([f"extra {extra[:5]}{' ...' if len(extra) > 5 else ''}"] if extra else []) + \
            ([f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}"] if missing else [])
    if not parts:  # the same leaves, another container (a tuple for a list, a dict subclass, ...)
        parts = [f"{jax.tree.structure(returned)} for {jax.tree.structure(given)}"]
    return "; ".join(parts)


def checked_step_output(out: Any, params: Any, opt_state: Any) -> tuple[Any, Any, Any]:
    """``inner_step``'s ``(params, opt_state, metrics)``, checked against what it was given: three
    values, the params and the optimizer state of the same structure as the inputs."""
    if not (isinstance(out, tuple) and len(out) == 3):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise ValueError(f"inner_step: must return (params, opt_state, metrics), got {got}")
    for name, given, returned in (("params", params, out[0]), ("opt_state", opt_state, out[1])):
        if jax.tree.structure(given) != jax.tree.structure(returned):
            raise ValueError(f"inner_step: the {name} it returns must have the structure of the {name} it is "
                             f"given (each worker's state keeps its layout): {_difference(given, returned)}")
    return out


def stacked_layer_count(params: Any, rule: str) -> int:
    """The layer count of params laid out for a layer-wise rule, ``{"root": ..., "layers": ...}``
    with every leaf of ``layers`` stacked on one leading layer axis (``ScannedModel``); else a
    ValueError saying what the layout is and, for per-layer trees in a list, how to stack them."""
    if not (isinstance(params, dict) and set(params) == {"root", "layers"}):
        keys = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"params: rule {rule!r} syncs layer by layer and needs "
                         f"{{'root': ..., 'layers': <stacked on a leading layer axis>}} (ScannedModel), got {keys}")
    layers = params["layers"]
    if isinstance(layers, (list, tuple)) and layers:
        same = "of one structure" if len({jax.tree.structure(x) for x in layers}) == 1 else \
            "of different structures: they must share one"
        raise ValueError(f"params: params['layers'] is a {type(layers).__name__} of {len(layers)} per-layer trees "
                         f"({same}); layer-wise rules need them stacked on a leading layer axis: "
                         "params['layers'] = jax.tree.map(lambda *x: jnp.stack(x), *layers)")
    dims = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(layers)}
    if len(dims) != 1 or None in dims or 0 in dims:
        raise ValueError(f"params: every leaf of params['layers'] must be stacked on one leading layer axis "
                         f"of the same size >= 1, got leading sizes {sorted(dims, key=str)}")
    return dims.pop()


__all__ = ["checked_step_output", "stacked_layer_count"]


class NonFiniteWatch:
    """Says, once, that a sync left θ̄ non-finite, and which workers were non-finite there. A rule
    without anomaly elimination (DiLoCo, Post Local SGD) averages a worker gone NaN into θ̄, and
    every worker restarts from it: the run is lost from that sync on, silently otherwise. The sync's
    two flags are read one call later (the next ``step`` or ``sync``), when the program that made
    them has most likely finished, so the watch adds no wait on the device to a sync."""

    def __init__(self, rule_name: str):
        self.rule_name, self.pending, self.warned = rule_name, None, False

    def saw(self, k: int, figures: dict) -> None:
        """The sync after step ``k`` made ``figures`` (``inner_reset`` [N], ``outer_finite``)."""
        if not self.warned:
            self.pending = (k, figures["inner_reset"], figures["outer_finite"])

    def check(self) -> None:
        if self.pending is None:
            return
        (k, reset, finite), self.pending = self.pending, None
        if bool(np.asarray(finite)):
            return
        bad = [int(i) for i in np.flatnonzero(np.asarray(reset))]
        self.warned = True
        warnings.warn(f"LocalSGD: the sync at step {k} made the outer params (θ̄) non-finite, and every worker "
                      f"restarts from them: worker(s) {bad} had non-finite params or pseudo gradients. Rule "
                      f"{self.rule_name!r} keeps them in the mean; edit()'s anomaly elimination leaves such a worker "
                      "out. Lower the learning rate, or restore a state saved before this sync.",
                      RuntimeWarning, stacklevel=3)

