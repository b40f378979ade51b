"""Issue 31, item 1: loss spikes roll back by themselves. The rule against a hand computation
(NumPy medians), the stream moving past skipped batches, rotation and restore keeping the healthy
checkpoint, and real runs through the CLI with one process and with one per worker: an injected
spike rolls back and finishes as the clean run does; a run that blows up for good exits 3 and a
rerun at a sane learning rate does not resume a blown-up checkpoint."""

import json
import math
import os

import numpy as np
import pytest

from edit_jax.config import ConfigError, apply_overrides
from edit_jax.data import load_corpus, make_train_stream
from edit_jax.rundir.checkpoint import Checkpointer
from edit_jax.training.resume import restore_verified
from edit_jax.data.corrupt import parse_lr_spike
from edit_jax.training.spike import SpikeWatch
from edit_jax.validate import validate
from tests.helpers import tiny_config
from tests.stages import one_stage
from tests.test_failures import _clean, _cli, _steps

# ----------------------------------------------------------------------------- the rule


def _watch(**spike):
    cfg = apply_overrides(tiny_config(2, 2), [f"train.spike.{k}={v}" for k, v in spike.items()])
    return SpikeWatch(cfg), math.log(cfg.model.vocab_size)


def _reference(history, mads, margin):
    h = np.asarray(history, np.float64)
    return np.median(h) + max(mads * np.median(np.abs(h - np.median(h))), margin * np.median(h))


def test_threshold_is_the_median_plus_mads_or_margin_by_hand():
    watch, _ = _watch(window=5, mads=3.0, margin=0.1)
    for step, loss in enumerate([3.0, 3.2, 2.9, 3.1, 3.05], start=1):
        assert not watch.observe(step, {"loss": loss}).spike
    # median 3.05, |x - median| = .05 .15 .15 .05 0 -> MAD .05; 3 MADs = .15 < 10% of 3.05 = .305
    assert watch.threshold() == pytest.approx(3.05 + 0.305)
    assert not watch.observe(6, {"loss": 3.35}).spike  # healthy: enters the window, 3.0 leaves it
    # median 3.1, deviations .1 .2 0 .05 .25 -> MAD .1; 3 MADs = .3 < 10% of 3.1 = .31
    assert watch.threshold() == pytest.approx(3.41)
    assert watch.threshold() == pytest.approx(_reference([3.2, 2.9, 3.1, 3.05, 3.35], 3.0, 0.1))
    assert watch.observe(7, {"loss": 3.42}).spike
    wide, _ = _watch(window=4, mads=6.0, margin=0.01)
    for step, loss in enumerate([2.0, 3.0, 2.5, 4.0], start=1):
        wide.observe(step, {"loss": loss})
    assert wide.threshold() == pytest.approx(_reference([2.0, 3.0, 2.5, 4.0], 6.0, 0.01))  # the MAD term wins
    assert wide.threshold() == pytest.approx(2.75 + 6 * 0.5)


def test_before_a_full_window_only_worse_than_guessing_is_a_spike():
    watch, ln_v = _watch(window=4, margin=0.2)
    assert watch.threshold() == pytest.approx(1.2 * ln_v)
    assert not watch.observe(1, {"loss": 1.19 * ln_v}).spike
    assert watch.observe(2, {"loss": 1.21 * ln_v}).spike


def test_patience_settling_and_what_is_trusted():
    watch, _ = _watch(window=3, patience=2, margin=0.5)
    for step in (1, 2, 3):
        watch.observe(step, {"loss": 2.0})
    assert watch.trusted_through == 2 and watch.healthy  # a record at step 3 vouches for step 2's params
    v = [watch.observe(step, {"loss": 9.0}) for step in (4, 5)]
    assert all(x.spike and not x.roll_back for x in v) and not watch.healthy and watch.spike_since == 4
    settled = watch.observe(6, {"loss": 2.1})
    assert settled.settled == 4 and watch.healthy and watch.trusted_through == 5
    for step in (7, 8):
        assert not watch.observe(step, {"loss": 9.0}).roll_back
    assert watch.observe(9, {"loss": 9.0}).roll_back  # a third spiked record: more than patience=2
    assert watch.trusted_through == 5 and list(watch.history) == [2.0, 2.0, 2.1]  # spiked records kept out


def test_one_workers_garbage_is_not_a_spike_of_the_run_but_nonfinite_is():
    watch, _ = _watch(window=2, patience=5)
    for step in (1, 2):
        watch.observe(step, {"loss": 2.0, "replica_loss": [2.0, 2.0]})
    assert not watch.observe(3, {"loss": 50.0, "replica_loss": [2.0, 98.0]}).spike  # EDiT's penalty's job
    assert not watch.observe(4, {"loss": math.nan, "replica_loss": [2.0, math.nan]}).spike
    assert watch.observe(5, {"loss": 2.0}, nonfinite=True).roll_back  # the drivers' rule says the run is lost


def test_disabled_watch_never_rolls_back_a_finite_spike():
    watch, _ = _watch(enabled="false", window=2)
    for step, loss in enumerate([2.0, 2.0, 500.0, 500.0, 500.0, 500.0], start=1):
        assert not watch.observe(step, {"loss": loss}).spike
    assert watch.healthy


@pytest.mark.parametrize("override, key", [("train.spike.window=0", "train.spike.window"),
                                           ("train.spike.max_rollbacks=-1", "train.spike.max_rollbacks"),
                                           ("debug.lr_spike=5:10", "debug.lr_spike"),
                                           ("debug.lr_spike=9-5:10", "debug.lr_spike"),
                                           ("debug.lr_spike=1-2:-3", "debug.lr_spike")])
def test_bad_spike_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(apply_overrides(tiny_config(2, 2), [override]))
    assert parse_lr_spike("20-22:100").active(22) and not parse_lr_spike("20-22:100").active(23)


# ----------------------------------------------------------------------------- the stream skips


def test_stream_skip_reads_later_batches_and_survives_a_resume():
    cfg = tiny_config(2, 2)
    corpus = load_corpus(cfg.data)
    fresh = make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, 2, cfg.data.seed)
    rolled = make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, 2, cfg.data.seed)
    rolled.skip(5)
    np.testing.assert_array_equal(rolled.replica_batch(1, 3), fresh.replica_batch(1, 8))
    rolled.step = 3
    resumed = make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, 2, cfg.data.seed)
    resumed.set_state(json.loads(json.dumps(rolled.get_state())))
    assert resumed.offset == 5 and resumed.step == 3
    np.testing.assert_array_equal(resumed.replica_batch(0), fresh.replica_batch(0, 8))
    old = {k: v for k, v in rolled.get_state().items() if k != "offset"}  # saved before rollbacks existed
    resumed.set_state(old)
    assert resumed.offset == 0


# ----------------------------------------------------------------------------- checkpoints keep the healthy one


def _saved(tmp_path, healthy_by_step, keep=2):
    """Checkpoints of a tiny state at the given steps, with these health flags."""
    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.localsgd.methods import plan_for
    from edit_jax.runtime.mesh import make_mesh
    import jax

    cfg = tiny_config(2, 2)
    programs = StepPrograms(plan_for(cfg), make_mesh(cfg.mesh, jax.devices()[:4]))
    state = programs.init_state(0, None)
    ckpt = Checkpointer(str(tmp_path), keep)
    for step, healthy in healthy_by_step:
        ckpt.save(step, state, {"step": step}, cfg, healthy=healthy)
    return ckpt, cfg, programs


def test_rotation_keeps_the_newest_healthy_checkpoint_during_a_spike(tmp_path):
    ckpt, *_ = _saved(tmp_path, [(2, True), (4, True), (6, False), (8, False), (10, False)], keep=2)
    try:
        assert ckpt.all_steps() == [4, 8, 10]  # 4 outlives rotation: the rollback's target
    finally:
        ckpt.close()


def test_restore_skips_checkpoints_written_during_a_spike(tmp_path):
    ckpt, cfg, programs = _saved(tmp_path, [(2, True), (4, False), (6, False)], keep=5)
    said = []
    try:
        _, _, step = restore_verified(ckpt, cfg, programs, said.append, None)
        assert step == 2 and ckpt.all_steps() == [2]
        assert sorted(os.listdir(tmp_path / "checkpoints.spike")) == ["4", "6"]  # moved, not deleted
        assert any("checkpoint 6 was written during a loss spike" in line for line in said), said
    finally:
        ckpt.close()


# ----------------------------------------------------------------------------- real runs, both modes

SPIKE = ["method=baseline", "steps=30", "checkpoint_every=5", "log_every=1", "eval_every=0"]


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_injected_spike_rolls_back_and_finishes_like_the_clean_run_in_both_modes(tmp_path):
    """HSDP (nothing of EDiT's own guards) with the updates of steps 20..23 x 3000: the loss
    blows up and stays up, the run rolls back to checkpoint 20, skips batches 20..24 and ends
    within 2% of the clean run's validation loss; 2 processes do exactly what 1 does."""
    one_stage("default", "an injected spike rolled back in both modes", 46)
    runs = {}
    for name, processes, extra in [("clean", 1, []), ("one", 1, ["debug.lr_spike=20-23:3000"]),
                                   ("two", 2, ["debug.lr_spike=20-23:3000"])]:
        code, out = _cli(tmp_path / name, processes, *SPIKE, *extra)
        assert code == 0, out[-3000:]
        _clean(out, processes)
        runs[name] = (out, _records(tmp_path / name))
    val = {name: [r["val_loss"] for r in recs if "val_loss" in r][-1] for name, (_, recs) in runs.items()}
    backs = {name: [r["rollback"] for r in recs if "rollback" in r] for name, (_, recs) in runs.items()}
    assert backs["clean"] == [] and len(backs["one"]) == 1, runs["one"][0][-3000:]
    back = backs["one"][0]
    assert back["to_step"] == 20 and back["skipped_batches"] == [20, back["from_step"]], back
    assert "rolled back from step" in runs["one"][0] and "to checkpoint 20" in runs["one"][0]
    assert [{k: v for k, v in b.items()} for b in backs["two"]] == backs["one"]
    assert abs(val["one"] - val["clean"]) / val["clean"] < 0.02, val
    np.testing.assert_allclose(val["two"], val["one"], rtol=2e-5)


@pytest.mark.parametrize("processes", [1, 2])
def test_blown_up_run_exits_3_and_a_sane_rerun_does_not_resume_it(tmp_path, processes):
    """The issue's run: lr 1e6, a checkpoint every 2 steps. The record after checkpoint 2 is
    already non-finite, so nothing vouches for 2: it goes to checkpoints.spike/ (kept), the run
    exits 3; the same command at a sane lr starts from step 0 and finishes (before: it resumed
    the blown-up checkpoint and exited 3 again)."""
    if processes == 2:
        one_stage("3.12", "the 2-process blown-up run", 31,
                  other="[1] and test_failures.py::test_divergence_exits_3_and_keeps_the_good_checkpoint[2]")
    else:  # (the same scenario in one process: its pair is [2])
        one_stage("default", "the 1-process blown-up run", 18, other="this test's [2]")
    over = ["method=edit", "steps=4", "checkpoint_every=2", "log_every=10"]
    code, out = _cli(tmp_path, processes, *over, "optim.lr=1e6")
    assert code == 3, out[-3000:]
    assert "not rolled back (no checkpoint before the spike)" in out and "A rerun resumes from step 0" in out
    _clean(out, processes)
    assert _steps(tmp_path) == [] and _steps(tmp_path, "checkpoints.spike") == [2]
    code, out = _cli(tmp_path, processes, *over)
    assert code == 0 and "resumed from" not in out, out[-3000:]
    assert _steps(tmp_path)[-1] == 4


def test_spike_after_max_rollbacks_exits_3_and_names_the_checkpoint_left(tmp_path):
    one_stage("3.12", "a spike past the rollbacks", 7)
    code, out = _cli(tmp_path, 1, *SPIKE, "debug.lr_spike=20-23:3000", "train.spike.max_rollbacks=0")
    assert code == 3, out[-3000:]
    assert ("not rolled back (train.spike.max_rollbacks=0 reached). A rerun resumes from checkpoint 20"
            in out), out[-3000:]
    assert _steps(tmp_path) == [15, 20]  # nothing newer than the last healthy record was written
