"""What ``LocalSGD`` checks of a user's own code and params, with one message each that names the
argument and what was expected (``api.py`` calls them; they hold no state), and the guard of a
sync that would leave θ̄ non-finite (``refuse_nonfinite_sync`` in the program, ``NonFiniteWatch``
on the host: the one line that says so).

A user's ``inner_step`` runs inside ``jax.vmap`` under ``jax.jit``: what it returns wrong would
surface as a bare unpacking error, or as JAX's pjit message about ``out_shardings`` many lines
long, far from the cause. These checks run while tracing (once per program), on structures only.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from edit_jax.localsgd.api_rules import LocalSGDRule
from edit_jax.localsgd.outer import UnitSync
from edit_jax.localsgd.sharding import REPLICA


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


def stacked_layer_count(params: Any, rule: str, why: str = "") -> int:
    """The layer count of params laid out for a layer-wise rule, ``{"root": ..., "layers": ...}``
    with every leaf of ``layers`` stacked on one leading layer axis (``ScannedModel``); else a
    ValueError saying what the layout is and, for per-layer trees in a list, how to stack them."""
    if not (isinstance(params, dict) and set(params) == {"root", "layers"}):
        keys = sorted(params) if isinstance(params, dict) else type(params).__name__
        how = "in groups of units" if why else "layer by layer"
        raise ValueError(f"params: {why}rule {rule!r} syncs {how} and needs "
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


def check_fragments(fragments, tau: int, rule) -> int:
    """``fragments`` (the staggered groups of units, the trainer's ``sync.fragments``) as an int,
    or a ValueError naming it."""
    if isinstance(fragments, bool) or not isinstance(fragments, (int, np.integer)) or fragments < 1:
        raise ValueError(f"fragments: expected an integer >= 1 (groups of units synced on staggered steps), "
                         f"got {fragments!r}")
    if tau % fragments:
        raise ValueError(f"fragments: must divide tau={tau} (group f syncs at step f·tau/F of each window), "
                         f"got {fragments}")
    if fragments > 1 and not rule.sync.streams:
        raise ValueError(f"fragments: rule {rule.name!r} syncs every unit together (co2's stale all-reduce "
                         "spans the whole model); leave fragments=1")
    return int(fragments)


def check_arguments(rule, mesh, tau, inner_step, loss_fn, optimizer, warmup_steps, replica: str) -> None:
    """``LocalSGD``'s arguments, each refused with one line naming it."""
    if not isinstance(rule, LocalSGDRule):
        raise ValueError("rule: expected a LocalSGDRule (diloco(), post_local_sgd(), edit(), co2(), "
                         f"compressed(...), from_method(...)), got {rule!r}")
    if not isinstance(mesh, Mesh) or replica not in mesh.axis_names:
        raise ValueError(f"mesh: expected a jax.sharding.Mesh with a {replica!r} axis (one position per "
                         f"worker), got {getattr(mesh, 'axis_names', mesh)!r}")
    if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)) or tau < 1:
        raise ValueError(f"tau: expected an integer >= 1 (inner steps between syncs), got {tau!r}")
    if (inner_step is None) == (loss_fn is None) or (loss_fn is None) != (optimizer is None):
        raise ValueError("inner_step / loss_fn, optimizer: give either inner_step, or loss_fn and optimizer")
    if rule.layerwise and inner_step is not None:
        raise ValueError(f"inner_step: rule {rule.name!r} syncs inside the forward, so its inner update must "
                         "apply to the synced params: give loss_fn(params, batch, hook, hook_xs) -> (loss, ys) "
                         "and optimizer instead (docs/api.md)")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer)) or warmup_steps < 0:
        raise ValueError(f"warmup_steps: expected an integer >= 0, got {warmup_steps!r}")
    if warmup_steps and inner_step is not None:
        raise ValueError("warmup_steps: the synchronous warmup averages the workers' gradients every step, "
                         "which an opaque inner_step does not expose: give loss_fn and optimizer instead")


def all_finite(tree, batch_dims: int = 0) -> jax.Array:
    """Whether every floating leaf is finite (per worker, [N], with ``batch_dims=1`` on stacked trees)."""
    ok = jnp.ones((), bool)
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(x), axis=tuple(range(batch_dims, x.ndim)))
    return ok


def zero_inexact(tree, reset):
    """The optimizer state with its floating leaves zeroed where ``reset`` (scalar, or [N] on
    stacked trees): a worker whose moments or pseudo gradient went non-finite (NaN moments would
    poison every later step); integer leaves (step counts) are kept."""
    def one(x):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return x
        r = jnp.reshape(reset, jnp.shape(reset) + (1,) * (x.ndim - jnp.ndim(reset)))
        return jnp.where(r, jnp.zeros_like(x), x)
    return jax.tree.map(one, tree)


def refuse_nonfinite_sync(old, new, figures: dict):
    """A sync whose θ̄ would be non-finite is not applied (inside the sync's program): θ̄, the outer
    state and the detectors stay ``old``'s, and every worker restarts from that θ̄ (the round's
    local steps are dropped; a non-finite worker's inner optimizer state is zeroed as at any sync).
    Without it a rule with no anomaly elimination (DiLoCo, Post Local SGD) averages a worker gone
    NaN into θ̄ and every worker trains from NaN from then on. ``figures["sync_refused"]`` says so.
    The inner optimizer states are the ones from before the step (a layer-wise step's update was
    taken at the non-finite θ̄), the non-finite workers' zeroed (``figures["inner_reset"]``)."""
    ok = all_finite(new.outer_params)

    def keep(a, b):
        return jax.tree.map(lambda x, y: jnp.where(ok, x, y), a, b)
    theta = jax.tree.map(lambda t, p: jnp.broadcast_to(t.astype(p.dtype), p.shape), old.outer_params, new.params)
    figures["sync_refused"] = ~ok
    opt_state = keep(new.opt_state, zero_inexact(old.opt_state, figures["inner_reset"]))
    return new._replace(params=keep(new.params, theta), opt_state=opt_state,
                        outer_params=keep(new.outer_params, old.outer_params),
                        outer_opt_state=keep(new.outer_opt_state, old.outer_opt_state),
                        detector=keep(new.detector, old.detector), extra=keep(new.extra, old.extra)), figures


class NonFiniteWatch:
    """Says, in one line, that a sync was refused because θ̄ would have been non-finite, and which
    workers were non-finite there (``refuse_nonfinite_sync``). The sync's flags are read one call
    later (the next ``step`` or ``sync``), when the program that made them has most likely finished,
    so the watch adds no wait on the device to a sync."""

    def __init__(self, rule_name: str):
        self.rule_name, self.pending = rule_name, None

    def saw(self, k: int, figures: dict) -> None:
        """The sync of step ``k`` made ``figures`` (``inner_reset`` [N], ``sync_refused``)."""
        self.pending = (k, figures["inner_reset"], figures["sync_refused"])

    def check(self) -> None:
        if self.pending is None:
            return
        (k, reset, refused), self.pending = self.pending, None
        if not bool(np.asarray(refused)):
            return
        bad = [int(i) for i in np.flatnonzero(np.asarray(reset))]
        warnings.warn(f"LocalSGD: the sync of step {k} was refused: it would have made the outer params (θ̄) "
                      f"non-finite (worker(s) {bad} had non-finite params or pseudo gradients; rule "
                      f"{self.rule_name!r} keeps every worker in the mean). θ̄ stays as it was and every worker "
                      "restarts from it; lower the learning rate if it happens again.", RuntimeWarning, stacklevel=3)


def base_key(seed):
    """``seed`` as a JAX key (an int, a typed key or a raw uint32[2] key), or None."""
    if seed is None:
        return None
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return jax.random.key(int(seed))
    if isinstance(seed, jax.Array) and (jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) or seed.shape == (2,)):
        return seed
    raise ValueError(f"seed: expected an int or a JAX random key, got {seed!r}")


def check_ys(ys, span=None) -> None:
    """The ys of a forward that synced: every unit's ``UnitSync``, laid out as root and layers;
    with ``span`` (a staggered group's sync) the root's if it is in the group, and the layers' as
    the list of the segments' (``layer_scan.scan_layers``)."""
    if span is not None:
        root_in, lo, hi = span
        layers = ys.get("layers") if isinstance(ys, dict) else None
        if not (isinstance(layers, list) and len(layers) == 3 and (hi == lo or isinstance(layers[1], UnitSync))
                and (not root_in or isinstance(ys.get("root"), UnitSync))):
            raise ValueError("loss_fn: on a staggered group's sync step the forward must pass the root through "
                             "hook(unit, unit_xs, 'root') and run the layers with edit_jax.scan_layers (LayerStack "
                             "and scan_blocks do), returning ys {'root': ..., 'layers': <the segments' list>}; got "
                             f"ys={type(ys).__name__}")
        return
    ok = isinstance(ys, dict) and isinstance(ys.get("root"), UnitSync) and isinstance(ys.get("layers"), UnitSync)
    if not ok:
        raise ValueError("loss_fn: on a sync step the forward must pass every unit through hook(unit, unit_xs, "
                         "which) (the root, then each layer inside its scan) and loss_fn must return the forward's "
                         f"ys laid out {{'root': ..., 'layers': ...}}; got ys={type(ys).__name__} "
                         "(models.family.ScannedModel)")


def per_worker(n: int, batch: Any) -> Any:
    """A global batch [N * B, ...] as the stacked one [N, B, ...]: worker i gets rows [iB, (i+1)B)."""
    def split(x):
        if np.ndim(x) < 1 or np.shape(x)[0] % n:
            raise ValueError(f"batch: a global batch's leading dim must be a multiple of the {n} workers, "
                             f"got shape {np.shape(x)}")
        return x.reshape((n, np.shape(x)[0] // n) + tuple(np.shape(x)[1:]))
    return jax.tree.map(split, batch)


def put_batch(mesh, n: int, batch_axes: tuple, batch: Any) -> Any:
    """A batch stacked per worker [N, B, ...] on ``mesh``: workers over ``replica``, each worker's
    rows over ``batch_axes``; a leaf of another layout is a ValueError naming it."""
    size = math.prod(mesh.shape[a] for a in batch_axes)

    def put(path, x):
        shape = np.shape(x)
        where = jax.tree_util.keystr(path) or "batch"
        if len(shape) < 1 or shape[0] != n:
            raise ValueError(f"batch: {where} must be stacked per worker, [N={n}, ...] (see per_worker), "
                             f"got shape {shape}")
        spec = P(REPLICA)
        if batch_axes and len(shape) >= 2:
            if shape[1] % size:
                raise ValueError(f"batch: {where}'s per-worker batch dim ({shape[1]}) must be divisible by the "
                                 f"mesh's {'x'.join(batch_axes)} size {size}, got shape {shape}")
            spec = P(REPLICA, batch_axes)
        return jax.device_put(x, NamedSharding(mesh, spec))
    return jax.tree_util.tree_map_with_path(put, batch)


__all__ = ["checked_step_output", "stacked_layer_count", "all_finite", "zero_inexact", "refuse_nonfinite_sync",
           "NonFiniteWatch", "base_key", "check_ys", "per_worker", "put_batch"]
