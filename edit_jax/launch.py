"""Starts one worker process per replica on this machine and watches them (``mesh.processes=N``).

``edit-jax train ... mesh.processes=N`` re-runs the same command line in N child processes, each
with ``mesh.shard`` CPU devices of its own and the coordinator address in its environment
(``multihost.py``). Process 0 writes the run dir's ``config.json``, the progress bar and the
sync and evaluation records; every worker appends its own training records.

Watching: a Ctrl-C or SIGTERM here is passed on to every worker (they stop together at their next
meeting and checkpoint). A worker that dies ends the run at once: the others are killed (a
collective with a lost peer could only hang or abort), the message names the lost worker, and the
launcher exits with ``EXIT_WORKER_LOST``. Nothing checkpointed is lost: orbax commits a checkpoint
only once it is whole, and re-running the same command resumes from the last one.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

from edit_jax.multihost import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

EXIT_WORKER_LOST = 5
NORMAL_EXITS = (0, 130)  # done; stopped by a signal with a checkpoint
PASSED_ON_EXITS = (2, 3, 4)  # cli.py: bad input, diverged, run dir locked
FINISH_GRACE_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(base: dict, coordinator: str, n: int, i: int, shard: int) -> dict:
    env = dict(base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={shard}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(n), ENV_PROCESS_ID: str(i)})
    return env


def _in_child(core: int | None) -> None:
    """Runs in each worker between fork and exec: die with the launcher (no orphaned workers if it
    is killed), and optionally stay on one CPU core (every thread the worker starts inherits it)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own cleanup still kills its workers
    if core is not None:
        os.sched_setaffinity(0, {core})


def launch(train_argv: list[str], n: int, shard: int, pin_cores: bool = False,
           say=lambda m: print(m, file=sys.stderr, flush=True)) -> int:
    """Runs ``python -m edit_jax train <train_argv>`` as N workers; returns the exit code. With
    ``pin_cores`` worker i (and every thread it starts) runs on core i mod (cores available)."""
    coordinator = f"127.0.0.1:{free_port()}"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    procs = []
    for i in range(n):
        env = worker_env(os.environ, coordinator, n, i, shard)
        core = cores[i % len(cores)] if pin_cores and cores else None
        procs.append(subprocess.Popen([sys.executable, "-m", "edit_jax", "train", *train_argv], env=env,
                                      preexec_fn=lambda core=core: _in_child(core)))
    say(f"edit-jax: started {n} worker processes (pids {', '.join(str(p.pid) for p in procs)}), "
        f"{shard} CPU devices each, coordinator {coordinator}")

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        finished_at = None  # when the first worker ended normally (done, or stopped by a signal)
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return EXIT_WORKER_LOST if any(c < 0 for c in codes) else next((c for c in codes if c), 0)
            ended = [(i, c) for i, c in enumerate(codes) if c is not None]
            lost = [(i, c) for i, c in ended if c not in NORMAL_EXITS]
            if ended and finished_at is None:
                finished_at = time.monotonic()
            # Workers that end normally end within moments of each other (they meet to finish).
            if not lost and ended and time.monotonic() - finished_at > FINISH_GRACE_S:
                lost = [(i, None) for i, c in enumerate(codes) if c is None]
            if lost:
                i, code = lost[0]
                how = ("did not finish with the others" if code is None else
                       f"signal {-code}" if code < 0 else f"exit code {code}")
                say(f"edit-jax: worker {i} (pid {procs[i].pid}) stopped with {how}; stopping the other workers. "
                    f"The last checkpoint is intact: re-run the same command to resume")
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                # A worker that ended with a message of its own (bad input 2, diverged 3, run dir
                # locked 4) passes its code on; anything else is a lost worker.
                return code if code in PASSED_ON_EXITS else EXIT_WORKER_LOST
            time.sleep(0.1)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        for p in procs:  # never leave a worker behind
            if p.poll() is None:
                p.kill()
                p.wait()


__all__ = ["launch", "free_port", "worker_env", "EXIT_WORKER_LOST"]
