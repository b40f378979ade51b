"""Every program a run will use, compiled before its first step and side by side.

Compiled on first use, a program costs its compile at that step: EDiT's sync step at its first
sync (every worker of a cluster waits there), the evaluation at the first evaluation, the
checkpoint's finiteness report and checksums at the first save. Here they are lowered and compiled
up front, in threads (XLA's compile releases the GIL, so on several cores the programs compile
together): the step of every kind the schedule runs, the outer state's first setting, the
evaluation (of the replicas' params, and of θ̄ with the sync that makes it), and the checkpoint's
report and checksums. ``jit(f).lower(args).compile()`` fills the same cache that ``jit(f)(args)``
reads, so the loop's calls find them compiled; with the persistent compilation cache on, a restart
loads them instead. What still compiles inside the loop shows as ``includes_compile`` on the
record whose time holds it (``runtime/compiles.py`` counts JAX's compile events).

A-EDiT's asynchronous phase runs programs of its own per worker (``drivers.AsyncWorkers``): its
local step and the meeting's sync step with the step shares, compiled here too. Orbax compiles small
slicing programs at the first save (inside the save, whose time is not a step's).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from edit_jax.localsgd.methods import LOCAL, step_kinds
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.rundir import integrity
from edit_jax.runtime import multihost
from edit_jax.training.drivers import shares_array
from edit_jax.training.evaluate import Evaluator

ENV_COMPILE_AHEAD = "EDIT_JAX_COMPILE_AHEAD"  # "0": off (as train.compile_ahead=false), for test suites


@dataclass
class Ahead:
    """What compiling ahead took: each program's seconds (its own thread's lower + compile, which
    overlaps the others') and the wall time of them all."""

    seconds: dict[str, float]
    wall_s: float
    failed: dict[str, str] = field(default_factory=dict)  # program -> why it could not compile ahead

    def line(self) -> str:
        longest = max(self.seconds.values(), default=0.0)
        failed = ("; not ahead, compiled at first use instead: "
                  + "; ".join(f"{name} ({why})" for name, why in self.failed.items())) if self.failed else ""
        return (f"edit-jax: compiled {len(self.seconds)} programs ahead in {self.wall_s:.1f} s "
                f"(the longest {longest:.1f} s, side by side){failed}")


def _abstract(tree: Any) -> Any:
    def one(x):
        sharding = getattr(x, "sharding", None)  # (a host value: placed as the call will place it)
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
        return jax.ShapeDtypeStruct(np.shape(x), dtype, **({"sharding": sharding} if sharding else {}))
    return jax.tree.map(one, tree)


def _evaluations(cfg, schedule, start: int) -> tuple[bool, bool]:
    """(whether an evaluation after ``start`` reads the replicas' params, whether one reads θ̄): the
    evaluations at every ``eval_every`` steps and at the end (``Evaluator.params_for``); only those
    up to the warmup's end and the last can differ from the rest."""
    every, end = cfg.eval_every, cfg.steps
    steps = {end} | (set(range(every, min(end, schedule.warmup + every) + 1, every)) if every > 0 else set())
    live = [schedule.uses_outer and schedule.outer_is_live(e) for e in sorted(steps) if e > start]
    return (not all(live), any(live)) if live else (False, False)


def run_programs(programs: StepPrograms, evaluator: Evaluator, state: Any, eval_rows: tuple[int, int] | None,
                 saves: bool, worker: StepPrograms | None = None, start: int = 0) -> dict[str, Callable[[], Any]]:
    """Name -> a call that lowers and compiles one program the run will use from step ``start`` on
    (a resumed run's restored step). ``eval_rows``: the validation batches' shape (None: no
    evaluation); ``saves``: checkpoints are written; ``worker``: A-EDiT's, the programs of this
    process's worker after the warmup."""
    cfg, schedule = programs.cfg, programs.schedule
    batch = programs.abstract_batch()
    state = _abstract(state)
    jobs: dict[str, Callable[[], Any]] = {}
    kinds = step_kinds(schedule, cfg, start)
    if worker is not None:  # lock-step only in the warmup; then the worker's steps and the sync with shares
        kinds = [k for k in kinds if k == "hsdp"]
        jobs.update(_worker_programs(programs, worker, state, batch))
    for kind in sorted(kinds, key=lambda k: "sync" not in k):  # the largest first: the pool ends sooner
        fn = programs.step_fn(kind)
        jobs[f"step {kind}"] = lambda fn=fn: fn.lower(state, batch).compile()
    # The first sync (step W) only sets θ̄: compiled while it lies ahead.
    if schedule.uses_outer and schedule.warmup > 0 and start <= schedule.warmup and worker is None:
        init = programs.init_outer_fn()
        jobs["outer init"] = lambda: init.lower(state).compile()
    replicas_read, outer_read = _evaluations(cfg, schedule, start)
    if eval_rows is not None:
        rows = jax.ShapeDtypeStruct(eval_rows, batch.dtype, sharding=batch.sharding)
        if replicas_read:  # Baseline, or an evaluation within the warmup
            replicas = evaluator.loss_fn(False)
            jobs["evaluation"] = lambda: replicas.lower(state.params, rows).compile()
        if outer_read:  # after the warmup the model evaluated is θ̄ after a sync
            sync, over_outer = programs.sync_fn(), evaluator.loss_fn(True)
            synced = jax.eval_shape(sync, state)[0]
            jobs["evaluation sync"] = lambda: sync.lower(state).compile()
            jobs["evaluation of θ̄"] = lambda: over_outer.lower(synced.outer.params, rows).compile()
    if saves:
        for name, fn, args in integrity.save_programs(state):
            jobs[name] = lambda fn=fn, args=args: fn.lower(*args).compile()
    return jobs


def _worker_programs(glob: StepPrograms, worker: StepPrograms, state: Any, batch: Any) -> dict:
    """A-EDiT after its warmup (``drivers.AsyncWorkers``): the worker's local step and first outer
    setting on its own devices, and the sync step over every worker with the step shares."""
    local, local_batch, jobs = worker.abstract_state(), worker.abstract_batch(), {}
    step = worker.step_fn(LOCAL)
    jobs["worker step local"] = lambda: step.lower(local, local_batch).compile()
    if glob.schedule.uses_outer and glob.schedule.warmup > 0:
        init = worker.init_outer_fn()
        jobs["worker outer init"] = lambda: init.lower(local).compile()
    sync, kind = glob.step_fn(glob.schedule.sync_kind()), str(glob.schedule.sync_kind())
    shares = shares_array([1.0 / glob.cfg.mesh.replica] * glob.cfg.mesh.replica)
    jobs[f"step {kind} (the workers' meeting)"] = lambda: sync.lower(state, batch, shares).compile()
    return jobs


def compile_ahead(jobs: dict[str, Callable[[], Any]], threads: int | None = None,
                  stopped: Callable[[], bool] = lambda: False) -> Ahead:
    """Runs ``jobs`` (``run_programs``) side by side. Compiling ahead only saves time, so a job that
    fails is named in ``Ahead.failed`` and the run goes on: the program compiles at its first use,
    where a real error (a model that cannot compile) is raised as it always was. ``stopped`` (a
    signal arrived): the jobs not yet started are dropped (those under way finish: XLA's compile
    cannot be cut short), and the loop then stops before its first step."""
    def timed(job):
        t0 = time.perf_counter()
        job()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    workers = max(1, min(len(jobs), threads or os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="compile-ahead") as pool:
        futures = {pool.submit(timed, job): name for name, job in jobs.items()}
        seconds, failed, pending = {}, {}, set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for f in done:
                if f.exception() is None:
                    seconds[futures[f]] = f.result()
                else:
                    failed[futures[f]] = f"{type(f.exception()).__name__}: {str(f.exception())[:200]}"
            if stopped():
                for f in pending:
                    f.cancel()
                break
    return Ahead(seconds, time.perf_counter() - t0, failed)


def compile_run_ahead(programs: StepPrograms, evaluator: Evaluator, state: Any, setup: Any, say, at: float,
                      worker: StepPrograms | None = None, stopped: Callable[[], bool] = lambda: False) -> None:
    """The loop's start: every program of the run compiled (``train.compile_ahead``; off with
    ``$EDIT_JAX_COMPILE_AHEAD=0``), one line said and a timing record written."""
    if not programs.cfg.train.compile_ahead or os.environ.get(ENV_COMPILE_AHEAD, "1") == "0":
        return
    rows = tuple(np.shape(setup.val[0])) if setup.val else None
    start = int(multihost.local_value(state.step))
    ahead = compile_ahead(run_programs(programs, evaluator, state, rows, setup.ckpt is not None, worker, start),
                          stopped=stopped)
    say(ahead.line())
    setup.sink.timing({"timing": "compile_ahead", "at": at, "wall_s": ahead.wall_s, "seconds": ahead.seconds})


__all__ = ["compile_run_ahead", "ENV_COMPILE_AHEAD", "Ahead", "run_programs", "compile_ahead"]
