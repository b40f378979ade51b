"""Issue 31, item 2 on a cluster: ``--distributed`` processes end with codes a wrapper acts on
(edit_jax/runtime/cluster_exit.py): 75 retry (a peer was lost), 76 shrink (this host's backend did
not start), 2/3/4 stop. Real processes started as a cluster launcher would (the EDIT_JAX_*
variables), real kills."""

import os
import signal
import subprocess
import sys
import time

from edit_jax.runtime.cluster_exit import EXIT_RETRY, EXIT_SHRINK, exit_code_for
from edit_jax.runtime.launch import free_port, process_state
from tests.helpers import REPO
from tests.stages import one_stage
from tests.test_cluster import _cli_env  # the same CLI environment

TRAIN = [sys.executable, "-m", "edit_jax", "train", "--distributed", "--config", "configs/tiny.py", "--no-progress",
         "mesh.replica=2", "mesh.shard=2", "mesh.processes=2", "batch_size=8", "data.seq_len=32", "log_every=1",
         "method=edit", "sync.tau=2", "eval_every=0", "checkpoint_every=2", "mesh.heartbeat_seconds=5"]


def _env(port, i, **extra):
    return _cli_env(**{"EDIT_JAX_COORDINATOR": f"127.0.0.1:{port}", "EDIT_JAX_NUM_PROCESSES": "2",
                       "EDIT_JAX_PROCESS_ID": str(i), **extra})


def _start(run, port, *over, extra=({}, {})):
    return [subprocess.Popen(TRAIN + ["--run-dir", str(run), *over], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=_env(port, i, **extra[i]), start_new_session=True)
            for i in range(2)]


def _finish(procs, timeout=240):
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_the_survivor_of_a_killed_peer_says_retry(tmp_path):
    """Process 1 (the one the cluster started, with its training child) is SIGKILLed after the
    first checkpoint: its child goes with it, and process 0 ends with exit 75 (retry) and one line
    saying so, however its training process ended (a collective's error or the runtime's abort)."""
    one_stage("3.12", "the survivor of a killed peer", 24,
              other="test_multiprocess.py::test_hung_worker_is_named_and_ends_the_run")
    run = tmp_path / "run"
    procs = _start(run, free_port(), "steps=400")
    try:
        deadline = time.time() + 300
        while not (run / "checkpoints" / "2").is_dir():
            assert time.time() < deadline and all(p.poll() is None for p in procs), "no checkpoint appeared"
            time.sleep(0.2)
        child = int(subprocess.run(["pgrep", "-P", str(procs[1].pid)], capture_output=True,
                                   text=True).stdout.split()[0])
        os.kill(procs[1].pid, signal.SIGKILL)
    finally:
        outs = _finish(procs, timeout=180)
    assert procs[1].returncode == -signal.SIGKILL
    assert process_state(child) in ("", "Z"), "the killed process's training child outlived it"  # (Z: dead)
    assert procs[0].returncode == EXIT_RETRY, outs[0][-3000:]
    assert f"exit {EXIT_RETRY} (retry: run the same job again" in outs[0], outs[0][-3000:]


def test_a_host_whose_backend_does_not_start_says_shrink(tmp_path):
    """Process 1's backend cannot start (JAX_PLATFORMS names none that exists): exit 76 (shrink),
    its host name in RUN_DIR/shrink_hosts; process 0, left without its peer, says retry."""
    run = tmp_path / "run"
    procs = _start(run, free_port(), "steps=4", extra=({}, {"JAX_PLATFORMS": "no_such_platform"}))
    outs = _finish(procs)
    assert procs[1].returncode == EXIT_SHRINK, outs[1][-3000:]
    assert (run / "shrink_hosts").read_text() == os.uname().nodename + "\n"
    assert f"exit {EXIT_SHRINK} (shrink: run again without this host" in outs[1], outs[1][-3000:]
    assert procs[0].returncode == EXIT_RETRY, outs[0][-3000:]


def test_exit_code_mapping():
    assert [exit_code_for(c) for c in (0, 2, 3, 4, 130, 75, 76)] == [0, 2, 3, 4, 130, 75, 76]
    assert [exit_code_for(c) for c in (1, -signal.SIGABRT, -signal.SIGKILL, 5)] == [EXIT_RETRY] * 4


def test_a_save_that_lost_its_peer_is_a_runtime_failure_a_full_disk_is_not():
    """The killed peer can end a checkpoint save on the survivor (orbax all-gathers across
    processes): the CheckpointSaveError raised from the collective's error is a lost peer (75 on
    a cluster), while one from a full disk (an OSError, or XLA's RESOURCE_EXHAUSTED) stays bad input."""
    import errno

    import jax

    from edit_jax.cli import _runtime_cause
    from edit_jax.rundir.checkpoint import CheckpointSaveError

    def save_failing_with(cause):
        try:
            try:
                raise cause
            except Exception as e:
                raise CheckpointSaveError("could not save checkpoint run/checkpoints/4") from e
        except CheckpointSaveError as e:
            return e

    gloo = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Connection closed by peer")
    assert _runtime_cause(save_failing_with(gloo)) is gloo
    for disk in (OSError(errno.ENOSPC, "No space left on device"),
                 jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: no space left")):
        assert _runtime_cause(save_failing_with(disk)) is None
