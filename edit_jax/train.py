"""The training loop: config in, result with the final metrics out.

    result = train(cfg, run_dir="runs/demo")

Order of work: validate the config, normalise it through the method table (``methods.plan_for``:
what runs is what ``config.json`` says), build the mesh and the compiled-step machinery, load the
data, restore or create the state, then step as the method's schedule says. Everything that can
reject the input does so before the first step. The run dir holds
``config.json`` (resolved config), ``metrics.jsonl`` (one JSON object per record: training
records with ``step``/``loss``/``tokens_per_s``, sync records with ``"sync": true``, evaluation
records with ``val_loss``) and ``checkpoints/``. Re-running on the same run dir resumes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from edit_jax import data as data_lib
from edit_jax.checkpoint import Checkpointer, CheckpointError
from edit_jax.config import Config, ConfigError, dumps, validate
from edit_jax.evaluate import Evaluator
from edit_jax.methods import plan_for
from edit_jax.sharding import make_mesh
from edit_jax.state import STATE_FORMAT, legacy_state_shapes, state_shapes
from edit_jax.step import Machinery


MAX_IN_FLIGHT = 2  # steps the loop may run ahead of the device (see the loop)


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


class _StopFlag:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the next step boundary and returns."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class MetricsLog:
    """Appends JSON lines; on resume drops records past the restored step (they will be redone).
    Records of multi-process runs carry the global mean step as ``global_step``: that is the step
    compared (a worker's own ``step`` may be ahead of it)."""

    def __init__(self, path: str | None, resume_step: int | None, truncate: bool = True):
        self.path = path
        if truncate and path and os.path.exists(path):
            keep = []
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut by a kill
                    if resume_step is not None and rec.get("global_step", rec.get("step", 0)) <= resume_step:
                        keep.append(line if line.endswith("\n") else line + "\n")
            with open(path, "w") as f:
                f.writelines(keep)

    def write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _to_json(x):
    a = np.asarray(x)
    return a.item() if a.ndim == 0 else a.tolist()


def _resume(ckpt: Checkpointer, step: int, cfg: Config, machinery: Machinery):
    """Restores checkpoint ``step`` (checked against ``cfg`` first): (state, data state, step).
    A different ``mesh.replica`` is an elastic restart (``StateLayout.elastic_state``); a
    checkpoint of the first state format (before outer optimizers were configurable) is upgraded."""
    meta = ckpt.read_meta(step)
    ckpt.check_compatible(meta, cfg, step)
    layout = machinery.layout
    legacy = meta.get("state_format", 1) < STATE_FORMAT
    old_n = meta["config"]["mesh"]["replica"]
    try:
        if old_n == cfg.mesh.replica:
            target = layout.legacy_abstract_state() if legacy else layout.abstract_state()
            state, data_state = ckpt.restore(step, target)
            state = jax.device_put(layout.upgrade_legacy(state), layout.state_shardings)
        else:
            old_cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, replica=old_n))
            host, data_state = ckpt.restore_host(step, legacy_state_shapes(old_cfg) if legacy else state_shapes(old_cfg))
            state = layout.elastic_state(layout.upgrade_legacy(host), old_n)
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {os.path.join(ckpt.directory, str(step))}: {e}") from e
    return state, data_state, step


def train(cfg: Config, run_dir: str | None = None, *, progress: bool = True, devices: list | None = None,
          stop_after: int | None = None, verbose: bool | None = None) -> TrainResult:
    """Trains ``cfg`` to ``cfg.steps`` (resuming from ``run_dir``'s latest checkpoint if any).

    ``stop_after`` stops (with a checkpoint) after that many steps of this invocation, as a signal
    would: for tests and for splitting a run into chunks.

    With ``mesh.processes > 1`` this runs in each of the worker processes (``workers.py``).
    """
    validate(cfg)
    if cfg.mesh.processes > 1:
        from edit_jax.workers import train_workers  # noqa: PLC0415

        return train_workers(cfg, run_dir, progress=progress, verbose=progress if verbose is None else verbose,
                             stop_after=stop_after)
    method_plan = plan_for(cfg)
    cfg, schedule = method_plan.cfg, method_plan.schedule  # normalised: config.json says what runs
    mesh = make_mesh(cfg.mesh, devices)
    machinery = Machinery(cfg, mesh)  # checks the layout against the mesh (no compilation yet)
    corpus = data_lib.load_corpus(cfg.data)
    data_lib.check_model_vocab(corpus, cfg.model.vocab_size)
    stream = data_lib.make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, cfg.mesh.replica, cfg.data.seed)
    val = data_lib.val_batches(corpus, cfg.data.seq_len, cfg.batch_size, cfg.eval_batches)

    ckpt, resumed_from, state, data_state = None, None, None, None
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        ckpt = Checkpointer(run_dir, cfg.keep_checkpoints)
        latest = ckpt.latest_step()
        try:
            state, data_state, resumed_from = _resume(ckpt, latest, cfg, machinery) if latest is not None \
                else (None, None, None)
        except CheckpointError:
            ckpt.close()
            raise
        if data_state is not None:
            stream.set_state(data_state)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(dumps(cfg) + "\n")
    if state is None:
        state = machinery.init_state(cfg.seed)
    log = MetricsLog(os.path.join(run_dir, "metrics.jsonl") if run_dir else None, resumed_from)
    if run_dir and cfg.log.tensorboard:  # every record also as TensorBoard scalars in RUN_DIR/tb/
        from edit_jax.tensorboard import TeeLog

        log = TeeLog(log, os.path.join(run_dir, "tb"), resumed_from)

    start_step = int(state.step)
    tokens_per_step = cfg.batch_size * cfg.data.seq_len
    verbose = progress if verbose is None else verbose
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else (lambda msg: None)
    say(f"edit-jax: {cfg.sync.method} on mesh replica={cfg.mesh.replica} x shard={cfg.mesh.shard} "
        f"({jax.devices()[0].platform}); data {corpus.description}")
    if method_plan.changed:
        say(f"edit-jax: method {cfg.sync.method} fixes " + ", ".join(
            f"{k}={v} (config had {old})" for k, old, v in method_plan.changed))
    if resumed_from is not None:
        say(f"edit-jax: resumed from {os.path.join(run_dir, 'checkpoints', str(resumed_from))}")

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    history, last_loss, val_loss = [], float("nan"), None
    t_start, interrupted, done_here = time.perf_counter(), False, 0
    timed_kinds: set[str] = set()
    kinds_since_record: set[str] = set()
    in_flight: list = []
    last_record = [time.perf_counter(), start_step]  # (time, step) of the last training record

    evaluator = Evaluator(machinery)

    def save(step):
        if ckpt is not None:
            ckpt.save(step, state, stream.get_state(), cfg)

    def evaluate(step):
        loss = evaluator(state, val)
        rec = {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
               "time": time.perf_counter() - t_start}
        log.write(rec)
        say(f"edit-jax: step {step} val_loss {loss:.4f} (ppl {rec['val_ppl']:.2f})")
        return loss

    with _StopFlag() as stop:
        k = start_step
        while k < cfg.steps:
            if schedule.init_outer_due(k):
                state = machinery.init_outer_fn()(state)
            kind = schedule.kind(k)
            kinds_since_record.add(kind)
            batch = machinery.put_batch(stream.next())
            state, metrics = machinery.step_fn(kind)(state, batch)
            # At most MAX_IN_FLIGHT steps dispatched ahead of the host: XLA:CPU's collectives
            # deadlock (rendezvous timeout) when ~50 steps are queued, and a short queue costs
            # nothing on any backend (the device is still fed one step ahead).
            in_flight.append(metrics["loss"])
            if len(in_flight) > MAX_IN_FLIGHT:
                in_flight.pop(0).block_until_ready()
            k += 1
            done_here += 1
            is_sync = "pseudo_grad_norm" in metrics
            if k % cfg.log_every == 0 or is_sync or k == cfg.steps:
                metrics = jax.device_get(metrics)
                # Throughput over the steps since the last record (the metrics fetch waits for them all).
                now = time.perf_counter()
                dt = (now - last_record[0]) / max(k - last_record[1], 1)
                last_record[:] = [now, k]
                last_loss = float(np.mean(metrics["loss"]))  # per replica -> mean on the host
                rec = {"step": k, "loss": last_loss, "grad_norm": float(np.mean(metrics["grad_norm"])),
                       "tokens_per_s": tokens_per_step / dt, "step_time": dt, "kind": kind}
                if cfg.mesh.replica > 1:
                    rec["replica_loss"] = _to_json(metrics["loss"])
                if kinds_since_record - timed_kinds:  # a first step of a kind also compiled it
                    rec["includes_compile"] = True
                timed_kinds |= kinds_since_record
                kinds_since_record = set()
                log.write(rec)
                history.append(rec)
                if is_sync:
                    srec = {"step": k, "sync": True}
                    for name in ("pseudo_grad_norm", "weight", "flagged", "clip_factor", "outer_update_norm"):
                        srec[name] = _to_json(metrics[name])
                    if cfg.sync.per_unit_metrics:
                        for name in ("unit_pseudo_grad_norm", "unit_weight", "unit_flagged", "unit_clip_factor"):
                            srec[name] = _to_json(metrics[name])
                    log.write(srec)
                if bar is not None:
                    bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", ms=f"{dt * 1e3:.0f}")
            if bar is not None:
                bar.update(1)
            if not math.isfinite(last_loss) and history and history[-1]["step"] == k:
                say(f"edit-jax: loss is {last_loss} at step {k}; stopping (checkpoints are kept)")
                interrupted = True
                break
            if cfg.eval_every and k % cfg.eval_every == 0 and k < cfg.steps:
                val_loss = evaluate(k)
                last_record[:] = [time.perf_counter(), k]  # evaluation time is not step time
            if cfg.checkpoint_every and k % cfg.checkpoint_every == 0 and k < cfg.steps:
                save(k)
                last_record[:] = [time.perf_counter(), k]
            if cfg.max_seconds and time.perf_counter() - t_start >= cfg.max_seconds and k < cfg.steps:
                say(f"edit-jax: max_seconds={cfg.max_seconds:g} reached at step {k}")
                break  # a normal end: evaluation and checkpoint follow
            if stop.signal is not None or (stop_after is not None and done_here >= stop_after and k < cfg.steps):
                save(k)
                interrupted = True
                say(f"edit-jax: stopped at step {k} ({'signal ' + str(stop.signal) if stop.signal else 'stop_after'}); "
                    "checkpoint saved, re-run the same command to resume")
                break
    if bar is not None:
        bar.close()
    if not interrupted:
        val_loss = evaluate(k)
        save(k)
    if ckpt is not None:
        ckpt.close()
    if hasattr(log, "close"):
        log.close()
    seconds = time.perf_counter() - t_start
    return TrainResult(steps=k, final_loss=last_loss, final_val_loss=val_loss,
                       final_val_ppl=math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
                       tokens=(k - start_step) * tokens_per_step, seconds=seconds, run_dir=run_dir,
                       interrupted=interrupted, resumed_from=resumed_from, history=history)


__all__ = ["train", "TrainResult", "CheckpointError"]
