"""The training loop: config in, result with the final metrics out.

    result = train(cfg, run_dir="runs/demo")

Order of work: validate the config, normalise it through the method table (``methods.plan_for``:
what runs is what ``config.json`` says), build the mesh and the compiled-step machinery, load the
data, restore or create the state, then step as the method's schedule says. Everything that can
reject the input does so before the first step. The run dir holds
``config.json`` (resolved config), ``metrics.jsonl`` (one JSON object per record: training
records with ``step``/``loss``/``tokens_per_s``, sync records with ``"sync": true``, evaluation
records with ``val_loss``) and ``checkpoints/``. Re-running on the same run dir resumes.

What protects a run (README, "Exit codes and what survives what"): the run dir is checked for
writability and locked (runlock.py) before any work; SIGINT / SIGTERM only set a flag for the
whole of ``train`` (a second one exits at once); a state is checked finite before it is saved
(a non-finite one stops the run with ``DivergedError``, the last good checkpoint kept); resumes
verify checksums and fall back to the newest checkpoint that verifies (``_resume_verified``).
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
from edit_jax.checkpoint import Checkpointer, CheckpointError, UnreadableCheckpointError, steps_on_disk
from edit_jax.config import Config, ConfigError, dumps
from edit_jax.data.corrupt import corrupt_batch, parse_corrupt
from edit_jax.evaluate import Evaluator
from edit_jax.integrity import finite_report, nonfinite_parts
from edit_jax.methods import plan_for
from edit_jax.runlock import RunLock, check_writable
from edit_jax.sharding import make_mesh
from edit_jax.state import STATE_FORMAT, TrainState, legacy_state_shapes, state_shapes
from edit_jax.step import Machinery
from edit_jax.validate import validate


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
    already_finished: bool = False  # the run dir's checkpoint was already at cfg.steps: nothing done


class DivergedError(RuntimeError):
    """Training produced non-finite values; nothing non-finite was saved (the CLI exits with 3)."""


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
        if self.signal is not None:  # a second signal: stop now, without a checkpoint
            # Not KeyboardInterrupt: raised inside JAX / XLA calls it gave a traceback and then a
            # segfault at interpreter exit. Checkpoints are written atomically (orbax renames a
            # finished temporary dir), so leaving now loses only the steps since the last one;
            # the kernel releases the run dir's lock.
            print(f"\nedit-jax: second signal ({signum}); exiting now without a checkpoint (the last "
                  "checkpoint is kept; re-run the same command to resume)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(130)
        self.signal = signum

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth > 0:
            return
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


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


def _guard_save(save, step: int, final: bool) -> str | None:
    """Runs ``save``; the divergence message instead of raising, so the loop can clean up first."""
    try:
        save(step, final)
    except DivergedError as e:
        return str(e)
    return None


def sync_fields(metrics: dict, per_unit: bool) -> dict:
    """The figures of a sync record (README, "Run dir"), from a sync step's metrics."""
    names = ("pseudo_grad_norm", "weight", "flagged", "clip_factor", "outer_update_norm", "inner_reset")
    if per_unit:
        names += ("unit_pseudo_grad_norm", "unit_weight", "unit_flagged", "unit_clip_factor")
    return {name: _to_json(metrics[name]) for name in names}


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


def _sayer(progress: bool, verbose: bool | None):
    verbose = progress if verbose is None else verbose
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else (lambda msg: None)


def _resume_verified(ckpt: Checkpointer, cfg: Config, machinery: Machinery, say, restore_step: int | None):
    """Restores the newest checkpoint that reads and verifies (or ``restore_step``): (state, data
    state, step), all None when there is none. Damaged ones newer than it are reported and moved to
    ``checkpoints.bad/``; with ``restore_step``, newer good ones are moved to ``checkpoints.aside/``
    (never deleted). If none verifies, nothing is moved and ``CheckpointError`` lists them all. An
    incompatible config is not a damaged checkpoint: it raises at once."""
    steps = sorted(ckpt.all_steps(), reverse=True)
    if restore_step is not None and restore_step not in steps:
        raise CheckpointError(f"--restore-step {restore_step}: no checkpoint {restore_step} in {ckpt.directory} "
                              f"(have {sorted(steps) or 'none'})")
    candidates = [restore_step] if restore_step is not None else steps
    bad, errors = [], []
    for step in candidates:
        try:
            meta = ckpt.read_meta(step)
            old_n = meta["config"]["mesh"]["replica"]
            state, data_state, step = _resume(ckpt, step, cfg, machinery)
        except UnreadableCheckpointError as e:
            bad.append(step)
            errors.append(e)
            continue
        for b, err in zip(bad, errors):
            reason = str(err).split(". It was left untouched")[0]
            say(f"edit-jax: {reason}. Moved it to {ckpt.set_aside(b)} (not deleted); falling back to step {step}")
        for newer in [s for s in steps if s > step and s not in bad]:
            say(f"edit-jax: --restore-step {step}: moved newer checkpoint {newer} to "
                f"{ckpt.set_aside(newer, 'checkpoints.aside')}")
        if old_n != cfg.mesh.replica:
            say(f"edit-jax: elastic restart: checkpoint {step} has mesh.replica={old_n}, this run {cfg.mesh.replica}; "
                "every worker restarts from the outer params, inner optimizer moments are the old workers' mean")
        return state, data_state, step
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise CheckpointError(f"no checkpoint in {ckpt.directory} verifies (tried {', '.join(map(str, bad))}); "
                              "all were left untouched. Move them away to start over.")
    return None, None, None


def _finished_result(run_dir: str, cfg: Config, say) -> TrainResult | None:
    """A result saying "nothing to do" when ``run_dir`` already has a checkpoint at ``cfg.steps``
    or later (a rerun of a finished run writes nothing)."""
    steps = steps_on_disk(run_dir)
    if not steps or steps[-1] < cfg.steps:
        return None
    say(f"edit-jax: run dir {run_dir} already finished (checkpoint at step {steps[-1]}, steps={cfg.steps}); "
        "nothing to do. Raise steps= to train further.")
    return TrainResult(steps=steps[-1], final_loss=float("nan"), final_val_loss=None, final_val_ppl=None, tokens=0,
                       seconds=0.0, run_dir=run_dir, already_finished=True)


def _check_before_save(state: TrainState, step: int, uses_outer: bool, final: bool, last_good) -> bool:
    """True if ``state`` may be saved. A state with non-finite values is never saved: the run stops
    (``DivergedError``) unless only some workers are non-finite in a Local SGD method with a finite
    outer state, mid-run (``final`` False): their next sync rolls them back to θ̄ and resets their
    inner state, so this checkpoint is skipped (False) and the next one tried."""
    report = finite_report(state)
    bad = nonfinite_parts(report)
    if not bad:
        return True
    recoverable = (uses_outer and bool(report["outer"]) and bool(report["opt_state (shared)"])
                   and bool((report["params"] & report["opt_state"]).any()))
    if recoverable and not final:
        return False
    raise DivergedError(f"non-finite values at step {step} in {'; '.join(bad)}: not saved. "
                        f"Last good checkpoint: {last_good or 'none'} (kept). Lower optim.lr or check the data.")


def _loss_divergence(metrics: dict, kind: str, step: int) -> str | None:
    """A message when a training record shows a run that cannot recover: in a synchronous (hsdp)
    step any non-finite loss or gradient norm; in a local step all workers' (a single worker's
    is rolled back at its next sync)."""
    loss, gnorm = np.atleast_1d(np.asarray(metrics["loss"])), np.atleast_1d(np.asarray(metrics["grad_norm"]))
    ok = np.isfinite(loss) & np.isfinite(gnorm)
    if (ok.all() if str(kind) == "hsdp" else ok.any()):
        return None
    return (f"non-finite loss / gradient norm at step {step} (loss {_to_json(loss)}, grad norm {_to_json(gnorm)}); "
            "stopping")


def train(cfg: Config, run_dir: str | None = None, *, progress: bool = True, devices: list | None = None,
          stop_after: int | None = None, verbose: bool | None = None, restore_step: int | None = None) -> TrainResult:
    """Trains ``cfg`` to ``cfg.steps`` (resuming from ``run_dir``'s latest checkpoint if any).

    ``stop_after`` stops (with a checkpoint) after that many steps of this invocation, as a signal
    would: for tests and for splitting a run into chunks. ``restore_step`` resumes from that
    checkpoint instead of the newest (newer ones are moved to ``checkpoints.aside/``).

    With ``mesh.processes > 1`` this runs in each of the worker processes (``workers.py``); process
    0 holds the run dir's lock.

    Raises ``RunDirError`` (run dir not writable), ``RunLockError`` (another run holds it),
    ``DivergedError`` (non-finite state; nothing non-finite saved) besides the input errors.
    """
    validate(cfg)
    say = _sayer(progress, verbose)
    if cfg.mesh.processes > 1:
        return _train_processes(cfg, run_dir, progress=progress, verbose=verbose, stop_after=stop_after,
                                restore_step=restore_step, say=say)
    with _StopFlag() as stop:  # for the whole call: a Ctrl-C while compiling or evaluating is a clean stop
        if not run_dir:
            return _train(cfg, None, progress=progress, devices=devices, stop_after=stop_after, verbose=verbose,
                          stop=stop, restore_step=None)
        check_writable(run_dir)
        with RunLock(run_dir, say):
            if restore_step is None:
                done = _finished_result(run_dir, cfg, say)
                if done is not None:
                    return done
            return _train(cfg, run_dir, progress=progress, devices=devices, stop_after=stop_after, verbose=verbose,
                          stop=stop, restore_step=restore_step)


def _train_processes(cfg: Config, run_dir: str | None, *, progress: bool, verbose: bool | None,
                     stop_after: int | None, restore_step: int | None, say) -> TrainResult:
    """``train`` in one of ``mesh.processes`` worker processes: every process checks the run dir,
    process 0 locks it, and every process sees the same "already finished" answer on disk."""
    import contextlib

    from edit_jax.workers import train_workers  # noqa: PLC0415

    if restore_step is not None:
        raise ConfigError("--restore-step: not supported with mesh.processes > 1 yet; move the newer checkpoints "
                          "aside by hand")
    lead = jax.process_index() == 0
    if run_dir:
        check_writable(run_dir)
    with RunLock(run_dir, say) if run_dir and lead else contextlib.nullcontext():
        done = _finished_result(run_dir, cfg, say if lead else (lambda m: None)) if run_dir else None
        if done is not None:
            return done
        return train_workers(cfg, run_dir, progress=progress, verbose=progress if verbose is None else verbose,
                             stop_after=stop_after)


def _train(cfg: Config, run_dir: str | None, *, progress: bool, devices: list | None, stop_after: int | None,
           verbose: bool | None, stop: _StopFlag, restore_step: int | None) -> TrainResult:
    method_plan = plan_for(cfg)
    cfg, schedule = method_plan.cfg, method_plan.schedule  # normalised: config.json says what runs
    mesh = make_mesh(cfg.mesh, devices)
    machinery = Machinery(cfg, mesh)  # checks the layout against the mesh (no compilation yet)
    corpus = data_lib.load_corpus(cfg.data)
    data_lib.check_model_vocab(corpus, cfg.model.vocab_size)
    stream = data_lib.make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, cfg.mesh.replica, cfg.data.seed)
    val = data_lib.val_batches(corpus, cfg.data.seq_len, cfg.batch_size, cfg.eval_batches)
    corrupt = parse_corrupt(cfg.debug.corrupt)  # None unless the testing knob is set

    ckpt, resumed_from, state, data_state = None, None, None, None
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        ckpt = Checkpointer(run_dir, cfg.keep_checkpoints)
        try:
            state, data_state, resumed_from = _resume_verified(ckpt, cfg, machinery, _sayer(progress, verbose),
                                                               restore_step)
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

    def save(step, final=False):
        if ckpt is not None:
            if _check_before_save(state, step, machinery.plan.uses_outer, final, ckpt.latest_step()):
                ckpt.save(step, state, stream.get_state(), cfg)
            else:
                say(f"edit-jax: step {step}: some workers are non-finite (they are rolled back at their next sync); "
                    f"checkpoint skipped, the last one ({ckpt.latest_step()}) is kept")

    def evaluate(step):
        loss = evaluator(state, val)
        rec = {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
               "time": time.perf_counter() - t_start}
        log.write(rec)
        say(f"edit-jax: step {step} val_loss {loss:.4f} (ppl {rec['val_ppl']:.2f})")
        return loss

    diverged = None
    with stop:
        k = start_step
        while k < cfg.steps:
            if stop.signal is not None and done_here == 0:  # a signal while compiling or restoring
                interrupted = True
                say(f"edit-jax: stopped before the first step (signal {stop.signal}); nothing new to save")
                break
            if schedule.init_outer_due(k):
                state = machinery.init_outer_fn()(state)
            kind = schedule.kind(k)
            kinds_since_record.add(kind)
            # debug.corrupt: garbage rows for one worker in its window; the stream is not touched.
            batch = machinery.put_batch(corrupt_batch(stream.next(), corrupt, k, cfg.mesh.replica,
                                                      cfg.model.vocab_size, cfg.seed))
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
                diverged = _loss_divergence(metrics, kind, k)
                rec = {"step": k, "loss": last_loss, "grad_norm": float(np.mean(metrics["grad_norm"])),
                       "tokens_per_s": tokens_per_step / dt, "step_time": dt, "kind": str(kind)}
                if cfg.mesh.replica > 1:
                    rec["replica_loss"] = _to_json(metrics["loss"])
                if kinds_since_record - timed_kinds:  # a first step of a kind also compiled it
                    rec["includes_compile"] = True
                timed_kinds |= kinds_since_record
                kinds_since_record = set()
                log.write(rec)
                history.append(rec)
                if is_sync:
                    if np.any(metrics["inner_reset"]):
                        reset = np.flatnonzero(metrics["inner_reset"]).tolist()
                        say(f"edit-jax: step {k}: non-finite worker(s) {reset} rolled back to the outer params, "
                            "their inner optimizer moments reset")
                    log.write({"step": k, "sync": True, **sync_fields(metrics, cfg.sync.per_unit_metrics)})
                if bar is not None:
                    bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", ms=f"{dt * 1e3:.0f}")
            if bar is not None:
                bar.update(1)
            if diverged is not None:
                interrupted = True
                break
            if cfg.eval_every and k % cfg.eval_every == 0 and k < cfg.steps:
                val_loss = evaluate(k)
                last_record[:] = [time.perf_counter(), k]  # evaluation time is not step time
            if cfg.checkpoint_every and k % cfg.checkpoint_every == 0 and k < cfg.steps:
                diverged = _guard_save(save, k, final=False)
                if diverged is not None:
                    interrupted = True
                    break
                last_record[:] = [time.perf_counter(), k]
            if cfg.max_seconds and time.perf_counter() - t_start >= cfg.max_seconds and k < cfg.steps:
                say(f"edit-jax: max_seconds={cfg.max_seconds:g} reached at step {k}")
                break  # a normal end: evaluation and checkpoint follow
            if stop.signal is not None or (stop_after is not None and done_here >= stop_after and k < cfg.steps):
                diverged = _guard_save(save, k, final=True)
                if diverged is not None:
                    interrupted = True
                    break
                interrupted = True
                say(f"edit-jax: stopped at step {k} ({'signal ' + str(stop.signal) if stop.signal else 'stop_after'}); "
                    "checkpoint saved, re-run the same command to resume")
                break
    if bar is not None:
        bar.close()
    if not interrupted:
        val_loss = evaluate(k)
        if stop.signal is not None:  # the run is complete: finish it rather than lose the final save
            say(f"edit-jax: signal {stop.signal} during the final evaluation; saving the finished run")
        diverged = _guard_save(save, k, final=True)
    if ckpt is not None:
        ckpt.close()
    if hasattr(log, "close"):
        log.close()
    if diverged is not None:
        raise DivergedError(diverged)
    seconds = time.perf_counter() - t_start
    return TrainResult(steps=k, final_loss=last_loss, final_val_loss=val_loss,
                       final_val_ppl=math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
                       tokens=(k - start_step) * tokens_per_step, seconds=seconds, run_dir=run_dir,
                       interrupted=interrupted, resumed_from=resumed_from, history=history)


__all__ = ["train", "TrainResult", "CheckpointError", "DivergedError"]
