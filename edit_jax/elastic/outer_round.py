"""A round's outer step, from the posts its manifest names: the plan's sync rule itself, the one the
collective meeting runs (``stacked.workers_sync``: the rule over the participants stacked in one
program, a vmap over ``replica``), run on the host's CPU backend.

Why the CPU: every worker must compute bit-identical θ̄ from the same posts, and workers may run on
different accelerators (an A100 and an H100 round differently, and XLA:GPU's reductions need not
be deterministic). XLA:CPU compiles the same program to the same code on hosts with the same CPU
features, and the participants are stacked in sorted worker order, so the summation order is
fixed: the same inputs give the same bits (``tests/test_elastic.py`` checks it across workers).
Every round checks it (the manifest's hash); a worker whose host rounds differently takes the
closer's published state instead (``worker.py``, recorded as ``theta_resync``). The cost is
host work on each worker: a few element-wise passes over the parameters per participant (norms,
weights, the weighted sum, clip, Nesterov), against a ``tau_time`` of minutes (docs/developer/exchange.md).
With a sparse ``sync.wire.kind`` the posts are packed rows and true norms: the same rule runs
over them with the ``packed.PackedPosts`` reduction (each post decoded as its worker's pseudo
gradient, its posted norm as the norm).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from edit_jax.elastic import packed as PK
from edit_jax.elastic.rounds import Post, RoundState
from edit_jax.localsgd.stacked import WORKERS, as_units, of_units, workers_sync
from edit_jax.localsgd.codec import NONE, Codec
from edit_jax.localsgd.compressed import Compressed
from edit_jax.localsgd.methods import Plan
from edit_jax.localsgd.outer import Detector, make_outer_optimizer
from edit_jax.localsgd.rule import SyncSpec
from edit_jax.localsgd.state import OuterState, init_outer_opt_state
from edit_jax.runtime.executables import ExecutableStore


class OuterRound:
    """The compiled outer step of one plan (compiled once per participant count). ``codec``: the
    posts' form, ``NONE`` (float32 Δ) or a sparse codec (packed posts, ``packed.py``).
    ``carried_weight`` (``sync.exchange.carried_weight``): a post's carried steps (a round or more stale)
    count at this fraction in its share of the steps, as its worker re-based their Δ at it.
    ``store``: where the compiled programs are kept whole (``runtime/executables.py``; None: off)."""

    def __init__(self, plan: Plan, codec: Codec = NONE, carried_weight: float = 1.0,
                 store: ExecutableStore | None = None):
        self.plan, self.codec, self.carried_weight = plan, codec, carried_weight
        self.packed = codec.kind != "none"
        # The posts crossed the wire already (encoded by their posters, decoded by the round's
        # reduction, ``packed.PackedPosts``): the round runs the rule inside the Compressed wrapper.
        self.rule = plan.rule.rule if isinstance(plan.rule, Compressed) else plan.rule
        self.layerwise = self.rule.in_forward  # the rule's units: the root and each layer; else the whole model
        self.store = store or ExecutableStore(None)
        self.opt = make_outer_optimizer(plan.outer)
        self.cpu = jax.devices("cpu")[0]
        self._fn, self._flush_fn = jax.jit(self._step), jax.jit(self._flush)
        self._programs: dict[int, Any] = {}  # participant count -> compiled program
        self._locks: dict[int, threading.Lock] = {}  # one per count: two counts compile side by side
        self._lock = threading.Lock()
        self._compiling: threading.Thread | None = None
        self._stop_compiling = threading.Event()

    def program(self, state: RoundState, n: int):
        """The compiled step for ``n`` participants (compiled once, whichever thread asks first)."""
        with self._lock:
            lock = self._locks.setdefault(n, threading.Lock())
        with lock:
            if n not in self._programs:
                spec = lambda x, lead=(): jax.ShapeDtypeStruct(lead + np.shape(x), np.asarray(x).dtype,
                                                               sharding=SingleDeviceSharding(self.cpu))
                args = (jax.tree.map(spec, state.theta), jax.tree.map(spec, state.outer_opt),
                        jax.tree.map(spec, state.extra), jax.tree.map(lambda x: spec(x[0], (n,)), state.detectors),
                        jax.tree.map(lambda x: spec(x, (n,)), state.theta),
                        jax.ShapeDtypeStruct((n,), np.float32, sharding=SingleDeviceSharding(self.cpu)))
                if self.packed:  # the packed rows per unit and the norms in place of Δ
                    args = args[:4] + ([spec(x, (n,)) for x in self._rows(state.theta)],
                                       spec(np.zeros(np.shape(state.detectors.mean)[1], np.float32), (n,)), args[5])
                self._programs[n] = self.store.compile(f"outer_round_{n}", self._fn, args, [self.cpu])
            return self._programs[n]

    def precompile(self, state: RoundState, counts: list[int]) -> threading.Thread:
        """Compiles the step for each participant count of ``counts``, in that order, in a
        background thread: a round whose membership changed then waits on no compile."""
        def run():
            for n in counts:
                if self._stop_compiling.is_set():
                    return
                self.program(state, n)
        thread = threading.Thread(target=run, daemon=True, name="outer-round-compile")
        self._compiling = thread
        thread.start()
        return thread

    def close(self) -> None:
        """Stops the background compiles and waits for the one under way (one compile, at most).
        Why wait: a daemon thread still inside XLA's compiler when the interpreter exits is torn down
        by a forced unwind that the C++ code catches, and the process aborts (SIGABRT, "FATAL:
        exception not rethrown") instead of exiting with its code: a worker stopped by SIGTERM
        seconds after it joined did so in CI."""
        self._stop_compiling.set()
        if self._compiling is not None:
            self._compiling.join()

    def _rows(self, theta) -> list[np.ndarray]:
        """One post's packed rows per unit, as zeros of their shapes."""
        nr, n_layers, nl = PK.unit_rows(theta, self.layerwise, self.codec.chunk)
        out = [np.zeros((nr, self.codec.row_bytes), np.uint8)]
        if self.layerwise:
            out.append(np.zeros((n_layers, nl, out[0].shape[1]), np.uint8))
        return out

    def _step(self, theta, outer_opt, pooled, dets: Detector, posts, *rest):
        """The rule's sync over the round's posts: float32 Δs (``posts`` θ̄'s tree [N, ...]; the
        shares follow), or packed rows (``posts`` per unit [N, ...]; the norms [N, U], the shares).
        ``pooled``: what the rule kept from the last round (``SyncRule.pooled_extra``), or None."""
        *norms, shares = rest
        if not self.rule.asynchronous:  # rounds by step count: every post is tau steps, no step shares
            shares = None
        layerwise = self.layerwise  # its units: the root and each layer; else the whole model
        n = jax.tree.leaves(posts)[0].shape[0]  # the participants
        if self.packed:  # each worker's "params" are its post; the reduction decodes them (packed.py)
            local, reduction = PK.posted_units(posts, norms[0], layerwise), PK.PackedPosts(codec=self.codec)
        else:  # θ_i = θ̄ - Δ_i: the rule forms Δ_i = θ̄ - θ_i again (exact up to one rounding of each
            # value, the same on every worker)
            local, reduction = as_units(jax.tree.map(lambda o, d: o[None] - d, theta, posts), layerwise), WORKERS
        n_layers = jax.tree.leaves(theta["layers"])[0].shape[0] if layerwise else 0
        spec = SyncSpec(self.plan.penalty, self.plan.outer, self.opt, n_layers, n, reduction=reduction)
        outer = OuterState(as_units(theta, layerwise), as_units(outer_opt, layerwise), dets, np.int32(0),
                           self._spread(pooled, n))
        _, _, outer, figures = workers_sync(self.rule, spec, local, None, outer, shares)
        figures.pop("inner_reset")  # (no inner optimizer state comes with a post)
        return (of_units(outer.params, layerwise), of_units(outer.opt_state, layerwise), self._pool(outer.extra),
                outer.detector, figures)

    def _spread(self, pooled, n: int):
        """The rule's kept state as its ``n`` workers' subtree, laid out as the rule's units."""
        if pooled is None:
            return None
        return self.rule.spread_extra({k: as_units(v, self.layerwise) for k, v in pooled.items()}, n)

    def _pool(self, extra):
        pooled = self.rule.pooled_extra(extra) if extra is not None else None
        return None if pooled is None else {k: of_units(v, self.layerwise) for k, v in pooled.items()}

    def _flush(self, theta, outer_opt, pooled):
        """What a rule has in flight applied, no new round (CO2's last pending): θ̄ and its outer state."""
        layerwise, n = self.layerwise, 1
        n_layers = jax.tree.leaves(theta["layers"])[0].shape[0] if layerwise else 0
        spec = SyncSpec(self.plan.penalty, self.plan.outer, self.opt, n_layers, n, reduction=WORKERS)
        units = as_units(theta, layerwise)
        dets = Detector.zeros((n, 1 + n_layers), 2)
        outer = OuterState(units, as_units(outer_opt, layerwise), dets, np.int32(0), self._spread(pooled, n))
        local = jax.tree.map(lambda x: x[None], units)
        _, _, outer, _ = workers_sync(self.rule, spec, local, None, outer, flush=True)
        return of_units(outer.params, layerwise), of_units(outer.opt_state, layerwise)

    def flushed(self, state: RoundState) -> RoundState:
        """``state`` with what its rule has in flight applied (CO2: the last round's mean pseudo
        gradient), for what reads the run's model (evaluation, ``exchange_state.npz``); ``state``
        itself when nothing is (every other rule)."""
        if state.extra is None:
            return state
        put = lambda t: jax.device_put(t, self.cpu)
        theta, outer_opt = jax.device_get(self._flush_fn(put(state.theta), put(state.outer_opt), put(state.extra)))
        host = lambda t: jax.tree.map(np.asarray, t)
        return dataclasses.replace(state, theta=host(theta), outer_opt=host(outer_opt))

    def initial(self, theta: Any, slots: int, n_units: int, window: int) -> RoundState:
        """Round 0: θ̄ = the initial params, a fresh outer state, zero detectors for every slot."""
        theta = jax.tree.map(lambda x: np.asarray(x, np.float32), theta)
        outer_opt = init_outer_opt_state(self.opt, theta, self.layerwise)
        det = Detector.zeros((slots, n_units), window)
        host = lambda t: jax.tree.map(np.asarray, t)
        units = as_units(theta, self.layerwise)
        extra = self.rule.init_extra(jax.tree.map(lambda x: x[None], units))  # one worker's: nothing in flight
        return RoundState(0, host(theta), host(outer_opt), host(det), 0, [0] * slots, extra=host(self._pool(extra)))

    def apply(self, state: RoundState, posts: list[Post]) -> tuple[RoundState, dict]:
        """Round state r from r - 1 and the round's posts (in sorted worker order)."""
        posts = sorted(posts, key=lambda p: p.worker)
        ids = np.asarray([p.worker for p in posts])
        if not self.packed:
            deltas = jax.tree.unflatten(jax.tree.structure(state.theta),
                                        [np.stack(ls) for ls in zip(*(p.delta for p in posts), strict=True)])
            extra = ()
        else:
            deltas, extra = self._stack_packed(state, posts)
        steps = np.asarray([p.steps_since - (1.0 - self.carried_weight) * p.carried for p in posts], np.float32)
        shares = steps / steps.sum() if steps.sum() > 0 else np.full(len(posts), 1.0 / len(posts), np.float32)
        dets = jax.tree.map(lambda x: x[ids], state.detectors)
        put = lambda t: jax.device_put(t, self.cpu)
        step = self.program(state, len(posts))
        theta, outer_opt, pooled, new_dets, figures = step(put(state.theta), put(state.outer_opt), put(state.extra),
                                                           put(dets), put(deltas), *map(put, extra),
                                                           put(np.asarray(shares, np.float32)))
        host = lambda t: jax.tree.map(np.asarray, jax.device_get(t))
        all_dets = host(state.detectors)
        all_dets = jax.tree.map(lambda a, n: _set_rows(a, ids, n), all_dets, host(new_dets))
        cursors = list(state.cursors)
        for p in posts:
            cursors[p.worker] = p.cursor
        new = RoundState(state.round + 1, host(theta), host(outer_opt), all_dets,
                         state.tally + int(sum(p.steps_since for p in posts)), cursors, [int(i) for i in ids],
                         extra=host(pooled))
        # (figures["unit_flagged"], [U, N]: which units of which post were flagged: a packed
        # poster settles its residual by them)
        return new, {k: np.asarray(v).tolist() for k, v in host(figures).items()}

    def _stack_packed(self, state: RoundState, posts: list[Post]) -> tuple[list[np.ndarray], tuple]:
        """The posts' rows stacked per unit [N, ...] and their norms [N, U], shapes checked."""
        want, units = self._rows(state.theta), np.shape(state.detectors.mean)[1]
        for p in posts:
            fits = len(p.delta) == len(want) and all(a.shape == b.shape and a.dtype == b.dtype
                                                     for a, b in zip(p.delta, want, strict=True))
            if not fits or np.shape(p.norms) != (units,):
                raise ValueError(f"round {p.round}: worker {p.worker}'s packed post has rows "
                                 f"{[(a.shape, str(a.dtype)) for a in p.delta]} and norms {np.shape(p.norms)}, this "
                                 f"config's model needs {[(b.shape, str(b.dtype)) for b in want]} and ({units},) "
                                 f"(sync.wire.kind={self.codec.name})")
        norms = np.stack([np.asarray(p.norms, np.float32) for p in posts])
        return [np.stack(rows) for rows in zip(*(p.delta for p in posts), strict=True)], (norms,)


def _set_rows(a: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    a = np.array(a)
    a[ids] = rows
    return a


__all__ = ["OuterRound"]
