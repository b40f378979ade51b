"""``edit-jax train --distributed``: exit codes that tell a cluster wrapper what to do.

The process a cluster launcher (srun, mpirun) starts runs the training in one child process of
its own and turns how that child ended into one of:

- 0 done, 130 stopped by a signal (with a checkpoint): nothing to do;
- 2 bad input, 3 diverged, 4 run dir locked: stop (running the same job again fails again);
- ``EXIT_RETRY`` (75): a peer was lost or hung, or joining the others failed (a collective's error,
  the coordination service aborting this worker, a crash of this worker's runtime): run the same
  job again; it resumes from the newest checkpoint;
- ``EXIT_SHRINK`` (76): this worker's own backend (its accelerators) did not start: run the job
  again without this node, with mesh.replica one smaller (an elastic resume: every worker from
  the outer params). Its host name is appended to ``RUN_DIR/shrink_hosts`` for the wrapper's
  ``--exclude``.

Why a child: a worker that loses a peer is often ended by the runtime itself (the coordination
service aborts it, SIGABRT) before Python could turn anything into an exit code. Signals reach the
child as the launcher's do (``launch.follow_launcher``: a SIGTERM from the cluster reaching both
processes counts once). docs/guides/restarts.md, docs/guides/cluster.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from edit_jax.runtime.launch import ENV_FORWARDS, _ended_how, _in_child

from edit_jax.exit_codes import EXIT_RETRY, EXIT_SHRINK  # (75: try again; 76: without this host)
ENV_CHILD = "EDIT_JAX_DISTRIBUTED_CHILD"  # "1": this process is the watched child
STOP_EXITS = (0, 2, 3, 4, 130)


def exit_code_for(code: int) -> int:
    """The wrapper's code for the child's exit status (``Popen.returncode``: negative = signal)."""
    return code if code in (*STOP_EXITS, EXIT_RETRY, EXIT_SHRINK) else EXIT_RETRY


def watch(train_argv: list[str]) -> int:
    """Runs ``python -m edit_jax train <train_argv>`` as the watched child; returns the wrapper's code."""
    env = dict(os.environ, **{ENV_CHILD: "1", ENV_FORWARDS: "1"})
    child = subprocess.Popen([sys.executable, "-m", "edit_jax", "train", *train_argv], env=env, stdin=subprocess.PIPE,
                             preexec_fn=lambda: _in_child(None))
    received = [0]

    def forward(signum, frame):
        received[0] += 1
        if child.poll() is None:
            try:
                os.write(child.stdin.fileno(), f"{signum} {received[0]}\n".encode())
            except OSError:
                pass

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if child.poll() is None:
            child.kill()
            child.wait()
    mapped = exit_code_for(code)
    if mapped != code:  # (a code it chose itself came with its own line)
        print(f"edit-jax: this worker's training process {_ended_how(code)}: exit {EXIT_RETRY} (retry: run the same "
              "job again, it resumes from the newest checkpoint)", file=sys.stderr, flush=True)
    return mapped


def note_shrink_host(run_dir: str) -> str:
    """Appends this host's name to ``RUN_DIR/shrink_hosts`` (the wrapper excludes it); returns it."""
    host = os.uname().nodename
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "shrink_hosts"), "a") as f:
            f.write(host + "\n")
    except OSError:
        pass  # the exit code still says it
    return host


__all__ = ["watch", "exit_code_for", "note_shrink_host", "EXIT_RETRY", "EXIT_SHRINK", "ENV_CHILD"]
