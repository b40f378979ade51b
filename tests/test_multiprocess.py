"""One JAX process per worker (mesh.processes = mesh.replica): the A-EDiT agreement rule on a fake
clock, the step weights against NumPy, the local program's HLO, and real multi-process runs on
CPU (gloo): equivalence with the single-process run, an A-EDiT run with a straggler, and a killed
worker. Subprocesses are started through the CLI's launcher and killed by PID on the way out."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from edit_jax.config import ConfigError, MeshConfig
from edit_jax.hf.export import write_export
from edit_jax.localsgd.methods import TimeSchedule, plan_for
from edit_jax.localsgd.outer import Penalty, mix_step_weights
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.models.llama import init_params
from edit_jax.runtime import multihost
from edit_jax.runtime.mesh import make_mesh
from edit_jax.analysis import hlo
from edit_jax.training.drivers import WorkerSteps
from edit_jax.training.train import train
from edit_jax.validate import load_config
from tests.helpers import REPO, kill_group as _kill_group, run_session
from tests.stages import one_stage

FLAGS = ["--config", "configs/tiny.py", "--no-progress"]
TINY = ["mesh.replica=2", "mesh.shard=2", "mesh.processes=2", "batch_size=8", "data.seq_len=32", "log_every=1"]


# ----------------------------------------------------------------------------- the agreement rule


def _simulate(step_times, tau_time, min_total, target, horizon=100.0):
    """Workers on a fake clock: each takes local steps of its own duration; at its due point it
    enters the meeting, which happens when the last worker arrives; every worker then gets the
    same decision from the exchanged counts. The counts are the drivers' own bookkeeping
    (drivers.WorkerSteps). Returns the meetings: (time, steps since the last sync that ran, decision)."""
    sched = TimeSchedule(True, True, 0, tau_time, min_total, target)
    n = len(step_times)
    workers = [WorkerSteps(0) for _ in range(n)]
    clock, last = [0.0] * n, 0.0
    meetings = []
    while max(clock) < horizon:
        for i, w in enumerate(workers):  # each worker steps until its own timer says a sync is due
            while not sched.sync_due(clock[i], last):
                clock[i] += step_times[i]
                w.step()
        meet = max(clock)  # the meeting starts when the last worker enters it
        since, done = [w.since_sync for w in workers], [w.done for w in workers]
        decisions = [sched.decide(list(since), list(done)) for _ in range(n)]  # one per worker
        assert all(d == decisions[0] for d in decisions)
        d = decisions[0]
        meetings.append((meet, since, d))
        for w in workers:
            w.after_meeting(d.run)
        clock, last = [meet] * n, meet
        if d.finished:
            break
    return meetings


def test_agreement_rule_on_a_fake_clock():
    # Worker 1 is a 2x straggler: worker 0 takes twice its steps, and the shares say so.
    meetings = _simulate([1.0, 2.0], tau_time=10.0, min_total=1, target=10_000)
    for _, since, d in meetings:
        assert d.run and since == [10, 5]
        np.testing.assert_allclose(d.shares, [2 / 3, 1 / 3])
    means = [d.mean_step for _, _, d in meetings]
    assert means == sorted(means) and means[0] == round(15 / 2)  # the mean of the workers' steps
    # Too few steps since the last sync: skipped (every worker sees the same total), timer reset.
    slow = _simulate([6.0, 6.0], tau_time=5.0, min_total=3, target=10_000, horizon=60)
    assert slow and not slow[0][2].run and slow[0][1] == [1, 1]
    # The global budget (steps x N) ends training at the meeting that reaches it.
    end = _simulate([1.0, 2.0], tau_time=10.0, min_total=1, target=60)
    assert end[-1][2].finished and end[-1][2].run
    assert not any(d.finished for _, _, d in end[:-1])


def test_skipped_meetings_accumulate_steps_since_the_last_sync():
    """Issue 18's case: step times 1 s and 2 s, tau_time 10 s, min_total_steps 20. Each meeting
    sees 10 + 5 = 15 new steps. The steps since the last sync that RAN count (the reference's
    rule): the first meeting skips (15 < 20), the second syncs (30 steps: 20 + 10), and so on at
    every other meeting, with shares from all 30 steps. Resetting the count at skipped meetings
    (the old rule) never synced."""
    meetings = _simulate([1.0, 2.0], tau_time=10.0, min_total=20, target=10_000, horizon=80)
    runs = [d.run for _, _, d in meetings]
    assert runs[:8] == [False, True] * 4, runs
    for _, since, d in meetings:
        if d.run:
            assert since == [20, 10]
            np.testing.assert_allclose(d.shares, [2 / 3, 1 / 3])
        else:
            assert since == [10, 5]
    # A skipped meeting whose workers run unequal shares: the shares count every step since the
    # last sync, not only those since the skipped meeting.
    uneven = _simulate([1.0, 3.0], tau_time=6.0, min_total=10, target=10_000, horizon=40)
    first_run = next((since, d) for _, since, d in uneven if d.run)
    assert first_run[0] == [12, 4] and np.allclose(first_run[1].shares, [0.75, 0.25]), first_run


def test_a_edit_config_rules():
    path = os.path.join(REPO, "configs/tiny.py")
    with pytest.raises(ConfigError, match=r"mesh.processes.*one process per worker"):
        load_config(path, ["method=a_edit"])
    with pytest.raises(ConfigError, match=r"mesh.processes.*must be 1.*or mesh.replica=2"):
        load_config(path, ["mesh.processes=3"])
    with pytest.raises(ConfigError, match=r"debug.slowdown"):
        load_config(path, ["debug.slowdown=1:fast", "mesh.processes=2"])
    cfg = load_config(path, ["method=a_edit", "mesh.processes=2", "sync.time.tau=30", "sync.warmup_steps=4"])
    sched = plan_for(cfg).schedule
    assert isinstance(sched, TimeSchedule) and sched.target_total_steps == cfg.steps * 2
    assert [str(sched.kind(k)) for k in range(6)] == ["hsdp"] * 4 + ["local"] * 2 and sched.init_outer_due(4)


def test_step_weights_mix_against_numpy():
    mesh = make_mesh(MeshConfig(replica=3, shard=1), jax.devices()[:3])
    p = Penalty(step_weight_ratio=0.5)
    w = np.array([0.2, 0.5, 0.3], np.float32)
    shares = np.array([0.6, 0.3, 0.1], np.float32)

    def run(w, flags):
        f = jax.jit(jax.shard_map(lambda w, s, fl: mix_step_weights(w, s, fl, p), mesh=mesh,
                                  in_specs=(P(), P(), P()), out_specs=P()))
        return np.asarray(f(w, shares, np.asarray(flags)))

    np.testing.assert_allclose(run(w, [False, False, False]), 0.5 * w + 0.5 * shares, rtol=1e-6)
    # a flagged worker (weight 0 from the penalty) gets no share: shares renormalised over the rest
    got = run(np.array([0.0, 0.7, 0.3], np.float32), [True, False, False])
    np.testing.assert_allclose(got, [0.0, 0.5 * 0.7 + 0.5 * 0.75, 0.5 * 0.3 + 0.5 * 0.25], rtol=1e-6)
    assert abs(got.sum() - 1.0) < 1e-6
    same = jnp.asarray(w)
    assert mix_step_weights(same, None, jnp.zeros(3, bool), p) is same  # no shares (step-based methods): unchanged


def test_local_program_stays_on_the_workers_devices():
    """A worker's inner step is a program over its own S devices: every collective in its HLO is
    among them (and none is over `replica`)."""
    cfg = load_config(os.path.join(REPO, "configs/tiny.py"),
                      ["method=edit", "mesh.replica=2", "mesh.shard=2", "mesh.processes=2", "batch_size=8",
                       "data.seq_len=32"])
    local_cfg = multihost.local_config(cfg)
    m = StepPrograms.for_config(local_cfg, make_mesh(local_cfg.mesh, jax.devices()[:2]))
    batch = np.zeros((local_cfg.batch_size, 33), np.int32)
    text = m.lowered("local", m.abstract_state(), m.put_batch(batch)).compile().as_text()
    recs = hlo.hlo_collectives(text, (1, 2), default_trip=cfg.model.n_layers)["collectives"]
    assert recs, "the FSDP gathers should be there"
    assert all(set(p for g in r["groups"] for p in g) <= {0, 1} for r in recs)
    assert "num_partitions=2" in text.split("\n", 1)[0], text.split("\n", 1)[0][:300]


# ----------------------------------------------------------------------------- real processes


def _run_cli(run_dir, *overrides, timeout=420, env=None):
    cmd = [sys.executable, "-m", "edit_jax", "train", *FLAGS, "--run-dir", str(run_dir), *TINY, *overrides]
    return run_session(cmd, timeout, env=env)


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


LIFTED = ["sync.outer_sharding=replica_shard", "sync.cpu_offload=true", "log.tensorboard=true"]
PARQUET = ["data.workers=1", "data.val_fraction=0.2"]  # + data.source=parquet on files made by the test
SHARDS = ["data.source=tokens"]  # + data.paths: a shard directory tokenized by the test


def _shard_dir(where) -> str:
    from edit_jax.data.tokenize import tokenize

    rng = np.random.default_rng(1)
    jsonl = where / "docs.jsonl"
    with open(jsonl, "w") as f:
        for i in range(400):
            text = f"doc {i} " + "".join(chr(97 + int(c)) for c in rng.integers(0, 26, 60))
            f.write(json.dumps({"text": text}) + "\n")
    out = str(where / "shards")
    tokenize([str(jsonl)], out, val_fraction=0.1, shard_tokens=4000, progress=False)
    return out


def _windows_read(trace, seq_len) -> dict[int, list[int]]:
    """pid -> the train windows it read (start // (seq_len + 1)), from the data trace."""
    out: dict[int, list[int]] = {}
    for rec in map(json.loads, open(trace)):
        if rec.get("split") == "train":
            assert rec["stop"] - rec["start"] == seq_len + 1 and rec["start"] % (seq_len + 1) == 0, rec
            out.setdefault(rec["pid"], []).append(rec["start"] // (seq_len + 1))
    return out


def _parquet_files(where) -> list[str]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(0)
    paths = []
    for k in range(2):  # 2 files x 4 row groups of 60 documents
        rows = [f"doc {k}-{i} " + "".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(3, 90))))
                for i in range(240)]
        paths.append(str(where / f"part{k}.parquet"))
        pq.write_table(pa.table({"text": rows}), paths[-1], row_group_size=60)
    return paths


def _trained_units(trace) -> dict[int, tuple[set, set]]:
    """pid -> (replicas, row groups) it read for training, from the data trace."""
    out: dict[int, tuple[set, set]] = {}
    for rec in map(json.loads, open(trace)):
        if rec["purpose"] == "train":
            reps, units = out.setdefault(rec["pid"], (set(), set()))
            reps.add(rec["replica"])
            units.add(rec["unit"])
    return out


# EDiT twice (on the stdlib corpus with the lifted options, and on streamed parquet); a plain
# EDiT case on the stdlib corpus would repeat them (each case is about 35 s). Two cases run in each
# of CI's stages (tests/stages.py): each stage still checks 2-process runs against one process
# under its own jax; tests/test_corrupt.py's 2-process case runs beside the default stage's two.
EQUAL_STAGE = {"co2": "default", "edit-streamed_parquet": "default", "diloco-token_shards": "3.12",
               "edit-replica_shard-offload-tensorboard-init_from-wandb": "3.12"}


@pytest.mark.parametrize("method,extra", [("diloco", SHARDS), ("co2", []), ("edit", LIFTED), ("edit", PARQUET)],
                         ids=["diloco-token_shards", "co2", "edit-replica_shard-offload-tensorboard-init_from-wandb",
                              "edit-streamed_parquet"])
def test_two_processes_equal_one_program(tmp_path, monkeypatch, request, method, extra):
    """2 processes x 2 devices give the single-process 2 x 2 run's losses (every kind of step:
    HSDP warmup, local steps, and the method's sync). The EDiT case on the stdlib corpus also uses what only one
    process could do before the one loop: θ̄ split over replica too, kept in host memory, and
    TensorBoard scalars (written by process 0); and what a cluster user adds: Hugging Face
    weights to start from (each process loading its own devices' slices) and W&B (process 0).
    The DiLoCo case trains on token shards: each process reads only its replica's windows (the
    read trace), and the two read what the one process read. The last streams parquet files: each
    process reads and tokenizes (in a reader process) only its own replica's row groups, and the
    final checkpoint holds both replicas' positions (the processes exchange them), as the single
    process's does."""
    case = request.node.callspec.id
    one_stage(EQUAL_STAGE[case], f"the 2-process equivalence case {case}", 45)
    over = [f"method={method}", "steps=8", "sync.warmup_steps=2", "sync.tau=3", "eval_every=0", *extra]
    if extra is PARQUET:
        over += ["data.source=parquet", "data.paths=" + ",".join(_parquet_files(tmp_path))]
    if extra is SHARDS:
        over += [f"data.paths={_shard_dir(tmp_path)}"]
    if extra in (PARQUET, SHARDS):
        monkeypatch.setenv("EDIT_JAX_DATA_TRACE", str(tmp_path / "trace_mp.jsonl"))
    if extra is LIFTED:
        for key, value in [("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"),
                           ("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))]:
            monkeypatch.setenv(key, value)
        hf = str(tmp_path / "hf")
        tiny = load_config(os.path.join(REPO, "configs/tiny.py"))
        write_export(hf, tiny, init_params(tiny.model, jax.random.key(5)))
        over += [f"model.init_from={hf}", "log.wandb=true"]
    code, out = _run_cli(tmp_path / "mp", *over)
    assert code == 0, out[-3000:]
    cfg = load_config(os.path.join(REPO, "configs/tiny.py"), [o for o in TINY if "processes" not in o] + over)
    if extra in (PARQUET, SHARDS):
        monkeypatch.setenv("EDIT_JAX_DATA_TRACE", str(tmp_path / "trace_sp.jsonl"))
    single = train(cfg, str(tmp_path / "sp"), progress=False, devices=jax.devices()[:4])
    want = {r["step"]: r["replica_loss"] for r in single.history}
    got = {r["step"]: r["replica_loss"] for r in _records(tmp_path / "mp") if "loss" in r}
    assert sorted(got) == sorted(want) == list(range(1, 9))
    np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=2e-5)
    vals = [r["val_loss"] for r in _records(tmp_path / "mp") if "val_loss" in r]
    np.testing.assert_allclose(vals[-1], single.final_val_loss, rtol=2e-5)
    assert json.load(open(tmp_path / "mp" / "config.json"))["mesh"]["processes"] == 2
    if "log.tensorboard=true" in extra:
        events = [f for f in os.listdir(tmp_path / "mp" / "tb") if f.startswith("events.")]
        assert len(events) == 1, events  # process 0's writer only
        assert f"params from model.init_from={hf}" in out
        assert len([d for d in os.listdir(tmp_path / "mp" / "wandb") if d.startswith("offline-run-")]) == 1
    if extra is SHARDS:
        per_pid = _windows_read(tmp_path / "trace_mp.jsonl", cfg.data.seq_len)
        assert len(per_pid) == 2, per_pid
        (a, b), rows = per_pid.values(), cfg.batch_size // 2
        assert len(a) == len(set(a)) == len(b) == len(set(b)) == 8 * rows  # each window once, B/N a step
        assert not set(a) & set(b)
        (single_windows,) = _windows_read(tmp_path / "trace_sp.jsonl", cfg.data.seq_len).values()
        assert set(a) | set(b) == set(single_windows)
    if extra is PARQUET:
        per_pid = _trained_units(tmp_path / "trace_mp.jsonl")
        assert len(per_pid) == 2, per_pid
        (reps_a, units_a), (reps_b, units_b) = per_pid.values()
        assert {len(reps_a), len(reps_b)} == {1} and reps_a != reps_b  # one replica per process
        assert units_a and units_b and not units_a & units_b  # disjoint row groups
        single_units = _trained_units(tmp_path / "trace_sp.jsonl")  # the one process read both sets
        assert set().union(*(u for _, u in single_units.values())) == units_a | units_b
        saved = [json.load(open(tmp_path / d / "checkpoints" / "8" / "data" / "metadata")) for d in ("mp", "sp")]
        assert saved[0]["kind"] == "parquet-stream" and saved[0] == saved[1], saved
        assert all(c[0] == 8 for c in saved[0]["cursors"])


def test_a_edit_straggler_fast_worker_takes_more_steps(tmp_path):
    """A-EDiT with worker 1 slowed 3x, on streamed parquet: the fast worker takes more steps and
    more weight, and reads its own data further: the final checkpoint's data state has each
    worker's stream cursor at that worker's own step count (gathered from both processes)."""
    one_stage("3.12", "A-EDiT's 2-process straggler run", 36,
              other="test_spike_faults.py::test_a_edit_asynchronous_spike_exits_3_and_sets_spiked_checkpoints_aside")
    files = _parquet_files(tmp_path)
    run = tmp_path / "run"
    code, out = _run_cli(run, "method=a_edit", "steps=24", "sync.warmup_steps=0", "sync.time.tau=3",
                         "debug.slowdown=1:3.0", "eval_every=0", "checkpoint_every=0", *PARQUET,
                         "data.source=parquet", "data.paths=" + ",".join(files))
    assert code == 0, out[-3000:]
    recs = _records(run)
    syncs = [r for r in recs if r.get("sync")]
    assert syncs, out[-2000:]
    since = np.array([s["worker_steps_since"] for s in syncs])
    assert since[:, 0].sum() > since[:, 1].sum(), since  # the fast worker stepped more
    later = syncs[1:] or syncs
    assert all(s["step_share"][0] > s["step_share"][1] for s in later)
    last = max(r["step"] for r in recs if r.get("worker") == 0)
    assert last > max(r["step"] for r in recs if r.get("worker") == 1)
    assert any("val_loss" in r for r in recs)  # the final evaluation on θ̄
    final = str(max(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit()))
    data = json.load(open(run / "checkpoints" / final / "data" / "metadata"))
    assert [c[0] for c in data["cursors"]] == data["worker_steps"], data
    assert data["worker_steps"][0] > data["worker_steps"][1]


def _fault_after_first_checkpoint(tmp_path, sig, timeout):
    """Starts a long 2-process EDiT run, sends ``sig`` to worker 1 once checkpoint 4 exists, and
    waits for the launcher: (exit code, output, seconds from the signal to the end, worker pids)."""
    over = ["method=edit", "steps=400", "sync.tau=2", "checkpoint_every=4", "eval_every=0", "mesh.heartbeat_seconds=5"]
    cmd = [sys.executable, "-m", "edit_jax", "train", *FLAGS, "--run-dir", str(tmp_path), *TINY, *over,
           "--max-restarts", "0"]  # (the launcher's restarts: tests/test_restarts.py)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (tmp_path / "checkpoints" / "4").is_dir() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert (tmp_path / "checkpoints" / "4").is_dir(), "no checkpoint appeared"
        pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                               text=True).stdout.split()]
        assert len(pids) == 2
        sent_at = time.time()
        os.kill(pids[1], sig)
        out, _ = proc.communicate(timeout=timeout)
        took = time.time() - sent_at
    finally:
        _kill_group(proc)
    for pid in pids:  # every worker is gone
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0
    return proc.returncode, out, took, pids, over


def test_killed_worker_stops_the_others_and_the_rerun_resumes(tmp_path):
    one_stage("3.12", "a killed worker without restarts", 45,
              other="test_restarts.py::test_killed_worker_is_restarted_and_the_run_ends_with_the_uninterrupted_losses")
    code, out, took, _, over = _fault_after_first_checkpoint(tmp_path, signal.SIGKILL, timeout=60)
    assert code == 5 and took < 30, (code, took, out[-2000:])
    assert "worker 1" in out and "re-run the same command" in out
    code, out = _run_cli(tmp_path, *[o if not o.startswith("steps=") else "steps=10" for o in over])
    assert code == 0, out[-3000:]
    assert "resumed from" in out


def test_signal_to_one_worker_stops_both_at_one_step_and_resumes(tmp_path):
    """SIGTERM to worker 1 alone: the processes agree on it at their next agreement (about once a
    second of steps, drivers.AGREE_S, no longer before every step), both stop at the same step with
    one checkpoint there, the launcher exits 130, and the rerun resumes from that step."""
    one_stage("3.12", "a signal to one of 2 worker processes", 40,
              other="test_failures.py::test_ctrl_c_while_compiling_is_a_clean_stop (2 processes, a signal "
                    "before the first agreement)")
    code, out, took, _, over = _fault_after_first_checkpoint(tmp_path, signal.SIGTERM, timeout=60)
    # 130 (not 5) says the two agreed on the stop, where a lost agreement would end by the heartbeat.
    # The time is the agreement plus the final save and the exit of two processes: under 20 s in
    # earlier runs, 20.2 s once with CI's two stages side by side on 2 cores (the bound was 20 s).
    assert code == 130 and took < 40, (code, took, out[-2000:])
    stopped = [int(n) for n in re.findall(r"stopped at step (\d+)", out)]
    assert stopped and len(set(stopped)) == 1, out[-2000:]
    step = stopped[0]
    assert (tmp_path / "checkpoints" / str(step)).is_dir(), sorted(os.listdir(tmp_path / "checkpoints"))
    code, out = _run_cli(tmp_path, *[o if not o.startswith("steps=") else f"steps={step + 2}" for o in over])
    assert code == 0 and f"resumed from {tmp_path / 'checkpoints' / str(step)}" in out, out[-3000:]


def test_hung_worker_is_named_and_ends_the_run(tmp_path):
    """A worker stopped with SIGSTOP (hung): the healthy one's coordination client gives up after
    mesh.heartbeat_seconds and aborts. The run ends within seconds with exit 5, one message naming
    the hung worker (before: "worker 0 stopped with signal 6", the healthy one, after a native
    stack dump), and no dump or runtime log line reaches the user."""
    one_stage("default", "a hung (SIGSTOPped) worker of 2 processes", 22,
              other="test_cluster_exit.py::test_the_survivor_of_a_killed_peer_says_retry")
    code, out, took, pids, _ = _fault_after_first_checkpoint(tmp_path, signal.SIGSTOP, timeout=90)
    assert code == 5 and took < 45, (code, took, out[-2000:])
    assert f"worker 1 (pid {pids[1]}) stopped responding" in out, out[-2000:]
    assert "worker 0" not in out and "*** " not in out and "Terminating process" not in out, out[-2000:]
    assert not any(line[:1] in "IWEF" and line[1:5].isdigit() for line in out.splitlines()), out[-2000:]
