"""How the loop's steps run: two drivers behind one loop (loop.py).

- ``LockStep``: one program over the global (replica, shard) mesh runs each step the schedule
  names, for every method and for A-EDiT's synchronous warmup. With one process it drives every
  device; with one process per worker (multi-controller JAX) every process runs the same program
  on its own devices, feeds only its replica's rows of the batch, and the processes agree on a
  signal or max_seconds about once a second of steps (``AGREE_S``). The numbers are the same
  either way (tests/test_multiprocess.py).
- ``AsyncWorkers``: A-EDiT after its warmup (one process per worker). Each worker takes local
  steps at its own pace, as a program over its own devices only; when ``sync.time.tau`` seconds
  have passed since the last meeting it enters the next one: every worker's step counts are
  exchanged and ``TimeSchedule.decide`` makes one decision, identical everywhere (skip, or run
  EDiT's sync over the global mesh with each worker's share of the steps in the weights).

Both answer ``advance(state, step, wants) -> Advance``: what happened between two points where
the loop may record, evaluate, checkpoint or stop. ``wants`` is this process's wish to stop
(a signal, ``stop_after``) and whether its ``max_seconds`` ran out; the answer is what all
processes agreed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from edit_jax.data.batches import ReplicaStreams
from edit_jax.data.corrupt import CorruptSpec, corrupt_rows, parse_lr_spike
from edit_jax.localsgd.methods import LOCAL, StepKind, TimeSchedule
from edit_jax.localsgd.optim import with_step_counts
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.sharding import BATCH_SPEC, named
from edit_jax.runtime import multihost
from edit_jax.runtime.compiles import compiles
from edit_jax.runtime.multihost import parse_slowdown
from edit_jax.training.throughput import StepFigures

MAX_IN_FLIGHT = 2  # steps the host may run ahead of the devices (see LockStep.advance)
# Several processes in one program agree on a signal or max_seconds about once a second of steps
# (at least every step), not before every step: each agreement is a round trip between all worker
# processes, the one thing a local step would otherwise send across a slow link. A stop waits at
# most this long; stop_after and the step budget need no agreement (every process counts the same).
AGREE_S = 1.0
AGREE_MAX_STEPS = 1000


@dataclass
class Wants:
    """This process's view before agreement."""

    stop: bool  # a signal arrived (this process only: agreed before it acts)
    time_up: bool  # max_seconds ran out (this process's clock: agreed)
    planned: bool = False  # stop_after was reached: the same step in every process, no agreement


@dataclass
class Advance:
    """What one ``advance`` did, as every process agreed."""

    state: Any
    step: int  # the global step now (A-EDiT: the workers' mean step)
    ran: int = 0  # steps this process took
    stop: bool = False  # stop now: checkpoint and exit 130
    time_up: bool = False  # max_seconds: end as at the last step (evaluate, save)
    finished: bool = False  # A-EDiT: the global token budget is reached (this was the final sync)
    cadence: bool = True  # evaluation and checkpoints may fall here (A-EDiT: only after a sync ran)
    records: list[dict] = field(default_factory=list)  # training records of the run (process 0 writes them)
    own_records: list[dict] = field(default_factory=list)  # this worker's own records (A-EDiT)
    sync: dict | None = None  # the metrics of a sync that ran (process 0 writes its record)
    sync_extra: dict = field(default_factory=dict)  # more fields for that record
    skipped: dict | None = None  # an A-EDiT meeting that skipped its sync: its record
    # What the spike rule judges besides ``records`` (not written): at each A-EDiT meeting every
    # worker's newest loss, the same in every process (training/spike.py)
    watched: list[dict] = field(default_factory=list)
    loss: float | None = None  # the workers' mean training loss of the newest record
    diverged: str | None = None  # the run cannot recover (message)
    data_s: float = 0.0  # time spent building this advance's batches (the loop's timing record)


def loss_divergence(loss: np.ndarray, grad_norm: np.ndarray, all_must_be_finite: bool, step: int) -> str | None:
    """A message when a training record shows a run that cannot recover: after a synchronous
    step any non-finite loss or gradient norm; after a local step all workers' (a single worker's
    is rolled back at its next sync)."""
    loss, grad_norm = np.atleast_1d(loss), np.atleast_1d(grad_norm)
    ok = np.isfinite(loss) & np.isfinite(grad_norm)
    if ok.all() if all_must_be_finite else ok.any():
        return None
    return (f"non-finite loss / gradient norm at step {step} (loss {_to_list(loss)}, grad norm "
            f"{_to_list(grad_norm)}); stopping")


class RecordWindow:
    """The time a training record reports, from step ``step``: its seconds per step and whether a
    program compiled inside it (JAX's own compile events, ``runtime/compiles.py``)."""

    def __init__(self, step: int):
        self.t, self.step, self.compiles = time.perf_counter(), step, compiles().mark()

    def close(self, step: int) -> tuple[float, bool]:
        """(seconds per step since, compiled since); the next window starts here."""
        now, compiled = time.perf_counter(), compiles().since(self.compiles) > 0
        dt = (now - self.t) / max(step - self.step, 1)
        self.t, self.step, self.compiles = now, step, compiles().mark()
        return dt, compiled


def _to_list(a: np.ndarray):
    return a.item() if a.size == 1 else a.tolist()


class LockStep:
    """Every step one program over the global mesh (any number of processes)."""

    def __init__(self, programs: StepPrograms, stream: ReplicaStreams, corrupt: CorruptSpec | None):
        self.m, self.cfg, self.stream, self.corrupt = programs, programs.cfg, stream, corrupt
        self.schedule = programs.schedule
        self.multi = jax.process_count() > 1
        self.in_flight: list = []
        self.last_record: RecordWindow | None = None  # where the next training record's time starts
        # debug.slowdown (a testing knob): this process's local steps take `slow` x as long.
        self.slow = parse_slowdown(self.cfg.debug.slowdown).get(jax.process_index(), 1.0) if self.multi else 1.0
        self.local_steps_timed = 0
        self.own_local_times: list[float] = []  # this worker's own local step times since the last record
        self.figures = StepFigures(self.cfg, self.cfg.mesh.replica * self.cfg.mesh.shard, jax.devices()[0].device_kind)
        self.record_next = False  # the loop asks for a record after a checkpoint (it vouches for it: spike.py)
        self.lr_spike = parse_lr_spike(self.cfg.debug.lr_spike)
        self.agree_at, self.agreed_since = 0, None  # the next step the processes agree at; (time, step) of the last

    def global_state(self, state):
        return state

    def batch(self, k: int) -> jax.Array:
        """The global batch of step ``k``, each process building only its devices' rows: replica
        r's rows are the stream's ``replica_batch(r, k)`` (debug.corrupt: garbage for one worker
        in its window; the stream itself is never written)."""
        n, cfg = self.cfg.mesh.replica, self.cfg
        rows = self.cfg.batch_size // n
        cache: dict[int, np.ndarray] = {}

        def block(index):
            lo = index[0].start or 0
            r = lo // rows
            if r not in cache:
                cache[r] = corrupt_rows(self.stream.replica_batch(r, k), self.corrupt, k, r, cfg.model.vocab_size,
                                        cfg.seed)
            return cache[r][lo - r * rows:(index[0].stop or cfg.batch_size) - r * rows]

        shape = (cfg.batch_size, cfg.data.seq_len + 1)
        return jax.make_array_from_callback(shape, named(self.m.mesh, BATCH_SPEC), block)

    def advance(self, state, k: int, wants: Wants) -> Advance:
        cfg, schedule = self.cfg, self.schedule
        stop, time_up = wants.stop, wants.time_up
        if self.multi:  # a signal or max_seconds: acted on where the processes agree (AGREE_S)
            due = self.agreed_since is None or not self.agreed_since[1] < k < self.agree_at  # (a rollback: k went back)
            stop, time_up = self._agree(k, stop, time_up) if due else (False, False)
        if wants.planned:
            stop = True
        if stop or time_up:
            return Advance(state, k, stop=stop, time_up=time_up)
        if self.last_record is None:
            self.last_record = RecordWindow(k)
        if schedule.init_outer_due(k):
            state = self.m.init_outer_fn()(state)
        kind = schedule.kind(k)
        t0 = time.perf_counter()
        before = _copy(state.params) if self._spikes(k) else None  # the step donates its input
        batch = self.batch(k)
        data_s = time.perf_counter() - t0
        state, metrics = self.m.step_fn(kind)(state, batch)
        if before is not None:  # debug.lr_spike: this step's update x factor
            state = state.replace(params=_scaled_update(before, state.params, self.lr_spike.factor))
        # At most MAX_IN_FLIGHT steps dispatched ahead of the host: XLA:CPU's collectives deadlock
        # (rendezvous timeout) when ~50 steps are queued, and a short queue costs nothing on any
        # backend (the device is still fed one step ahead). Several processes wait for each step:
        # the agreement above must not overtake a step's collectives.
        self.in_flight.append(metrics["loss"])
        while len(self.in_flight) > (0 if self.multi else MAX_IN_FLIGHT):
            self.in_flight.pop(0).block_until_ready()
        if self.multi and kind == LOCAL:  # a local step's time is this worker's own (no peer in it)
            self._pace(t0)
            self.own_local_times.append(time.perf_counter() - t0)
        k += 1
        adv = Advance(state, k, ran=1, data_s=data_s)
        if not (k % cfg.log_every == 0 or kind.syncs or k == cfg.steps or self.record_next):
            return adv
        self.record_next = False
        metrics = multihost.host_values(metrics)  # waits for the steps since the last record
        dt, compiled = self.last_record.close(k)  # evaluation time excluded (mark)
        adv.loss = float(np.mean(metrics["loss"]))  # per replica -> mean on the host
        tokens_per_s = cfg.batch_size * cfg.data.seq_len / dt
        rec = {"step": k, "loss": adv.loss, "grad_norm": float(np.mean(metrics["grad_norm"])),
               "tokens_per_s": tokens_per_s, **self.figures(k, tokens_per_s), "step_time": dt, "kind": str(kind)}
        if cfg.mesh.replica > 1:
            rec["replica_loss"] = _to_list(np.asarray(metrics["loss"]))
        if self.multi:  # each worker's own speed (median local step since the last record): stragglers show
            own = np.median(self.own_local_times) if self.own_local_times else np.nan
            rec["worker_step_time"] = _to_list(multihost.exchange_floats([own])[:, 0])
            self.own_local_times = []
        if compiled:
            rec["includes_compile"] = True
        adv.records.append(rec)
        adv.diverged = loss_divergence(metrics["loss"], metrics["grad_norm"], kind.name == "hsdp", k)
        if kind.syncs:
            adv.sync = metrics
        return adv

    def _agree(self, k: int, stop: bool, time_up: bool) -> tuple[bool, bool]:
        """Every process's stop and time-up wishes, and its seconds per step since the last
        agreement; the next agreement AGREE_S of the slowest process's steps ahead, the same step
        in every process (computed from the same gathered figures)."""
        now = time.perf_counter()
        per_step = -1.0 if self.agreed_since is None else \
            (now - self.agreed_since[0]) / max(k - self.agreed_since[1], 1)
        got = multihost.exchange_floats([float(stop), float(time_up), per_step])
        slowest = float(np.max(got[:, 2]))
        ahead = 1 if slowest <= 0 or not np.isfinite(slowest) else int(min(max(AGREE_S // slowest, 1), AGREE_MAX_STEPS))
        self.agree_at, self.agreed_since = k + ahead, (now, k)
        return bool(got[:, 0].any()), bool(got[:, 1].any())

    def _spikes(self, k: int) -> bool:
        """debug.lr_spike covers the batch step ``k`` trains on (k + the batches rollbacks skipped)."""
        return self.lr_spike is not None and self.lr_spike.active(k + self.stream.offset)

    def _pace(self, t0: float) -> None:
        """debug.slowdown: sleep (slow - 1) x the step's own time; not the first local step (it compiled)."""
        if self.slow > 1.0:
            self.local_steps_timed += 1
            if self.local_steps_timed > 1:
                time.sleep((self.slow - 1.0) * (time.perf_counter() - t0))

    def mark(self, k: int) -> None:
        """Time from here on is step time again (after an evaluation or a checkpoint)."""
        self.last_record = RecordWindow(k)

    def data_extra(self) -> dict:
        return {}


def shares_array(shares) -> jax.Array:
    """A-EDiT's step shares as its sync step takes them ([N] float32, on the default device)."""
    return jnp.asarray(np.asarray(shares, np.float32))


@jax.jit
def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@jax.jit
def _scaled_update(before, after, factor):
    return jax.tree.map(lambda b, a: b + factor * (a - b), before, after)


def _set_step(state, step: int, shardings):
    """``state`` with its step counter and every inner optimizer step count set to ``step``: the
    learning-rate schedule then follows the global mean step (A-EDiT). Each count gets a buffer
    of its own (the next step donates them all)."""
    new = state.replace(step=np.asarray(step, np.int32), opt_state=with_step_counts(state.opt_state, step))
    return jax.device_put(new, shardings)


@dataclass
class WorkerSteps:
    """One A-EDiT worker's step counts. ``since_sync`` counts from the last sync that RAN: a
    skipped meeting leaves it growing, so ``min_total_steps`` and the step shares see every step
    still in the worker's pseudo gradient (the reference's rule; resetting at every meeting could
    skip forever, e.g. step times 1 s and 2 s, tau_time 10 s, min_total_steps 20)."""

    done: int  # inner steps since the start of training (this worker's position in its data)
    since_sync: int = 0

    def step(self) -> None:
        self.done += 1
        self.since_sync += 1

    def after_meeting(self, ran: bool) -> None:
        if ran:  # the sync is a step on every worker, and starts a new pseudo gradient
            self.done += 1
            self.since_sync = 0


def worker_programs(glob: StepPrograms) -> StepPrograms:
    """The programs of this process's worker in A-EDiT's asynchronous phase (its own devices)."""
    return StepPrograms.for_config(multihost.local_config(glob.cfg), multihost.meshes(glob.cfg)[1])


class AsyncWorkers:
    """A-EDiT after the warmup: this process's worker (one process per worker)."""

    def __init__(self, glob: StepPrograms, stream: ReplicaStreams, corrupt: CorruptSpec | None, k: int,
                 data_state: dict | None, loc: StepPrograms | None = None):
        cfg = glob.cfg
        self.cfg, self.glob, self.stream, self.corrupt = cfg, glob, stream, corrupt
        self.schedule: TimeSchedule = glob.schedule
        self.me, self.n = jax.process_index(), cfg.mesh.replica
        self.loc = loc or worker_programs(glob)  # (compiled ahead when given: training/ahead.py)
        self.g_abstract, self.l_abstract = glob.abstract_state(), self.loc.abstract_state()
        saved = data_state or {}
        done = saved.get("worker_steps") or [k] * self.n
        since = saved.get("worker_steps_since") or [0] * self.n
        self.steps = WorkerSteps(int(done[self.me]), int(since[self.me]))
        self.all_steps = [int(x) for x in done]  # every worker's counts as of the last meeting
        self.all_since = [int(x) for x in since]
        self.slow = parse_slowdown(cfg.debug.slowdown).get(self.me, 1.0)
        self.paced = 0
        self.last_meeting = time.monotonic()
        self.last_record = RecordWindow(self.steps.done)
        self.rows = cfg.batch_size // self.n
        self.figures = StepFigures(cfg, cfg.mesh.shard, jax.devices()[0].device_kind)  # this worker's devices
        self.lr_spike = parse_lr_spike(cfg.debug.lr_spike)

    def enter(self, global_state):
        """The global state (after the warmup) as this worker's local state."""
        state = multihost.to_local(global_state, self.l_abstract)
        if self.schedule.init_outer_due(self.steps.done):
            state = self.loc.init_outer_fn()(state)
        self.last_meeting = time.monotonic()
        return state

    def global_state(self, state):
        return multihost.to_global(state, self.g_abstract)

    def _rows(self) -> np.ndarray:
        k = self.steps.done  # the corrupted worker's own step count decides (it may run ahead)
        return corrupt_rows(self.stream.replica_batch(self.me, k), self.corrupt, k, self.me,
                            self.cfg.model.vocab_size, self.cfg.seed)

    def _spiked(self, step, state):
        """``step(state)`` (a local step); debug.lr_spike: its update x factor when it trains on a
        batch in the knob's range (this worker's own step count + the batches rollbacks skipped)."""
        k = self.steps.done + self.stream.offset
        if self.lr_spike is None or not self.lr_spike.active(k):
            return step(state)
        before = _copy(state.params)  # the step donates its input
        state, *rest = step(state)
        return (state.replace(params=_scaled_update(before, state.params, self.lr_spike.factor)), *rest)

    def _pace(self, t0: float) -> None:
        """Testing knob (debug.slowdown): this worker's local steps take ``slow`` x as long (it
        sleeps (slow - 1) x the step's own time); not the first local step (it compiled)."""
        if self.slow > 1.0:
            self.paced += 1
            if self.paced > 1:
                time.sleep((self.slow - 1.0) * (time.perf_counter() - t0))

    def _record(self, kind: StepKind, loss: float, gnorm: float, global_step: int, force: bool = False):
        k = self.steps.done
        if not (force or k % self.cfg.log_every == 0):
            return None
        dt, compiled = self.last_record.close(k)
        tokens_per_s = self.rows * self.cfg.data.seq_len / dt
        return {"step": k, "worker": self.me, "global_step": global_step, "loss": loss, "grad_norm": gnorm,
                "tokens_per_s": tokens_per_s, **self.figures(k, tokens_per_s), "step_time": dt, "kind": str(kind),
                **({"includes_compile": True} if compiled else {})}

    def advance(self, state, k: int, wants: Wants) -> Advance:
        schedule, own = self.schedule, []
        loss, gnorm, ran = float("nan"), float("nan"), 0
        while True:  # local steps until this worker's timer says the next meeting is due
            t0 = time.perf_counter()
            state, metrics = self._spiked(lambda s: self.loc.step_fn(LOCAL)(s, self.loc.put_batch(self._rows())),
                                          state)
            m = jax.device_get(metrics)
            loss, gnorm = float(m["loss"][0]), float(m["grad_norm"][0])
            self._pace(t0)
            self.steps.step()
            ran += 1
            rec = self._record(LOCAL, loss, gnorm, k)
            if rec is not None:
                own.append(rec)
            if schedule.sync_due(time.monotonic(), self.last_meeting):
                break
        # The meeting: every worker's counts and wishes, one decision everywhere.
        finite = int(np.isfinite(loss) and np.isfinite(gnorm))
        info = multihost.exchange([self.steps.since_sync, self.steps.done, int(wants.stop or wants.planned),
                                   int(wants.time_up),
                                   finite])
        since, done = [int(x) for x in info[:, 0]], [int(x) for x in info[:, 1]]
        decision = schedule.decide(since, done)
        if info[:, 3].any() and not decision.finished:  # the wall-time budget ends the run here
            decision = dataclasses.replace(decision, run=True, finished=True)
        adv = Advance(state, decision.mean_step, ran=ran, finished=decision.finished, cadence=decision.run,
                      stop=bool(info[:, 2].any()) and not decision.finished, time_up=bool(info[:, 3].any()))
        if not info[:, 4].any():
            adv.diverged = (f"non-finite loss / gradient norm on every worker at global step {decision.mean_step} "
                            "(A-EDiT meeting); stopping")
        if decision.run:
            state = _set_step(state, decision.mean_step, self.loc.state_shardings)
            state, loss, gnorm, sync = self._sync(state, decision.shares)
            ran += 1
            adv.sync, adv.sync_extra = sync, {"worker_steps_since": since, "step_share": list(decision.shares)}
        else:
            adv.skipped = {"step": decision.mean_step, "global_step": decision.mean_step, "sync_skipped": True,
                           "worker_steps_since": since}
        self.steps.after_meeting(decision.run)
        self.all_steps = [d + (1 if decision.run else 0) for d in done]
        self.all_since = [0] * self.n if decision.run else since
        if decision.run:
            own.append(self._record(schedule.sync_kind(), loss, gnorm, decision.mean_step, force=True))
        adv.state, adv.own_records = state, own
        losses = multihost.exchange_floats([loss])[:, 0]
        adv.loss = float(np.nanmean(losses))  # the workers' mean, as one program's
        adv.watched = [{"step": decision.mean_step, "loss": adv.loss, "replica_loss": [float(x) for x in losses]}]
        self.last_meeting = time.monotonic()
        self.last_record = RecordWindow(self.steps.done)  # meeting time is not step time
        return adv

    def _sync(self, state, shares):
        """EDiT's sync over the global mesh, this worker's rows of its next batch in the step."""
        kind = self.schedule.sync_kind()
        batch = multihost.global_batch(self.glob.mesh, self._rows(), self.cfg.batch_size)
        g_state, metrics = self.glob.step_fn(kind)(self.global_state(state), batch, shares_array(shares))
        loss, gnorm = (float(multihost.local_value(metrics[k])[0]) for k in ("loss", "grad_norm"))
        sync = {k: multihost.local_value(v) for k, v in metrics.items() if k not in ("loss", "grad_norm")}
        return multihost.to_local(g_state, self.l_abstract), loss, gnorm, sync

    def mark(self, k: int) -> None:
        self.last_record = RecordWindow(self.steps.done)

    def data_extra(self) -> dict:
        """Every worker's counts, saved with the data state (they differ between workers)."""
        return {"worker_steps": list(self.all_steps), "worker_steps_since": list(self.all_since)}


__all__ = ["LockStep", "AsyncWorkers", "worker_programs", "shares_array", "RecordWindow", "WorkerSteps", "Wants",
           "Advance", "loss_divergence", "MAX_IN_FLIGHT", "AGREE_S"]
