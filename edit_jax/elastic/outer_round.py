"""A round's outer step, from the posts its manifest names: the same penalised, weighted EDiT sync
as the collective meeting (``api.stacked_sync``: ``outer.sync_unit`` with the ``Stacked``
reduction, unit by unit), run on the host's CPU backend.

Why the CPU: every worker must compute bit-identical θ̄ from the same posts, and workers may run on
different accelerators (an A100 and an H100 round differently, and XLA:GPU's reductions need not
be deterministic). XLA:CPU compiles the same program to the same code on hosts with the same CPU
features, and the participants are stacked in sorted worker order, so the summation order is
fixed: the same inputs give the same bits (``tests/test_elastic.py`` checks it across workers).
Every round checks it (the manifest's hash); a worker whose host rounds differently takes the
closer's published state instead (``worker.py``, recorded as ``theta_resync``). The cost is
host work on each worker: a few element-wise passes over the parameters per participant (norms,
weights, the weighted sum, clip, Nesterov), against a ``tau_time`` of minutes (BUILD_NOTES 20).
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from edit_jax.elastic.rounds import Post, RoundState
from edit_jax.localsgd.api import stacked_sync
from edit_jax.localsgd.methods import Plan
from edit_jax.localsgd.outer import Detector, make_outer_optimizer
from edit_jax.localsgd.state import init_outer_opt_state


class OuterRound:
    """The compiled outer step of one plan (compiled once per participant count)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.opt = make_outer_optimizer(plan.outer)
        self.cpu = jax.devices("cpu")[0]
        self._fn = jax.jit(self._step)
        self._programs: dict[int, Any] = {}  # participant count -> compiled program
        self._locks: dict[int, threading.Lock] = {}  # one per count: two counts compile side by side
        self._lock = threading.Lock()

    def program(self, state: RoundState, n: int):
        """The compiled step for ``n`` participants (compiled once, whichever thread asks first)."""
        with self._lock:
            lock = self._locks.setdefault(n, threading.Lock())
        with lock:
            if n not in self._programs:
                spec = lambda x, lead=(): jax.ShapeDtypeStruct(lead + np.shape(x), np.asarray(x).dtype,  # noqa: E731
                                                               sharding=SingleDeviceSharding(self.cpu))
                args = (jax.tree.map(spec, state.theta), jax.tree.map(spec, state.outer_opt),
                        jax.tree.map(lambda x: spec(x[0], (n,)), state.detectors),
                        jax.tree.map(lambda x: spec(x, (n,)), state.theta),
                        jax.ShapeDtypeStruct((n,), np.float32, sharding=SingleDeviceSharding(self.cpu)))
                self._programs[n] = self._fn.lower(*args).compile()
            return self._programs[n]

    def precompile(self, state: RoundState, slots: int, now: int | None = None) -> threading.Thread:
        """Compiles the step for every participant count 1..slots in a background thread, nearest
        to ``now`` (the last round's member count) first: a round whose membership changed (a
        worker left or joined) then waits on no compile."""
        now = now or slots

        def run():
            for n in sorted(range(1, slots + 1), key=lambda n: (abs(n - now), -n)):
                self.program(state, n)
        thread = threading.Thread(target=run, daemon=True, name="outer-round-compile")
        thread.start()
        return thread

    def _step(self, theta, outer_opt, dets: Detector, deltas, shares):
        # θ_i = θ̄ - Δ_i: sync_unit forms Δ_i = θ̄ - θ_i again (exact up to one rounding of each
        # value, the same on every worker), then the penalty, the weights and the outer step.
        local = jax.tree.map(lambda o, d: o[None] - d, theta, deltas)
        _, theta, outer_opt, dets, figures = stacked_sync(local, theta, outer_opt, dets, self.plan.penalty,
                                                          self.opt, self.plan.layerwise, shares)
        return theta, outer_opt, dets, figures

    def initial(self, theta: Any, slots: int, n_units: int, window: int) -> RoundState:
        """Round 0: θ̄ = the initial params, a fresh outer state, zero detectors for every slot."""
        theta = jax.tree.map(lambda x: np.asarray(x, np.float32), theta)
        if self.plan.layerwise:
            outer_opt = init_outer_opt_state(self.opt, theta)
        else:
            outer_opt = self.opt.init(theta)
        det = Detector.zeros((slots, n_units), window)
        host = lambda t: jax.tree.map(np.asarray, t)  # noqa: E731
        return RoundState(0, host(theta), host(outer_opt), host(det), 0, [0] * slots)

    def apply(self, state: RoundState, posts: list[Post]) -> tuple[RoundState, dict]:
        """Round state r from r - 1 and the round's posts (in sorted worker order)."""
        posts = sorted(posts, key=lambda p: p.worker)
        ids = np.asarray([p.worker for p in posts])
        treedef = jax.tree.structure(state.theta)
        deltas = jax.tree.unflatten(treedef, [np.stack(ls) for ls in zip(*(p.delta for p in posts))])
        steps = np.asarray([p.steps_since for p in posts], np.float32)
        shares = steps / steps.sum() if steps.sum() > 0 else np.full(len(posts), 1.0 / len(posts), np.float32)
        dets = jax.tree.map(lambda x: x[ids], state.detectors)
        put = lambda t: jax.device_put(t, self.cpu)  # noqa: E731
        step = self.program(state, len(posts))
        theta, outer_opt, new_dets, figures = step(put(state.theta), put(state.outer_opt), put(dets), put(deltas),
                                                   put(np.asarray(shares, np.float32)))
        host = lambda t: jax.tree.map(np.asarray, jax.device_get(t))  # noqa: E731
        all_dets = host(state.detectors)
        all_dets = jax.tree.map(lambda a, n: _set_rows(a, ids, n), all_dets, host(new_dets))
        cursors = list(state.cursors)
        for p in posts:
            cursors[p.worker] = p.cursor
        new = RoundState(state.round + 1, host(theta), host(outer_opt), all_dets,
                         state.tally + int(sum(p.steps_since for p in posts)), cursors, [int(i) for i in ids])
        return new, {k: np.asarray(v).tolist() for k, v in host(figures).items()}


def _set_rows(a: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    a = np.array(a)
    a[ids] = rows
    return a


__all__ = ["OuterRound"]
