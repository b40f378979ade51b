"""The training loop of one worker process (``mesh.processes = mesh.replica``): every method, and
A-EDiT's time-based asynchronous syncs.

Each process runs this loop for its own replica (multihost.py has the meshes and the moves
between them). Two regimes:

- **In step** (Baseline, Post Local SGD, DiLoCo, EDiT, and A-EDiT's synchronous warmup): every
  worker runs the schedule's kind of step k. ``local`` steps are programs over the worker's own
  devices; ``hsdp``, ``sync_forward`` and ``local_then_sync`` are one program over the global
  mesh that all workers enter together. Evaluation and checkpoints fall on the same steps as in a
  single-process run, and the losses equal the single-process run's (tests/test_multiprocess.py).
- **A-EDiT** after the warmup: each worker takes local steps at its own pace. When ``tau_time``
  seconds (float64 monotonic clock) have passed since its last sync, a worker enters the meeting:
  every worker's step counts are exchanged (one small all-gather) and ``TimeSchedule.decide``
  turns them into one decision, identical everywhere: skip (fewer than ``min_total_steps``
  steps since the last sync: timers reset), or sync. A sync first sets every worker's inner step
  count (its learning-rate schedule) and state step to the global mean step, then runs EDiT's
  sync step over the global mesh with each worker's share of the steps mixed into the weights.
  Training ends at the sync where the total steps reach ``steps x N`` (the global token budget):
  that sync is the last, then evaluation on θ̄.

Stopping (Ctrl-C, SIGTERM, ``stop_after``) is agreed at meetings too, so that every worker saves
the same checkpoint: at the next global step in step mode, at the next meeting in A-EDiT.
Checkpoints hold the global state (θ̄, outer optimizer state, detectors, every worker's params and
inner state) plus every worker's step count and data position, written with orbax's multi-process
support; re-running resumes, with fewer processes as an elastic restart from θ̄.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from edit_jax import data as data_lib
from edit_jax import multihost
from edit_jax.checkpoint import Checkpointer, CheckpointError
from edit_jax.config import Config, dumps
from edit_jax.data.corrupt import corrupt_rows, parse_corrupt
from edit_jax.evaluate import Evaluator
from edit_jax.methods import LOCAL, TimeSchedule, plan_for
from edit_jax.multihost import parse_slowdown
from edit_jax.step import Machinery

def _set_step(state, step: int, shardings):
    """``state`` with its step counter and every inner optimizer step count set to ``step``: the
    learning-rate schedule then follows the global mean step (A-EDiT). Each count gets a buffer
    of its own (the next step donates them all)."""
    def count(path, x):
        named = getattr(path[-1], "name", None) == "count" if path else False
        return jnp.full_like(x, step) if named else x

    opt_state = jax.tree_util.tree_map_with_path(count, state.opt_state)
    new = state.replace(step=jnp.asarray(step, jnp.int32), opt_state=opt_state)
    return jax.device_put(new, shardings)


class Worker:
    """One worker's programs and state: local steps on its own devices, global ones on all."""

    def __init__(self, cfg: Config):
        n, s = cfg.mesh.replica, cfg.mesh.shard
        self.cfg, self.n, self.index = cfg, n, jax.process_index()
        gmesh, lmesh = multihost.meshes(cfg)
        self.glob = Machinery(cfg, gmesh)
        self.loc = Machinery(multihost.local_config(cfg), lmesh)
        self.g_abstract = self.glob.abstract_state()
        self.l_abstract = self.loc.abstract_state()
        self.rows = cfg.batch_size // n
        del s

    def to_global(self, state):
        return multihost.to_global(state, self.g_abstract)

    def to_local(self, state):
        return multihost.to_local(state, self.l_abstract)

    def step(self, kind: str, state, rows: np.ndarray, shares=None):
        """One step of ``kind`` on this worker's ``rows`` of the global batch: (state, loss, grad norm,
        sync metrics or None)."""
        if not kind.crosses_replica:
            state, metrics = self.loc.step_fn(kind)(state, self.loc.put_batch(rows))
            m = jax.device_get(metrics)
            return state, float(m["loss"][0]), float(m["grad_norm"][0]), None
        batch = multihost.global_batch(self.glob.mesh, rows, self.cfg.batch_size)
        args = (self.to_global(state), batch) if shares is None else \
            (self.to_global(state), batch, jnp.asarray(shares, jnp.float32))
        g_state, metrics = self.glob.step_fn(kind)(*args)
        loss, gnorm = (float(multihost.local_value(metrics[k])[0]) for k in ("loss", "grad_norm"))
        sync = None
        if "pseudo_grad_norm" in metrics:
            sync = {k: multihost.local_value(v) for k, v in metrics.items() if k not in ("loss", "grad_norm")}
        return self.to_local(g_state), loss, gnorm, sync


def train_workers(cfg: Config, run_dir: str | None, *, progress: bool = True, verbose: bool = True,
                  stop_after: int | None = None):
    """``train()`` for ``mesh.processes = mesh.replica``: run in every worker process."""
    from edit_jax.train import MetricsLog, TrainResult, _StopFlag, _resume, sync_fields  # noqa: PLC0415

    multihost.check_runtime(cfg)
    mp = plan_for(cfg)
    cfg, schedule = mp.cfg, mp.schedule
    me, n = jax.process_index(), cfg.mesh.replica
    lead = me == 0
    w = Worker(cfg)
    corpus = data_lib.load_corpus(cfg.data)
    data_lib.check_model_vocab(corpus, cfg.model.vocab_size)
    stream = data_lib.make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, n, cfg.data.seed)
    val = data_lib.val_batches(corpus, cfg.data.seq_len, cfg.batch_size, cfg.eval_batches)
    slow = parse_slowdown(cfg.debug.slowdown).get(me, 1.0)
    corrupt = parse_corrupt(cfg.debug.corrupt)  # None unless the testing knob is set

    ckpt, resumed_from, state, data_state = None, None, None, None
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        ckpt = Checkpointer(run_dir, cfg.keep_checkpoints)
        latest = ckpt.latest_step()
        try:
            if latest is not None:
                g_state, data_state, resumed_from = _resume(ckpt, latest, cfg, w.glob)
                state = w.to_local(g_state)
        except CheckpointError:
            ckpt.close()
            raise
        if data_state is not None:
            stream.set_state(data_state)
        if lead:
            with open(os.path.join(run_dir, "config.json"), "w") as f:
                f.write(dumps(cfg) + "\n")
    if state is None:
        state = w.loc.init_state(cfg.seed)
    # Own step counts: this worker's position in its data stream (A-EDiT workers differ).
    steps_of = (data_state or {}).get("worker_steps")
    k = int(steps_of[me]) if steps_of and len(steps_of) == n else int(state.step)
    global_step = int(state.step)
    log_path = os.path.join(run_dir, "metrics.jsonl") if run_dir else None
    log = MetricsLog(log_path if lead else None, resumed_from)  # truncation on resume: process 0
    multihost.exchange([0])  # everyone waits until the log is truncated before appending to it
    own_log = MetricsLog(log_path, None, truncate=False)  # this worker's training records

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if (verbose and lead) else (lambda msg: None)
    say(f"edit-jax: {cfg.sync.method} with {n} worker processes x {cfg.mesh.shard} {jax.devices()[0].platform} "
        f"devices; data {corpus.description}")
    if resumed_from is not None:
        say(f"edit-jax: resumed from {os.path.join(run_dir, 'checkpoints', str(resumed_from))}")
    bar = None
    if progress and lead:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=global_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    tokens_per_worker_step = w.rows * cfg.data.seq_len
    evaluator = Evaluator(w.glob)
    history, last_loss, val_loss, interrupted, timed_out = [], float("nan"), None, False, False
    t_start, done_here, last_saved = time.perf_counter(), 0, resumed_from
    last_record = [time.perf_counter(), k]

    def rows_for(step: int) -> np.ndarray:
        """This worker's rows of its step ``step`` (debug.corrupt: garbage in its window; the
        corrupted worker's own step count decides, which in A-EDiT may run ahead of the others)."""
        return corrupt_rows(stream.replica_batch(me, step), corrupt, step, me, cfg.model.vocab_size, cfg.seed)

    def record(kind, loss, gnorm, force=False):
        nonlocal last_loss
        last_loss = loss
        if not (force or k % cfg.log_every == 0):
            return
        now = time.perf_counter()
        dt = (now - last_record[0]) / max(k - last_record[1], 1)
        last_record[:] = [now, k]
        rec = {"step": k, "worker": me, "global_step": global_step, "loss": loss, "grad_norm": gnorm,
               "tokens_per_s": tokens_per_worker_step / dt, "step_time": dt, "kind": str(kind), "time": now - t_start}
        own_log.write(rec)
        history.append(rec)

    def sync_record(sync, extra=None):
        if sync is None or not lead:
            return
        log.write({"step": global_step, "global_step": global_step, "sync": True, "time": time.perf_counter() - t_start,
                   **(extra or {}), **sync_fields(sync, cfg.sync.per_unit_metrics)})

    def evaluate():
        nonlocal val_loss
        t0 = time.perf_counter()
        val_loss = evaluator(w.to_global(state), val)
        if lead:
            log.write({"step": global_step, "global_step": global_step, "val_loss": val_loss,
                       "val_ppl": math.exp(min(val_loss, 50.0)), "time": t0 - t_start,
                       "eval_seconds": time.perf_counter() - t0})
        say(f"edit-jax: step {global_step} val_loss {val_loss:.4f} (ppl {math.exp(min(val_loss, 50.0)):.2f})")

    def save(steps_all):
        nonlocal last_saved
        if ckpt is None or (last_saved is not None and global_step <= last_saved):
            return
        stream.step = global_step
        data = {**stream.get_state(), "worker_steps": [int(x) for x in steps_all]}
        ckpt.save(global_step, w.to_global(state), data, cfg)
        last_saved = global_step

    def time_up() -> bool:
        return bool(cfg.max_seconds) and time.perf_counter() - t_start >= cfg.max_seconds

    paced = [0]  # local steps timed so far

    def pace(kind, t0):
        """Testing knob: this worker's local steps take `slow` x as long (it sleeps (slow - 1) x the
        step's own time). Not the first local step (it compiled) and not global steps (their time
        is the slowest worker's anyway)."""
        if slow <= 1.0 or str(kind) != "local":
            return
        paced[0] += 1
        if paced[0] > 1:
            time.sleep((slow - 1.0) * (time.perf_counter() - t0))

    with _StopFlag() as stop:
        # ---- in step: every method, and A-EDiT's synchronous warmup
        in_step_end = schedule.warmup if isinstance(schedule, TimeSchedule) else cfg.steps
        while k < in_step_end:
            if schedule.init_outer_due(k):
                state = w.loc.init_outer_fn()(state)
            kind = schedule.kind(k)
            t0 = time.perf_counter()
            state, loss, gnorm, sync = w.step(kind, state, rows_for(k))
            pace(kind, t0)
            k += 1
            done_here += 1
            global_step = k
            record(kind, loss, gnorm, force=sync is not None or k == cfg.steps)
            sync_record(sync)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")
            if kind.crosses_replica or k == in_step_end:  # a meeting: agree on stopping
                want = stop.signal is not None or (stop_after is not None and done_here >= stop_after)
                agreed = multihost.exchange([int(want), int(time_up())])
                if agreed[:, 0].any() and k < cfg.steps:
                    save([k] * n)
                    interrupted = True
                    say(f"edit-jax: stopped at step {k}; checkpoint saved, re-run the same command to resume")
                    break
                if agreed[:, 1].any() and k < cfg.steps:
                    say(f"edit-jax: max_seconds={cfg.max_seconds:g} reached at step {k}")
                    timed_out = True
                    break
            if cfg.eval_every and k % cfg.eval_every == 0 and k < cfg.steps:
                evaluate()
                last_record[:] = [time.perf_counter(), k]  # evaluation time is not step time
            if cfg.checkpoint_every and k % cfg.checkpoint_every == 0 and k < cfg.steps:
                save([k] * n)
                last_record[:] = [time.perf_counter(), k]

        # ---- A-EDiT: local steps at each worker's own pace, syncs by wall clock
        if isinstance(schedule, TimeSchedule) and not (interrupted or timed_out):
            if schedule.init_outer_due(k):
                state = w.loc.init_outer_fn()(state)
            last_sync, since, syncs = time.monotonic(), 0, 0
            while True:
                t0 = time.perf_counter()
                state, loss, gnorm, _ = w.step(LOCAL, state, rows_for(k))
                pace("local", t0)
                k += 1
                since += 1
                done_here += 1
                record("local", loss, gnorm)
                if not schedule.sync_due(time.monotonic(), last_sync):
                    continue
                want = stop.signal is not None or (stop_after is not None and done_here >= stop_after)
                info = multihost.exchange([since, k, int(want), int(time_up())])
                decision = schedule.decide(list(info[:, 0]), list(info[:, 1]))
                if info[:, 3].any() and not decision.finished:  # the wall-time budget ends the run here
                    decision = dataclasses.replace(decision, run=True, finished=True)
                    say(f"edit-jax: max_seconds={cfg.max_seconds:g} reached")
                previous = global_step
                global_step = decision.mean_step
                if decision.run:
                    state = _set_step(state, global_step, w.loc.state_shardings)
                    state, loss, gnorm, sync = w.step(schedule.sync_kind(), state, rows_for(k), decision.shares)
                    k += 1
                    done_here += 1
                    syncs += 1
                    record(schedule.sync_kind(), loss, gnorm, force=True)
                    sync_record(sync, {"worker_steps_since": [int(x) for x in info[:, 0]],
                                       "step_share": list(decision.shares)})
                elif lead:
                    log.write({"step": global_step, "global_step": global_step, "sync_skipped": True,
                               "worker_steps_since": [int(x) for x in info[:, 0]]})
                last_sync, since = time.monotonic(), 0
                if bar is not None:
                    bar.update(max(global_step - previous, 0))
                    bar.set_postfix(loss=f"{loss:.3f}", syncs=syncs)
                steps_all = info[:, 1] + (1 if decision.run else 0)  # a sync is a step on every worker
                if decision.finished:
                    break
                if info[:, 2].any():
                    save(steps_all)
                    interrupted = True
                    say(f"edit-jax: stopped at global step {global_step}; checkpoint saved, re-run the same "
                        "command to resume")
                    break
                crossed = lambda every: every and global_step // every > previous // every  # noqa: E731
                if decision.run and crossed(cfg.eval_every):
                    evaluate()
                if decision.run and crossed(cfg.checkpoint_every):
                    save(steps_all)
                last_record[:] = [time.perf_counter(), k]  # meeting time is not step time
    if bar is not None:
        bar.close()
    if not interrupted:
        evaluate()
        save(multihost.exchange([k])[:, 0])
    if ckpt is not None:
        ckpt.close()
    seconds = time.perf_counter() - t_start
    return TrainResult(steps=k, final_loss=last_loss, final_val_loss=val_loss,
                       final_val_ppl=math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
                       tokens=done_here * tokens_per_worker_step, seconds=seconds, run_dir=run_dir,
                       interrupted=interrupted, resumed_from=resumed_from, history=history)


__all__ = ["train_workers", "Worker"]
