"""CO2 (method=co2, CO2.md): the one-round-stale outer update against independent references.

- The worked example of CO2.md section 5 (two workers on moving quadratics, tau = 2, clip on),
  through the same pure functions the compiled sync uses (outer.stale_outer_step and the clipped
  momentum), against the numbers printed in the design page and a NumPy loop written here.
- The compiled CO2 step on a 2 x 2 mesh against a NumPy re-computation of every sync of three
  rounds (pending pseudo gradients, momentum with the clamp active, anchor, every worker reset).
- The evaluation model is the flush (the last round's all-reduce applied).
- HLO: the exchange over `replica` in CO2's sync program does not depend on the step's batch
  (so a GPU can overlap it with the round's compute), while DiLoCo's does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.config import CO2Config, ConfigError, OuterConfig, WireConfig
from edit_jax.localsgd.methods import OuterSpec, plan_for
from edit_jax.localsgd.stale import StaleSync
from edit_jax.localsgd.outer import make_outer_optimizer, sgd_trace, stale_outer_step
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.presets import cpu, paper
from edit_jax.analysis import hlo, hlo_parse
from edit_jax.validate import validate
from tests.helpers import mesh_for, random_batch, tiny_config
from tests.stages import one_stage

# ----------------------------------------------------------------------------- worked example

G, TAU, ROUNDS, GAMMA = 2, 2, 3, 0.25
ALPHA, BETA, LAM, PHI = 0.7, 0.5, 2.0, 0.5
C = np.array([[1.0, -2.0], [3.0, 1.0]])

# CO2.md section 5, as printed: (Delta_{t-1}, m, a_{t+1}) per round, then the flush.
DOC_ROUNDS = [
    ([0.0, 0.0], [0.0, 0.0], [0.0, 0.0]),
    ([-0.875, 0.21875], [-0.4375, 0.109375], [0.30625, -0.0765625]),
    ([-1.09375, 0.21875], [-0.5, 0.1640625], [0.65625, -0.19140625]),
]
DOC_FLUSH = ([-1.178516, 0.185254], [-0.5, 0.174658], [1.00625, -0.313667])


def _inner(x, i, t):
    for _ in range(TAU):  # SGD on 0.5 ||x - c_i(t)||^2, c_i(t) = c_i + (0.5 t, 0)
        x = x - GAMMA * (x - (C[i] + np.array([0.5 * t, 0.0])))
    return x


def _numpy_co2():
    """The spec loop of CO2.md section 1 in float64: round t applies round t-1's mean."""
    a, m, pending, out = np.zeros(2), np.zeros(2), np.zeros((G, 2)), []
    for t in range(ROUNDS + 1):  # the last pass is the flush: no new round, the old mean applied
        delta = pending.mean(axis=0)
        m = np.clip(BETA * m + delta / LAM, -PHI, PHI)
        a_next = a - ALPHA * m
        if t < ROUNDS:
            xs = np.stack([_inner(a.copy(), i, t) for i in range(G)])
            pending = a[None] - xs
        out.append((delta, m.copy(), a_next))
        a = a_next
    return out


def test_numpy_reference_matches_the_worked_example():
    ref = _numpy_co2()
    for (d, m, a), (dd, dm, da) in zip(ref, DOC_ROUNDS + [DOC_FLUSH], strict=True):
        np.testing.assert_allclose(d, dd, atol=1e-6)
        np.testing.assert_allclose(m, dm, atol=1e-6)
        np.testing.assert_allclose(a, da, atol=1e-6)
    assert ref[2][1][0] == -PHI  # round 2 clamps m_x = -0.765625 to -0.5, as the page says


def test_stale_outer_step_reproduces_the_worked_example():
    opt = make_outer_optimizer(OuterSpec("nesterov", ALPHA, BETA, nesterov=False, momentum_clip=PHI))
    a = jnp.zeros(2, jnp.float32)
    state = opt.init(a)
    pending = np.zeros((G, 2), np.float32)
    for t, (dd, dm, da) in enumerate(DOC_ROUNDS + [DOC_FLUSH]):
        xs = [np.float32(_inner(np.asarray(a, np.float64), i, t)) for i in range(G)] if t < ROUNDS else [a] * G
        results = [stale_outer_step(jnp.asarray(pending.sum(0)), G, jnp.asarray(xs[i]), a, state, opt, LAM)
                   for i in range(G)]
        new_a, state, _, g = results[0]
        np.testing.assert_allclose(np.asarray(g) * LAM, dd, atol=1e-6)
        np.testing.assert_allclose(np.asarray(sgd_trace(state)), dm, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_a), da, atol=1e-6)
        for i in range(G):  # every worker computes the same anchor; its own pending is a_t - x^i_t
            np.testing.assert_array_equal(np.asarray(results[i][0]), np.asarray(new_a))
            np.testing.assert_allclose(np.asarray(results[i][2]), np.asarray(a) - xs[i], atol=1e-7)
        pending = np.stack([np.asarray(r[2]) for r in results])
        a = new_a


# ----------------------------------------------------------------------------- the compiled step

CO2_SYNC = {"co2": CO2Config(momentum_clip=3e-4, gap_penalty=2.0), "outer": OuterConfig(lr=0.7, momentum=0.5)}


@pytest.fixture(scope="module")
def co2_2x2():
    cfg = tiny_config(2, 2, "co2", sync=CO2_SYNC, steps=6)
    return cfg, StepPrograms.for_config(cfg, mesh_for(cfg))


def _f64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))


def _leaves(tree):
    return jax.tree.leaves(tree)


def test_co2_steps_match_numpy(co2_2x2):
    """Three rounds of tau = 2: each sync step's anchor, momentum, pending and params against NumPy,
    given the workers' params after the round's last inner step (the same step run as "local")."""
    cfg, m = co2_2x2
    n = cfg.mesh.replica
    state = m.init_state(0)
    clamped = 0
    for k in range(6):
        batch = m.put_batch(random_batch(cfg, k))
        if k % 2 == 0:
            state, _ = m.step_fn("local")(state, batch)
            continue
        before = _f64(state)
        shadow = jax.device_put(jax.device_get(state), m.state_shardings)  # steps donate their input
        local, _ = m.step_fn("local")(shadow, batch)
        xs = _f64(local.params)  # x^i_t: [N, ...] leaves
        state, metrics = m.step_fn("local_then_sync")(state, batch)
        got = _f64(state)
        a, pend = before.outer.params, before.outer.extra["pending"]
        m_old = {u: sgd_trace(before.outer.opt_state[u]) for u in ("root", "layers")}
        delta = jax.tree.map(lambda p: p.mean(axis=0), pend)  # the previous round's mean
        raw = jax.tree.map(lambda d, mo: BETA * mo + d / LAM, delta, m_old)
        m_new = jax.tree.map(lambda r: np.clip(r, -CO2_SYNC["co2"].momentum_clip, CO2_SYNC["co2"].momentum_clip), raw)
        clamped += sum(int(np.sum(np.abs(r) > CO2_SYNC["co2"].momentum_clip)) for r in _leaves(raw))
        a_new = jax.tree.map(lambda x, mm: x - ALPHA * mm, a, m_new)
        pend_new = jax.tree.map(lambda x, xi: x[None] - xi, a, xs)
        got_m = {u: sgd_trace(got.outer.opt_state[u]) for u in ("root", "layers")}
        for want, have, what in [(a_new, got.outer.params, "anchor"), (m_new, got_m, "momentum"),
                                 (pend_new, got.outer.extra["pending"], "pending")]:
            for w, h in zip(_leaves(want), _leaves(have), strict=True):
                np.testing.assert_allclose(h, w, rtol=2e-5, atol=2e-7, err_msg=f"step {k}: {what}")
        for w, h in zip(_leaves(a_new), _leaves(got.params), strict=True):  # every worker restarts from a_{t+1}
            for i in range(n):
                np.testing.assert_allclose(h[i], w, rtol=2e-5, atol=2e-7, err_msg=f"step {k}: params of worker {i}")
        # The reported norms are those of the pending pseudo gradients each worker sent.
        want_norm = [np.sqrt(sum(np.sum(np.square(p[i])) for p in _leaves(pend))) for i in range(n)]
        np.testing.assert_allclose(np.asarray(metrics["pseudo_grad_norm"]), want_norm, rtol=1e-4, atol=1e-6)
    assert clamped > 0, "the momentum clamp never engaged: the test would not see a wrong clip"


def test_co2_evaluation_model_is_the_flush(co2_2x2):
    cfg, m = co2_2x2
    state = m.init_state(1)
    for k in range(4):
        state, _ = m.step_fn("local_then_sync" if k % 2 else "local")(state, m.put_batch(random_batch(cfg, 10 + k)))
    before = _f64(state)
    synced, _ = m.sync_fn()(state)
    delta = jax.tree.map(lambda p: p.mean(axis=0), before.outer.extra["pending"])
    phi = CO2_SYNC["co2"].momentum_clip
    flush = {u: jax.tree.map(lambda x, d, mo: x - ALPHA * np.clip(BETA * mo + d / LAM, -phi, phi),
                             before.outer.params[u], delta[u], sgd_trace(before.outer.opt_state[u]))
             for u in ("root", "layers")}
    for w, h in zip(_leaves(flush), _leaves(_f64(synced.outer.params)), strict=True):
        np.testing.assert_allclose(h, w, rtol=2e-5, atol=2e-7)
    assert any(np.any(np.abs(w - b) > 1e-6) for w, b in zip(_leaves(flush), _leaves(before.outer.params), strict=True))


# ----------------------------------------------------------------------------- HLO


def _bulk_exchanges_depend_on_batch(cfg) -> list[bool]:
    """For each large collective across `replica` in the sync step's compiled program: does it
    depend (transitively) on the step's batch?"""
    m = StepPrograms.for_config(cfg, mesh_for(cfg))
    state = m.init_state(0)
    text = m.lowered("local_then_sync", state, m.put_batch(random_batch(cfg, 0))).compile().as_text()
    per_device_batch = (cfg.batch_size // (cfg.mesh.replica * cfg.mesh.shard), cfg.data.seq_len + 1)
    batch = [name for name, t in hlo_parse.entry_parameters(text)
             if hlo_parse.parse_shapes(t) == [("s32", per_device_batch)]]
    assert len(batch) == 1, hlo_parse.entry_parameters(text)
    bulk = [r for r in hlo.hlo_collectives(text, (cfg.mesh.replica, cfg.mesh.shard))["collectives"]
            if r["crosses_replica"] and r["operand_bytes"] > 1024]
    assert bulk, "no pseudo-gradient exchange across replica found"
    return [batch[0] in hlo_parse.upstream(text, r["name"]) for r in bulk]


def test_hlo_co2_exchange_is_independent_of_the_round():
    one_stage("3.12", "CO2's exchange in the HLO", 9, other="test_hlo_diloco_exchange_waits_for_the_step")
    assert not any(_bulk_exchanges_depend_on_batch(tiny_config(2, 2, "co2", sync=CO2_SYNC)))


def test_hlo_diloco_exchange_waits_for_the_step():
    """The control: the same check sees DiLoCo's exchange depend on the step's batch."""
    one_stage("default", "DiLoCo's exchange in the HLO", 13, other="test_hlo_co2_exchange_is_independent_of_the_round")
    assert all(_bulk_exchanges_depend_on_batch(tiny_config(2, 2, "diloco")))


# ----------------------------------------------------------------------------- config


def test_co2_fixes_heavy_ball_and_no_penalty():
    mp = plan_for(tiny_config(2, 2, "co2", sync=CO2_SYNC))
    s = mp.cfg.sync
    assert ((s.layerwise, s.outer.nesterov, s.penalty.anomaly, s.penalty.weighting, s.penalty.clip)
            == (False, False, False, False, False))
    assert isinstance(mp.plan.rule, StaleSync) and mp.plan.rule.gap_penalty == 2.0
    assert mp.plan.rule.momentum_clip == 3e-4 and mp.plan.outer.momentum_clip == 3e-4  # the rule's clamp
    assert str(mp.schedule.kind(1)) == "local_then_sync" and str(mp.schedule.kind(0)) == "local"
    assert plan_for(cpu("co2")).changed == () and plan_for(paper("1b", "co2")).changed == ()


@pytest.mark.parametrize("sync, key", [
    ({"co2": CO2Config(gap_penalty=0.0)}, "sync.co2.gap_penalty"),
    ({"co2": CO2Config(momentum_clip=-1.0)}, "sync.co2.momentum_clip"),
    ({"fragments": 2}, "sync.fragments"),
    ({"wire": WireConfig(kind="int8")}, "sync.wire.kind"),
    ({"outer_sharding": "replica_shard"}, "sync.outer_sharding"),
])
def test_co2_bad_settings_name_the_key(sync, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(2, 2, "co2", sync=sync)


def test_co2_fields_rejected_for_other_methods():
    with pytest.raises(ConfigError, match=r"sync\.co2\.momentum_clip.*co2 only"):
        tiny_config(2, 2, "diloco", sync={"co2": CO2Config(momentum_clip=1.0)})
    cfg = tiny_config(2, 2, "co2", sync={"co2": CO2Config(momentum_clip=1.0)})
    validate(cfg)
