"""End to end: config errors, run-dir outputs, checkpoints (resume exactness with real kills,
corrupt and incompatible checkpoints), elastic restarts, and the 8 x 8 mesh."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from edit_jax.config import ConfigError
from edit_jax.localsgd.state import STATE_FORMAT
from edit_jax.rundir.checkpoint import CheckpointError
from edit_jax.training.train import train
from edit_jax.validate import load_config
from tests.helpers import REPO, child_xla_flags, tiny_config
from tests.stages import one_stage


def devs(cfg):
    return jax.devices()[: cfg.mesh.replica * cfg.mesh.shard]


def _records(run_dir, key="loss"):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r[key] for r in recs if key in r}


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("override,match", [
    ("mesh.replcia=2", r"unknown config key 'mesh.replcia'.*did you mean mesh.replica"),
    ("steps=ten", r"config key 'steps': expected a value of type int, got 'ten'"),
    ("batch_size=12", r"config key 'batch_size': global batch 12 must be divisible by .* 2 x 4 = 8"),
    ("method=sgd", r"config key 'sync.method': expected one of baseline, post_local_sgd, diloco, edit"),
    ("model.n_kv_heads=3", r"config key 'model.n_kv_heads'"),
    ("model.remat_saves=all", r"config key 'model.remat_saves': expected one of nothing, dots, dots_attention"),
    ("sync.outer.momentum=1.5", r"config key 'sync.outer.momentum'"),
    ("model", r"expected key=value"),
])
def test_bad_config_names_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(os.path.join(REPO, "configs/tiny.py"), [override])


def test_cli_bad_config_fails_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "edit_jax", "train", "--config", "configs/tiny.py",
                           "--run-dir", str(run_dir), "mesh.shard=3"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "mesh.shard" in proc.stderr and "divisible" in proc.stderr
    assert not run_dir.exists()  # nothing was written


def test_missing_data_path_is_named(tmp_path):
    cfg = tiny_config()
    cfg.data.source, cfg.data.paths = "text", (str(tmp_path / "nope*.txt"),)
    from edit_jax.data import DataError

    with pytest.raises(DataError, match="nope"):
        train(cfg, str(tmp_path / "run"), progress=False, devices=devs(cfg))


# ----------------------------------------------------------------------------- a run


def test_run_dir_outputs_and_loss_falls(tmp_path):
    one_stage("default", "a run dir's outputs and a falling loss", 29)
    cfg = tiny_config(2, 4, method="edit", steps=24, eval_every=12, eval_batches=2, seq_len=64,
                      optim={"warmup_steps": 4}, sync={"warmup_steps": 4, "tau": 4})
    result = train(cfg, str(tmp_path), progress=False, devices=devs(cfg))
    assert result.steps == 24 and not result.interrupted
    losses = _records(tmp_path)
    assert losses[24] < losses[1] - 1.0  # from ~log(320)=5.8 down well below
    vals = _records(tmp_path, "val_loss")
    assert set(vals) == {12, 24} and vals[24] < vals[12]
    syncs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"sync": true' in line]
    assert [s["step"] for s in syncs] == [9, 13, 17, 21]  # syncs inside steps W + k*tau (0-based 8, 12, ...)
    assert all(len(s["weight"]) == 2 and abs(sum(s["weight"]) - 1) < 1e-5 for s in syncs)
    saved = json.load(open(tmp_path / "config.json"))
    assert saved["sync"]["method"] == "edit" and saved["mesh"]["replica"] == 2
    assert os.listdir(tmp_path / "checkpoints") == ["24"]


def test_edit_loss_falls_like_baseline_on_4x2():
    """EDiT and the Baseline on a 4 x 2 mesh, same data and steps: both learn, and EDiT's
    validation loss ends within 10% of the Baseline's."""
    one_stage("default", "EDiT against the Baseline on 4 x 2", 21,
              other="test_edit_trains_on_8x8_mesh")
    results = {}
    for method in ("baseline", "edit"):
        cfg = tiny_config(4, 2, method=method, steps=30, seq_len=32, eval_batches=2,
                          optim={"warmup_steps": 3}, sync={"warmup_steps": 6, "tau": 4})
        results[method] = train(cfg, None, progress=False, devices=devs(cfg))
    assert results["baseline"].final_val_loss < 4.0 and results["edit"].final_val_loss < 4.0  # from 5.77
    assert results["edit"].final_val_loss < 1.1 * results["baseline"].final_val_loss


def test_edit_trains_on_8x8_mesh(tmp_path):
    one_stage("3.12", "EDiT on an 8 x 8 mesh", 19,
              other="test_edit_loss_falls_like_baseline_on_4x2")
    cfg = tiny_config(8, 8, method="edit", steps=8, batch_size=64, seq_len=16,
                      sync={"warmup_steps": 2, "tau": 3})
    result = train(cfg, None, progress=False, devices=devs(cfg))
    assert np.isfinite(result.final_loss) and result.final_val_loss < 5.5


# ----------------------------------------------------------------------------- resume exactness


def _cli(run_dir, *overrides):
    cmd = [sys.executable, "-m", "edit_jax", "train", "--config", "configs/tiny.py", "--run-dir", str(run_dir),
           "--no-progress", "method=edit", "steps=24", "log_every=1", "checkpoint_every=5", "sync.warmup_steps=3",
           "sync.tau=4", "data.seq_len=32", *overrides]
    env = dict(os.environ, XLA_FLAGS=child_xla_flags())  # the CLI sets its own device count
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(run_dir, step, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(path) and any(s >= step for s in _records(run_dir)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise TimeoutError


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    one_stage("3.12", "a killed run resumed exactly (SIGKILL, SIGTERM)", 95,
              other="test_restarts.py::test_killed_worker_is_restarted_and_the_run_ends_with_the_uninterrupted_losses")
    run_dir = tmp_path_factory.mktemp("full")
    proc = _cli(run_dir)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return _records(run_dir)


def test_killed_run_resumes_exactly(tmp_path, uninterrupted):
    """SIGKILL mid-window (after the checkpoint at 10; syncs run in steps 7, 11, 15, ...), resume,
    then SIGTERM (which checkpoints at the current step), resume again: the losses of every step
    equal the uninterrupted run's, bit for bit."""
    proc = _cli(tmp_path)
    _wait_for_step(tmp_path, 12, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    resumed = _cli(tmp_path)
    _wait_for_step(tmp_path, 17, resumed)
    resumed.send_signal(signal.SIGTERM)
    out, err = resumed.communicate(timeout=120)
    assert "resumed from" in err and "/checkpoints/10" in err
    assert resumed.returncode == 130 and "checkpoint saved" in err, err
    stopped_at = max(_records(tmp_path))
    assert str(stopped_at) in os.listdir(tmp_path / "checkpoints")  # SIGTERM saved the current step
    final = _cli(tmp_path)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    assert f"/checkpoints/{stopped_at}" in err
    losses = _records(tmp_path)
    assert sorted(losses) == sorted(uninterrupted)  # no step lost or logged twice
    for step, loss in uninterrupted.items():
        assert losses[step] == loss, (step, losses[step], loss)  # bit-exact on CPU


# ----------------------------------------------------------------------------- broken checkpoints


def _tree_digest(path):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def test_corrupt_checkpoint_is_reported_and_kept(tmp_path):
    cfg = tiny_config(2, 4, steps=3)
    train(cfg, str(tmp_path), progress=False, devices=devs(cfg))
    ckpt = tmp_path / "checkpoints" / "3"
    victims = [os.path.join(r, f) for r, _, fs in os.walk(ckpt / "state") for f in fs if "manifest" in f or
               f.endswith(".zarray") or "d" in r.split(os.sep)[-1]]
    assert victims
    for v in victims:
        with open(v, "wb") as f:
            f.write(b"garbage")
    before = _tree_digest(ckpt)
    cfg.steps = 6
    with pytest.raises(CheckpointError, match=r"checkpoints/3 could not be restored.*left untouched"):
        train(cfg, str(tmp_path), progress=False, devices=devs(cfg))
    assert _tree_digest(ckpt) == before
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]


def test_incompatible_checkpoint_names_keys(tmp_path):
    train(tiny_config(2, 4, steps=2), str(tmp_path), progress=False, devices=jax.devices()[:8])
    other = tiny_config(2, 4, steps=4, model={"d_model": 128})
    with pytest.raises(CheckpointError, match=r"model.d_model: checkpoint 64, config 128"):
        train(other, str(tmp_path), progress=False, devices=devs(other))


# ----------------------------------------------------------------------------- elasticity


def test_elastic_restart_with_more_replicas(tmp_path, capfd):
    one_stage("default", "a restart with more replicas", 32)
    cfg = tiny_config(2, 4, method="edit", steps=6, sync={"warmup_steps": 0, "tau": 3})
    train(cfg, str(tmp_path), progress=False, devices=devs(cfg))
    from edit_jax.rundir.checkpoint import Checkpointer
    from edit_jax.localsgd.state import state_shapes

    host, _ = Checkpointer(str(tmp_path), 2).restore_host(6, state_shapes(cfg))
    theta = host.outer.params
    bigger = tiny_config(4, 4, method="edit", steps=9, sync={"warmup_steps": 0, "tau": 3})
    from edit_jax.runtime.mesh import make_mesh
    from edit_jax.localsgd.methods import plan_for
    from edit_jax.localsgd.state import StateLayout

    layout = StateLayout(plan_for(bigger), make_mesh(bigger.mesh, jax.devices()[:16]))
    state = layout.elastic_state(host, old_n=2)
    for new, t in zip(jax.tree.leaves(state.params), jax.tree.leaves(theta), strict=True):
        new = np.asarray(new)
        assert new.shape[0] == 4
        for r in range(4):  # every replica, old or new, restarts from θ̄
            np.testing.assert_array_equal(new[r], np.asarray(t))
    for a, b in zip(jax.tree.leaves(state.outer.params), jax.tree.leaves(theta), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the outer state carries over
    det = np.asarray(state.outer.detector.count)
    np.testing.assert_array_equal(det[:2], np.asarray(host.outer.detector.count))
    assert (det[2:] == 0).all()  # new workers' detectors start fresh
    capfd.readouterr()
    result = train(bigger, str(tmp_path), progress=False, verbose=True, devices=jax.devices()[:16])
    assert result.resumed_from == 6 and result.steps == 9 and np.isfinite(result.final_loss)
    assert "elastic restart: checkpoint 6 has mesh.replica=2, this run 4" in capfd.readouterr().err  # issue 13


def test_placement_file_drives_the_mesh(tmp_path):
    """`edit-jax placement` on an 8-device network whose fast pairs are interleaved (0,2,4,6 on
    one node, 1,3,5,7 on another) writes a device order that puts each node in one replica;
    training with `mesh.placement` builds that mesh and trains."""
    one_stage("3.12", "a placement file", 12)
    from edit_jax.commands.placement import main as placement_main
    from edit_jax.runtime.mesh import make_mesh

    n = 8
    node = [i % 2 for i in range(n)]
    delay = [[0.0 if node[i] == node[j] else 10.0 for j in range(n)] for i in range(n)]
    bw = [[100.0 if node[i] == node[j] else 1.0 for j in range(n)] for i in range(n)]
    topo = tmp_path / "net.json"
    topo.write_text(json.dumps({"delay_ms": delay, "bandwidth_gbps": bw}))
    place = tmp_path / "place.json"
    rc = placement_main(["--topology", str(topo), "--objective", "edit", "--replica", "2", "--shard", "4",
                         "--evaluations", "200", "--params", "1e8", "--json", str(place), "--no-baselines"])
    assert rc == 0
    cfg = tiny_config(2, 4, method="edit", steps=4)
    cfg.mesh.placement = str(place)
    mesh = make_mesh(cfg.mesh, devs(cfg))
    for r in range(2):
        ids = {jax.devices().index(d) for d in mesh.devices[r]}
        assert ids in ({0, 2, 4, 6}, {1, 3, 5, 7}), ids  # a replica is one fast node
    result = train(cfg, None, progress=False, devices=devs(cfg))
    assert np.isfinite(result.final_loss)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device_order": [0, 1, 2]}))
    cfg.mesh.placement = str(bad)
    from edit_jax.placement import PlacementError

    with pytest.raises(PlacementError, match="bad.json"):
        make_mesh(cfg.mesh, devs(cfg))


def test_long_unlogged_run_does_not_deadlock(tmp_path):
    """With nothing fetched for many steps the loop used to queue every step, and XLA:CPU's
    collective rendezvous deadlocked on the 8-device mesh (abort after 40 s). The loop now caps the
    steps in flight. Reproduces in a fresh 8-device process (the CLI), not in this 64-device one."""
    one_stage("3.12", "the long unlogged run", 35)
    # XLA's default -O2, not the suite's -O0: the demo model's 100 steps ran 2x slower without it.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "edit_jax", "train", "--config", "configs/demo.py", "--run-dir",
                           str(tmp_path), "--no-progress", "method=baseline", "steps=100", "log_every=1000",
                           "eval_every=0", "checkpoint_every=0", "eval_batches=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done at step 100" in proc.stdout


# ----------------------------------------------------------------------------- checkpoints of older formats


def _resumes_like_the_old_code(tmp_path, fixture: str):
    """Resumes ``fixture``'s ``checkpoints/4`` (an 8-step run of an older state format, on
    legacy_edit_run's corpus) with today's code: steps 5 to 8 and the final validation loss are the
    old code's uninterrupted run's (``expected.json``), and what it saved is the current format."""
    import shutil

    from edit_jax.config import from_dict
    from edit_jax.config.renames import quiet, upgrade

    run = tmp_path / "run"
    shutil.copytree(os.path.join(fixture, "checkpoints"), run / "checkpoints")
    with open(os.path.join(fixture, "expected.json")) as f:
        expected = json.load(f)
    cfg = from_dict(upgrade(expected["config"], quiet))  # (older fixtures: keys since moved into sections)
    # the same text wherever the tests run from
    cfg.data.paths = (os.path.join(REPO, "tests", "fixtures", "legacy_edit_run", "corpus.txt"),)
    result = train(cfg, str(run), progress=False, devices=jax.devices()[:4])
    assert result.resumed_from == 4 and result.steps == 8
    got = {r["step"]: r["loss"] for r in result.history}
    want = {int(k): v for k, v in expected["losses"].items()}
    assert sorted(got) == [5, 6, 7, 8]
    # Within a few ulps under the jax that wrote the fixture (XLA:CPU's kernels follow the host's
    # vector instructions, so the last bit differs between machines: 1 ulp at step 7 on a Xeon
    # without the writer's, 2026-11-28); other jax versions may round differently.
    tol = 1e-6 if jax.__version__ == expected["jax"] else 1e-4
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=tol, err_msg=f"step {k}")
    np.testing.assert_allclose(result.final_val_loss, expected["final_val_loss"], rtol=tol)
    meta = json.load(open(run / "checkpoints" / "8" / "meta" / "metadata"))
    assert meta["state_format"] == STATE_FORMAT


def test_legacy_checkpoint_resumes(tmp_path):
    """A checkpoint written before the outer state held an optax state (format 1: `outer.trace`)
    resumes and reproduces the losses the old code computed without interruption. Under the default
    Python only: format 1's translation is the loader's Python; reading an older orbax checkpoint
    under 3.12's jax and orbax is test_format2_checkpoint_resumes[co2]'s, which runs there."""
    one_stage("default", "the format-1 checkpoint resumed", 27, other="test_format2_checkpoint_resumes[co2]")
    _resumes_like_the_old_code(tmp_path, os.path.join(REPO, "tests", "fixtures", "legacy_edit_run"))


@pytest.mark.parametrize("case", ["co2", "edit_int8_ef"])
def test_format2_checkpoint_resumes(tmp_path, case):
    """A checkpoint of state format 2 (the error-feedback residuals and CO2's in-flight pseudo
    gradients as fields of OuterState; now the rule's own subtree, ``outer.extra``) resumes and
    reproduces the losses the old code computed without interruption. CO2's case runs under Python
    3.12 only, beside test_legacy_checkpoint_resumes under the default (both: an older checkpoint
    read by today's jax and orbax, a translation in Python); edit_int8_ef's runs in both stages."""
    if case == 'edit_int8_ef':
        one_stage("default", "the format-2 EDiT + int8 checkpoint", 13, other="the format-2 CO2 one")
    if case == "co2":
        one_stage("3.12", "CO2's format-2 checkpoint resumed", 17, other="test_legacy_checkpoint_resumes")
    _resumes_like_the_old_code(tmp_path, os.path.join(REPO, "tests", "fixtures", "format2_run", case))
