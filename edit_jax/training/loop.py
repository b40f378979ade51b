"""The training loop: one for every method and mode, read as set up, then for each advance the due hooks.

    result = run(cfg, run_dir, stop=stop_flag, say=print_to_stderr)

Set up (``_set_up``): normalise the config through the method table (``methods.plan_for``: what
runs is what ``config.json`` says), build the global mesh and the compiled step programs, load
the data, restore (verified, with fallback) or create the state (from ``model.init_from``'s
weights where set), open the records sink. Then ``Training.loop``: advance as the driver says
(``drivers.py``: lock-step programs over the global mesh, or A-EDiT's asynchronous workers once
the method plan says its asynchronous phase began), then run the hooks (``hooks.py``) that are
due; the first hook that ends the run ends the loop; then the final evaluation and save.

The hooks, in order (what every mode must guarantee):

- ``records``: the advance's training, sync and skipped-sync records (``rundir/sink.py`` writes
  ``metrics.jsonl``, TensorBoard, W&B);
- ``progress``: the progress bar;
- ``spike``: each training record, and in A-EDiT's asynchronous phase each meeting, through the
  loss-spike rule (spike.py); a spike that does not settle rolls back in-process (``roll_back``),
  or ends the run (exit 3) where it cannot;
- ``stop checks``: a non-finite record stops the run (``DivergedError``); A-EDiT's token budget;
  a signal or ``stop_after`` (agreed by every process before it acts: checkpoint, exit 130);
  ``max_seconds``;
- ``evaluate`` every ``eval_every`` and ``checkpoint`` every ``checkpoint_every`` steps (a state is
  checked finite before every save, resume.check_before_save, so no non-finite checkpoint is ever
  written; a save at a step whose checkpoint exists with another data position, a stop right at a
  rollback's checkpoint, replaces it: ``Training.to_write``).

With several processes (one per worker) every process runs this loop; process 0 writes the
files (config.json, the run's records, checkpoint directories moved aside) and the others only
take part in the collectives (orbax writes each process's shards).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import jax

from edit_jax.config import Config, dumps
from edit_jax.data import check_model_vocab, load_corpus, make_train_stream, val_batches
from edit_jax.data.batches import ReplicaStreams
from edit_jax.data.corrupt import CorruptSpec, parse_corrupt
from edit_jax.hf.load import initial_params
from edit_jax.localsgd.methods import MethodPlan, TimeSchedule, plan_for
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.rundir.checkpoint import Checkpointer, CheckpointError, data_checksum
from edit_jax.rundir.records import replace_file
from edit_jax.rundir.sink import RunRecords
from edit_jax.rundir.trained import store_run_tokenizer
from edit_jax.runtime import multihost
from edit_jax.runtime.mesh import make_mesh
from edit_jax.training.drivers import Advance, AsyncWorkers, LockStep, Wants, worker_programs
from edit_jax.training.evaluate import Evaluator
from edit_jax.training.ahead import compile_run_ahead
from edit_jax.training.hooks import End, Hooks, Rewind
from edit_jax.training.resume import DivergedError, check_before_save, restore_verified, set_aside_untrusted
from edit_jax.training.result import TrainResult, announce
from edit_jax.training.spike import SpikeWatch


@dataclass
class Setup:
    """What the loop starts from (``_set_up``)."""

    method_plan: MethodPlan
    programs: StepPrograms
    stream: ReplicaStreams
    val: list
    corrupt: CorruptSpec | None
    ckpt: Checkpointer | None
    state: object
    data_state: dict | None
    resumed_from: int | None
    sink: RunRecords
    description: str  # the data, as the start-up line says it


def _set_up(cfg: Config, run_dir: str | None, say, devices: list | None, restore_step: int | None,
            on_timing=None) -> Setup:
    """The method plan, mesh, programs, data, state (restored, or new) and the records sink;
    whatever was opened is closed again when a later part fails."""
    method_plan = plan_for(cfg)
    cfg = method_plan.cfg  # normalised: config.json says what runs
    lead = jax.process_index() == 0
    if cfg.mesh.processes > 1:
        multihost.check_runtime(cfg)
        mesh = multihost.meshes(cfg)[0]
    else:
        mesh = make_mesh(cfg.mesh, devices)
    programs = StepPrograms(method_plan, mesh)  # checks the layout against the mesh (no compilation yet)
    corpus = load_corpus(cfg.data)
    check_model_vocab(corpus, cfg.model.vocab_size)
    stream = make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, cfg.mesh.replica, cfg.data.seed)
    ckpt, resumed_from, state, data_state = None, None, None, None
    try:
        val = val_batches(corpus, cfg.data.seq_len, cfg.batch_size, cfg.eval_batches)
        if 0 < len(val) < cfg.eval_batches:
            say(f"edit-jax: validation on {len(val)} batches (eval_batches={cfg.eval_batches}): the validation split "
                f"{'read at start ' if corpus.streamed is not None else ''}holds no more")
        corrupt = parse_corrupt(cfg.debug.corrupt)  # None unless the testing knob is set
        if run_dir:
            # Several processes save synchronously: a background write failing on one process (a
            # full disk) left the others in orbax's background barrier (docs/developer/restarts.md).
            ckpt = Checkpointer(run_dir, cfg.keep_checkpoints,
                                asynchronous=cfg.train.async_checkpoint and cfg.mesh.processes == 1)
            state, data_state, resumed_from = restore_verified(ckpt, cfg, programs, say, restore_step, lead=lead,
                                                               barrier=multihost.barrier)
            if data_state is not None:
                stream.set_state(data_state)
            if lead:
                replace_file(os.path.join(run_dir, "config.json"), dumps(cfg) + "\n")
                store_run_tokenizer(cfg, run_dir)  # the run dir is self-contained (sample, export)
        if state is None:
            start = initial_params(cfg, programs.layout) if cfg.model.init_from else None
            state = programs.init_state(cfg.seed, start)
            if cfg.model.init_from:
                say(f"edit-jax: params from model.init_from={cfg.model.init_from}")
        sink = RunRecords.open(run_dir, resumed_from, lead, cfg, on_timing)
    except Exception:
        if ckpt is not None:
            ckpt.close()
        stream.close()
        raise
    multihost.barrier()  # the log is truncated (process 0) before any worker appends to it
    return Setup(method_plan, programs, stream, val, corrupt, ckpt, state, data_state, resumed_from, sink,
                 corpus.description)


class Training:
    """One run of the loop: the state as it advances, the driver, the hooks and what they share."""

    def __init__(self, setup: Setup, *, stop, say, progress: bool, stop_after: int | None):
        self.setup, self.cfg, self.say = setup, setup.method_plan.cfg, say
        self.stop, self.stop_after = stop, stop_after
        self.programs, self.state, self.sink = setup.programs, setup.state, setup.sink
        self.multi = self.cfg.mesh.processes > 1
        self.k = self.start_step = int(multihost.local_value(self.state.step))
        self.bar = None
        if progress and jax.process_index() == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=self.cfg.steps, initial=self.start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr)
        self.driver = LockStep(self.programs, setup.stream, setup.corrupt)
        self.workers_apart = False  # the driver is AsyncWorkers (A-EDiT after its warmup)
        self.evaluator = Evaluator(self.programs)
        self.history, self.last_loss, self.val_loss, self.done_here = [], float("nan"), None, 0
        self.t_start = time.perf_counter()
        self.watch = SpikeWatch(self.cfg, (setup.data_state or {}).get("spike_history", ()), setup.resumed_from)
        self.rollbacks = 0
        self.hooks = Hooks(last_step=self.cfg.steps)
        self.hooks.add("records", self.write_records)
        self.hooks.add("progress", self.show_progress)
        self.hooks.add("spike", self.watch_loss)
        self.hooks.add("stop checks", self.check_stop)
        self.hooks.add("evaluate", self.evaluate_on_cadence, every=self.cfg.eval_every)
        self.hooks.add("checkpoint", self.checkpoint_on_cadence, every=self.cfg.checkpoint_every)
        if setup.ckpt is not None and not self.multi:  # a background save that is written counts now
            self.hooks.add("checkpoint written", lambda adv, before, now: self.finish_save(poll=True))
        # A-EDiT's asynchronous phase runs its worker's own programs (built here: compiled ahead)
        self.worker = worker_programs(self.programs) if isinstance(self.programs.schedule, TimeSchedule) else None
        if self.k < self.cfg.steps:
            compile_run_ahead(self.programs, self.evaluator, self.state, setup, say, self.elapsed(), self.worker,
                              stopped=lambda: self.stop.signal is not None)

    def elapsed(self) -> float:  # since this invocation started (the sink adds the earlier invocations')
        return time.perf_counter() - self.t_start

    # -- the loop ------------------------------------------------------------------------------

    def loop(self) -> End:
        """Advances until a hook ends the run or the last step is reached."""
        cfg = self.cfg
        while True:
            if not self.workers_apart:
                if self.k >= cfg.steps:
                    return End(interrupted=False)
                if self.setup.method_plan.asynchronous_at(self.k):  # each worker at its own pace from here
                    self.driver = AsyncWorkers(self.programs, self.setup.stream, self.setup.corrupt, self.k,
                                               self.setup.data_state, self.worker)
                    self.state, self.workers_apart = self.driver.enter(self.state), True
            t0 = time.perf_counter()
            adv = self.driver.advance(self.state, self.k, self._wants())
            t1 = time.perf_counter()
            before, self.state, self.k = self.k, adv.state, adv.step
            self.done_here += adv.ran
            end = self.hooks.run(adv, before, self.k)
            self.sink.timing({"timing": "advance", "step": self.k, "at": t1 - self.t_start, "advance_s": t1 - t0,
                              "data_s": adv.data_s, "hooks_s": dict(self.hooks.seconds),
                              "includes_compile": any(r.get("includes_compile", False) for r in adv.records)})
            if isinstance(end, End):
                return end

    def _wants(self) -> Wants:
        return Wants(stop=self.stop.signal is not None,
                     time_up=bool(self.cfg.max_seconds) and self.elapsed() >= self.cfg.max_seconds,
                     planned=self.stop_after is not None and self.done_here >= self.stop_after)

    def finish(self, end: End) -> str | None:
        """The final evaluation and save of a run that was not interrupted; a divergence message."""
        if self.bar is not None:
            self.bar.close()
        if end.interrupted:
            return end.diverged
        self.val_loss = self.evaluate(self.k)
        if self.stop.signal is not None:  # the run is complete: finish it rather than lose the final save
            self.say(f"edit-jax: signal {self.stop.signal} during the final evaluation; saving the finished run")
        return self.guarded_save(self.k, final=True)

    # -- the hooks -----------------------------------------------------------------------------

    def write_records(self, adv: Advance, before: int, now: int) -> None:
        self.history += self.sink.training(adv.records, adv.own_records, self.elapsed())
        if adv.loss is not None:
            self.last_loss = adv.loss
        if adv.sync is not None:
            if adv.sync["inner_reset"].any():
                reset = [int(i) for i in adv.sync["inner_reset"].nonzero()[0]]
                self.say(f"edit-jax: step {now}: non-finite worker(s) {reset} rolled back to the outer params, "
                         "their inner optimizer moments reset")
            self.sink.sync(now, adv.sync, adv.sync_extra, self.elapsed())
        if adv.skipped is not None:
            self.sink.skipped(adv.skipped)

    def show_progress(self, adv: Advance, before: int, now: int) -> None:
        if self.bar is not None:
            self.bar.update(max(now - before, 0))
            if adv.loss is not None:
                self.bar.set_postfix(loss=f"{adv.loss:.3f}")

    def check_stop(self, adv: Advance, before: int, now: int) -> End | None:
        """A-EDiT's budget, a stop (signal, stop_after, another worker), max_seconds."""
        if adv.finished:  # A-EDiT: the global token budget is reached (or max_seconds)
            if adv.time_up:
                self.say(f"edit-jax: max_seconds={self.cfg.max_seconds:g} reached")
            return End(interrupted=False)
        if adv.stop:
            if self.done_here == 0:  # a signal while compiling or restoring: nothing new to save
                self.say(f"edit-jax: stopped before the first step (signal {self.stop.signal}); nothing new to save")
                return End(interrupted=True)
            diverged = self.guarded_save(now, final=True)
            if diverged is None:
                how = (f"signal {self.stop.signal}" if self.stop.signal else
                       "stop_after" if self.stop_after is not None else "another worker")
                self.say(f"edit-jax: stopped at step {now} ({how}); checkpoint saved, "
                         f"re-run the same command to resume")
            return End(interrupted=True, diverged=diverged)
        if adv.time_up:
            self.say(f"edit-jax: max_seconds={self.cfg.max_seconds:g} reached at step {now}")
            return End(interrupted=False)  # a normal end: evaluation and checkpoint follow
        return None

    def evaluate_on_cadence(self, adv: Advance, before: int, now: int) -> None:
        self.val_loss = self.evaluate(now)
        self.driver.mark(now)  # evaluation time is not step time

    def checkpoint_on_cadence(self, adv: Advance, before: int, now: int) -> End | Rewind | None:
        diverged = self.guarded_save(now, final=False)
        if diverged is not None:  # a non-finite state: as a non-finite loss
            return self.roll_back(now, diverged) if self.cfg.train.spike.enabled else End(True, diverged)
        self.driver.mark(now)
        if self.cfg.train.spike.enabled and hasattr(self.driver, "record_next"):  # it vouches for this checkpoint
            self.driver.record_next = True
        return None

    # -- loss spikes (spike.py) ------------------------------------------------------------------

    def watch_loss(self, adv: Advance, before: int, now: int) -> End | Rewind | None:
        """Each training record through the spike rule; a spike that does not settle (or a
        non-finite record, or one still under way at the last step) rolls back."""
        if not self.cfg.train.spike.enabled:  # the old rule: a non-finite record ends the run
            return End(interrupted=True, diverged=adv.diverged) if adv.diverged is not None else None
        judged = adv.records + adv.watched  # A-EDiT's asynchronous phase: every worker's loss at each meeting
        for i, rec in enumerate(judged):
            last = i == len(judged) - 1
            verdict = self.watch.observe(rec["step"], rec, nonfinite=last and adv.diverged is not None)
            # The console hears of a spike once it outlasts one record (and then of its end); a
            # one-record blip that settles is only its spike_settled record.
            if verdict.settled is not None:
                self.sink.event({"step": rec["step"], "spike_settled": verdict.settled}, self.elapsed())
                if verdict.records > 1:
                    self.say(f"edit-jax: step {rec['step']}: the loss spike from step {verdict.settled} settled")
            elif verdict.spike and verdict.records == 2 and not verdict.roll_back:
                self.say(f"edit-jax: step {rec['step']}: loss spike since step {self.watch.spike_since} "
                         f"({verdict.loss:.4g} > {verdict.threshold:.4g}); rolling back unless it settles within "
                         f"{self.cfg.train.spike.patience} records")
            if verdict.roll_back or (verdict.spike and last and (now >= self.cfg.steps or adv.finished)):
                why = adv.diverged.removesuffix("; stopping") if adv.diverged is not None and last else (
                    f"loss spike from step {self.watch.spike_since} (loss {verdict.loss:.4g} at step {rec['step']}, "
                    f"threshold {verdict.threshold:.4g})")
                return self.roll_back(now, why)
        return None

    def roll_back(self, now: int, why: str) -> End | Rewind:
        """Back to the newest checkpoint a healthy record vouches for, past the data the spike
        consumed; after ``train.spike.max_rollbacks`` (or with nothing to go back to) exit 3."""
        ckpt, cfg, lead = self.setup.ckpt, self.cfg, jax.process_index() == 0
        if ckpt is not None:
            self.finish_save()  # a background save counts (or fails) before the checkpoints are judged
        trusted = self.watch.trusted_through
        target = [s for s in (ckpt.all_steps() if ckpt else []) if trusted is not None and s <= trusted]
        cannot = ("no run dir" if ckpt is None else
                  "A-EDiT's asynchronous phase does not roll back in-process" if self.workers_apart else
                  f"train.spike.max_rollbacks={cfg.train.spike.max_rollbacks} reached"
                  if self.rollbacks >= cfg.train.spike.max_rollbacks else
                  "no checkpoint before the spike" if not target else None)
        if ckpt is not None:
            set_aside_untrusted(ckpt, trusted, self.say, lead, multihost.barrier)
        if cannot is not None:
            left = ckpt.latest_step() if ckpt is not None else None
            return End(interrupted=True, diverged=f"{why}; not rolled back ({cannot}). A rerun resumes from "
                                                  f"{f'checkpoint {left}' if left is not None else 'step 0'}")
        state, data_state, step = restore_verified(ckpt, cfg, self.programs, self.say, None, lead=lead,
                                                   barrier=multihost.barrier)
        stream = self.setup.stream
        skipped = [step + stream.offset, now + stream.offset]  # the stream's batches [a, b) the spike consumed
        stream.skip(now - step)
        self.state, self.k, self.rollbacks = state, step, self.rollbacks + 1
        self.last_loss = self.loss_at(step, data_state)  # not the spike's: a stop here reports this one
        self.watch.rewound(data_state.get("spike_history", ()), step)
        self.driver.mark(step)
        self.sink.event({"step": step, "rollback": {"from_step": now, "to_step": step, "skipped_batches": skipped,
                                                    "reason": why, "count": self.rollbacks}}, self.elapsed())
        self.say(f"edit-jax: {why}: rolled back from step {now} to checkpoint {step} (rollback {self.rollbacks} of "
                 f"{cfg.train.spike.max_rollbacks}), skipping data batches {skipped[0]}..{skipped[1] - 1}")
        if self.bar is not None:
            self.bar.n = step
        return Rewind()

    def loss_at(self, step: int, data_state: dict) -> float:
        """The run's training loss as of checkpoint ``step``: its newest record at or before it in
        this invocation, else the newest healthy loss the checkpoint's spike window holds."""
        for rec in reversed(self.history):
            if "loss" in rec and "worker" not in rec and rec["step"] <= step:
                return float(rec["loss"])
        window = data_state.get("spike_history") or ()
        return float(window[-1]) if window else float("nan")

    # -- evaluation and checkpoints --------------------------------------------------------------

    def evaluate(self, step: int) -> float:
        t0 = time.perf_counter()
        loss = self.evaluator(self.driver.global_state(self.state), self.setup.val)
        rec = self.sink.evaluation(step, loss, t0 - self.t_start, time.perf_counter() - t0)
        self.say(f"edit-jax: step {step} val_loss {loss:.4f} (ppl {rec['val_ppl']:.2f})")
        return loss

    def save(self, step: int, final: bool = False) -> None:
        ckpt, stream = self.setup.ckpt, self.setup.stream
        if ckpt is None:
            return
        global_state = self.driver.global_state(self.state)
        if check_before_save(global_state, step, self.programs.rule.keeps_outer, final, ckpt.latest_step()):
            stream.step = step
            # A streamed corpus keeps each replica's position in the process that trains it: the
            # processes exchange them here (every process saves), so the checkpoint has them all.
            data = stream.get_state(gather=multihost.exchange_floats if self.multi else None)
            data = {**data, **self.driver.data_extra(), "spike_history": self.watch.state()}
            if self.to_write(step, data):
                t0 = time.perf_counter()
                ckpt.save(step, global_state, data, self.cfg, healthy=self.watch.healthy)
                self.sink.timing({"timing": "save", "step": step, "at": t0 - self.t_start,
                                  "save_s": time.perf_counter() - t0, "final": final})
                if ckpt.pending is None:  # a synchronous save is written when it returns
                    self.sink.timing({"timing": "written", "step": step, "at": self.elapsed()})
        else:
            self.say(f"edit-jax: step {step}: some workers are non-finite (they are rolled back at their next sync); "
                     f"checkpoint skipped, the last one ({ckpt.latest_step()}) is kept")

    def to_write(self, step: int, data: dict) -> bool:
        """Whether a save of ``step`` is to be written: yes when no checkpoint ``step`` exists;
        when one does (a stop or the end right after a periodic save, or right at the checkpoint a
        rollback restored), only if it holds another data position than ``data``. After a rollback
        it is the position from before the spike: resuming it would train on the batches the
        rollback skipped, so it is moved to ``checkpoints.aside/`` (not deleted) and this save
        takes its place."""
        ckpt = self.setup.ckpt
        self.finish_save()  # a background save of this step counts first
        if step not in ckpt.all_steps():
            return True
        try:
            same = ckpt.read_meta(step).get("data_checksum") == data_checksum(data)
        except CheckpointError:
            same = False  # unreadable: replaced by a good one (the old one is kept aside)
        if same:
            return False
        dest = ckpt.set_aside(step, "checkpoints.aside", move=jax.process_index() == 0)
        multihost.barrier()
        ckpt.reload()
        self.say(f"edit-jax: checkpoint {step} holds the data position from before the rollback; moved it to "
                 f"{dest} (not deleted) and saving step {step} at the new one")
        return True

    def finish_save(self, poll: bool = False) -> None:
        """``ckpt.finish()`` (``poll``: only if written already); a finished write is a timing record."""
        ckpt = self.setup.ckpt
        pending = ckpt.pending[0] if ckpt.pending is not None else None
        ckpt.poll() if poll else ckpt.finish()
        if pending is not None and ckpt.pending is None:
            self.sink.timing({"timing": "written", "step": int(pending), "at": self.elapsed()})

    def guarded_save(self, step: int, final: bool) -> str | None:
        """``save``, with a divergence as its message (the loop cleans up before raising it)."""
        try:
            self.save(step, final)
        except DivergedError as e:
            return str(e)
        return None

    def result(self, run_dir: str | None, interrupted: bool) -> TrainResult:
        val = self.val_loss
        return TrainResult(steps=self.k, final_loss=self.last_loss, final_val_loss=val,
                           final_val_ppl=math.exp(min(val, 50.0)) if val is not None else None,
                           tokens=(self.k - self.start_step) * self.cfg.batch_size * self.cfg.data.seq_len,
                           seconds=self.elapsed(), run_dir=run_dir, interrupted=interrupted,
                           resumed_from=self.setup.resumed_from, history=self.history, rollbacks=self.rollbacks)


def run(cfg: Config, run_dir: str | None, *, stop, say: Callable[[str], None], progress: bool,
        devices: list | None = None, stop_after: int | None = None, restore_step: int | None = None,
        on_timing: Callable[[dict], None] | None = None) -> TrainResult:
    """Trains ``cfg`` (validated) to ``cfg.steps``; ``stop`` is the signal flag (``.signal``);
    ``on_timing`` receives the loop's timing records (``result.TIMING_KINDS``)."""
    setup = _set_up(cfg, run_dir, say, devices, restore_step, on_timing)
    try:
        announce(setup, run_dir, say)
        training = Training(setup, stop=stop, say=say, progress=progress, stop_after=stop_after)
        end = training.loop()
        diverged = training.finish(end)
        if setup.ckpt is not None:
            training.finish_save()  # the last save is written (or its failure raised) before the run returns
    finally:
        if setup.ckpt is not None:
            setup.ckpt.close()
        setup.sink.close()
        setup.stream.close()  # a streamed corpus's reader processes
    if diverged is not None:
        raise DivergedError(diverged)
    return training.result(run_dir, end.interrupted)


__all__ = ["run", "TrainResult", "Training", "CheckpointError", "DivergedError"]
