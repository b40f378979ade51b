"""The sync functions of ``sync.py`` called directly, like optax transformations: a state built by
``state.StateLayout`` for a tiny config on a small mesh, the function run under ``jax.shard_map``
over that mesh, and its output against an independent NumPy re-computation. No ``StepPrograms``, no
model forward, no inner step.

- ``sync_whole``: Algorithm 2 of EDIT.md on every unit (test_edit_sync.np_sync: Δ_i = θ̄ − θ_i,
  detector, softmax(−g/T) weights, clip, Nesterov), on 2 x 2 and 3 x 1 meshes, with one worker
  flagged in one unit and the clip active in some units only.
- ``sync_whole`` with one fragment group's span: the group's units as the reference, every other
  unit (params, θ̄, trace, detectors) bit for bit as before.
- The layer-wise sync (``forward_inputs``, ``sync_in_forward`` per unit, ``assemble_forward``) run
  unit by unit as the forward runs it: the same result.
- ``sync_stale`` (CO2): two rounds and a flush against CO2.md's formulas, one round stale.
- ``reset_nonfinite_workers``: a worker with a NaN AdamW moment or a NaN pseudo-gradient norm has
  its moments zeroed; the other workers and the shared step counts are untouched.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from edit_jax.config import CO2Config, OuterConfig
from edit_jax.localsgd import layerwise, stale, sync, whole_model
from edit_jax.localsgd.fragments import fragment_layers, fragment_of_unit
from edit_jax.localsgd.methods import plan_for
from edit_jax.localsgd.outer import Detector, sgd_trace
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.localsgd.state import StateLayout
from edit_jax.runtime.mesh import make_mesh
from test_edit_sync import _assert_det_close, _assert_tree_close, _det_tuple, _host, _ref_of, _replica, _unit, np_sync
from tests.helpers import tiny_config

# EDiT with every part of the penalty doing something: T != 1, a clip that binds on big units.
EDIT_SYNC = {"penalty": {"anomaly_alpha": 0.3, "temperature": 0.5, "clip_threshold": 0.5},
             "outer": OuterConfig(lr=0.7, momentum=0.8)}
K = 3  # tiny_config's anomaly_warmup


def _layout(replica, shard, method, **kw) -> StateLayout:
    cfg = tiny_config(replica, shard, method, batch_size=12, **kw)  # 12: divisible by 2 x 2 and 3 x 1
    return StateLayout(plan_for(cfg), make_mesh(cfg.mesh, jax.devices()[: replica * shard]))


def _put(layout: StateLayout, host):
    return jax.device_put(host, layout.state_shardings)


def _mapped(layout: StateLayout, fn):
    """``fn(params, outer, layout) -> (params, outer, metrics)`` under shard_map over the layout's
    mesh and specs, jitted: ``(state) -> host (params, outer, metrics)``."""
    specs = layout.state_specs
    f = jax.jit(jax.shard_map(lambda p, o: fn(p, o, layout), mesh=layout.mesh, in_specs=(specs.params, specs.outer),
                              out_specs=(specs.params, specs.outer, P())))
    return lambda state: _host(f(state.params, state.outer))


def _whole(p, o, lay, span=None):
    """The whole-model sync as ``_mapped`` wants it: (params, outer, metrics)."""
    return whole_model.sync_whole(p, o, lay.sync_spec, span=span)[:3]


def _n_units(layout) -> int:
    return 1 + layout.cfg.model.n_layers


def _spread_state(layout: StateLayout, seed: int, outlier=(1, 1)):
    """The layout's fresh state with worker i's params of unit u at θ̄ − g[i, u]·d_i (d_i a unit
    direction, random but correlated across workers, so their mean is not small), g = (0.6, 0.9,
    1.2, ...)[i], 20x smaller in unit 1 (so the clip, φ = 0.5, binds on
    the other units only); a random momentum trace (so μ matters); every detector ready (count K)
    and centred on its worker's norm with σ = 0.1 g, except that worker ``outlier[0]``'s norm in
    unit ``outlier[1]`` is 10x its detector's mean (z = 90: flagged, not fed)."""
    rng = np.random.default_rng(seed)
    start = _host(layout.init_state(0))
    theta = start.outer.params
    n, n_units = layout.n, _n_units(layout)
    g = np.array([[(0.6 + 0.3 * i) * (0.05 if u == 1 else 1.0) for u in range(n_units)] for i in range(n)])
    params = jax.tree.map(lambda x: np.array(np.broadcast_to(x, (n,) + x.shape), np.float32), theta)
    common = [[rng.standard_normal(np.shape(t)) for t in _unit(theta, u)] for u in range(n_units)]
    for i in range(n):
        for u in range(n_units):
            scale = g[i, u] * (10.0 if (i, u) == outlier else 1.0)
            views, tb = _unit(_replica(params, i), u), _unit(theta, u)
            r = [c + 0.5 * rng.standard_normal(v.shape) for c, v in zip(common[u], views, strict=True)]
            norm = math.sqrt(sum(float(np.sum(x * x)) for x in r))
            for v, t, x in zip(views, tb, r, strict=True):
                v[...] = (t - scale * x / norm).astype(np.float32)
    det = Detector(g.astype(np.float32), (0.1 * g).astype(np.float32) ** 2, np.full((n, n_units), K, np.int32),
                   rng.uniform(-0.5, 0.5, (n, n_units, K)).astype(np.float32))
    trace = jax.tree.map(lambda x: (0.01 * rng.standard_normal(x.shape)).astype(np.float32), theta)
    return start.replace(params=params, outer=start.outer.with_trace(trace).replace(detector=det))


def _check_units(got_params, got_outer, metrics, start, ref, units, what):
    """The units ``units`` (and the metrics' rows, in that order) against the NumPy reference."""
    theta, trace, det, params, info = ref
    for u in units:
        _assert_tree_close(_unit(got_outer.params, u), _unit(theta, u), f"{what}: θ̄ of unit {u}")
        _assert_tree_close(_unit(got_outer.trace, u), _unit(trace, u), f"{what}: trace of unit {u}")
        for i in range(start.params["root"]["embed"].shape[0]):
            _assert_tree_close(_unit(_replica(got_params, i), u), _unit(theta, u), f"{what}: θ_{i} of unit {u}")
    got_det = jax.tree.map(lambda x: np.asarray(x)[:, units], got_outer.detector)
    _assert_det_close(got_det, tuple(x[:, units] for x in det), f"{what}: detector")
    np.testing.assert_array_equal(metrics["unit_flagged"], info["flagged"][units], err_msg=f"{what}: flags")
    np.testing.assert_array_equal(metrics["flagged"], info["flagged"][units].sum(0), err_msg=f"{what}: flags")
    np.testing.assert_allclose(metrics["unit_weight"], info["w"][units], atol=1e-5, err_msg=f"{what}: weights")
    np.testing.assert_allclose(metrics["unit_pseudo_grad_norm"], info["g"][units], rtol=1e-5, err_msg=f"{what}: g")
    np.testing.assert_allclose(metrics["pseudo_grad_norm"], np.sqrt(np.sum(info["g"][units] ** 2, axis=0)),
                               rtol=1e-5, err_msg=f"{what}: whole-model g")
    np.testing.assert_allclose(metrics["unit_clip_factor"], info["clip"][units], rtol=1e-5, err_msg=f"{what}: clip")
    update = math.sqrt(sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2)) for u in units
                           for a, b in zip(_unit(theta, u), _unit(start.outer.params, u), strict=True)))
    np.testing.assert_allclose(metrics["outer_update_norm"], update, rtol=1e-4, err_msg=f"{what}: update norm")


# ============================================================================= whole model


@pytest.mark.parametrize("replica,shard", [(2, 2), (3, 1)])
def test_sync_whole_matches_numpy(replica, shard):
    layout = _layout(replica, shard, "edit", sync=EDIT_SYNC)
    start = _spread_state(layout, seed=replica)
    ref = np_sync(start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector),
                  _ref_of(layout.cfg))
    info = ref[-1]
    # The state does what _spread_state says (checked on the reference itself).
    want_flags = np.zeros((_n_units(layout), replica), bool)
    want_flags[1, 1] = True
    np.testing.assert_array_equal(info["flagged"], want_flags)
    assert info["clip"][0] < 1 and info["clip"][1] == 1.0 and not info["skipped"].any()

    params, outer, metrics = _mapped(layout, _whole)(_put(layout, start))
    units = list(range(_n_units(layout)))
    _check_units(params, outer, metrics, start, ref, units, f"{replica} x {shard}")
    assert int(outer.syncs) == int(start.outer.syncs) + 1
    np.testing.assert_allclose(metrics["clip_factor"], info["clip"].min(), rtol=1e-5)
    for i in range(replica):  # every worker restarts from θ̄, exactly
        for a, b in zip(jax.tree.leaves(_replica(params, i)), jax.tree.leaves(outer.params), strict=True):
            np.testing.assert_array_equal(a, b)


# ============================================================================= one fragment group


@pytest.mark.parametrize("group", [0, 1])
def test_sync_whole_of_one_group_leaves_the_other_units_alone(group):
    """3 layers, F = 2: groups {root, L0} {L1, L2}. The group's units as the whole-model reference;
    every other unit's params, θ̄, trace and detectors bit for bit as they were; the sync count
    goes up with group 0 (the one with the root) only."""
    layout = _layout(2, 2, "edit", sync={**EDIT_SYNC, "fragments": 2}, model={"n_layers": 3})
    groups = fragment_of_unit(layout.cfg)
    assert groups == (0, 0, 1, 1)
    units = [u for u, g in enumerate(groups) if g == group]
    others = [u for u in range(_n_units(layout)) if u not in units]
    start = _spread_state(layout, seed=5, outlier=(1, 2 * group + 1))  # an outlier inside the group
    ref = np_sync(start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector),
                  _ref_of(layout.cfg))
    assert ref[-1]["flagged"][units].sum() == 1

    span = fragment_layers(groups, group)
    params, outer, metrics = _mapped(layout, lambda p, o, lay: _whole(p, o, lay, span=span))(
        _put(layout, start))
    _check_units(params, outer, metrics, start, ref, units, f"group {group}")
    assert metrics["unit_pseudo_grad_norm"].shape == (len(units), 2)
    for u in others:
        for got, was in ([(_unit(_replica(params, i), u), _unit(_replica(start.params, i), u)) for i in range(2)]
                         + [(_unit(outer.params, u), _unit(start.outer.params, u)),
                            (_unit(outer.trace, u), _unit(start.outer.trace, u))]):
            for a, b in zip(got, was, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"unit {u} outside group {group}")
    for a, b in zip(jax.tree.leaves(outer.detector), jax.tree.leaves(start.outer.detector), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[:, others], np.asarray(b)[:, others])
    assert int(outer.syncs) == int(start.outer.syncs) + (1 if group == 0 else 0)


# ============================================================================= layer-wise, as the forward runs it


def _as_in_forward(params, outer, layout):
    """The layer-wise sync the way ``family.forward`` drives the hook: the root, then a scan over
    the layers, each unit through ``sync_in_forward``; then ``assemble_forward``. (The forward would
    also gather each returned unit over ``shard``; nothing of the sync depends on it.)"""
    spec = layout.sync_spec
    hook_xs, segments = layerwise.forward_inputs(outer, spec)
    assert segments is None
    local = jax.tree.map(lambda x: x[0], params)
    _, root = layerwise.sync_in_forward(local["root"], hook_xs["root"], "root", spec)
    _, layers = jax.lax.scan(lambda c, x: (c, layerwise.sync_in_forward(x[0], x[1], "layer", spec)[1]), None,
                             (local["layers"], hook_xs["layers"]))
    return layerwise.assemble_forward(params, outer, {"root": root, "layers": layers})[:3]


def test_layerwise_sync_matches_numpy_and_the_whole_sync():
    layout = _layout(2, 2, "edit", sync=EDIT_SYNC)
    start = _spread_state(layout, seed=11)
    ref = np_sync(start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector),
                  _ref_of(layout.cfg))
    params, outer, metrics = _mapped(layout, _as_in_forward)(_put(layout, start))
    _check_units(params, outer, metrics, start, ref, list(range(_n_units(layout))), "layer-wise")
    w_params, w_outer, w_metrics = _mapped(layout, _whole)(_put(layout, start))
    _assert_tree_close((params, outer.params, outer.trace), (w_params, w_outer.params, w_outer.trace),
                       "layer-wise vs whole", rtol=1e-6, atol=1e-7)
    for k in sync.SYNC_METRICS[:-1]:  # all but inner_reset (the step's, after the sync)
        np.testing.assert_allclose(metrics[k], w_metrics[k], rtol=1e-6, err_msg=k)


# ============================================================================= CO2


CO2_SYNC = {"co2": CO2Config(momentum_clip=0.01, gap_penalty=2.0), "outer": OuterConfig(lr=0.7, momentum=0.5)}


def test_sync_stale_is_one_round_stale():
    """Two CO2 syncs and a flush against CO2.md section 1 (NumPy, float64): at round t's sync
    Δ_{t−1} = mean_i pending_i (what the workers sent at the previous sync), m ← clip(β m + Δ/Λ,
    −φ, φ) element-wise and stored, a_{t+1} = a_t − α m; each worker's new pending is a_t − x^i_t
    and it restarts from a_{t+1}. The second sync applies the first sync's pendings, not its own
    round's; the flush applies the pending and keeps it."""
    layout = _layout(2, 2, "co2", sync=CO2_SYNC)
    alpha, beta = CO2_SYNC["outer"].lr, CO2_SYNC["outer"].momentum
    lam, phi = CO2_SYNC["co2"].gap_penalty, CO2_SYNC["co2"].momentum_clip
    rng = np.random.default_rng(2)
    start = _host(layout.init_state(0))

    def noise(tree, s):
        return jax.tree.map(lambda x: (s * rng.standard_normal(x.shape)).astype(np.float32), tree)

    trace = noise(start.outer.params, 0.01)
    state = start.replace(params=jax.tree.map(lambda p, d: p - d, start.params, noise(start.params, 0.01)),
                          outer=start.outer.with_trace(trace).replace(
                              extra={"pending": noise(start.outer.extra["pending"], 0.01)}))
    f64 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)
    run = _mapped(layout, lambda p, o, lay: stale.sync_stale(p, o, lay.sync_spec, layout.rule.gap_penalty))
    flush = _mapped(layout, lambda p, o, lay: stale.sync_stale(p, o, lay.sync_spec, layout.rule.gap_penalty, True))

    def expected(st):
        a, x, pend = f64(st.outer.params), f64(st.params), f64(st.outer.extra["pending"])
        m_old = f64({u: sgd_trace(st.outer.opt_state[u]) for u in ("root", "layers")})
        raw = jax.tree.map(lambda mo, p: beta * mo + p.mean(0) / lam, m_old, pend)
        m = jax.tree.map(lambda r: np.clip(r, -phi, phi), raw)
        return jax.tree.map(lambda a, m: a - alpha * m, a, m), m, raw, jax.tree.map(lambda a, x: a[None] - x, a, x)

    clamped, free = 0, 0
    for rnd in range(2):
        a_next, m, raw, pend_next = expected(state)
        params, outer, metrics = run(_put(layout, state))
        what = f"round {rnd}"
        _assert_tree_close(outer.params, a_next, f"{what}: anchor", rtol=2e-5, atol=2e-7)
        _assert_tree_close(outer.trace, m, f"{what}: momentum", rtol=2e-5, atol=2e-7)
        _assert_tree_close(outer.extra["pending"], pend_next, f"{what}: pending", rtol=2e-5, atol=2e-7)
        _assert_tree_close(params, jax.tree.map(lambda a: np.broadcast_to(a, (2,) + a.shape), a_next),
                           f"{what}: every worker restarts from a_(t+1)", rtol=2e-5, atol=2e-7)
        assert int(outer.syncs) == int(state.outer.syncs) + 1
        sent = [math.sqrt(sum(float(np.sum(np.square(p[i], dtype=np.float64))) for p in jax.tree.leaves(
            state.outer.extra["pending"]))) for i in range(2)]
        np.testing.assert_allclose(metrics["pseudo_grad_norm"], sent, rtol=1e-5, err_msg=what)
        np.testing.assert_allclose(metrics["unit_weight"], 0.5)
        assert not metrics["unit_flagged"].any() and not metrics["inner_reset"].any()
        clip = [math.sqrt(sum(float(np.sum(np.square(x))) for x in _unit(m, u))) /
                math.sqrt(sum(float(np.sum(np.square(x))) for x in _unit(raw, u))) for u in range(_n_units(layout))]
        np.testing.assert_allclose(metrics["unit_clip_factor"], clip, rtol=1e-4, err_msg=what)
        clamped += sum(int(np.sum(np.abs(r) > phi)) for r in jax.tree.leaves(raw))
        free += sum(int(np.sum(np.abs(r) < phi)) for r in jax.tree.leaves(raw))
        if rnd == 0:  # the flush: the same update, the pending kept as it was
            f_params, f_outer, _ = flush(_put(layout, state))
            _assert_tree_close(f_outer.params, a_next, "flush: anchor", rtol=2e-5, atol=2e-7)
            for a, b in zip(jax.tree.leaves(f_outer.extra["pending"]), jax.tree.leaves(state.outer.extra["pending"]),
                            strict=True):
                np.testing.assert_array_equal(a, b)
        # The next round: the workers step away from a_(t+1) (new local params x^i_(t+1)).
        state = state.replace(params=jax.tree.map(lambda p, d: p - d, params, noise(params, 0.01)), outer=outer)
    assert clamped > 0 and free > 0, "the clamp should bind on some elements and not on others"


# ============================================================================= the non-finite reset


def test_reset_nonfinite_workers_zeroes_only_the_bad_workers_moments():
    """3 workers: worker 1 has one NaN in an AdamW moment, worker 2 a NaN pseudo-gradient norm in
    one unit, worker 0 is healthy. Workers 1 and 2 get every per-worker float leaf zeroed; worker 0's
    leaves and the shared step counts stay bit for bit; nothing is reset when all are finite."""
    layout = _layout(3, 1, "edit")
    specs = layout.state_specs.opt_state
    rng = np.random.default_rng(4)
    is_spec = lambda x: isinstance(x, P)
    per_worker = lambda spec, x: bool(spec) and spec[0] == REPLICA and np.issubdtype(x.dtype, np.floating)
    clean = jax.tree.map(lambda spec, x: rng.standard_normal(x.shape).astype(x.dtype) if per_worker(spec, x) else x,
                         specs, _host(layout.init_state(0).opt_state), is_leaf=is_spec)
    moments = [x for spec, x in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(clean), strict=True)
               if per_worker(spec, x)]
    assert len(moments) >= 2, "expected AdamW's mu and nu"
    bad_opt = jax.tree.map(np.array, clean)
    poisoned = [x for spec, x in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(bad_opt), strict=True)
                if per_worker(spec, x)][-1]
    poisoned.reshape(3, -1)[1, 7] = np.nan
    norms = rng.uniform(0.5, 1.5, (_n_units(layout), 3)).astype(np.float32)
    bad_norms = norms.copy()
    bad_norms[2, 2] = np.nan

    f = jax.jit(jax.shard_map(lambda o, g: sync.reset_nonfinite_workers(o, {"unit_pseudo_grad_norm": g},
                                                                        layout.state_specs.opt_state),
                              mesh=layout.mesh, in_specs=(specs, P()), out_specs=(specs, P())))
    put = lambda o: jax.device_put(o, layout.state_shardings.opt_state)
    out, reset = _host(f(put(bad_opt), bad_norms))
    np.testing.assert_array_equal(reset, [False, True, True])
    for spec, got, was in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(out), jax.tree.leaves(bad_opt),
                              strict=True):
        if per_worker(spec, was):
            np.testing.assert_array_equal(got[0], was[0])
            assert np.all(got[1:] == 0)
        else:  # the shared counts (learning-rate schedule, bias correction) go on
            np.testing.assert_array_equal(got, was)
    out, reset = _host(f(put(clean), norms))
    assert not reset.any()
    for got, was in zip(jax.tree.leaves(out), jax.tree.leaves(clean), strict=True):
        np.testing.assert_array_equal(got, was)
