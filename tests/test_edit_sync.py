"""The sync machinery against independent references (issue 3, item 8).

- A NumPy implementation of Algorithm 2 (EDIT.md), written from the design page, not from
  ``outer.py``: per unit Δ_i = θ̄ − θ_i, g_i = ‖Δ_i‖, detector z-test and feed, softmax(−g/T) over
  the non-flagged workers, clip min(1, φ/(‖Δ‖ + 1e-6)), Nesterov b ← μb + Δ, θ̄ ← θ̄ − η(Δ + μb),
  skip when every worker is flagged. Checked against EDIT.md's worked numbers first.
- The layer-wise sync (step kind ``sync_forward``) and the whole-model sync (``sync_fn``) against it.
- Degenerate configurations against other methods: N = 1 EDiT == AdamW; Post Local SGD == mean;
  DiLoCo == EDiT with the penalty off.
- A poisoned (NaN) replica is excluded and training goes on.
- HLO: the local step has no collective across replicas; the HSDP warmup step has.
- The step-kind schedule.

HLO replica_groups ids, established by experiment (test_hlo_replica_group_ids_are_mesh_positions):
in these SPMD-partitioned programs the ids are *partition ids*, i.e. positions in the mesh's
flattened device order (``mesh.devices.flat``), not ``device.id``. The mesh used here is built
from devices 8..15 in a permuted order, so the two readings cannot be confused.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from edit_jax.config import MeshConfig
from edit_jax.localsgd.optim import lr_schedule
from edit_jax.localsgd.outer import (Detector, Penalty, detector_step, detector_test, outer_optimizer, sgd_trace,
                             sync_unit, with_sgd_trace, worker_weights)
from edit_jax.localsgd.methods import plan_for
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.runtime.mesh import make_mesh
from edit_jax.analysis import hlo
from edit_jax.validate import load_config
from tests.stages import one_stage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.py")
N4, S2 = 4, 2
K = 3  # anomaly_warmup (K) everywhere in this file
# Small and fast: 3 layers (U = 4 units), 16 tokens of context, one sequence per device.
BASE = ["data.seq_len=16", "batch_size=8", "steps=30", "model.n_layers=3", f"sync.penalty.anomaly_warmup={K}",
        "sync.warmup_steps=0"]
BASE4 = BASE + [f"mesh.replica={N4}", f"mesh.shard={S2}"]
# A permuted mesh on devices 8..15, so that device ids, mesh positions and replicas all differ.
PERM = [5, 2, 7, 0, 3, 6, 1, 4]


# ============================================================================= helpers


def _cfg(*overrides):
    return load_config(TINY, list(overrides))


def _batch(seed: int, cfg) -> np.ndarray:
    rng = np.random.default_rng(1000 + seed)
    return rng.integers(0, cfg.model.vocab_size, (cfg.batch_size, cfg.data.seq_len + 1)).astype(np.int32)


def _put(m: StepPrograms, host_state):
    """A fresh device copy of a host state (steps donate their input)."""
    return jax.device_put(host_state, m.state_shardings)


def _host(x):
    return jax.device_get(x)


def _f64(tree):
    return jax.tree.map(lambda x: np.array(x, dtype=np.float64), tree)


def _replica(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def _unit(tree, u):
    """The leaves of unit u (0: root, 1 + l: layer l) as views (writable when ``tree`` is)."""
    if u == 0:
        return jax.tree.leaves(tree["root"])
    return [x[u - 1] for x in jax.tree.leaves(tree["layers"])]


def _assert_tree_close(got, want, what, rtol=1e-5, atol=1e-6):
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    for path, g, w in zip(paths, gl, wl, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol,
                                   err_msg=f"{what}{path}")


# ============================================================================= NumPy reference


@dataclass
class Ref:
    """Constants of Algorithm 2 (EDIT.md)."""

    anomaly: bool = True
    alpha: float = 0.02
    k: int = K
    delta: float = 3.0
    weighting: bool = True
    temperature: float = 1.0
    clip: bool = True
    phi: float = 10.0
    lr: float = 0.8
    mu: float = 0.85


def np_detector_flags(mean, m2, count, window, g, r: Ref) -> bool:
    """Flagged: g non-finite, or (K syncs seen and one-sided z = (g − μ)/σ > δ·max(1, std(window)))."""
    if not math.isfinite(g):
        return True
    if count < r.k:
        return False
    z = (g - mean) / math.sqrt(m2) if m2 > 0 else 0.0  # σ = 0 is no evidence (as the reference)
    return z > r.delta * max(1.0, float(np.std(window, ddof=1)))


def np_detector_feed(mean, m2, count, window, x, r: Ref):
    """μ ← μ + α(x − μ); M2 ← (1 − α)(M2 + α·d·d2); append z = d2/σ (0 while count < K)."""
    d = x - mean
    mean = mean + r.alpha * d
    d2 = x - mean
    m2 = (1.0 - r.alpha) * (m2 + r.alpha * d * d2)
    count = count + 1
    z = d2 / math.sqrt(m2) if count >= r.k else 0.0
    window = np.concatenate([np.asarray(window, np.float64)[1:], [z]])
    return mean, m2, count, window


def np_sync(theta, trace, params, det, r: Ref):
    """Algorithm 2 on every unit, from gathered arrays. ``params`` has the leading replica dim;
    ``det`` is (mean [N, U], m2 [N, U], count [N, U], window [N, U, K]). Returns the new θ̄, trace,
    detector (as a tuple of arrays), per-replica params and per-unit info ([U, N] / [U])."""
    theta, trace, params = _f64(theta), _f64(trace), _f64(params)
    mean, m2 = np.array(det[0], np.float64), np.array(det[1], np.float64)
    count, window = np.array(det[2], np.int64), np.array(det[3], np.float64)
    n, n_units = mean.shape
    info = {"g": np.zeros((n_units, n)), "w": np.zeros((n_units, n)), "flagged": np.zeros((n_units, n), bool),
            "clip": np.ones(n_units), "skipped": np.zeros(n_units, bool)}
    for u in range(n_units):
        tb, tr = _unit(theta, u), _unit(trace, u)
        deltas = [[t - x for t, x in zip(tb, _unit(_replica(params, i), u), strict=True)] for i in range(n)]
        g = np.array([math.sqrt(sum(float(np.sum(d * d)) for d in deltas[i])) for i in range(n)])
        flagged = np.zeros(n, bool)
        for i in range(n):
            flagged[i] = r.anomaly and np_detector_flags(mean[i, u], m2[i, u], count[i, u], window[i, u], g[i], r)
            if not flagged[i]:
                mean[i, u], m2[i, u], count[i, u], window[i, u] = np_detector_feed(
                    mean[i, u], m2[i, u], count[i, u], window[i, u], g[i], r)
        ok = ~flagged
        w = np.zeros(n)
        if ok.any():
            if r.weighting:
                logits = -g[ok] / r.temperature
                e = np.exp(logits - logits.max())
                w[ok] = e / e.sum()
            else:
                w[ok] = 1.0 / ok.sum()
            avg = [sum(w[i] * deltas[i][j] for i in range(n) if ok[i]) for j in range(len(tb))]
            norm = math.sqrt(sum(float(np.sum(a * a)) for a in avg))
            c = min(1.0, r.phi / (norm + 1e-6)) if r.clip else 1.0
            avg = [a * c for a in avg]
            for j in range(len(tb)):
                tr[j][...] = r.mu * tr[j] + avg[j]
                tb[j][...] = tb[j] - r.lr * (avg[j] + r.mu * tr[j])
            info["clip"][u] = c
        else:
            info["skipped"][u] = True
        info["g"][u], info["w"][u], info["flagged"][u] = g, w, flagged
    new_params = jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), theta)
    return theta, trace, (mean, m2, count, window), new_params, info


def _ref_of(cfg) -> Ref:
    s = cfg.sync
    p = s.penalty
    return Ref(anomaly=p.anomaly, alpha=p.anomaly_alpha, k=p.anomaly_warmup, delta=p.anomaly_threshold,
               weighting=p.weighting, temperature=p.temperature, clip=p.clip, phi=p.clip_threshold,
               lr=s.outer.lr, mu=s.outer.momentum)


def _det_tuple(det):
    return tuple(np.asarray(x) for x in (det.mean, det.m2, det.count, det.window))


def _assert_det_close(got: Detector, want, what):
    mean, m2, count, window = want
    np.testing.assert_array_equal(np.asarray(got.count), count, err_msg=f"{what}: count")
    np.testing.assert_allclose(np.asarray(got.mean), mean, rtol=1e-5, atol=1e-7, err_msg=f"{what}: mean")
    np.testing.assert_allclose(np.asarray(got.m2), m2, rtol=1e-4, atol=1e-9, err_msg=f"{what}: M2")
    np.testing.assert_allclose(np.asarray(got.window), window, rtol=1e-4, atol=1e-4, err_msg=f"{what}: window")


# ============================================================================= the reference vs EDIT.md


def test_reference_detector_matches_worked_numbers():
    """The NumPy detector reproduces EDIT.md's worked trace (so it can serve as a reference)."""
    r = Ref(alpha=0.5, k=3, delta=3.0)
    st = (0.0, 0.0, 0, np.zeros(3))
    for x in (1.0, 1.0, 1.2, 1.1):
        assert not np_detector_flags(*st, x, r)
        st = np_detector_feed(*st, x, r)
    assert st[0] == pytest.approx(1.0375, abs=1e-7)
    assert st[1] == pytest.approx(0.0380469, abs=1e-7)
    np.testing.assert_allclose(st[3], [0.0, 0.837436, 0.320421], atol=1e-6)
    assert (5.0 - st[0]) / math.sqrt(st[1]) == pytest.approx(20.32, abs=0.01)
    assert np_detector_flags(*st, 5.0, r)
    assert (1.0 - st[0]) / math.sqrt(st[1]) == pytest.approx(-0.19, abs=0.01)
    assert not np_detector_flags(*st, 1.0, r)
    st = np_detector_feed(*st, 1.0, r)
    assert st[0] == pytest.approx(1.01875, abs=1e-7)
    assert st[1] == pytest.approx(0.0191992, abs=1e-7)


# ============================================================================= worked numbers (EDIT.md)


def test_detector_worked_numbers():
    """α = 0.5, K = 3, δ = 3 fed 1.0, 1.0, 1.2, 1.1, 5.0, 1.0 (EDIT.md)."""
    p = Penalty(alpha=0.5, warmup=3, threshold=3.0)
    step = jax.jit(lambda d, g: detector_step(d, g, p))
    det = Detector.zeros((), 3)
    for x in (1.0, 1.0, 1.2, 1.1):
        det, flagged = step(det, jnp.float32(x))
        assert not bool(flagged)
    assert float(det.mean) == pytest.approx(1.0375, abs=1e-6)
    assert float(det.m2) == pytest.approx(0.0380469, abs=1e-6)
    assert int(det.count) == 4
    np.testing.assert_allclose(np.asarray(det.window), [0.0, 0.837436, 0.320421], atol=1e-5)
    # 5.0: z ≈ 20.32 > 3 · max(1, std(window)) -> flagged, and the detector is not fed.
    assert bool(detector_test(det, jnp.float32(5.0), p))
    before = _host(det)
    det, flagged = step(det, jnp.float32(5.0))
    assert bool(flagged)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), det, before)
    # 1.0: z ≈ −0.19 -> fed.
    det, flagged = step(det, jnp.float32(1.0))
    assert not bool(flagged)
    assert float(det.mean) == pytest.approx(1.01875, abs=1e-6)
    assert float(det.m2) == pytest.approx(0.0191992, abs=1e-6)
    assert int(det.count) == 5
    z_last = (1.0 - 1.01875) / math.sqrt(0.0191992)  # appended with the statistics after the update
    np.testing.assert_allclose(np.asarray(det.window), [0.837436, 0.320421, z_last], atol=1e-4)


def test_detector_nonfinite_flagged_before_warmup():
    p = Penalty(alpha=0.5, warmup=3, threshold=3.0)
    det = Detector.zeros((), 3)
    for bad in (np.nan, np.inf):
        assert bool(detector_test(det, jnp.float32(bad), p))
    assert not bool(detector_test(det, jnp.float32(1e6), p))  # not ready: only non-finite is flagged


def test_detector_zero_sigma_is_no_evidence():
    """Issue 13, item 7: a unit whose pseudo gradients were all zero for K syncs has σ = 0. A later
    positive norm used to get z = +inf: flagged, never fed, so σ stayed 0 and the unit's outer step
    was skipped forever. σ = 0 now gives z = 0 (not flagged); the norm is fed and the test works
    again from the next sync (a real outlier is still flagged)."""
    p = Penalty(alpha=0.5, warmup=3, threshold=3.0)
    step = jax.jit(lambda d, g: detector_step(d, g, p))
    det = Detector.zeros((), 3)
    for _ in range(4):  # K + 1 syncs of an all-zero pseudo gradient: ready, with σ = 0
        det, flagged = step(det, jnp.float32(0.0))
        assert not bool(flagged)
    assert int(det.count) == 4 and float(det.m2) == 0.0
    for x in (0.5, 0.6, 0.55):
        det, flagged = step(det, jnp.float32(x))
        assert not bool(flagged), x  # fed: the detector learns the new scale
    assert int(det.count) == 7 and float(det.m2) > 0
    assert bool(detector_test(det, jnp.float32(50.0), p))  # and still catches a real outlier


@pytest.fixture(scope="module")
def mesh_2x1():
    return make_mesh(MeshConfig(replica=2, shard=1), jax.devices()[:2])


def test_weights_worked_numbers(mesh_2x1):
    """N = 2, g = (1, 2), T = 1 -> w = (0.73106, 0.26894); a flagged worker gets 0, all flagged -> 0."""
    p = Penalty(temperature=1.0)

    def weights(g, flagged, pen):
        f = jax.shard_map(lambda g, fl: worker_weights(g[0], fl[0], pen)[None], mesh=mesh_2x1,
                          in_specs=(P(REPLICA), P(REPLICA)), out_specs=P(REPLICA))
        return np.asarray(jax.jit(f)(jnp.asarray(g, jnp.float32), jnp.asarray(flagged)))

    np.testing.assert_allclose(weights([1.0, 2.0], [False, False], p), [0.73106, 0.26894], atol=1e-5)
    np.testing.assert_allclose(weights([1.0, 2.0], [False, True], p), [1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(weights([1.0, 2.0], [True, True], p), [0.0, 0.0], atol=0)
    np.testing.assert_allclose(weights([1.0, 2.0], [False, False], Penalty(weighting=False)), [0.5, 0.5], atol=1e-7)
    # T scales the logits: softmax(−g/T).
    np.testing.assert_allclose(weights([1.0, 2.0], [False, False], Penalty(temperature=0.5)),
                               np.exp([-2.0, -4.0]) / np.exp([-2.0, -4.0]).sum(), atol=1e-6)


def test_first_outer_step_worked_numbers(mesh_2x1):
    """η = 0.7, μ = 0.8: the first outer step is θ̄ − 1.26·Δ; with g = (1, 2) Δ = 0.73106Δ_1 + 0.26894Δ_2."""
    opt = outer_optimizer(0.7, 0.8)
    delta = {"a": jnp.array([1.0, -2.0, 0.5])}
    upd, _ = opt.update(delta, opt.init(jax.tree.map(jnp.zeros_like, delta)))
    np.testing.assert_allclose(np.asarray(upd["a"]), -1.26 * np.asarray(delta["a"]), rtol=1e-6)

    # The same through sync_unit on a 2 x 1 mesh: ‖Δ_1‖ = 1, ‖Δ_2‖ = 2, penalty on but no clip active.
    theta = {"w": np.array([0.3, -0.1, 0.2, 0.05], np.float32), "b": np.array([[1.0, 2.0]], np.float32)}
    d1 = {"w": np.array([1.0, 0, 0, 0], np.float32), "b": np.zeros((1, 2), np.float32)}
    d2 = {"w": np.array([0, 0, 0, 0], np.float32), "b": np.array([[0.0, 2.0]], np.float32)}
    local = jax.tree.map(lambda t, a, b: np.stack([t - a, t - b]), theta, d1, d2)
    trace = jax.tree.map(np.zeros_like, theta)
    pen = Penalty(alpha=0.5, warmup=3, clip=True, clip_threshold=10.0)

    def body(local, theta, trace, det):
        opt_state = with_sgd_trace(opt.init(theta), trace)
        res = sync_unit(jax.tree.map(lambda x: x[0], local), theta, opt_state, jax.tree.map(lambda x: x[0], det),
                        pen, opt)
        return res.outer_params, sgd_trace(res.opt_state), jax.tree.map(lambda x: x[None], res.params), \
            res.metrics["weight"]

    rep, none = P(REPLICA), P()
    f = jax.jit(jax.shard_map(body, mesh=mesh_2x1, in_specs=(rep, none, none, rep), out_specs=(none, none, rep, none)))
    new_theta, new_trace, new_local, w = _host(f(local, theta, trace, Detector.zeros((2,), 3)))
    np.testing.assert_allclose(w, [0.73106, 0.26894], atol=1e-5)
    avg = jax.tree.map(lambda a, b: 0.7310586 * a + 0.2689414 * b, d1, d2)
    _assert_tree_close(new_theta, jax.tree.map(lambda t, a: t - 1.26 * a, theta, avg), "θ̄", rtol=1e-5, atol=1e-6)
    _assert_tree_close(new_trace, avg, "trace", rtol=1e-5, atol=1e-6)
    _assert_tree_close(new_local, jax.tree.map(lambda x: np.stack([x, x]), new_theta), "θ_i ← θ̄", rtol=0, atol=0)


# ============================================================================= the shared 4 x 2 EDiT machinery


@pytest.fixture(scope="module")
def edit4():
    """EDiT on a 4 x 2 mesh with every penalty part on and non-default constants (so that each one
    matters): α = 0.3, T = 0.5, φ = 0.2 (clips), η = 0.7, μ = 0.8."""
    cfg = _cfg(*BASE4, "sync.method=edit", "sync.penalty.anomaly_alpha=0.3", "sync.penalty.temperature=0.5",
               "sync.penalty.clip_threshold=0.2", "sync.outer.lr=0.7", "sync.outer.momentum=0.8")
    mesh = make_mesh(cfg.mesh, jax.devices()[8:16], device_order=PERM)
    m = StepPrograms.for_config(cfg, mesh)
    return m, _host(m.init_state(0))


@pytest.fixture(scope="module")
def diverged(edit4):
    """The state after 3 local steps from a common start: replicas differ, θ̄ = the start."""
    m, init = edit4
    state = _put(m, init)
    for k in range(3):
        state, metrics = m.step_fn("local")(state, m.put_batch(_batch(k, m.cfg)))
        assert np.isfinite(float(np.mean(metrics["loss"])))
    host = _host(state)
    p = host.params["root"]["embed"]
    assert np.max(np.abs(p[0] - p[1])) > 1e-4, "replicas should have diverged"
    return host


def _crafted_state(m: StepPrograms, init):
    """A state where each worker's pseudo gradient per unit has a known norm and each detector is
    set up for one path of the z-test (U = 4 units: root, layers 0..2):

    unit 0: every detector ready; worker 0 z = 1 (fed); worker 1 z = 5 but std(window) = 3, so the
            threshold is 9 (fed); worker 2 z = 2 (fed); worker 3 is 10x off (z = 90: flagged, not fed).
    unit 1: worker 3 is 10x off again, but no detector is ready (counts 0, 1, 2, 2): nobody flagged;
            counts 2 -> 3 = K append a real z-score, the others append 0.
    unit 2: every detector ready and tight around 0.01: every worker flagged, the outer step skipped.
    unit 3: pseudo gradients 20x smaller: no flag, and the clip (φ = 0.2) is inactive (active in 0, 1).
    The Nesterov trace is random (non-zero) so that μ matters.
    """
    rng = np.random.default_rng(7)
    theta = init.outer.params
    n, n_units = m.n, 1 + m.cfg.model.n_layers
    assert n == 4 and n_units == 4
    base = np.array([0.6, 0.9, 1.2, 1.5])
    g = np.zeros((n, n_units))
    params = jax.tree.map(lambda x: np.array(np.broadcast_to(x, (n,) + x.shape), np.float32), theta)
    for i in range(n):
        for u in range(n_units):
            g[i, u] = base[i] * (0.05 if u == 3 else 1.0) * (10.0 if (i == 3 and u in (0, 1)) else 1.0)
            views, tb = _unit(_replica(params, i), u), _unit(theta, u)
            r = [rng.standard_normal(v.shape) for v in views]
            norm = math.sqrt(sum(float(np.sum(x * x)) for x in r))
            for v, t, x in zip(views, tb, r, strict=True):
                v[...] = (t - g[i, u] * x / norm).astype(np.float32)
    mean, m2 = np.zeros((n, n_units), np.float32), np.zeros((n, n_units), np.float32)
    count, window = np.zeros((n, n_units), np.int32), np.zeros((n, n_units, K), np.float32)
    # unit 0
    sig = 0.1 * g[:, 0]
    z0 = np.array([1.0, 5.0, 2.0, 0.0])
    mean[:, 0] = g[:, 0] - z0 * sig
    mean[3, 0] = 1.5
    sig[3] = 0.15
    m2[:, 0] = sig ** 2
    count[:, 0] = 5
    window[:, 0] = [[0.5, -0.5, 0.2], [-3.0, 0.0, 3.0], [0.1, 0.2, 0.3], [0.0, 0.0, 0.0]]
    # unit 1
    count[:, 1] = [0, 1, 2, 2]
    mean[:, 1] = [0.0, 0.5, 0.8, 1.0]
    m2[:, 1] = [0.0, 0.01, 0.02, 0.04]
    # unit 2
    count[:, 2], mean[:, 2], m2[:, 2] = K, 0.01, 1e-6
    # unit 3
    count[:, 3], mean[:, 3], m2[:, 3] = 4, 0.9 * g[:, 3], (0.2 * g[:, 3]) ** 2
    window[:, 3] = rng.uniform(-0.5, 0.5, (n, K))
    trace = jax.tree.map(lambda x: (0.01 * rng.standard_normal(x.shape)).astype(np.float32), theta)
    outer = init.outer.with_trace(trace).replace(detector=Detector(mean, m2, count, window))
    return init.replace(params=params, outer=outer)


def _check_against_reference(new_state, metrics, start, r: Ref, what, check_params=True, check_norms=True):
    theta, trace, det, params, info = np_sync(start.outer.params, start.outer.trace, start.params,
                                              _det_tuple(start.outer.detector), r)
    _assert_tree_close(new_state.outer.params, theta, f"{what}: θ̄")
    _assert_tree_close(new_state.outer.trace, trace, f"{what}: trace")
    _assert_det_close(new_state.outer.detector, det, f"{what}: detector")
    if check_params:
        _assert_tree_close(new_state.params, params, f"{what}: θ_i")
    np.testing.assert_array_equal(np.asarray(metrics["unit_flagged"]), info["flagged"], err_msg=f"{what}: flags")
    np.testing.assert_array_equal(np.asarray(metrics["flagged"]), info["flagged"].sum(0), err_msg=f"{what}: flags")
    np.testing.assert_allclose(np.asarray(metrics["unit_weight"]), info["w"], atol=1e-5, err_msg=f"{what}: weights")
    if check_norms:
        np.testing.assert_allclose(np.asarray(metrics["unit_pseudo_grad_norm"]), info["g"], rtol=1e-5,
                                   err_msg=f"{what}: norms")
    np.testing.assert_allclose(np.asarray(metrics["unit_clip_factor"])[~info["skipped"]],
                               info["clip"][~info["skipped"]], rtol=1e-5, err_msg=f"{what}: clip")
    return info


def test_sync_matches_numpy_reference(edit4):
    """Both sync paths (whole-model ``sync_fn`` and layer-wise ``sync_forward``) equal the NumPy
    Algorithm 2 on a crafted state exercising flags, the window-std threshold, warmup, the
    all-flagged skip, clipping on and off, weights with T != 1 and a non-zero momentum trace."""
    m, init = edit4
    start = _crafted_state(m, init)
    r = _ref_of(m.cfg)
    # The setup does what its docstring says (checked on the reference itself).
    info = np_sync(start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector), r)[-1]
    np.testing.assert_array_equal(info["flagged"], [[0, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert list(info["skipped"]) == [False, False, True, False]
    assert info["clip"][0] < 1 and info["clip"][1] < 1 and info["clip"][3] == 1.0

    # Whole-model sync (not donated).
    synced, metrics = m.sync_fn()(_put(m, start))
    synced, metrics = _host((synced, metrics))
    _check_against_reference(synced, metrics, start, r, "sync_fn")
    # The skipped unit (layer 1) is untouched: θ̄ and trace as before, detectors as before.
    for a, b in zip(_unit(synced.outer.params, 2), _unit(start.outer.params, 2), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_unit(synced.outer.trace, 2), _unit(start.outer.trace, 2), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(synced.outer.syncs) == int(start.outer.syncs) + 1

    # Layer-wise sync inside the forward. The state is at step 0, where the inner learning rate is
    # 0 (linear warmup from 0), so the inner AdamW update is zero and θ_i must equal the new θ̄.
    assert float(lr_schedule(m.cfg.optim, m.cfg.steps)(0)) == 0.0
    stepped, metrics = m.step_fn("sync_forward")(_put(m, start), m.put_batch(_batch(0, m.cfg)))
    stepped, metrics = _host((stepped, metrics))
    assert np.isfinite(metrics["loss"]).all()
    _check_against_reference(stepped, metrics, start, r, "sync_forward")
    assert int(stepped.step) == 1


@pytest.mark.parametrize("layout", ["sync.outer_sharding=replica_shard", "sync.cpu_offload=true"])
def test_outer_state_layouts_match_numpy_reference(edit4, layout):
    """θ̄ and the trace split over `replica` too (all-to-all, local weighted sum, all-gather) or
    kept in host memory: the same Algorithm 2 results as the NumPy reference, on both sync paths."""
    offload = layout.startswith("sync.cpu_offload")
    one_stage("3.12" if offload else "default", f"the outer state layout {layout}", 22,
              other="the other layout")
    m0, init = edit4
    cfg = _cfg(*BASE4, "sync.method=edit", "sync.penalty.anomaly_alpha=0.3", "sync.penalty.temperature=0.5",
               "sync.penalty.clip_threshold=0.2", "sync.outer.lr=0.7", "sync.outer.momentum=0.8", layout)
    m = StepPrograms.for_config(cfg, m0.mesh)
    start = _crafted_state(m, init)
    r = _ref_of(cfg)
    synced, metrics = _host(m.sync_fn()(_put(m, start)))
    _check_against_reference(synced, metrics, start, r, f"sync_fn [{layout}]")
    stepped, metrics = _host(m.step_fn("sync_forward")(_put(m, start), m.put_batch(_batch(0, cfg))))
    _check_against_reference(stepped, metrics, start, r, f"sync_forward [{layout}]")
    state = m.step_fn("local")(_put(m, start), m.put_batch(_batch(1, cfg)))[0]
    theta = state.outer.params["layers"]["mlp"]["w_up"]
    if "replica_shard" in layout:  # each device holds 1/(S*N) of the FSDP dim
        assert theta.sharding.spec[-1] == ("shard", "replica")
        assert {s.data.shape[-1] for s in theta.addressable_shards} == {theta.shape[-1] // (N4 * S2)}
    else:
        assert theta.sharding.memory_kind == "pinned_host"


def test_sync_forward_equals_sync_then_local_step(edit4, diverged):
    """The layer-wise sync inside step k's forward is the whole-model sync followed by a local step
    at the synced point (EDIT.md, Algorithm 1 step 4: the gradient of step k is taken at the synced
    params and AdamW updates them). At step 3 the inner learning rate is non-zero."""
    m, _ = edit4
    batch = _batch(11, m.cfg)
    assert float(lr_schedule(m.cfg.optim, m.cfg.steps)(int(diverged.step))) > 0
    a, ma = _host(m.step_fn("sync_forward")(_put(m, diverged), m.put_batch(batch)))
    synced, _ = m.sync_fn()(_put(m, diverged))
    b, mb = _host(m.step_fn("local")(synced, m.put_batch(batch)))
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-6)
    np.testing.assert_allclose(ma["grad_norm"], mb["grad_norm"], rtol=1e-5)
    _assert_tree_close(a.params, b.params, "θ_i", rtol=1e-5, atol=1e-7)
    _assert_tree_close(a.opt_state, b.opt_state, "AdamW state", rtol=1e-5, atol=1e-9)
    _assert_tree_close(a.outer.params, b.outer.params, "θ̄", rtol=1e-6, atol=1e-8)
    _assert_tree_close(a.outer.trace, b.outer.trace, "trace", rtol=1e-6, atol=1e-8)
    _assert_det_close(a.outer.detector, _det_tuple(b.outer.detector), "detector")
    assert int(a.step) == int(b.step) and int(a.outer.syncs) == int(b.outer.syncs) == 1
    # and the local params did move away from θ̄ by this step's update
    assert np.max(np.abs(a.params["root"]["embed"][0] - a.outer.params["root"]["embed"])) > 1e-5


# ============================================================================= a poisoned replica


def _poison(host_state, replica: int):
    return host_state.replace(params=jax.tree.map(
        lambda x: np.concatenate([x[:replica], np.full_like(x[replica:replica + 1], np.nan), x[replica + 1:]]),
        host_state.params))


def test_nan_replica_flagged_excluded_and_training_goes_on(edit4, diverged):
    m, _ = edit4
    start = _poison(diverged, 1)
    n_units = 1 + m.cfg.model.n_layers
    state, metrics = m.step_fn("sync_forward")(_put(m, start), m.put_batch(_batch(10, m.cfg)))
    host, metrics = _host((state, metrics))
    np.testing.assert_array_equal(metrics["flagged"], [0, n_units, 0, 0])
    assert np.all(metrics["unit_weight"][:, 1] == 0)
    np.testing.assert_allclose(metrics["unit_weight"].sum(1), 1.0, rtol=1e-5)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host.outer.params))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host.params))
    assert np.isfinite(metrics["loss"]).all()
    # θ̄, trace and detectors equal the reference, in which replica 1 is flagged for its NaN norm.
    # (θ_i also carries this step's inner update here, so it is not compared; the norm metrics
    # are checked in the next tests.)
    info = _check_against_reference(host, metrics, start, _ref_of(m.cfg), "NaN replica", check_params=False,
                                    check_norms=False)
    assert info["flagged"][:, 1].all() and not info["flagged"][:, [0, 2, 3]].any()
    # The poisoned worker's detectors are not fed (unchanged); the others' are.
    np.testing.assert_array_equal(host.outer.detector.count[1], start.outer.detector.count[1])
    np.testing.assert_array_equal(host.outer.detector.count[0], start.outer.detector.count[0] + 1)
    # Equal to the update from the other replicas only: drop replica 1 and sync N = 3 in NumPy.
    keep = [0, 2, 3]
    only = np_sync(start.outer.params, start.outer.trace, jax.tree.map(lambda x: x[keep], start.params),
                   tuple(x[keep] for x in _det_tuple(start.outer.detector)), _ref_of(m.cfg))
    _assert_tree_close(host.outer.params, only[0], "θ̄ from the other replicas only")

    # Training goes on: local steps, another sync, a local step; all finite.
    for k, kind in enumerate(["local", "local", "local", "sync_forward", "local"]):
        state, metrics = m.step_fn(kind)(state, m.put_batch(_batch(20 + k, m.cfg)))
        assert np.isfinite(float(np.mean(metrics["loss"]))), (k, kind)
        if kind == "sync_forward":
            np.testing.assert_array_equal(np.asarray(metrics["flagged"]), 0)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize("kind", ["sync_forward", "local_then_sync"])
def test_nan_worker_rejoins_after_sync(edit4, diverged, kind):
    """Issue 13, item 4: a worker whose params and AdamW moments are NaN is flagged and rolled back
    to θ̄ at the sync, and its inner optimizer moments are zeroed (shared step count kept), so every
    worker's loss is finite at every step after the sync. Before, its moments stayed NaN and its
    loss was NaN at every later local step."""
    one_stage("default" if kind == "sync_forward" else "3.12", "a NaN worker rejoining", 14,
              other="the other step kind")
    m, _ = edit4
    start = _poison(diverged, 1)
    start = start.replace(opt_state=jax.tree.map(
        lambda x: np.concatenate([x[:1], np.full_like(x[1:2], np.nan), x[2:]])
        if np.ndim(x) >= 1 and np.shape(x)[0] == N4 and np.issubdtype(np.asarray(x).dtype, np.floating) else x,
        start.opt_state))
    state = _put(m, start)
    state, metrics = m.step_fn("local")(state, m.put_batch(_batch(30, m.cfg)))
    assert np.isnan(np.asarray(metrics["loss"])[1])  # the poisoned worker really is NaN before the sync
    state, sync_metrics = m.step_fn(kind)(state, m.put_batch(_batch(31, m.cfg)))
    assert np.asarray(sync_metrics["flagged"])[1] > 0
    for k in range(4):
        state, metrics = m.step_fn("local")(state, m.put_batch(_batch(32 + k, m.cfg)))
        assert np.isfinite(np.asarray(metrics["loss"])).all(), (k, metrics["loss"])
    np.testing.assert_array_equal(np.asarray(sync_metrics["inner_reset"]), [False, True, False, False])
    host = _host(state)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(host.opt_state) if np.issubdtype(x.dtype, np.floating))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(host.params))
    assert int(host.opt_state[1][0].count) == int(diverged.opt_state[1][0].count) + 6  # step count kept


def _expected_norms(start):
    g = np_sync(start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector), Ref())[-1]["g"]
    return g  # [U, N], NaN only in the poisoned worker's column


def test_nan_replica_norm_metrics_whole_model_sync(edit4, diverged):
    """sync_fn: the per-worker norm metrics of the healthy workers stay finite and exact."""
    m, _ = edit4
    start = _poison(diverged, 1)
    _, metrics = _host(m.sync_fn()(_put(m, start)))
    np.testing.assert_allclose(metrics["unit_pseudo_grad_norm"], _expected_norms(start), rtol=1e-5)


def test_nan_replica_norm_metrics_layerwise_sync(edit4, diverged):
    """sync_forward: the same metrics as the whole-model sync (healthy workers finite and exact)."""
    m, _ = edit4
    start = _poison(diverged, 1)
    _, metrics = _host(m.step_fn("sync_forward")(_put(m, start), m.put_batch(_batch(10, m.cfg))))
    np.testing.assert_allclose(metrics["unit_pseudo_grad_norm"], _expected_norms(start), rtol=1e-5)
    assert np.all(np.isfinite(metrics["pseudo_grad_norm"][[0, 2, 3]]))


# ============================================================================= degenerate configurations


def _run(m: StepPrograms, state, kinds, batch_seeds):
    losses, hist = [], []
    for kind, seed in zip(kinds, batch_seeds, strict=True):
        state, metrics = m.step_fn(kind)(state, m.put_batch(_batch(seed, m.cfg)))
        losses.append(float(np.mean(metrics["loss"])))
        hist.append(_host(state))
    return state, losses, hist


def test_edit_with_one_replica_equals_adamw():
    """N = 1, τ = 1, η_out = 1, μ_out = 0, no penalty: every sync sets θ̄ to the worker's params and
    changes nothing, so EDiT is plain AdamW (the Baseline on a 1 x S mesh)."""
    one_stage("default", "EDiT on one replica against AdamW", 30, other="test_step_program's scan_unroll")
    common = [*BASE, "mesh.replica=1", "mesh.shard=2"]
    edit_cfg = _cfg(*common, "sync.method=edit", "sync.tau=1", "sync.outer.lr=1.0", "sync.outer.momentum=0.0",
                    "sync.penalty.anomaly=false", "sync.penalty.weighting=false", "sync.penalty.clip=false")
    base_cfg = _cfg(*common, "sync.method=baseline")
    devices = jax.devices()[16:18]
    e = StepPrograms.for_config(edit_cfg, make_mesh(edit_cfg.mesh, devices))
    b = StepPrograms.for_config(base_cfg, make_mesh(base_cfg.mesh, devices))
    steps = 6
    edit_kinds = [step_kind(edit_cfg, k) for k in range(steps)]
    assert edit_kinds == ["local"] + ["sync_forward"] * (steps - 1)
    assert [step_kind(base_cfg, k) for k in range(steps)] == ["hsdp"] * steps
    seeds = [0, 1, 0, 1, 0, 1]  # two batches in turn, so that the loss visibly falls
    e_state, e_losses, e_hist = _run(e, e.init_state(0), edit_kinds, seeds)
    b_state, b_losses, b_hist = _run(b, b.init_state(0), ["hsdp"] * steps, seeds)
    np.testing.assert_allclose(e_losses, b_losses, rtol=1e-5)
    assert b_losses[-1] < b_losses[1] - 0.01 and b_losses[-2] < b_losses[0] - 0.01  # it trains at all
    for k in range(steps):
        _assert_tree_close(e_hist[k].params, b_hist[k].params, f"params after step {k}", rtol=1e-5, atol=1e-7)
    # θ̄ after the sync at step k is the params after step k - 1.
    _assert_tree_close(e_hist[-1].outer.params, _replica(b_hist[-2].params, 0), "θ̄", rtol=1e-5, atol=1e-7)


def test_post_local_sgd_sync_is_replica_mean(edit4, diverged):
    m, _ = edit4
    cfg = _cfg(*BASE4, "sync.method=post_local_sgd")
    post = StepPrograms.for_config(cfg, m.mesh)
    synced, metrics = _host(post.sync_fn()(_put(post, diverged)))
    mean = jax.tree.map(lambda x: np.asarray(x, np.float64).mean(0), diverged.params)
    _assert_tree_close(synced.outer.params, mean, "θ̄ = mean of the replicas", rtol=1e-5, atol=1e-7)
    _assert_tree_close(synced.params, jax.tree.map(lambda x: np.broadcast_to(x, (post.n,) + x.shape),
                                                   synced.outer.params), "θ_i = θ̄", rtol=0, atol=0)
    np.testing.assert_allclose(metrics["weight"], 0.25, rtol=1e-6)


def test_diloco_sync_equals_edit_layerwise_without_penalty(edit4, diverged):
    """The same pseudo gradients through DiLoCo's whole-model sync and through EDiT's layer-wise sync
    (penalty off, same η and μ) give the same θ̄ and trace, equal to the NumPy reference."""
    one_stage("3.12", "DiLoCo as EDiT without its penalty", 23, other="test_rule_conformance's DiLoCo")
    m, _ = edit4
    outer = ["sync.outer.lr=0.7", "sync.outer.momentum=0.8"]
    diloco = StepPrograms.for_config(_cfg(*BASE4, "sync.method=diloco", *outer), m.mesh)
    edit_off = StepPrograms.for_config(_cfg(*BASE4, "sync.method=edit", *outer, "sync.penalty.anomaly=false",
                                         "sync.penalty.weighting=false", "sync.penalty.clip=false"), m.mesh)
    rng = np.random.default_rng(3)
    start = diverged.replace(outer=diverged.outer.with_trace(jax.tree.map(
        lambda x: (0.003 * rng.standard_normal(x.shape)).astype(np.float32), diverged.outer.params)))
    a, _ = _host(diloco.sync_fn()(_put(diloco, start)))
    b, metrics = _host(edit_off.step_fn("sync_forward")(_put(edit_off, start), edit_off.put_batch(_batch(5, m.cfg))))
    assert np.isfinite(float(np.mean(metrics["loss"])))
    _assert_tree_close(b.outer.params, a.outer.params, "θ̄: EDiT layer-wise vs DiLoCo", rtol=1e-6, atol=1e-8)
    _assert_tree_close(b.outer.trace, a.outer.trace, "trace: EDiT layer-wise vs DiLoCo", rtol=1e-6, atol=1e-8)
    r = Ref(anomaly=False, weighting=False, clip=False, lr=0.7, mu=0.8)
    theta, trace, _, params, _ = np_sync(start.outer.params, start.outer.trace, start.params,
                                         _det_tuple(start.outer.detector), r)
    _assert_tree_close(a.outer.params, theta, "DiLoCo θ̄ vs reference")
    _assert_tree_close(a.outer.trace, trace, "DiLoCo trace vs reference")
    _assert_tree_close(a.params, params, "DiLoCo θ_i = θ̄")


# ============================================================================= HLO: where traffic goes

def collectives(text: str):
    """(op, groups, operand elements, record) of every collective in a compiled program (the parser
    in edit_jax.analysis.hlo reads every replica-group form jax 0.10 to 0.12 prints)."""
    return [(r["op"], r["groups"], hlo.operand_elements(r), r)
            for r in hlo.hlo_collectives(text, (N4, S2), default_trip=4)["collectives"]]


def _crosses(groups, n: int, s: int) -> bool:
    return hlo.crosses_replica(groups, s)


def _hlo(m: StepPrograms, state_host, kind: str) -> str:
    return m.lowered(kind, _put(m, state_host), m.put_batch(_batch(0, m.cfg))).compile().as_text()


def test_hlo_replica_group_ids_are_mesh_positions(edit4):
    """The experiment behind ``_crosses``: on a mesh of devices 8..15 in a permuted order, the HSDP
    step's FSDP collectives group ids {0,1},{2,3},{4,5},{6,7} (the mesh's rows by *position*), and
    its gradient all-reduce groups the columns {0,2,4,6},{1,3,5,7}. No id is a device id here."""
    m, init = edit4
    flat_ids = [d.id for d in m.mesh.devices.flat]
    assert sorted(flat_ids) == list(range(8, 16)) and flat_ids != sorted(flat_ids)
    colls = collectives(_hlo(m, init, "hsdp"))
    seen = {tuple(map(tuple, g)) for _, g, _, _ in colls if g is not None}
    ids = {p for groups in seen for g in groups for p in g}
    assert ids <= set(range(N4 * S2)) and not ids & set(flat_ids)
    rows = tuple(tuple(range(r * S2, (r + 1) * S2)) for r in range(N4))
    cols = tuple(tuple(range(s, N4 * S2, S2)) for s in range(S2))
    assert rows in seen, seen
    assert cols in seen, seen
    gathers = {tuple(map(tuple, g)) for op, g, _, _ in colls if op == "all-gather"}
    assert gathers == {rows}


def test_hlo_hsdp_step_crosses_replicas(edit4):
    m, init = edit4
    crossing = [(op, n, line) for op, g, n, line in collectives(_hlo(m, init, "hsdp")) if _crosses(g, N4, S2)]
    assert crossing, "the HSDP warmup step must average gradients across replicas"
    assert max(n for _, n, _ in crossing) > 1000, "gradient-sized traffic across replicas expected"


def test_hlo_local_step_moves_no_tensor_across_replicas(edit4):
    """No gradient or parameter traffic crosses replicas in a local step (scalars aside: see the
    next test)."""
    m, init = edit4
    colls = collectives(_hlo(m, init, "local"))
    assert any(op == "all-gather" for op, *_ in colls)  # the parser sees the FSDP gathers
    crossing = [(op, n, line) for op, g, n, line in colls if _crosses(g, N4, S2)]
    assert all(n <= 2 for _, n, _ in crossing), crossing


def test_hlo_local_step_has_no_cross_replica_collective(edit4):
    m, init = edit4
    crossing = [line for op, g, n, line in collectives(_hlo(m, init, "local")) if _crosses(g, N4, S2)]
    assert not crossing, "\n".join(crossing)


# ============================================================================= the schedule


def step_kind(cfg, k):
    return str(plan_for(cfg).schedule.kind(k))  # the kind's record name, e.g. "sync_forward@1"


def init_outer_due(cfg, k):
    return plan_for(cfg).schedule.init_outer_due(k)


def test_step_kind_schedule():
    w, tau, steps = 4, 4, 20
    edit = _cfg(*BASE, "sync.method=edit", f"sync.warmup_steps={w}", f"sync.tau={tau}")
    kinds = [step_kind(edit, k) for k in range(steps)]
    assert kinds[:w] == ["hsdp"] * w
    assert [k for k in range(steps) if kinds[k] == "sync_forward"] == [w + tau, w + 2 * tau, w + 3 * tau]
    assert all(kinds[k] == "local" for k in range(w, steps) if k not in (8, 12, 16))
    assert [k for k in range(steps) if init_outer_due(edit, k)] == [w]

    for method in ("diloco", "post_local_sgd"):
        cfg = _cfg(*BASE, f"sync.method={method}", f"sync.warmup_steps={w}", f"sync.tau={tau}")
        kinds = [step_kind(cfg, k) for k in range(steps)]
        assert kinds[:w] == ["hsdp"] * w
        # The same windows, synced after the step before: W + τ − 1, W + 2τ − 1, ...
        assert [k for k in range(steps) if kinds[k] == "local_then_sync"] == [7, 11, 15, 19]
        assert set(kinds[w:]) == {"local", "local_then_sync"}
        assert [k for k in range(steps) if init_outer_due(cfg, k)] == [w]

    whole = _cfg(*BASE, "sync.method=edit", "sync.layerwise=false", f"sync.warmup_steps={w}", f"sync.tau={tau}")
    assert [k for k in range(steps) if step_kind(whole, k) == "local_then_sync"] == [7, 11, 15, 19]

    no_warmup = _cfg(*BASE, "sync.method=edit", "sync.warmup_steps=0", "sync.tau=3")
    assert [k for k in range(10) if step_kind(no_warmup, k) == "sync_forward"] == [3, 6, 9]
    assert step_kind(no_warmup, 0) == "local"
    assert not any(init_outer_due(no_warmup, k) for k in range(10))  # θ̄ starts as the params

    base = _cfg(*BASE, "sync.method=baseline", f"sync.warmup_steps={w}")
    assert {step_kind(base, k) for k in range(steps)} == {"hsdp"}
    assert not any(init_outer_due(base, k) for k in range(steps))
