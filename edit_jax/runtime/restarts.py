"""The launcher's restart policy (``mesh.processes=N``, ``edit-jax train --max-restarts K``).

A lost or hung worker (the launcher's exit 5 situations) ends the worker set as before; then,
up to K times per invocation, the same worker command lines are started again (a fresh
coordinator port each time). Each restart resumes by itself from the newest finished checkpoint
(the workers' own resume; ``RUN_DIR/compile_cache`` makes it a warm start), and is announced in one
line: which worker was lost and how, the restart's number, the step it resumes from and the steps
lost (the newest step in ``metrics.jsonl`` minus that checkpoint's step). Nothing else restarts:
bad input (2), diverged (3), run dir locked (4) and a Ctrl-C / SIGTERM (130) pass through, and a
worker lost after the launcher got a Ctrl-C or SIGTERM ends the run (exit 5), as does a Ctrl-C
between two starts.

A worker that fails again at once: the same worker index is lost again by the restarted set
before that set logged a new training step (no record newer than the checkpoint it resumed
from). With ``mesh.elastic=true`` the next restart goes on without it: N-1 workers
(``mesh.replica=N-1 mesh.processes=N-1`` appended to the overrides: an elastic resume, every
worker from the outer params θ̄), if the config can run with N-1 (else one line why, exit 5). The
restart after that starts N workers again: the dropped worker is taken back whenever it starts
cleanly. Without ``mesh.elastic`` such a failure is one more restart, and K exhausted ends in
exit 5 as without restarts.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from edit_jax.exit_codes import EXIT_INTERRUPTED, EXIT_WORKER_LOST
ENV_DEBUG = "EDIT_JAX_DEBUG"  # as cli.ENV_DEBUG


def survivors_note(run_dir: str | None) -> str:
    """What a lost worker leaves: the newest finalised checkpoint of ``run_dir`` (unfinished saves
    are orbax temporary dirs, never taken for one)."""
    if run_dir is None:
        return "The last checkpoint is intact: re-run the same command to resume"
    step = newest_checkpoint(run_dir)
    if step is None:
        return f"No checkpoint in {run_dir} yet: re-running the same command starts from step 0"
    where = os.path.join(run_dir, "checkpoints", str(step))
    return (f"The newest checkpoint, step {step} ({where}), is intact (an unfinished save is never taken "
            f"for one): re-run the same command to resume from it")




def newest_checkpoint(run_dir: str | None) -> int | None:
    """The step of the newest finished checkpoint, None if there is none. As
    ``rundir.checkpoint.steps_on_disk`` (runtime/ does not import rundir/): a finished checkpoint is
    a dir named by its step; an unfinished save is "<step>.orbax-checkpoint-tmp..."."""
    where = os.path.join(run_dir, "checkpoints") if run_dir else ""
    steps = [int(d) for d in (os.listdir(where) if where and os.path.isdir(where) else [])
             if d.isdigit() and os.path.isdir(os.path.join(where, d))]
    return max(steps) if steps else None


def newest_logged_step(run_dir: str | None) -> int | None:
    """The newest step of a training record in ``RUN_DIR/metrics.jsonl`` (None: none yet)."""
    path = os.path.join(run_dir, "metrics.jsonl") if run_dir else ""
    newest = None
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:  # a line cut short by the kill
                    continue
                if isinstance(rec, dict) and "loss" in rec and isinstance(rec.get("step"), int):
                    newest = rec["step"] if newest is None else max(newest, rec["step"])
    except OSError:
        return None
    return newest


def _mtime(run_dir: str | None) -> float | None:
    try:
        return os.stat(os.path.join(run_dir, "metrics.jsonl")).st_mtime_ns if run_dir else None
    except OSError:
        return None


def supervise(start: Callable[[list[str], int], tuple[int, tuple | None]], argv: list[str], n: int,
              max_restarts: int, run_dir: str | None, say: Callable[[str], None], interrupted: Callable[[], bool],
              shrink_check: Callable[[int], str | None] | None = None) -> int:
    """Starts the worker set (``start(argv, workers)``: exit code, lost worker) and restarts it
    after a lost worker as the module docstring says; returns the run's exit code.
    ``shrink_check``: None without ``mesh.elastic``; else ``shrink_check(n)`` is None if the run
    can go on with n workers, or why not."""
    restarts, workers, previous_lost = 0, n, None
    while True:
        resumed, mtime_before = newest_checkpoint(run_dir), _mtime(run_dir)
        code, lost = start(argv if workers == n else [*argv, f"mesh.replica={workers}", f"mesh.processes={workers}"],
                           workers)
        if code != EXIT_WORKER_LOST or lost is None:
            return code
        i, pid, how, suppressed = lost
        reached, ckpt = newest_logged_step(run_dir), newest_checkpoint(run_dir)
        progressed = _mtime(run_dir) != mtime_before and reached is not None and reached > (resumed or 0)
        dumps = (f" ({suppressed} lines of diagnostics (native dumps, tracebacks) left out; {ENV_DEBUG}=1 shows them)"
                 if suppressed else "")
        what = f"edit-jax: worker {i} (pid {pid}) {how}"
        if interrupted():
            say(f"{what}; stopped the other workers (no restart: the launcher was asked to stop). "
                f"{survivors_note(run_dir)}{dumps}")
            return EXIT_WORKER_LOST
        if restarts >= max_restarts:
            spent = f"; no restart left (--max-restarts {max_restarts} used up)" if max_restarts else ""
            say(f"{what}; stopped the other workers{spent}. {survivors_note(run_dir)}{dumps}")
            return EXIT_WORKER_LOST
        restarts += 1
        again_at_once = not progressed and previous_lost == i and workers == n
        previous_lost = i
        lost_steps = max(0, (reached or 0) - (ckpt or 0))
        where = (f"resuming from step {ckpt} ({lost_steps} steps lost)" if ckpt is not None
                 else f"starting from step 0, no checkpoint yet ({lost_steps} steps lost)")
        if again_at_once and shrink_check is not None:
            why = shrink_check(n - 1) if n > 1 else "no worker would be left"
            if why:
                say(f"{what} again before a new step; mesh.elastic cannot go on without it: {why}. "
                    f"{survivors_note(run_dir)}{dumps}")
                return EXIT_WORKER_LOST
            workers = n - 1
            say(f"{what} again before a new step; restart {restarts} of {max_restarts} without it: {workers} "
                f"worker(s) (mesh.replica={workers}, every worker from the outer params), {where}")
        else:
            back = f" with all {n} workers again" if workers < n else ""
            workers = n
            say(f"{what}; restart {restarts} of {max_restarts}{back}: {where}")
        if interrupted():
            say("edit-jax: stopped before the restart (a Ctrl-C or SIGTERM came); nothing more started. "
                f"{survivors_note(run_dir)}")
            return EXIT_INTERRUPTED


__all__ = ["supervise", "survivors_note", "EXIT_WORKER_LOST", "newest_checkpoint", "newest_logged_step"]
