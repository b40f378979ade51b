"""The method table (methods.py): normalised configs, schedules, and a configurable outer optimizer."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from edit_jax.config import CO2Config, ConfigError, OuterConfig
from edit_jax.config import MeshConfig
from edit_jax.localsgd.methods import METHODS, OuterSpec, plan_for
from edit_jax.localsgd.outer import Detector, Penalty, make_outer_optimizer, sync_unit
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.presets import cpu
from edit_jax.runtime.mesh import make_mesh
from edit_jax.training.train import train
from edit_jax.validate import load_config
from tests.helpers import REPO, tiny_config
from tests.stages import one_stage


def test_method_fixes_are_written_as_they_take_effect():
    cfg = load_config(os.path.join(REPO, "configs/demo.py"), ["method=diloco"])
    assert cfg.sync.layerwise and cfg.sync.penalty.anomaly  # the demo's EDiT settings, as configured
    mp = plan_for(cfg)
    s = mp.cfg.sync
    assert (s.layerwise, s.penalty.anomaly, s.penalty.weighting, s.penalty.clip) == (False, False, False, False)
    assert {k for k, _, _ in mp.changed} == {"sync.layerwise", "sync.penalty.anomaly", "sync.penalty.weighting",
                                             "sync.penalty.clip"}
    assert not mp.plan.layerwise and mp.plan.penalty == Penalty.off()
    pls = plan_for(load_config(os.path.join(REPO, "configs/demo.py"), ["method=post_local_sgd"]))
    assert (pls.cfg.sync.outer.lr, pls.cfg.sync.outer.momentum) == (1.0, 0.0)
    edit = plan_for(load_config(os.path.join(REPO, "configs/demo.py"), []))
    assert edit.changed == () and edit.cfg == load_config(os.path.join(REPO, "configs/demo.py"), [])
    for name in METHODS:  # presets carry what the table fixes: normalising them changes nothing
        assert plan_for(cpu(name)).changed == (), name


def test_the_rule_of_a_row_decides_its_timing_and_owns_its_hyperparameters(monkeypatch):
    """A METHODS row names a rule factory; where the rule syncs (``in_forward``) and when
    (``asynchronous``) pick the plan's step kinds and its schedule, whatever the method is called,
    and a rule's own fields (CO2's) are its attributes. A row added in this test (a new name for
    the whole-model sync, timed) plans and validates with nothing else registered."""
    from edit_jax.localsgd.methods import Method, StepSchedule, TimeSchedule
    from edit_jax.localsgd.rule import SyncRule
    from edit_jax.localsgd.timed import Timed
    from edit_jax.localsgd.whole_model import WholeModelSync

    for name, m in METHODS.items():
        mp = plan_for(cpu(name))
        rule = mp.plan.rule
        assert isinstance(rule, SyncRule) and mp.plan.layerwise == rule.in_forward, name
        assert isinstance(mp.schedule, TimeSchedule if rule.asynchronous else StepSchedule), name
        assert m.keeps_outer == rule.keeps_outer == (name != "baseline"), name
    assert [n for n in METHODS if plan_for(cpu(n)).plan.rule.asynchronous] == ["a_edit"]
    for name in METHODS:  # a rule is a value: two plans of one config are equal, and hash alike
        a, b = plan_for(cpu(name)).plan, plan_for(cpu(name)).plan
        assert a == b and hash(a.rule) == hash(b.rule) and a.rule is not b.rule, name
    assert plan_for(cpu("edit")).plan.rule != plan_for(cpu("a_edit")).plan.rule
    co2 = plan_for(tiny_config(2, 2, "co2", sync={"co2": CO2Config(gap_penalty=3.0, momentum_clip=0.5)})).plan
    assert (co2.rule.gap_penalty, co2.rule.momentum_clip, co2.outer.momentum_clip) == (3.0, 0.5, 0.5)  # the rule's
    monkeypatch.setitem(METHODS, "timed_diloco", Method("timed_diloco", "DiLoCo's sync by wall clock",
                                                        rule=Timed.around(WholeModelSync.build)))
    cfg = load_config(os.path.join(REPO, "configs/tiny.py"), [
        "method=timed_diloco", "mesh.replica=2", "mesh.shard=1", "mesh.processes=2", "sync.exchange.url=/nowhere",
        "sync.warmup_steps=0"])
    mp = plan_for(cfg)
    assert isinstance(mp.plan.rule, Timed) and not mp.plan.layerwise and isinstance(mp.schedule, TimeSchedule)
    assert str(mp.schedule.sync_kind()) == "local_then_sync"
    # The exchange runs every rule that keeps θ̄ (CO2's too, its in-flight state pooled in the round
    # state): the baseline's refusal names them from the table, the registered one included.
    base = ["mesh.replica=2", "mesh.shard=1", "mesh.processes=2", "sync.exchange.url=/nowhere", "sync.warmup_steps=0"]
    for ok in ("diloco", "co2"):
        assert load_config(os.path.join(REPO, "configs/tiny.py"), [f"method={ok}", *base]).sync.method == ok
    names = "post_local_sgd . diloco . edit . a_edit . co2 . timed_diloco"
    with pytest.raises(ConfigError, match=f"sync.exchange.*method {names}"):
        load_config(os.path.join(REPO, "configs/tiny.py"), ["method=baseline", *base])


def test_only_fields_the_user_set_are_announced():
    # The demo (EDiT) run as DiLoCo: layerwise/anomaly/... were never set by the user (defaults).
    quiet = plan_for(load_config(os.path.join(REPO, "configs/demo.py"), ["method=diloco"]))
    assert quiet.changed and quiet.user_changes() == ()
    # outer.lr=0.5 (an override) and the demo file's outer.momentum=0.5 are not the defaults (0.8,
    # 0.85) and Post Local SGD fixes them: said; its other fixes (defaults) are not.
    said = plan_for(load_config(os.path.join(REPO, "configs/demo.py"), ["method=post_local_sgd", "sync.outer.lr=0.5"]))
    assert set(said.user_changes()) == {("sync.outer.lr", 0.5, 1.0), ("sync.outer.momentum", 0.5, 0.0)}
    assert len(said.changed) > 2


def test_run_dir_config_says_what_ran(tmp_path):
    one_stage("3.12", "the run dir's config of a DiLoCo run", 20)
    cfg = tiny_config(2, 2, method="diloco", steps=2, sync={"layerwise": True, "penalty": {"anomaly": True}})
    train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4])
    saved = json.load(open(tmp_path / "config.json"))["sync"]
    assert saved["method"] == "diloco" and saved["layerwise"] is False and saved["penalty"]["anomaly"] is False


def test_bad_outer_optimizer_names_the_key():
    with pytest.raises(ConfigError, match=r"sync.outer.optimizer.*nesterov, adam.*'lion'"):
        load_config(os.path.join(REPO, "configs/tiny.py"), ["sync.outer.optimizer=lion"])
    with pytest.raises(ConfigError, match=r"model.family.*llama.*'gpt'"):
        load_config(os.path.join(REPO, "configs/tiny.py"), ["model.family=gpt"])


def test_outer_adam_step_matches_numpy():
    """One sync of a unit with an outer Adam: θ̄ ← θ̄ − lr·m̂/(√v̂ + ε) on the weighted pseudo gradient,
    and the unit's Adam state (count, mu, nu) is carried."""
    mesh = make_mesh(MeshConfig(replica=2, shard=1), jax.devices()[:2])
    lr, b1, b2 = 0.1, 0.5, 0.9
    opt = make_outer_optimizer(OuterSpec("adam", lr, b1, True, b2))
    theta = {"w": np.array([0.3, -0.1, 0.2], np.float32)}
    d = [np.array([1.0, -2.0, 0.5], np.float32), np.array([3.0, 0.0, -1.0], np.float32)]
    local = {"w": np.stack([theta["w"] - d[0], theta["w"] - d[1]])}
    pen = Penalty(anomaly=False, weighting=False, clip=False)

    def body(local, theta, det):
        state = opt.init(theta)
        for _ in range(2):  # two syncs from the same local params: the second sees Adam's moments
            res = sync_unit(jax.tree.map(lambda x: x[0], local), theta, state, jax.tree.map(lambda x: x[0], det), pen,
                            opt)
            theta, state = res.outer_params, res.opt_state
        return theta, state[0].count, state[0].mu, state[0].nu

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(REPLICA), P(), P(REPLICA)), out_specs=P()))
    new_theta, count, mu, nu = jax.device_get(f(local, theta, Detector.zeros((2,), 3)))
    # NumPy Adam on the plain mean of the workers' pseudo gradients (weighting off).
    t = theta["w"].astype(np.float64)
    m = v = np.zeros(3)
    for step in (1, 2):
        g = np.mean([t - (theta["w"] - d[0]), t - (theta["w"] - d[1])], axis=0)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        t = t - lr * (m / (1 - b1 ** step)) / (np.sqrt(v / (1 - b2 ** step)) + 1e-8)
    assert int(count) == 2
    np.testing.assert_allclose(mu["w"], m, rtol=1e-5)
    np.testing.assert_allclose(nu["w"], v, rtol=1e-5)
    np.testing.assert_allclose(new_theta["w"], t, rtol=1e-5, atol=1e-7)


def test_outer_adam_run_end_to_end(tmp_path):
    """EDiT with an outer Adam trains, checkpoints and resumes; each unit's Adam step count is the
    number of syncs."""
    one_stage("default", "an outer-Adam run end to end", 26)
    from edit_jax.rundir.checkpoint import Checkpointer
    from edit_jax.localsgd.state import state_shapes

    cfg = tiny_config(2, 2, method="edit", steps=8, checkpoint_every=4,
                      sync={"outer": OuterConfig(optimizer="adam", lr=0.05, momentum=0.9), "tau": 2})
    first = train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4], stop_after=4)
    assert first.interrupted and first.steps == 4
    result = train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4])
    assert result.resumed_from == 4 and result.steps == 8
    losses = [r["loss"] for r in result.history]
    assert all(np.isfinite(losses)) and np.isfinite(result.final_val_loss)
    host, _ = Checkpointer(str(tmp_path), 2).restore_host(8, state_shapes(cfg))
    adam = host.outer.opt_state
    syncs = int(host.outer.syncs)
    assert syncs == 3  # syncs inside steps 2, 4, 6 (W = 0, τ = 2)
    assert int(adam["root"][0].count) == syncs
    np.testing.assert_array_equal(np.asarray(adam["layers"][0].count), [syncs] * cfg.model.n_layers)
    assert float(np.abs(np.asarray(adam["root"][0].nu["embed"])).max()) > 0
    assert json.load(open(tmp_path / "config.json"))["sync"]["outer"]["optimizer"] == "adam"
