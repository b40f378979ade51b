"""Training, the public entry: ``train(cfg, run_dir)`` -> ``TrainResult``.

    result = train(cfg, run_dir="runs/demo")

What happens before the loop (loop.py) starts, in every mode: the config is validated, SIGINT /
SIGTERM only set a flag for the whole call (a second one exits at once), the run dir is checked
for writability and locked (runlock.py; process 0 holds the lock when there are several), and a
run dir that already holds a checkpoint at ``cfg.steps`` is left alone ("already finished").
Everything else (restore, the steps, records, evaluation, checkpoints, the divergence checks and
stopping) is the loop's, the same for one process and for one process per worker. The run dir
holds ``config.json`` (resolved config), ``metrics.jsonl`` (records.py) and ``checkpoints/``.
Re-running on the same run dir resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from typing import Callable

import jax

from edit_jax.config import Config, ConfigError, to_dict
from edit_jax.data.errors import DataError
from edit_jax.localsgd.methods import normalise
from edit_jax.localsgd.sharding import MeshError
from edit_jax.placement.topology import PlacementError
from edit_jax.rundir.checkpoint import CheckpointError, steps_on_disk
from edit_jax.rundir.records import TB_DIR, read_records
from edit_jax.rundir.runlock import (RunLock, RunLockError, check_writable, exchange_problem, first_missing, listing,
                                     remove_if_unused, remove_new_files)
from edit_jax.runtime import multihost
from edit_jax.runtime.compile_cache import cache_dir_for, compile_cache, run_dir_cache
from edit_jax.runtime.launch import ENV_FORWARDS, take_forwarded
from edit_jax.training.loop import TrainResult, run
from edit_jax.training.resume import DivergedError
from edit_jax.validate import validate
from edit_jax.exit_codes import EXIT_INTERRUPTED

# Bad input (exit 2): found after the run dir was written to, what this invocation wrote is removed
# when no checkpoint exists (docs/guides/restarts.md: nothing written). A save or record that cannot be
# written (CheckpointError, RunDirError) keeps what the run wrote, as a divergence or a signal does.
INPUT_ERRORS = (ConfigError, DataError, MeshError, PlacementError)


class _StopFlag:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the next step boundary and returns."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}
        self._depth = 0  # re-entrant: ``train`` holds it for its whole life, the loop enters it again

    def __enter__(self):
        self._depth += 1
        if self._depth > 1:
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def _handle(self, signum, frame):
        # A worker started by launch.py gets the launcher's signals with its count of them
        # (take_forwarded): a terminal's Ctrl-C reaches the worker directly too, so the launcher
        # alone says which is the second; a signal sent to the worker directly only asks it to stop.
        nth = take_forwarded(signum)
        if nth is not None:
            second = nth > 1  # (also when the first forward's call merged with this one)
        else:
            second = self.signal is not None and os.environ.get(ENV_FORWARDS) != "1"
        if second:  # stop now, without a checkpoint
            # Not KeyboardInterrupt: raised inside JAX / XLA calls it gave a traceback and then a
            # segfault at interpreter exit. Checkpoints are written atomically (orbax renames a
            # finished temporary dir), so leaving now loses only the steps since the last one;
            # the kernel releases the run dir's lock.
            print(f"\nedit-jax: second signal ({signum}); exiting now without a checkpoint (the last "
                  "checkpoint is kept; re-run the same command to resume)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_INTERRUPTED)
        if self.signal is None:
            self.signal = signum

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth > 0:
            return
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def _sayer(progress: bool, verbose: bool | None):
    verbose = progress if verbose is None else verbose
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else (lambda msg: None)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _config_changes(run_dir: str, cfg: Config) -> list[str]:
    """``key: old -> new`` for each config key that differs from ``run_dir/config.json`` (keys
    that only say how a run is logged or how long it is aside); [] if that file is unreadable."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            old = _flat(json.load(f))
    except (OSError, ValueError):
        return []
    # As config.json holds it: normalised by the method table, tuples as lists.
    new = _flat(json.loads(json.dumps(to_dict(normalise(cfg)[0]))))
    ignore = {"steps", "max_seconds", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"}
    return [f"{k}: {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in sorted(set(old) | set(new))
            if k not in ignore and not k.startswith(("log.", "train.")) and old.get(k) != new.get(k)]


def finished_result(run_dir: str, cfg: Config, say) -> TrainResult | None:
    """A result saying "nothing to do" when ``run_dir`` already has a checkpoint at ``cfg.steps``
    or later (a rerun of a finished run writes nothing), said in one line (and a warning when the
    config differs). The launcher of ``mesh.processes > 1`` asks this before it starts workers."""
    steps = steps_on_disk(run_dir)
    if not steps or steps[-1] < cfg.steps:
        return None
    say(f"edit-jax: already finished at step {steps[-1]} (steps={cfg.steps}); nothing to do, nothing written; "
        f"run dir {run_dir}. Raise steps= to train further.")
    changed = _config_changes(run_dir, cfg)
    if changed:  # e.g. a README example run on the demo's run dir: nothing of what was asked ran
        shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
        say(f"edit-jax: warning: this config differs from the one {run_dir} was trained with ({shown}); "
            "nothing of it ran. Give it its own --run-dir.")
    return TrainResult(steps=steps[-1], final_loss=float("nan"), final_val_loss=None, final_val_ppl=None, tokens=0,
                       seconds=0.0, run_dir=run_dir, already_finished=True)


def train(cfg: Config, run_dir: str | None = None, *, progress: bool = True, devices: list | None = None,
          stop_after: int | None = None, verbose: bool | None = None, restore_step: int | None = None,
          on_timing: Callable[[dict], None] | None = None) -> TrainResult:
    """Trains ``cfg`` to ``cfg.steps`` (resuming from ``run_dir``'s newest checkpoint that verifies).

    ``stop_after`` stops (with a checkpoint) after that many steps of this invocation, as a signal
    would: for tests and for splitting a run into chunks. ``restore_step`` resumes from that
    checkpoint instead of the newest (newer ones are moved to ``checkpoints.aside/``).
    ``on_timing`` receives the loop's own timing records (advance: data, step, hooks; save;
    written; ``training/result.py``): how benchmarks time the loop without patching it.

    With ``mesh.processes > 1`` this runs in each of the worker processes (started by launch.py or
    a cluster launcher); process 0 holds the run dir's lock and writes the run's files.

    Raises ``ConfigError`` (also for an exchange run's dir: its config.json names a ``sync.exchange.url``,
    runlock.py), ``RunDirError`` (run dir not writable), ``RunLockError`` (another run holds it),
    ``DivergedError`` (non-finite state; nothing non-finite saved) besides the input errors.
    """
    validate(cfg)
    problem = run_dir and exchange_problem(run_dir, cfg.sync.exchange.url)  # an exchange run's dir is its launcher's
    if problem:
        raise ConfigError(problem)
    multi = cfg.mesh.processes > 1
    lead = jax.process_index() == 0 if multi else True
    say = _sayer(progress, verbose) if lead else (lambda msg: None)
    with _StopFlag() as stop:  # for the whole call: a Ctrl-C while compiling or evaluating is a clean stop
        created = first_missing(run_dir) if run_dir and lead else None  # what check_writable will create
        before = listing(run_dir) if run_dir and lead else None  # what this invocation must never remove
        cache = cache_dir_for(cfg.train.compile_cache, run_dir)
        # Only the run dir's own cache: a directory of the user's (a path, $EDIT_JAX_COMPILE_CACHE)
        # may be shared with other runs, however new it is.
        new_cache = (lead and run_dir and cache is not None and not os.path.exists(cache)
                     and cache == run_dir_cache(run_dir))
        try:
            if run_dir:
                check_writable(run_dir, deepest=lead)
            lock = _take_lock(run_dir, say, lead, multi) if run_dir else None
            try:
                if run_dir and restore_step is None:  # every process sees the same answer on disk
                    done = finished_result(run_dir, cfg, say)
                    if done is not None:
                        return done
                # Every worker runs this: each reads the cache (process 0 writes it, JAX's rule).
                with compile_cache(cache):
                    return run(cfg, run_dir, stop=stop, say=say, progress=progress, devices=devices,
                               stop_after=stop_after, restore_step=restore_step, on_timing=on_timing)
            except INPUT_ERRORS:
                # Found after the run wrote its files (a bad token id at the first read): with no
                # checkpoint there is nothing to resume, so what this invocation wrote goes again,
                # while it still holds the lock; what was there before it stays.
                # A run that already trained (records written) keeps them: only an error before the
                # first record leaves nothing behind.
                if lock is not None and before is not None and not steps_on_disk(run_dir) \
                        and not read_records(os.path.join(run_dir, "metrics.jsonl")):
                    remove_new_files(run_dir, before, dirs=(TB_DIR,))
                raise
            finally:
                if lock is not None:
                    lock.release()
        except BaseException:
            if new_cache and not steps_on_disk(run_dir):  # an input error: the programs it cached serve no resume
                shutil.rmtree(cache, ignore_errors=True)
            if created:  # an input error found after the run dir was made: leave no empty run dir behind
                remove_if_unused(run_dir, created)
            raise


def _take_lock(run_dir: str, say, lead: bool, multi: bool) -> RunLock | None:
    """Process 0 takes the run dir's lock; with several processes the others learn at once whether
    it did, and stop with it (quietly: its message says why) instead of waiting in a collective."""
    lock, error = None, None
    if lead:
        try:
            lock = RunLock(run_dir, say).acquire()
        except RunLockError as e:
            error = e
    if multi and not multihost.exchange([int(error is None)]).all() and error is None:
        error = RunLockError(f"run dir {run_dir!r}: process 0 could not lock it")
        error.quiet = True  # process 0 reports it
    if error is not None:
        raise error
    return lock


__all__ = ["train", "finished_result", "TrainResult", "CheckpointError", "DivergedError"]
