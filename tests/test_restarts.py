"""Issue 31, item 2: the launcher restarts a lost worker set by itself (``--max-restarts``,
``mesh.elastic``; edit_jax/runtime/restarts.py). Real processes, real SIGKILLs: the worker hooks in
tests/worker_hooks/sitecustomize.py make worker 1 kill itself once a given step is logged on the
first launch, and optionally again at the start of every restart (a worker that fails at once)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

from edit_jax.rundir.checkpoint import steps_on_disk
from tests.helpers import REPO, child_xla_flags, kill_group, run_session
from tests.stages import one_stage

HOOKS = os.path.join(REPO, "tests", "worker_hooks")
TINY = ["--config", "configs/tiny.py", "--no-progress", "mesh.replica=2", "mesh.shard=2", "mesh.processes=2",
        "batch_size=8", "data.seq_len=32", "log_every=1", "method=edit", "sync.tau=2", "eval_every=0",
        "checkpoint_every=2", "mesh.heartbeat_seconds=5"]


def _env(tmp_path, run, **extra):
    env = dict(os.environ, XLA_FLAGS=child_xla_flags())  # the launcher sets its workers' own
    env["PYTHONPATH"] = os.pathsep.join([HOOKS, REPO, env.get("PYTHONPATH", "")])
    env.update(EDIT_JAX_TEST_LOG=str(tmp_path / "hooks.log"), EDIT_JAX_TEST_GO=str(tmp_path / "go"),
               EDIT_JAX_TEST_RUN_DIR=str(run), **extra)
    return env


def _train(run, env, *over, timeout=600):
    return run_session([sys.executable, "-m", "edit_jax", "train", "--run-dir", str(run), *TINY, *over], timeout, env)


def _losses(run) -> dict[int, float]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_killed_worker_is_restarted_and_the_run_ends_with_the_uninterrupted_losses(tmp_path):
    """Worker 1 is SIGKILLed once step 5 is logged: one restart line (worker, restart 1 of 3, the
    checkpoint it resumes from, the steps lost), the run finishes, and every step's loss equals
    the one of a run that was never interrupted (EDiT is lockstep; resume is exact on CPU)."""
    one_stage("default", "a killed worker restarted by the launcher", 64,
              other="test_multiprocess.py::test_killed_worker_stops_the_others_and_the_rerun_resumes")
    ref = tmp_path / "ref"
    code, out = _train(ref, _env(tmp_path / "r", ref), "steps=8", "--max-restarts", "0")
    assert code == 0, out[-3000:]
    run = tmp_path / "run"
    code, out = _train(run, _env(tmp_path, run, EDIT_JAX_TEST_KILL_AT="1:5"), "steps=8")
    assert code == 0, out[-3000:]
    killed_at = int((tmp_path / "hooks.log.first-kill").read_text())
    line = re.search(r"edit-jax: worker 1 \(pid \d+\) was ended by signal 9 \(SIGKILL\); restart 1 of 3: "
                     r"resuming from step (\d+) \((\d+) steps lost\)", out)
    assert line, out[-3000:]
    resumed, lost = int(line[1]), int(line[2])
    assert resumed % 2 == 0 and resumed <= killed_at and lost >= killed_at - resumed, (resumed, lost, killed_at)
    assert out.count("restart ") == 1 and "resumed from" in out, out[-3000:]
    # The launcher's line names the checkpoint the workers resume from: the newest (keep 2: an older one is there too).
    assert set(map(int, re.findall(r"edit-jax: resumed from \S*checkpoints[/\\](\d+)", out))) == {resumed}, out[-3000:]
    assert _losses(run) == _losses(ref) and sorted(_losses(ref)) == list(range(1, 9))
    assert steps_on_disk(str(run))[-1] == 8


def test_worker_failing_again_at_once_is_dropped_with_elastic_and_the_run_finishes(tmp_path):
    """Worker 1 is killed at step 3, then kills itself at the start of every restart. Restart 1
    (2 workers) loses it again before a new step; with mesh.elastic=true restart 2 goes on
    without it: 1 worker, an elastic resume from the outer params; the run finishes."""
    one_stage("3.12", "a worker failing at every restart, elastic", 28,
              other="test_restarts_exhausted_end_in_exit_5_without_elastic")
    run = tmp_path / "run"
    env = _env(tmp_path, run, EDIT_JAX_TEST_KILL_AT="1:3", EDIT_JAX_TEST_FAIL_AGAIN="1")
    code, out = _train(run, env, "steps=6", "mesh.elastic=true")
    assert code == 0, out[-3000:]
    assert "restart 1 of 3: resuming from step" in out, out[-3000:]
    assert re.search(r"worker 1 \(pid \d+\) was ended by signal 9 \(SIGKILL\) again before a new step; restart 2 of 3 "
                     r"without it: 1 worker\(s\) \(mesh.replica=1", out), out[-3000:]
    assert "elastic restart: checkpoint" in out and "done at step 6" in out, out[-3000:]
    assert steps_on_disk(str(run))[-1] == 6


def test_restarts_exhausted_end_in_exit_5_without_elastic(tmp_path):
    """The same failing worker without mesh.elastic: every restart counts; after --max-restarts 2
    the run ends with exit 5 and a line saying the restarts are used up."""
    one_stage("default", "restarts used up (exit 5)", 19,
              other="test_worker_failing_again_at_once_is_dropped_with_elastic_and_the_run_finishes")
    run = tmp_path / "run"
    env = _env(tmp_path, run, EDIT_JAX_TEST_KILL_AT="1:3", EDIT_JAX_TEST_FAIL_AGAIN="1")
    code, out = _train(run, env, "steps=6", "--max-restarts", "2")
    assert code == 5, out[-3000:]
    assert "restart 1 of 2" in out and "restart 2 of 2: resuming" in out and "without it" not in out, out[-3000:]
    assert re.search(r"worker 1 \(pid \d+\) was ended by signal 9 \(SIGKILL\); stopped the other workers; no restart "
                     r"left \(--max-restarts 2 used up\)\. The newest checkpoint, step \d+", out), out[-3000:]


def test_a_stop_request_during_a_restart_is_not_followed_by_another_restart(tmp_path):
    """The restarted workers are held at start; the launcher gets a Ctrl-C (SIGINT) and one of
    the held workers is SIGKILLed. The launcher was asked to stop: exit 5 naming the lost
    worker, and no second restart."""
    one_stage("3.12", "a stop request during a restart", 24)
    run = tmp_path / "run"
    env = _env(tmp_path, run, EDIT_JAX_TEST_KILL_AT="1:3", EDIT_JAX_TEST_HOLD_RESTART="1")
    cmd = [sys.executable, "-m", "edit_jax", "train", "--run-dir", str(run), *TINY, "steps=40"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    log = tmp_path / "hooks.log"
    try:
        deadline = time.time() + 400
        while not (log.exists() and log.read_text().count("restart held") == 2):
            assert time.time() < deadline and proc.poll() is None, "the restart was not held"
            time.sleep(0.05)
        held = sorted(int(x) for x in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                     text=True).stdout.split())
        assert len(held) == 2, held
        # In this order: the launcher's main thread runs its handler (sleeping, it wakes at once)
        # before it can look at the workers again and see the kill.
        os.kill(proc.pid, signal.SIGINT)
        os.kill(held[1], signal.SIGKILL)
        (tmp_path / "go").write_text("")
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 5, out[-3000:]
    assert "restart 1 of 3" in out and "restart 2" not in out, out[-3000:]
    assert f"worker 1 (pid {held[1]}) was ended by signal 9 (SIGKILL); stopped the other workers (no restart: the " \
           "launcher was asked to stop)" in out, out[-3000:]
