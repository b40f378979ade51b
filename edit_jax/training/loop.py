"""The training loop: one for every method and mode.

    result = run(cfg, run_dir, stop=stop_flag, say=print_to_stderr)

Order of work: normalise the config through the method table (``methods.plan_for``: what runs
is what ``config.json`` says), build the global mesh and the compiled-step machinery, load the
data, restore (verified, with fallback) or create the state, then advance as the driver says
(``drivers.py``: lock-step programs over the global mesh, or A-EDiT's asynchronous workers
after its warmup). The loop itself owns what every mode must guarantee:

- records (``metrics.jsonl``, TensorBoard), the progress bar and the final summary;
- evaluation and checkpoint cadence, ``max_seconds``, and stopping on a signal or
  ``stop_after`` (agreed by every process before it acts);
- the divergence checks: a non-finite record stops the run (``DivergedError``), and a state is
  checked finite before every save (resume.check_before_save), so no non-finite checkpoint is
  ever written;
- the final evaluation and save.

With several processes (one per worker) every process runs this loop; process 0 writes the
files (config.json, the run's records, checkpoint directories moved aside) and the others only
take part in the collectives (orbax writes each process's shards).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import jax

from edit_jax.runtime import multihost
from edit_jax.rundir.checkpoint import Checkpointer, CheckpointError
from edit_jax.config import Config, dumps
from edit_jax.data import check_model_vocab, load_corpus, make_train_stream, val_batches
from edit_jax.data.corrupt import parse_corrupt
from edit_jax.training.drivers import AsyncWorkers, LockStep, Wants, wants_async
from edit_jax.training.evaluate import Evaluator
from edit_jax.localsgd.methods import plan_for
from edit_jax.rundir.records import open_log, read_records, replace_file, sync_fields, worker_log
from edit_jax.training.resume import DivergedError, check_before_save, restore_verified
from edit_jax.runtime.mesh import make_mesh
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.rundir.trained import store_run_tokenizer
from edit_jax.rundir.wandb_log import WandbLog


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    final_val_loss: float | None
    final_val_ppl: float | None
    tokens: int
    seconds: float
    run_dir: str | None
    interrupted: bool = False
    resumed_from: int | None = None
    history: list[dict] = field(default_factory=list)  # training records of this invocation
    already_finished: bool = False  # the run dir's checkpoint was already at cfg.steps: nothing done


def _crossed(every: int, before: int, now: int) -> bool:
    """A multiple of ``every`` lies in (before, now]: evaluation / checkpoint cadence when the
    step advances by one (lock-step) or by many (an A-EDiT meeting)."""
    return bool(every) and now // every > before // every


def run(cfg: Config, run_dir: str | None, *, stop, say: Callable[[str], None], progress: bool,
        devices: list | None = None, stop_after: int | None = None, restore_step: int | None = None) -> TrainResult:
    """Trains ``cfg`` (validated) to ``cfg.steps``; ``stop`` is the signal flag (``.signal``)."""
    method_plan = plan_for(cfg)
    cfg = method_plan.cfg  # normalised: config.json says what runs
    multi, lead = cfg.mesh.processes > 1, jax.process_index() == 0
    if multi:
        multihost.check_runtime(cfg)
        mesh = multihost.meshes(cfg)[0]
    else:
        mesh = make_mesh(cfg.mesh, devices)
    machinery = StepPrograms(method_plan, mesh)  # checks the layout against the mesh (no compilation yet)
    corpus = load_corpus(cfg.data)
    check_model_vocab(corpus, cfg.model.vocab_size)
    stream = make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, cfg.mesh.replica, cfg.data.seed)
    try:
        val = val_batches(corpus, cfg.data.seq_len, cfg.batch_size, cfg.eval_batches)
    except Exception:
        stream.close()
        raise
    if 0 < len(val) < cfg.eval_batches:
        say(f"edit-jax: validation on {len(val)} batches (eval_batches={cfg.eval_batches}): the validation split "
            f"{'read at start ' if corpus.streamed is not None else ''}holds no more")
    corrupt = parse_corrupt(cfg.debug.corrupt)  # None unless the testing knob is set

    ckpt, resumed_from, state, data_state = None, None, None, None
    if run_dir:
        ckpt = Checkpointer(run_dir, cfg.keep_checkpoints)
        try:
            state, data_state, resumed_from = restore_verified(ckpt, cfg, machinery, say, restore_step, lead=lead,
                                                               barrier=multihost.barrier)
            if data_state is not None:
                stream.set_state(data_state)
            if lead:
                replace_file(os.path.join(run_dir, "config.json"), dumps(cfg) + "\n")
                store_run_tokenizer(cfg, run_dir)  # the run dir is self-contained (sample, export)
        except Exception:
            ckpt.close()
            stream.close()
            raise
    if state is None:
        state = machinery.init_state(cfg.seed)
        if cfg.model.init_from:
            say(f"edit-jax: params from model.init_from={cfg.model.init_from}")
    log = open_log(run_dir, resumed_from, lead, cfg.log.tensorboard)
    if cfg.log.wandb and run_dir and lead:
        try:
            log = WandbLog(log, run_dir, cfg, earlier=read_records(os.path.join(run_dir, "metrics.jsonl")))
        except Exception:
            log.close()
            stream.close()
            if ckpt is not None:
                ckpt.close()
            raise
    multihost.barrier()  # the log is truncated (process 0) before any worker appends to it

    start_step = k = int(multihost.local_value(state.step))
    tokens_per_step = cfg.batch_size * cfg.data.seq_len
    devices_desc = (f"{cfg.mesh.processes} worker processes x {cfg.mesh.shard}" if multi else
                    f"replica={cfg.mesh.replica} x shard={cfg.mesh.shard}")
    say(f"edit-jax: {cfg.sync.method} on mesh {devices_desc} ({jax.devices()[0].platform}); data {corpus.description}")
    if method_plan.changed:
        say(f"edit-jax: method {cfg.sync.method} fixes " + ", ".join(
            f"{key}={v} (config had {old})" for key, old, v in method_plan.changed))
    if resumed_from is not None:
        say(f"edit-jax: resumed from {os.path.join(run_dir, 'checkpoints', str(resumed_from))}")

    bar = None
    if progress and lead:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    driver = LockStep(machinery, stream, corrupt)
    own_log = worker_log(run_dir)  # A-EDiT workers' own records
    evaluator = Evaluator(machinery)
    history, last_loss, val_loss = [], float("nan"), None
    t_start, interrupted, done_here, diverged = time.perf_counter(), False, 0, None

    def save(step: int, final: bool = False) -> None:
        if ckpt is None:
            return
        global_state = driver.global_state(state)
        if check_before_save(global_state, step, machinery.plan.uses_outer, final, ckpt.latest_step()):
            stream.step = step
            # A streamed corpus keeps each replica's position in the process that trains it: the
            # processes exchange them here (every process saves), so the checkpoint has them all.
            data = stream.get_state(gather=multihost.exchange_floats if multi else None)
            ckpt.save(step, global_state, {**data, **driver.data_extra()}, cfg)
        else:
            say(f"edit-jax: step {step}: some workers are non-finite (they are rolled back at their next sync); "
                f"checkpoint skipped, the last one ({ckpt.latest_step()}) is kept")

    def guarded_save(step: int, final: bool) -> str | None:
        """``save``, with a divergence as its message (the loop cleans up before raising it)."""
        try:
            save(step, final)
        except DivergedError as e:
            return str(e)
        return None

    def evaluate(step: int) -> float:
        t0 = time.perf_counter()
        loss = evaluator(driver.global_state(state), val)
        rec = {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "time": t0 - t_start}
        if multi:
            rec.update(global_step=step, eval_seconds=time.perf_counter() - t0)
        log.write(rec)
        say(f"edit-jax: step {step} val_loss {loss:.4f} (ppl {rec['val_ppl']:.2f})")
        return loss

    try:
        while True:
            if not isinstance(driver, AsyncWorkers):
                if k >= cfg.steps:
                    break
                if wants_async(machinery, k):  # A-EDiT's warmup is over: each worker at its own pace
                    driver = AsyncWorkers(machinery, stream, corrupt, k, data_state)
                    state = driver.enter(state)
            want_stop = stop.signal is not None or (stop_after is not None and done_here >= stop_after)
            wants = Wants(stop=want_stop, time_up=bool(cfg.max_seconds) and time.perf_counter() - t_start >= cfg.max_seconds)
            adv = driver.advance(state, k, wants)
            state, before, k = adv.state, k, adv.step
            done_here += adv.ran
            now = time.perf_counter() - t_start
            if multi:  # records of several processes carry the wall time (bench_straggler reads it)
                adv.records = [{**rec, "time": now} for rec in adv.records]
                adv.own_records = [{**rec, "time": now} for rec in adv.own_records]
            for rec in adv.records:
                log.write(rec)
            for rec in adv.own_records:
                own_log.write(rec)
            history += adv.records + adv.own_records
            if adv.loss is not None:
                last_loss = adv.loss
            if adv.sync is not None:
                if adv.sync["inner_reset"].any():
                    reset = [int(i) for i in adv.sync["inner_reset"].nonzero()[0]]
                    say(f"edit-jax: step {k}: non-finite worker(s) {reset} rolled back to the outer params, "
                        "their inner optimizer moments reset")
                rec = {"step": k, "sync": True, **adv.sync_extra, **sync_fields(adv.sync, cfg.sync.per_unit_metrics)}
                log.write({**rec, "global_step": k, "time": time.perf_counter() - t_start} if multi else rec)
            if adv.skipped is not None:
                log.write(adv.skipped)
            if bar is not None:
                bar.update(max(k - before, 0))
                if adv.loss is not None:
                    bar.set_postfix(loss=f"{adv.loss:.3f}")
            if adv.diverged is not None:
                diverged, interrupted = adv.diverged, True
                break
            if adv.finished:  # A-EDiT: the global token budget is reached (or max_seconds)
                if adv.time_up:
                    say(f"edit-jax: max_seconds={cfg.max_seconds:g} reached")
                break
            if adv.stop:
                if done_here == 0:  # a signal while compiling or restoring: nothing new to save
                    interrupted = True
                    say(f"edit-jax: stopped before the first step (signal {stop.signal}); nothing new to save")
                    break
                diverged = guarded_save(k, final=True)
                interrupted = True
                if diverged is None:
                    how = f"signal {stop.signal}" if stop.signal else "stop_after" if stop_after is not None else "another worker"
                    say(f"edit-jax: stopped at step {k} ({how}); checkpoint saved, re-run the same command to resume")
                break
            if adv.time_up:
                say(f"edit-jax: max_seconds={cfg.max_seconds:g} reached at step {k}")
                break  # a normal end: evaluation and checkpoint follow
            if adv.cadence and _crossed(cfg.eval_every, before, k) and k < cfg.steps:
                val_loss = evaluate(k)
                driver.mark(k)  # evaluation time is not step time
            if adv.cadence and _crossed(cfg.checkpoint_every, before, k) and k < cfg.steps:
                diverged = guarded_save(k, final=False)
                if diverged is not None:
                    interrupted = True
                    break
                driver.mark(k)
        if bar is not None:
            bar.close()
        if not interrupted:
            val_loss = evaluate(k)
            if stop.signal is not None:  # the run is complete: finish it rather than lose the final save
                say(f"edit-jax: signal {stop.signal} during the final evaluation; saving the finished run")
            diverged = guarded_save(k, final=True)
    finally:
        if ckpt is not None:
            ckpt.close()
        log.close()
        stream.close()  # a streamed corpus's reader processes
    if diverged is not None:
        raise DivergedError(diverged)
    return TrainResult(steps=k, final_loss=last_loss, final_val_loss=val_loss,
                       final_val_ppl=math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
                       tokens=(k - start_step) * tokens_per_step, seconds=time.perf_counter() - t_start,
                       run_dir=run_dir, interrupted=interrupted, resumed_from=resumed_from, history=history)


__all__ = ["run", "TrainResult", "CheckpointError", "DivergedError"]
