"""Issue 31, item 5: the launcher's races (``mesh.processes=2``), each reproduced by construction.
Test hooks in tests/worker_hooks/sitecustomize.py pause a worker at the exact point of the race
(a SIGUSR1 hold of its main thread; a hang just before orbax commits a checkpoint), and the test
sends the signals in the exact order.

1. One Ctrl-C in a terminal reaches the launcher and each worker (one process group), and the
   launcher forwards it: a worker saw it twice and took the second arrival for a second Ctrl-C
   ("second signal; exiting now without a checkpoint", a Gloo traceback, exit 5, no checkpoint).
2. A worker killed while checkpoint 8 was written: the survivor failed too, and when the launcher
   saw both ends in one look it exited 5 without a word."""

import os
import signal
import subprocess
import sys
import time

import pytest

from edit_jax.rundir.checkpoint import steps_on_disk
from edit_jax.runtime.launch import lost_worker, process_state
from tests.helpers import REPO, child_xla_flags, kill_group, run_session
from tests.stages import one_stage

HOOKS = os.path.join(REPO, "tests", "worker_hooks")
TINY = ["--config", "configs/tiny.py", "--no-progress", "mesh.replica=2", "mesh.shard=2", "mesh.processes=2",
        "batch_size=8", "data.seq_len=32", "log_every=1", "method=edit", "sync.tau=2", "eval_every=0"]


def _env(tmp_path, **extra):
    env = dict(os.environ, XLA_FLAGS=child_xla_flags())  # the launcher sets its workers' own
    env["PYTHONPATH"] = os.pathsep.join([HOOKS, REPO, env.get("PYTHONPATH", "")])
    env.update(EDIT_JAX_TEST_LOG=str(tmp_path / "hooks.log"), EDIT_JAX_TEST_GO=str(tmp_path / "go"), **extra)
    return env


def _start(run_dir, env, *over):
    cmd = [sys.executable, "-m", "edit_jax", "train", "--run-dir", str(run_dir), *TINY, *over]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def _wait(proc, ready, what, timeout=240):
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert proc.poll() is None, (f"ended ({proc.returncode}) while waiting for {what}: "
                                     f"{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)


def _workers(proc) -> list[int]:
    pids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(pids) == 2, pids
    return sorted(int(p) for p in pids)


def _logged(tmp_path, pid, text) -> int:
    path = tmp_path / "hooks.log"
    return path.read_text().splitlines().count(f"{pid} {text}") if path.exists() else 0


def _ended(pid) -> bool:
    """Ended and waiting to be reaped by its parent: a zombie with no thread left (the main thread
    of a process that aborts from another thread is a zombie before the rest of it is gone)."""
    try:
        return process_state(pid) == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return False


def _alive(pid) -> bool:
    return process_state(pid) not in ("", "Z")


@pytest.mark.parametrize("order", ["direct_first", "launcher_first"])
def test_one_ctrl_c_counts_once_however_it_reaches_a_worker(tmp_path, order):
    """A terminal's Ctrl-C: SIGINT to each worker directly and to the launcher, which forwards it.
    Both workers are held (SIGUSR1) so that each arrival is handled on its own, in the given
    order; then released. One Ctrl-C: exit 130, a checkpoint, a clean resume. One order runs in
    each of CI's stages (tests/stages.py)."""
    one_stage("default" if order == "direct_first" else "3.12", f"the Ctrl-C order {order}", 57,
              other="the other order")
    run = tmp_path / "run"
    env = _env(tmp_path)
    proc = _start(run, env, "steps=400", "checkpoint_every=0")
    try:
        metrics = run / "metrics.jsonl"
        _wait(proc, lambda: metrics.exists() and metrics.read_text().count('"step"') >= 4, "training")
        workers = _workers(proc)
        for w in workers:
            os.kill(w, signal.SIGUSR1)
        _wait(proc, lambda: all(_logged(tmp_path, w, "held") == 1 for w in workers), "both workers held")

        def direct():
            for w in workers:
                os.kill(w, signal.SIGINT)

        def via_launcher():
            os.kill(proc.pid, signal.SIGINT)

        first, second = (direct, via_launcher) if order == "direct_first" else (via_launcher, direct)
        first()
        _wait(proc, lambda: all(_logged(tmp_path, w, "handled 2") == 1 for w in workers), "the first arrivals")
        second()
        # Handled one by one inside the hold (before the fix, the second arrival ended the worker)
        _wait(proc, lambda: all(_logged(tmp_path, w, "handled 2") == 2 or not _alive(w) for w in workers),
              "the second arrivals", timeout=60)
        (tmp_path / "go").write_text("")
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 130, out[-3000:]
    assert "second signal" not in out and "Traceback" not in out and "Gloo" not in out, out[-3000:]
    steps = steps_on_disk(str(run))
    assert steps, out[-3000:]
    code, out = run_session([sys.executable, "-m", "edit_jax", "train", "--run-dir", str(run), *TINY,
                             f"steps={steps[-1] + 2}", "checkpoint_every=0"], 300, env=_env(tmp_path))
    assert code == 0 and "resumed from" in out, out[-3000:]


def test_worker_killed_while_saving_is_named_even_when_both_ends_show_at_once(tmp_path):
    """Worker 0 hangs just before committing checkpoint 8 (checkpoint 4 is done); the launcher is
    stopped (SIGSTOP), worker 0 SIGKILLed, and the launcher resumed only once worker 1 has ended
    too: it sees both ends at once. Exit 5 naming worker 0 and SIGKILL, and the newest good
    checkpoint, 4; the unfinished 8 is not taken for a checkpoint, and the rerun resumes from 4."""
    one_stage("3.12", "a worker killed while saving, both ends seen at once", 48)
    run = tmp_path / "run"
    env = _env(tmp_path, EDIT_JAX_TEST_HANG_SAVE="8")
    proc = _start(run, env, "steps=400", "checkpoint_every=4", "mesh.heartbeat_seconds=5", "--max-restarts", "0")
    try:
        log = tmp_path / "hooks.log"
        _wait(proc, lambda: log.exists() and "hanging" in log.read_text(), "worker 0 inside save 8")
        workers = _workers(proc)
        assert steps_on_disk(str(run)) == [4]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            os.kill(workers[0], signal.SIGKILL)
            deadline = time.time() + 120
            while not _ended(workers[1]) and time.time() < deadline:
                time.sleep(0.1)
            assert _ended(workers[1]), "worker 1 did not end after losing worker 0"
            time.sleep(0.5)  # (not needed for the race: so that a failure here is not a zombie's last moment)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 5, out[-3000:]
    ckpt4 = os.path.join(str(run), "checkpoints", "4")
    assert f"worker 0 (pid {workers[0]}) was ended by signal 9 (SIGKILL)" in out, out[-3000:]
    assert f"The newest checkpoint, step 4 ({ckpt4}), is intact" in out, out[-3000:]
    assert steps_on_disk(str(run)) == [4]
    code, out = run_session([sys.executable, "-m", "edit_jax", "train", "--run-dir", str(run), *TINY, "steps=6",
                             "checkpoint_every=4"], 300, env=_env(tmp_path))
    assert code == 0 and "resumed from" in out and "checkpoints/4" in out, out[-3000:]
    assert steps_on_disk(str(run))[-1] == 6


def test_lost_worker_names_the_cause_not_its_consequence():
    kill, abort = -signal.SIGKILL, -signal.SIGABRT
    assert lost_worker([kill, 1], ["", ""]) == (0, "was ended by signal 9 (SIGKILL)")
    assert lost_worker([1, kill], ["", ""])[0] == 1  # the survivor's error shows first: still the killed one
    assert lost_worker([abort, None], ["", "T"]) == (1, "stopped responding (its process is stopped)")
    assert lost_worker([abort, 1], ["", ""]) == (1, "ended with exit code 1")
    assert lost_worker([130, None], ["", "S"]) == (1, "did not finish with the others")
    assert lost_worker([None, abort], ["S", ""]) == (1, "was ended by signal 6 (SIGABRT)")


def test_relay_leaves_out_worker_tracebacks_chained_ones_included():
    """A survivor's traceback (gloo's "Connection reset by peer" once its peer is killed; the full
    disk of its peer) is not a user's message: the launcher's one line names the cause. The
    relay drops the whole traceback, chained ones included, counts the lines, and passes the next
    line on; with EDIT_JAX_DEBUG it keeps everything."""
    import io

    from edit_jax.runtime.launch import Relay

    lines = ["step 1\n", "Traceback (most recent call last):\n", '  File "loop.py", line 1, in run\n', "    f()\n",
             "    ^^^\n", "jax.errors.JaxRuntimeError: UNKNOWN: Gloo AllGather failed: Connection reset by peer\n",
             "\n", "The above exception was the direct cause of the following exception:\n", "\n",
             "Traceback (most recent call last):\n", '  File "cli.py", line 9, in main\n', "RuntimeError: boom\n",
             "edit-jax: the run dir's message\n", "  indented, after the traceback\n"]
    quiet, out = Relay(), io.StringIO()
    for line in lines:
        quiet.segment(1, line, out)
    assert out.getvalue() == "step 1\nedit-jax: the run dir's message\n  indented, after the traceback\n"
    assert quiet.suppressed == 11
    debug, everything = Relay(keep_everything=True), io.StringIO()
    for line in lines:
        debug.segment(1, line, everything)
    assert everything.getvalue() == "".join(lines)
