"""An exchange worker's own training between rounds (``worker.py``'s ``ElasticWorker`` is one):
local steps for a round's time, θ̄ − θ_i, the restart from θ̄ (with a carried Δ), the saved
progress of steps no round counted yet (``progress.py``) and θ̄'s evaluation. Split from the
worker's round protocol so that each reads whole."""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from edit_jax.elastic import progress as PG
from edit_jax.elastic import rounds as R
from edit_jax.localsgd.optim import with_step_counts
from edit_jax.runtime import multihost
from edit_jax.training.evaluate import Evaluator


@dataclass
class Local:
    """This worker's position: its state, steps since it last entered a round, its data cursor."""
    state: object
    since: int = 0
    done: int = 0
    carried: int = 0  # steps of a late post carried into the next one
    residual: list | None = None  # packed posts: the error-feedback residual per unit (packed.py), from zeros
    pending: list | None = None  # the residual if the round uses the post just made


class LocalTraining:
    """The local half of ``ElasticWorker`` (it sets ``cfg``, ``me``, ``loc``, ``stream``, ``val``,
    ``exe``, ``local_step``, ``slow``, ``stop``, ``compiled``, ``progress_file``, ``progress_s``,
    ``initial_state``, ``t0``, ``ex``)."""

    def evaluate(self, theta) -> float:
        if self._eval_fn is None:
            self._eval_fn = Evaluator(self.loc).loss_fn(True)
        params = jax.tree.map(lambda x, s: jax.device_put(jnp.asarray(x), s), theta,
                              self.loc.layout.state_shardings.outer.params)  # (no eval_shape per evaluation)
        losses = [float(multihost.local_value(self._eval_fn(params, self.loc.put_batch(b)))) for b in self.val]
        return sum(losses) / len(losses)

    def restart_from(self, shared: R.RoundState, state, delta=None, count: int | None = None, opt=None,
                     stale: bool = False):
        """This worker's params at θ̄ (minus a carried Δ, a ``stale`` one damped to ``sync.exchange.carried_weight``;
        w = 1 gives Δ exactly); ``count``: a fresh inner optimizer at that step count; ``opt``: that state."""
        w = np.float32(self.cfg.sync.exchange.carried_weight if stale else 1.0)
        theta = shared.theta if delta is None else jax.tree.map(lambda t, d: t - w * d, shared.theta, delta)
        params = jax.tree.map(lambda t, p: jax.device_put(np.asarray(t, p.dtype)[None], p.sharding), theta,
                              state.params)
        state = state.replace(params=params)
        if count is not None:  # the initial state's optimizer: its moments are zero
            opt = with_step_counts(self.initial_state.opt_state, count)
        if opt is not None:
            state = state.replace(opt_state=jax.device_put(opt, jax.tree.map(lambda a: a.sharding, state.opt_state)))
        return state

    def train_for(self, local: Local, seconds: float, started=lambda: None, aligned: bool = False,
                  save=None, steps: int | None = None) -> float:
        """Local steps until ``seconds`` passed (at least one), or ``steps`` of them when given (a
        rule whose rounds go by step count: DiLoCo, EDiT); returns the last loss. ``started``
        runs after the first step (the first of a process compiles: announcing a round only then
        keeps the others from waiting on a compile). ``aligned``: ``seconds`` lead to the round's due
        time, so a compile counts against them. ``save`` runs every ``sync.exchange.progress_every`` s."""
        step = self.local_step
        start, loss, last_log = time.monotonic(), float("nan"), (time.perf_counter(), local.done)
        saved, taken = start, 0
        compiling = not self.compiled  # the first step compiles: the round's clock starts after it
        self.compiled = True
        while True:
            t = time.perf_counter()
            rows = self.stream.replica_batch(self.me, local.done)
            local.state, metrics = step(local.state, self.loc.put_batch(rows))
            m = jax.device_get(metrics)
            loss = float(np.asarray(m["loss"]).reshape(-1)[0])
            if self.slow > 1.0:
                time.sleep((self.slow - 1.0) * (time.perf_counter() - t))
            local.done += 1
            local.since += 1
            taken += 1
            if local.done % self.cfg.log_every == 0:
                now = time.perf_counter()
                dt = (now - last_log[0]) / max(local.done - last_log[1], 1)
                last_log = (now, local.done)
                rows_n = self.cfg.batch_size // self.cfg.mesh.replica
                self.record({"step": local.done, "worker": self.me, "loss": loss, "kind": "local", "step_time": dt,
                             "tokens_per_s": rows_n * self.cfg.data.seq_len / dt, "progress_s": self.progress_s})
            if compiling:  # the run's first round: its clock starts after the compile (every worker compiles)
                start = start if aligned else time.monotonic()
                last_log, compiling = (time.perf_counter(), local.done), False
                self.record({"step": local.done, "worker": self.me, "programs": self.exe.summary()})
            if started is not None:
                started()
                started = None
            if self.stop or (taken >= steps if steps is not None else time.monotonic() - start >= seconds):
                return loss
            if save is not None and 0 < self.cfg.sync.exchange.progress_every <= time.monotonic() - saved:
                save()
                saved = time.monotonic()

    def delta_of(self, shared: R.RoundState, params) -> list[np.ndarray]:
        """Δ = θ̄ − θ_i per leaf, float32, from this worker's host params (leading axis: its replica)."""
        return [np.asarray(t - np.asarray(p, np.float32)[0], np.float32)
                for t, p in zip(jax.tree.leaves(shared.theta), jax.tree.leaves(params), strict=True)]

    def save_progress(self, shared: R.RoundState, local: Local) -> None:
        """This worker's steps no round counted yet, on disk (``progress.py``)."""
        t = time.perf_counter()
        params, opt = jax.device_get((local.state.params, local.state.opt_state))
        PG.save(self.progress_file, PG.Progress(
            self.t0, shared.round, shared.cursors[self.me], local.done, local.since, self.delta_of(shared, params),
            [np.asarray(x) for x in jax.tree.leaves(opt)], list(local.residual or [])))
        self.progress_s += time.perf_counter() - t

    def resume_progress(self, shared: R.RoundState, local: Local) -> bool:
        """A (re)starting worker carries its saved steps onto θ̄ when no round counted or can still
        count them (``progress.why_not``); otherwise it starts from θ̄, recorded."""
        p, why = PG.resumable(self.progress_file, run_start=self.t0, cursor=shared.cursors[self.me],
                              posted_rounds=R.posted_rounds(self.ex, self.me),
                              delta_like=[jax.ShapeDtypeStruct(np.shape(t), np.float32)
                                          for t in jax.tree.leaves(shared.theta)],
                              opt_like=jax.tree.leaves(local.state.opt_state), residual_like=list(local.residual or []))
        if p is None and why:
            self.record({"step": shared.global_step, "worker": self.me, "progress_ignored": why})
        if p is None:
            return False
        stale = shared.round > p.round  # a round closed since the save: its steps are carried, a round stale
        local.state = self.restart_from(shared, local.state,
                                        jax.tree.unflatten(jax.tree.structure(shared.theta), p.delta),
                                        opt=jax.tree.unflatten(jax.tree.structure(local.state.opt_state), p.opt),
                                        stale=stale)
        local.done, local.since, local.carried = p.done, p.since, p.since if stale else 0
        local.residual = p.residual if local.residual is not None else None
        self.record({"step": shared.global_step, "worker": self.me, "progress_resumed": p.since, "from_round": p.round,
                     "cursor": p.done})
        return True


__all__ = ["Local", "LocalTraining"]
