"""The sync of one unit (EDIT.md, Algorithm 2): pseudo gradient, penalty, outer Nesterov step.

Everything here runs per device under ``shard_map`` on the device's FSDP block of one unit, with
collectives over the named axes: ``psum`` over ``shard`` turns a block's squared norm into the norm
of the worker's whole unit, and reductions over ``replica`` combine workers. The same function
serves the layer-wise sync inside the forward (one unit per call, EDiT) and the whole-model sync
after the step (DiLoCo, Post Local SGD: called on every unit).

Anomaly detector (one per worker and unit), worked example in EDIT.md:
  flagged  = not finite(g) or (count >= K and (g - mu)/sigma > delta * max(1, std(window)))
  if not flagged: mu += a*d; M2 = (1-a)(M2 + a*d*d2); count += 1; window <- z (0 while count < K)
The test's z uses the statistics before the update; the z appended to the window uses those after.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from edit_jax.localsgd.codec import NONE, Codec
from edit_jax.localsgd.quantize import compressed_weighted_sum, stacked_compressed_sum
from edit_jax.localsgd.outer_spec import Penalty  # the static switches, part of a method's plan (re-exported here)
from edit_jax.localsgd.reduction import Reduction, ReplicaPsum
from edit_jax.localsgd.sharding import REPLICA, SHARD, replica_gather, shard_sq_norm


@struct.dataclass
class Detector:
    """EWMA z-test state. Leading dims are free (e.g. [N, U] globally, [U] or [] locally)."""

    mean: jax.Array
    m2: jax.Array
    count: jax.Array  # int32: syncs fed (outliers are not fed)
    window: jax.Array  # [..., K] last K z-scores, oldest first

    @staticmethod
    def zeros(shape: tuple[int, ...], window: int) -> "Detector":
        return Detector(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                        jnp.zeros(shape, jnp.int32), jnp.zeros(shape + (window,), jnp.float32))


def outer_optimizer(lr: float, momentum: float, nesterov: bool = True) -> optax.GradientTransformation:
    """Outer optimizer: SGD with (Nesterov) momentum on the pseudo gradient. With lr 1 and
    momentum 0 it sets θ̄ to the (weighted) mean of the workers: Post Local SGD."""
    return optax.sgd(lr, momentum=momentum, nesterov=nesterov)


def clipped_momentum(momentum: float, clip: float) -> optax.GradientTransformation:
    """Heavy-ball momentum whose *stored* buffer is clamped element-wise: m <- clip(b m + g, -phi,
    phi), update m (CO2's outer momentum clipping, CO2.md section 1). ``optax.chain(trace, clip)``
    would clip only the update and keep the unclipped buffer; the released CO2 code meant to clip
    the buffer but its ``torch.clamp`` result is discarded (a no-op), so we clip as intended."""

    def init(params):
        return optax.TraceState(trace=jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del params
        m = jax.tree.map(lambda g, t: jnp.clip(g + momentum * t, -clip, clip), updates, state.trace)
        return m, optax.TraceState(trace=m)

    return optax.GradientTransformation(init, update)


def make_outer_optimizer(spec) -> optax.GradientTransformation:
    """The outer transformation of an ``outer_spec.OuterSpec``. Any optax transformation works here:
    the pseudo gradient plays the gradient, and its state is kept per unit (``state.py``)."""
    if spec.name == "nesterov" and spec.momentum_clip > 0:
        if spec.nesterov:
            raise ValueError("outer momentum clipping is built for heavy-ball momentum (nesterov=False)")
        return optax.chain(clipped_momentum(spec.momentum, spec.momentum_clip), optax.scale(-spec.lr))
    if spec.name == "nesterov":
        return outer_optimizer(spec.lr, spec.momentum, spec.nesterov)
    if spec.name == "adam":
        return optax.adam(spec.lr, b1=spec.momentum, b2=spec.b2, eps=1e-8)
    raise ValueError(f"unknown outer optimizer {spec.name!r}")


def sgd_trace(opt_state: Any) -> Any:
    """The momentum buffer of an SGD outer state (``optax.sgd``'s TraceState.trace)."""
    return optax.tree_utils.tree_get(opt_state, "trace")


def with_sgd_trace(opt_state: Any, trace: Any) -> Any:
    """``opt_state`` with its SGD momentum buffer replaced by ``trace``."""
    return optax.tree_utils.tree_set(opt_state, trace=trace)


# ----------------------------------------------------------------------------- the detector


def detector_test(det: Detector, g: jax.Array, p: Penalty) -> jax.Array:
    """True where ``g`` is an anomaly (non-finite, or a one-sided z-test once K syncs were seen)."""
    sigma = jnp.sqrt(det.m2)
    z = (g - det.mean) / jnp.where(sigma > 0, sigma, 1.0)
    # σ = 0 (every norm fed so far equal, e.g. a unit whose pseudo gradients were all zero) is no
    # evidence: z = 0, as the reference does. z = +inf here used to flag every later positive norm,
    # which is then never fed, so σ stayed 0 and that unit's outer step was skipped forever.
    z = jnp.where(sigma > 0, z, 0.0)
    k = det.window.shape[-1]
    win_std = jnp.sqrt(jnp.sum(jnp.square(det.window - det.window.mean(-1, keepdims=True)), -1) / (k - 1))
    ready = det.count >= p.warmup
    return ~jnp.isfinite(g) | (ready & (z > p.threshold * jnp.maximum(1.0, win_std)))


def detector_feed(det: Detector, g: jax.Array, p: Penalty) -> Detector:
    """The detector after seeing the (non-anomalous) norm ``g``."""
    d = g - det.mean
    mean = det.mean + p.alpha * d
    d2 = g - mean
    m2 = (1.0 - p.alpha) * (det.m2 + p.alpha * d * d2)
    count = det.count + 1
    sigma = jnp.sqrt(m2)
    z = jnp.where((count >= p.warmup) & (sigma > 0), d2 / jnp.where(sigma > 0, sigma, 1.0), 0.0)
    window = jnp.concatenate([det.window[..., 1:], z[..., None]], axis=-1)
    return Detector(mean, m2, count, window)


def detector_step(det: Detector, g: jax.Array, p: Penalty) -> tuple[Detector, jax.Array]:
    """Tests ``g``; feeds it only when it is not flagged (the reference feeds g + 1e6 by mistake,
    blinding the detector for hundreds of syncs; we leave the detector untouched instead)."""
    flagged = detector_test(det, g, p) if p.anomaly else jnp.zeros_like(g, dtype=bool)
    fed = detector_feed(det, jnp.where(flagged, det.mean, g), p)
    new = jax.tree.map(lambda a, b: jnp.where(flagged[..., None] if a.ndim > flagged.ndim else flagged, a, b), det, fed)
    return new, flagged


# ----------------------------------------------------------------------------- weights


def softmax_weights(g_all: jax.Array, flagged_all: jax.Array, p: Penalty) -> jax.Array:
    """Every worker's weight from every worker's norm ``[N]``: softmax of -g/T over the
    non-flagged workers, or their plain mean; all zero if every worker is flagged."""
    ok = ~flagged_all
    if p.weighting:
        logit = jnp.where(ok, -g_all / p.temperature, -jnp.inf)
        top = jnp.max(logit)
        e = jnp.where(ok, jnp.exp(logit - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    else:
        e = ok.astype(jnp.float32)
    total = jnp.sum(e)
    return jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0)


def mix_step_weights(w_all: jax.Array, shares: jax.Array | None, flagged_all: jax.Array, p: Penalty) -> jax.Array:
    """A-EDiT's step weights: w <- (1 - rho) w + rho s, where s is each worker's share of the steps
    since the last sync, renormalised over the workers not flagged (a flagged worker keeps weight 0,
    and the weights still sum to 1, or are all 0 when every worker is flagged). Without shares
    (every step-based method) the weights are unchanged."""
    if shares is None or p.step_weight_ratio == 0.0:
        return w_all
    s = jnp.where(flagged_all, 0.0, shares.astype(jnp.float32))
    total = jnp.sum(s)
    s = jnp.where(total > 0, s / jnp.where(total > 0, total, 1.0), 0.0)
    return (1.0 - p.step_weight_ratio) * w_all + p.step_weight_ratio * s


def worker_weights(g: jax.Array, flagged: jax.Array, p: Penalty) -> jax.Array:
    """This worker's weight (under ``shard_map``), from its own norm and flag."""
    w_all = softmax_weights(replica_gather(g), replica_gather(flagged) > 0.5, p)
    return w_all[jax.lax.axis_index(REPLICA)]


# ----------------------------------------------------------------------------- one unit


@struct.dataclass
class UnitSync:
    """Result of syncing one unit on one device."""

    params: Any  # θ̄ after the outer step: the worker's new local params (its block)
    outer_params: Any
    opt_state: Any  # the unit's outer optimizer state after the step
    detector: Detector
    metrics: dict
    residual: Any = None  # this worker's error-feedback residual of the unit (sync.wire.error_feedback), else None


def sync_unit(local: Any, outer_params: Any, opt_state: Any, det: Detector, p: Penalty,
              opt: optax.GradientTransformation, replica_dims: Any = None, shares: jax.Array | None = None,
              codec: Codec = NONE, residual: Any = None, reduction: Reduction | None = None) -> UnitSync:
    """Algorithm 2 for one unit. ``local`` and ``outer_params`` are this device's FSDP blocks of
    the unit, ``opt_state`` the unit's outer optimizer state (param-shaped leaves as blocks too);
    ``det`` is this worker's detector for the unit (scalars).

    ``reduction`` (``reduction.py``) is how the workers meet: ``ReplicaPsum()`` (the default) runs
    per worker under ``shard_map`` with collectives over ``replica``; ``Stacked()`` takes every
    worker's ``local`` and ``det`` (and ``residual``) stacked on a leading axis [N] in one program
    and returns the workers' values (params, detector, residual, per-worker metrics) stacked the
    same way. The penalty and the outer step are the same code either way.

    With ``replica_dims`` (the FSDP dim of each leaf), θ̄ and the outer state are sharded over
    ``replica`` too (each device holds 1/N of its shard block): see ``_sync_unit_over_replica``.
    ``shares`` ([N], A-EDiT): each worker's share of the steps since the last sync.

    With a lossy ``codec`` (codec.py: bf16, int8, topk2, topk4) the pseudo gradients cross ``replica``
    in that form (quantize.py, sparse.py); their norms, flags and weights are computed before, in
    float32. ``residual`` (this worker's block of the unit) turns on error feedback; a flagged
    worker's residual is reset.
    """
    if replica_dims is not None:
        return _sync_unit_over_replica(local, outer_params, opt_state, det, p, opt, replica_dims, shares)
    red = ReplicaPsum() if reduction is None else reduction

    def worker(local, det):
        # 1. pseudo gradient (old minus new, float32) and 2. the norm of this worker's whole unit.
        delta, g = red.pseudo_gradient(outer_params, local)
        # 3. anomaly elimination (the norm is identical on all of the worker's shards, so are flags).
        det, flagged = detector_step(det, g, p)
        delta = jax.tree.map(lambda d: jnp.where(flagged, 0.0, d), delta)  # where: NaN * 0 is NaN
        return delta, g, det, flagged

    delta, g, det, flagged = red.per_worker(worker, local, det)
    # 4. weighted average over workers (every worker's norm and flag: a few scalars over `replica`).
    g_all, flags = red.gather(g), red.gather_flags(flagged)
    w_all = mix_step_weights(softmax_weights(g_all, flags, p), shares, flags, p)
    new_residual, stored = None, residual
    if codec.kind == "none":
        avg = red.weighted_sum(w_all, delta)
    else:
        if residual is not None:
            residual = red.per_worker(
                lambda e, f: jax.tree.map(lambda x: jnp.where(f, 0.0, x.astype(jnp.float32)), e), residual, flagged)
        if red.stacked:
            avg, new_residual = stacked_compressed_sum(delta, w_all, codec, residual)
        else:
            avg, new_residual = compressed_weighted_sum(delta, w_all, codec, residual)
        if new_residual is not None:  # stored as it came (sync.wire.residual_dtype), computed in float32
            new_residual = jax.tree.map(lambda n, e: n.astype(e.dtype), new_residual, stored)
    # 5.-6. clip, outer step.
    new_outer, new_opt_state, clip, avg_norm, update_norm = outer_step(avg, outer_params, opt_state,
                                                                        jnp.sum(w_all) > 0, p, opt, red.sq_norm)
    metrics = {
        "pseudo_grad_norm": g_all,  # [N]: every worker's norm of this unit
        "weight": w_all,
        "flagged": flags,
        "avg_norm": avg_norm,
        "clip_factor": clip,
        "update_norm": update_norm,
    }
    # 7. every worker restarts from θ̄ (a flagged worker loses its local progress).
    params = new_outer
    if red.stacked:
        params = jax.tree.map(lambda o: jnp.broadcast_to(o, (g_all.shape[0],) + o.shape), new_outer)
    return UnitSync(params, new_outer, new_opt_state, det, metrics, new_residual)


def outer_step(avg, outer_params, opt_state, any_ok, p: Penalty, opt, norm_axes):
    """Steps 5-6: clip the averaged pseudo gradient over the whole unit, then the optax outer step,
    skipped (a rollback of the window: θ̄ and the optimizer state kept) when every worker was
    flagged. ``norm_axes``: the mesh axes a unit's blocks are split over, or a function giving
    a tree's squared norm (a reduction's ``sq_norm``)."""
    sq = norm_axes if callable(norm_axes) else (lambda t: shard_sq_norm(t, norm_axes))
    avg_norm = jnp.sqrt(sq(avg))
    clip = jnp.minimum(1.0, p.clip_threshold / (avg_norm + 1e-6)) if p.clip else jnp.ones_like(avg_norm)
    avg = jax.tree.map(lambda d: d * clip, avg)
    updates, stepped = opt.update(avg, opt_state, outer_params)
    new_outer = jax.tree.map(lambda o, u: jnp.where(any_ok, o + u, o), outer_params, updates)
    new_opt_state = jax.tree.map(lambda old, new: jnp.where(any_ok, new, old), opt_state, stepped)
    update_norm = jnp.sqrt(sq(jax.tree.map(lambda a, b: a - b, new_outer, outer_params)))
    return new_outer, new_opt_state, clip, avg_norm, update_norm


# ----------------------------------------------------------------------------- CO2


def staleness_gap_penalty(avg: Any, lam: float) -> jax.Array:
    """CO2's staleness-gap penalty Lambda_t (the stale mean pseudo gradient is divided by it).

    The hook for an adaptive rule: CO2.md could not recover the paper's formula, and the released
    code uses one constant (``sync.co2.gap_penalty``, default 1), which is what this returns. A rule
    computed from ``avg`` (the unit's stale mean pseudo gradient, this device's block) must return
    a scalar or a pytree like ``avg`` and use only collectives over ``shard`` (the unit's norm, say:
    ``shard_sq_norm``), so the exchange stays independent of the current round."""
    del avg
    return jnp.float32(lam)


def stale_outer_step(pending_sum: Any, n_workers: int, local: Any, outer_params: Any, opt_state: Any,
                     opt: optax.GradientTransformation, lam: float):
    """CO2's outer update of one unit (CO2.md section 1, step 3), on this device's blocks.

    ``pending_sum`` is the sum over the ``n_workers`` workers of the pseudo gradients
    a_{t-1} - x^i_{t-1} of the previous round (all-reduced by the caller, independently of this
    round's steps); its mean is Delta_{t-1} = a_{t-1} - xbar_{t-1}. All-reducing a - x^i rather
    than the parameters gives the same mean with one buffer fewer (CO2.md section 4). Returns
    (a_{t+1}, the optimizer state, this worker's new pending a_t - x^i_t, the step's input
    Delta_{t-1} / Lambda_t)."""
    local = jax.tree.map(lambda x: x.astype(jnp.float32), local)
    avg = jax.tree.map(lambda x: x / n_workers, pending_sum)
    lam = staleness_gap_penalty(avg, lam)
    g = jax.tree.map(lambda d: d / lam, avg)
    updates, new_opt_state = opt.update(g, opt_state, outer_params)
    new_outer = jax.tree.map(lambda o, u: o + u, outer_params, updates)
    new_pending = jax.tree.map(lambda o, x: o - x, outer_params, local)  # a_t - x^i_t, sent next round
    return new_outer, new_opt_state, new_pending, g


def _sync_unit_over_replica(local, outer_chunk, opt_chunk, det: Detector, p: Penalty, opt, dims,
                            shares=None) -> UnitSync:
    """Algorithm 2 with θ̄ and the trace split over ``replica`` as well as ``shard``.

    Device (r, s) holds chunk r (of N) of shard block s of θ̄ (and of the outer state's
    param-shaped leaves). An all-to-all over ``replica``
    gives it chunk r of every worker's block s, so it can form every worker's pseudo gradient on
    its chunk, their weighted sum, and the outer step of its chunk without holding θ̄ whole; an
    all-gather over ``replica`` then hands every worker the new θ̄ block. Bytes per device:
    (N-1)/N + (N-1)/N of a block, the same as one all-reduce (EDIT.md), for N times less outer
    memory. Norms are sums over all devices' chunks (psum over both axes).
    """
    n, r = jax.lax.axis_size(REPLICA), jax.lax.axis_index(REPLICA)

    def exchange(x, d):  # [.., D, ..] -> [N, .., D/N, ..]: worker i's chunk r of this block
        x = x.astype(jnp.float32)
        parts = x.reshape(x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1:])
        return jax.lax.all_to_all(parts, REPLICA, split_axis=d, concat_axis=0)

    workers = jax.tree.map(exchange, local, dims)
    delta = jax.tree.map(lambda o, x: o[None] - x, outer_chunk, workers)  # [N, chunk]: every worker's Δ_i
    per_worker_sq = sum(jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(delta))
    g_all = jnp.sqrt(jax.lax.psum(per_worker_sq, (SHARD, REPLICA)))  # [N] on every device
    det, flagged = detector_step(det, g_all[r], p)  # this worker's detector, on its own norm
    flags = replica_gather(flagged) > 0.5  # [N]
    w_all = mix_step_weights(softmax_weights(g_all, flags, p), shares, flags, p)
    bcast = lambda v, x: v.reshape((n,) + (1,) * (x.ndim - 1))
    avg = jax.tree.map(lambda d: jnp.sum(bcast(w_all, d) * jnp.where(bcast(flags, d), 0.0, d), axis=0), delta)
    new_outer, new_opt_state, clip, avg_norm, update_norm = outer_step(avg, outer_chunk, opt_chunk,
                                                                        jnp.sum(w_all) > 0, p, opt, (SHARD, REPLICA))
    new_local = jax.tree.map(lambda o, d: jax.lax.all_gather(o, REPLICA, axis=d, tiled=True), new_outer, dims)
    metrics = {"pseudo_grad_norm": g_all, "weight": w_all, "flagged": flags, "avg_norm": avg_norm,
               "clip_factor": clip, "update_norm": update_norm}
    return UnitSync(new_local, new_outer, new_opt_state, det, metrics)


__all__ = ["Detector", "Penalty", "UnitSync", "sync_unit", "detector_step", "detector_test", "detector_feed",
           "worker_weights", "softmax_weights", "mix_step_weights", "outer_optimizer", "make_outer_optimizer",
           "sgd_trace", "clipped_momentum", "staleness_gap_penalty", "stale_outer_step",
           "with_sgd_trace", "outer_step"]
