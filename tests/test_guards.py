"""Guards that no other test pinned down, each at the unit level (no training run, no process):

- the anomaly detector's z-test (``outer.detector_test``): strict ``>`` at its boundary, and the
  window's standard deviation with ddof = 1 (the reference's);
- the HLO reader (``tools.hlo_parse``, ``tools.hlo``, ``tools.hlo_overlap``, ``tools.profile``)
  sees every collective kind (collective-permute, ragged-all-to-all, collective-broadcast, the
  async ``-start`` / ``-done`` forms) and whether it crosses ``replica``, on hand-written HLO and
  on a real compiled ``ppermute``;
- the launcher's restart line (``runtime.restarts``) names the newest finished checkpoint, the one
  the workers resume from;
- ``training.resume.check_before_save`` with one worker non-finite: skipped mid-run, an error
  (``DivergedError``, the CLI's exit 3) at the final save.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.localsgd.outer import Detector, Penalty, detector_test
from edit_jax.analysis import hlo, hlo_overlap, hlo_parse

# ----------------------------------------------------------------------------- the detector's z-test


def _detector(window: list[float], n: int, warmup: int) -> Detector:
    """n detectors with mean 0, M2 = 1 (sigma = 1: z = g exactly), past their warmup, all with
    ``window`` as their last K z-scores."""
    k = len(window)
    return Detector(mean=jnp.zeros((n,), jnp.float32), m2=jnp.ones((n,), jnp.float32),
                    count=jnp.full((n,), warmup, jnp.int32),
                    window=jnp.broadcast_to(jnp.asarray(window, jnp.float32), (n, k)))


def _flags(window: list[float], g: list[float], threshold: float = 3.0) -> list[bool]:
    p = Penalty(warmup=4, threshold=threshold)
    return np.asarray(detector_test(_detector(window, len(g), p.warmup), jnp.asarray(g, jnp.float32), p)).tolist()


def test_detector_z_equal_to_the_threshold_is_not_an_anomaly_the_next_float_is():
    """flagged = z > delta * max(1, std(window)), strictly. With sigma = 1 and mean 0, z = g; a
    window of zeros has std 0, so the bound is delta = 3 exactly; a window (-2, 0, 2) has std 2
    exactly (ddof 1: 8 / 2 = 4), so the bound is 6 exactly. Equal is not flagged; the next float32
    up is."""
    up = lambda x: float(np.nextafter(np.float32(x), np.float32(np.inf)))
    assert _flags([0.0, 0.0, 0.0], [3.0, up(3.0), 2.0]) == [False, True, False]
    assert _flags([-2.0, 0.0, 2.0], [6.0, up(6.0), 5.0]) == [False, True, False]
    # Before the warmup nothing finite is flagged; a non-finite norm always is.
    p = Penalty(warmup=4, threshold=3.0)
    early = _detector([0.0, 0.0, 0.0], 3, 3)
    assert np.asarray(detector_test(early, jnp.asarray([100.0, np.nan, np.inf], jnp.float32), p)).tolist() == [
        False, True, True]


def test_detector_window_std_uses_ddof_1():
    """Window (-2, 0, 2): its std is 2 with ddof 1 (bound 6) but sqrt(8/3) = 1.63 with ddof 0
    (bound 4.90). z = 5.5 lies between: not flagged (ddof 1). z = 6.5 is above both."""
    window = [-2.0, 0.0, 2.0]
    w = np.asarray(window)
    assert 3.0 * np.std(w, ddof=0) < 5.5 < 3.0 * np.std(w, ddof=1) < 6.5
    assert _flags(window, [5.5, 6.5]) == [False, True]
    # A longer window, whose std is above 1 with either ddof: (1, -1, 3, -3): ddof 1 sqrt(20/3) =
    # 2.58 (bound 7.75), ddof 0 sqrt(5) = 2.24 (bound 6.71).
    assert _flags([1.0, -1.0, 3.0, -3.0], [7.2, 7.8]) == [False, True]


# ----------------------------------------------------------------------------- the HLO reader

# A (replica=2, shard=2) mesh: position p is on replica p // 2, so {0,2} / {1,3} cross replica and
# {0,1} / {2,3} stay inside one. Each kind once across replica (_r) and once inside one (_s).
_HLO = """HloModule m, entry_computation_layout={(f32[4]{0}, s32[2]{0}, f32[4,4]{1,0})->f32[4]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4], off: s32[2], m: f32[4,4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %off = s32[2]{0} parameter(1)
  %m = f32[4,4]{1,0} parameter(2)
  %cp_r = f32[4]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %cp_s = f32[4]{0} collective-permute(%x), channel_id=2, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %cps_r = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=3, source_target_pairs={{0,2},{2,0}}
  %d1 = f32[4]{0} dot(%m, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %cpd_r = f32[4]{0} collective-permute-done(%cps_r)
  %cps_s = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=4, source_target_pairs={{2,3},{3,2}}
  %cpd_s = f32[4]{0} collective-permute-done(%cps_s)
  %d2 = f32[4]{0} dot(%m, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ra_r = f32[4]{0} ragged-all-to-all(%x, %x, %off, %off, %off, %off), channel_id=5, replica_groups={{0,2},{1,3}}
  %ra_s = f32[4]{0} ragged-all-to-all(%x, %x, %off, %off, %off, %off), channel_id=6, replica_groups={{0,1},{2,3}}
  %cb_r = f32[4]{0} collective-broadcast(%x), channel_id=7, replica_groups={{0,2},{1,3}}
  %cb_s = f32[4]{0} collective-broadcast(%x), channel_id=8, replica_groups={{0,1},{2,3}}
  %ars_r = f32[4]{0} all-reduce-start(%x), channel_id=9, replica_groups={{0,2},{1,3}}, to_apply=%add
  %ard_r = f32[4]{0} all-reduce-done(%ars_r)
  %ags_s = (f32[4]{0}, f32[8]{0}) all-gather-start(%x), channel_id=10, replica_groups={{0,1},{2,3}}, dimensions={0}
  %agd_s = f32[8]{0} all-gather-done(%ags_s)
  %a2a_r = f32[4]{0} all-to-all(%x), channel_id=11, replica_groups={{0,2},{1,3}}, dimensions={0}
  %rs_s = f32[2]{0} reduce-scatter(%x), channel_id=12, replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
  ROOT %r = f32[4]{0} add(%cp_r, %cp_s)
}
"""  # noqa: E501 - HLO text as XLA prints it: one instruction a line

# name -> (op, async, crosses replica). The -done halves are not collectives of their own.
_EXPECTED = {
    "cp_r": ("collective-permute", False, True), "cp_s": ("collective-permute", False, False),
    "cps_r": ("collective-permute", True, True), "cps_s": ("collective-permute", True, False),
    "ra_r": ("ragged-all-to-all", False, True), "ra_s": ("ragged-all-to-all", False, False),
    "cb_r": ("collective-broadcast", False, True), "cb_s": ("collective-broadcast", False, False),
    "ars_r": ("all-reduce", True, True), "ags_s": ("all-gather", True, False),
    "a2a_r": ("all-to-all", False, True), "rs_s": ("reduce-scatter", False, False),
}


def test_hlo_reader_sees_every_collective_kind_and_its_axis():
    for op in ("collective-permute", "ragged-all-to-all", "collective-broadcast", "all-reduce", "all-gather",
               "reduce-scatter", "all-to-all"):
        assert op in hlo_parse.COLLECTIVES, op
    recs = hlo.hlo_collectives(_HLO, (2, 2))["collectives"]
    got = {r["name"]: (r["op"], r["async"], r["crosses_replica"]) for r in recs}
    assert got == _EXPECTED
    by = {r["name"]: r for r in recs}
    assert by["cps_r"]["groups"] == [[0, 2], [2, 0]] and by["cps_r"]["group_size"] == 2
    assert by["ra_r"]["groups"] == [[0, 2], [1, 3]] and by["ra_r"]["replica_only"]
    assert by["cb_r"]["ring_bytes"] == 16.0 and by["cp_r"]["ring_bytes"] == 16.0  # the whole f32[4], once
    assert {r["name"] for r in hlo.replica_crossing(_HLO, (2, 2))} == {n for n, e in _EXPECTED.items() if e[2]}
    tot = hlo.collective_totals(hlo.hlo_collectives(_HLO, (2, 2)))
    assert set(tot["by_op"]) == {"collective-permute", "ragged-all-to-all", "collective-broadcast", "all-reduce",
                                 "all-to-all"}
    assert tot["by_op"]["collective-permute"]["executions"] == 2


def test_hlo_schedule_pairs_start_with_done_and_profile_files_both_as_collectives():
    """``collective_schedule``: the compute issued between a -start and its -done (one dot between
    cps_r and cpd_r, none between cps_s and cpd_s); ``profile.op_categories``: every collective,
    -start and -done halves included, is filed under "collective"."""
    sched = {r["name"]: r for r in hlo_overlap.collective_schedule(_HLO, (2, 2))}
    assert set(sched) == set(_EXPECTED)
    assert sched["cps_r"]["axis"] == "replica" and sched["cps_r"]["compute_between"] == 1
    assert sched["cps_s"]["axis"] == "shard" and sched["cps_s"]["compute_between"] == 0
    assert sched["ra_r"]["axis"] == "replica" and sched["cb_s"]["axis"] == "shard"
    by_axis = hlo_overlap.by_axis(list(sched.values()))
    assert by_axis["replica"]["collective-permute"] == {"async": 1.0, "sync": 1.0, "ring_bytes": 32.0}

    from edit_jax.analysis.profile import op_categories

    cats = op_categories(_HLO)
    for name in [*_EXPECTED, "cpd_r", "cpd_s", "ard_r", "agd_s"]:
        assert cats[name] == "collective", (name, cats[name])
    assert cats["d1"] == "matmul"


def test_hlo_reader_finds_a_real_ppermute_across_replica():
    """A ``ppermute`` over ``replica`` and one over ``shard`` under ``shard_map`` on a 2 x 2 mesh,
    compiled by the installed jax: both are read as collective-permutes, only the first crosses
    replica."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("replica", "shard"))

    def f(x):
        return jax.lax.ppermute(x, "replica", [(0, 1), (1, 0)]) + 2 * jax.lax.ppermute(x, "shard", [(0, 1), (1, 0)])

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("replica", "shard")), out_specs=P(("replica", "shard"))))
    text = g.lower(jnp.arange(16.0)).compile().as_text()
    recs = [r for r in hlo.hlo_collectives(text, (2, 2))["collectives"] if r["op"] == "collective-permute"]
    assert len(recs) == 2, text
    across = [r for r in recs if r["crosses_replica"]]
    assert len(across) == 1, recs
    assert sorted(map(tuple, across[0]["groups"])) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert [r["name"] for r in hlo.replica_crossing(text, (2, 2))] == [across[0]["name"]]


# ----------------------------------------------------------------------------- the restart line


def _checkpoint_dirs(run_dir, steps, unfinished=(), files=()):
    where = os.path.join(run_dir, "checkpoints")
    os.makedirs(where, exist_ok=True)
    for s in steps:
        os.makedirs(os.path.join(where, str(s)))
    for s in unfinished:  # orbax's in-progress save: never a finished checkpoint
        os.makedirs(os.path.join(where, f"{s}.orbax-checkpoint-tmp-1700000000"))
    for s in files:  # a stray file named like a step
        open(os.path.join(where, str(s)), "w").close()


def test_newest_checkpoint_is_the_newest_finished_step_as_the_workers_see_it(tmp_path):
    from edit_jax.rundir.checkpoint import steps_on_disk
    from edit_jax.runtime.restarts import newest_checkpoint, survivors_note

    run = str(tmp_path / "run")
    assert newest_checkpoint(run) is None and newest_checkpoint(None) is None
    _checkpoint_dirs(run, [4, 12, 8], unfinished=[16], files=[20])
    assert newest_checkpoint(run) == 12 == steps_on_disk(run)[-1]
    assert "step 12" in survivors_note(run)


def test_restart_line_names_the_newest_checkpoint(tmp_path):
    """``supervise`` with a fake worker set: the first set loses worker 1 after checkpoints 2, 4
    and 6 were finished (8 unfinished) and step 7 was logged; the restart line says it resumes
    from step 6 (the newest, the one the workers' own resume takes) with 1 step lost."""
    import json

    from edit_jax.rundir.checkpoint import steps_on_disk
    from edit_jax.runtime.restarts import EXIT_WORKER_LOST, supervise

    run = str(tmp_path / "run")
    os.makedirs(run)
    calls, lines = [], []

    def start(argv, workers):
        calls.append((list(argv), workers))
        if len(calls) == 1:
            _checkpoint_dirs(run, [2, 4, 6], unfinished=[8])
            with open(os.path.join(run, "metrics.jsonl"), "w") as f:
                for step in range(1, 8):
                    f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
            return EXIT_WORKER_LOST, (1, 4242, "was ended by signal 9 (SIGKILL)", 0)
        return 0, None

    code = supervise(start, ["train"], 2, 3, run, lines.append, interrupted=lambda: False)
    assert code == 0 and len(calls) == 2 and calls[1] == (["train"], 2)
    assert len(lines) == 1, lines
    m = re.fullmatch(r"edit-jax: worker 1 \(pid 4242\) was ended by signal 9 \(SIGKILL\); restart 1 of 3: "
                     r"resuming from step (\d+) \((\d+) steps lost\)", lines[0])
    assert m, lines[0]
    assert int(m[1]) == steps_on_disk(run)[-1] == 6 and int(m[2]) == 1


# ----------------------------------------------------------------------------- the check before a save


def _state(nan_params=(), nan_opt=(), keeps_outer=True, nan_outer=False, nan_shared=False):
    """A tiny TrainState of 2 workers: params and the inner optimizer's moments [2, 3], a shared
    scalar in the inner optimizer's state, θ̄ [3] when ``keeps_outer``; NaN where asked."""
    from edit_jax.localsgd.state import TrainState

    def per_worker(bad):
        x = np.ones((2, 3), np.float32)
        for w in bad:
            x[w, 1] = np.nan
        return jnp.asarray(x)

    outer = None
    if keeps_outer:
        outer = {"params": jnp.full((3,), np.nan if nan_outer else 0.5, jnp.float32),
                 "syncs": jnp.int32(2)}
    return TrainState(step=jnp.int32(6), params={"w": per_worker(nan_params)},
                      opt_state={"mu": per_worker(nan_opt), "count": jnp.int32(6),
                                 "scale": jnp.float32(np.nan if nan_shared else 1.0)},
                      outer=outer, rng=jnp.zeros((2,), jnp.uint32))


def test_check_before_save_one_nonfinite_worker_skips_mid_run_and_fails_at_the_end():
    from edit_jax import cli
    from edit_jax.training import train as train_module
    from edit_jax.training.resume import DivergedError, check_before_save

    for final in (False, True):
        assert check_before_save(_state(), 6, True, final, 4) is True
        assert check_before_save(_state(keeps_outer=False), 6, False, final, 4) is True

    # Worker 1 non-finite (params, or only its inner moments), θ̄ finite: the sync will roll it back.
    one_bad = _state(nan_params=[1], nan_opt=[1])
    assert check_before_save(one_bad, 6, True, False, 4) is False
    assert check_before_save(_state(nan_opt=[1]), 6, True, False, 4) is False
    # ... but the final save has no next sync: the run ends diverged (the CLI's exit 3).
    with pytest.raises(DivergedError, match=r"non-finite values at step 6 in params of worker 1; "
                                            r"opt_state of worker 1: not saved\. Last good checkpoint: 4"):
        check_before_save(one_bad, 6, True, True, 4)
    assert train_module.DivergedError is DivergedError and cli.EXIT_DIVERGED == 3

    # Never recoverable, mid-run either: no outer state (the Baseline), every worker non-finite,
    # θ̄ non-finite, the inner optimizer's shared state non-finite.
    with pytest.raises(DivergedError, match="Last good checkpoint: none"):
        check_before_save(_state(nan_params=[1], keeps_outer=False), 6, False, False, None)
    with pytest.raises(DivergedError, match="params of workers 0, 1"):
        check_before_save(_state(nan_params=[0, 1]), 6, True, False, 4)
    with pytest.raises(DivergedError, match="outer"):
        check_before_save(_state(nan_params=[1], nan_outer=True), 6, True, False, 4)
    with pytest.raises(DivergedError, match=r"opt_state \(shared\)"):
        check_before_save(_state(nan_params=[1], nan_shared=True), 6, True, False, 4)
