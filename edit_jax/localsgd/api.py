"""DiLoCo / EDiT in anyone's JAX training: your model, your optax optimizer, your loop.

    trainer = LocalSGD(diloco(), mesh, tau=16, inner_step=my_step)             # any pytree, any step
    trainer = LocalSGD(edit(), mesh, tau=16, loss_fn=my_loss, optimizer=tx)    # layer-wise EDiT
    state = trainer.init(params, opt_state)
    for batch in batches:                                                      # batch: [N, B, ...]
        state, metrics = trainer.step(state, batch)
    theta_bar = trainer.sync(state)[0].outer_params

N workers (the size of the mesh's ``replica`` axis) each train their own copy of the model, stacked
on a leading axis [N, ...] sharded over ``replica``: ``jax.vmap(worker, axis_name="replica",
spmd_axis_name="replica")`` under ``jax.jit``, so each replica's devices run their own worker and
nothing crosses ``replica`` between syncs. Other mesh axes (e.g. ``shard``) split each worker's
batch (dim 1 of the stacked batch): GSPMD partitions the worker's step as data parallelism.

Every ``tau`` steps the workers sync with the rule's ``sync``: the registry's rule object
(``rule.py``; ``api_rules.py`` builds it, ``from_method`` exactly as the trainer does), called
through the protocol the trainer's programs call, so the sync is written once for both
(``tests/test_rule_conformance.py``). Inside the vmap a rule sees one worker's values with their
local replica dim ([1, ...], as under the trainer's ``shard_map``) and meets the others through
collectives over ``replica`` (``ReplicaPsum``, each worker holding its whole units). Two compiled
programs, picked on the host from the step count (a host integer: picking never waits for the
device): the local step, and the sync (a small program after the local step) or, for layer-wise
rules, the step with the sync inside its forward.

- Whole-model rules (``diloco``, ``post_local_sgd``, ``edit(layerwise=False)``, ``co2``): the sync
  runs after the step of every tau-th step ((k + 1) % tau == 0 for the 0-based step k), on the
  whole params pytree as one unit (the root of a model without layers: one norm, one detector per
  worker; ``SyncRule.after_step``). Any pytree, any inner step. The inner optimizer state is kept
  as it is (DiLoCo keeps it).
- Layer-wise rules (``edit()``): the sync of the window of steps [k − tau, k) runs inside the
  forward of step k (k > 0, k % tau == 0), unit by unit (the root, then each layer) on its way into
  compute (``forward_inputs``, ``in_forward_sync``, ``assemble``), so a unit's exchange can overlap
  the previous unit's compute. The forward sees θ̄, the gradient is taken at θ̄ and the inner update
  is applied to θ̄ (the harness's ``sync_forward``). The model must meet ``models.family.ScannedModel``.
- ``compressed(rule, wire)``: either kind on a lossy wire, each worker's residual in
  ``LocalSGDState.extra``.

Layer-wise rules take ``loss_fn`` and ``optimizer``, not an opaque step: the update must apply to
θ̄, which exists only once the hooks ran inside the forward, and an opaque step applies its optimizer
to the θ_i it was given (docs/api.md, "Why layer-wise rules take loss_fn and optimizer").
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from edit_jax.localsgd.api_checks import NonFiniteWatch, base_key, check_arguments, check_fragments, check_ys, \
    checked_step_output, per_worker, put_batch, refuse_nonfinite_sync, stacked_layer_count
from edit_jax.localsgd.api_layout import manual_workers, on_device, state_shardings, worker_unit_specs
from edit_jax.localsgd.fragments import group_span
from edit_jax.localsgd.layer_scan import LayerSegments
from edit_jax.localsgd.methods import StepSchedule
from edit_jax.localsgd.api_rules import LocalSGDRule, co2, compressed, diloco, edit, from_method, post_local_sgd
from edit_jax.localsgd.nnx_model import NNXModel, transformation
from edit_jax.localsgd.outer_spec import OuterSpec, Penalty
from edit_jax.localsgd.outer import Detector, make_outer_optimizer
from edit_jax.localsgd.rule import SyncSpec
from edit_jax.localsgd.sharding import REPLICA  # the mesh axis the workers live on
from edit_jax.localsgd.stacked import WORKERS, as_units, of_units, workers_sync
from edit_jax.localsgd.state import OuterState, init_outer_opt_state
from edit_jax.localsgd.sync import local_blocks, with_replica_dim
from edit_jax.models.family import HOOK_SAVED, identity_hook

LOCAL, SYNC_FORWARD, LOCAL_THEN_SYNC, HSDP = "local", "sync_forward", "local_then_sync", "hsdp"


# ----------------------------------------------------------------------------- state


class LocalSGDState(NamedTuple):
    """Everything the workers and the sync carry (a pytree; ``step`` is a host integer)."""

    params: Any  # every worker's params, stacked [N, ...], sharded over `replica`
    opt_state: Any  # every worker's inner optimizer state, stacked [N, ...] likewise
    outer_params: Any  # θ̄: float32, one copy (no worker axis): replicated, or split (shard_outer)
    outer_opt_state: Any  # the outer optimizer's; layer-wise: {"root": ..., "layers": per-layer, stacked}
    detector: Detector  # anomaly detectors, leading dims [N, U] (U = 1, or 1 + layers for layer-wise)
    step: Any  # inner steps done (np.int32): picks the next step's program without a device read
    # The rule's own per-worker subtree (``SyncRule.init_extra``), [N, ...]: CO2's pseudo gradients
    # in flight, a lossy wire's error-feedback residuals; None for the others.
    extra: Any = None


# ----------------------------------------------------------------------------- the trainer


class LocalSGD:
    """Wraps one worker's training step into N workers with a ``rule``'s sync every ``tau`` steps.

    Give either ``inner_step(params, opt_state, batch) -> (params, opt_state, metrics)`` (whole-model
    rules only), or ``loss_fn(params, batch, hook, hook_xs) -> (loss, ys)`` and an optax
    ``optimizer`` (every rule): ``loss_fn`` passes ``hook, hook_xs`` to the model's forward and
    returns the forward's ``ys``; without a sync the hook is ``identity_hook`` and ``hook_xs`` None.
    ``loss_fn`` may return ``(loss, ys, metrics)``: a dict of the user's scalars, returned by
    ``step`` per worker (``averaged``: their means). ``seed`` (an int or a JAX key): ``inner_step`` / ``loss_fn``
    get a random key as one more, last argument (dropout), a different one per worker and step.
    ``donate``: each step consumes the state it is given (its buffers are reused). ``warmup_steps``:
    W synchronous steps first (every step the workers' mean gradient, ``loss_fn`` only), then θ̄ =
    the workers' params and the rule's schedule counted from W (EDIT.md's warmup). ``fsdp``: each
    worker's params, optimizer state and rule state split over the worker's own devices (1/S each);
    ``shard_outer``: θ̄ and the outer optimizer state split over every device of the mesh (1/(N·S)),
    as the harness lays them out (``api_layout.py``); else whole copies on each device."""

    def __init__(self, rule: LocalSGDRule, mesh: Mesh, tau: int, inner_step: Callable | None = None, *,
                 loss_fn: Callable | None = None, optimizer: optax.GradientTransformation | None = None,
                 seed: int | jax.Array | None = None, donate: bool = True, warmup_steps: int = 0,
                 shard_outer: bool = False, fsdp: bool = False, fragments: int = 1, offload_outer: bool = False):
        check_arguments(rule, mesh, tau, inner_step, loss_fn, optimizer, warmup_steps, REPLICA)
        # The workers' psum runs inside vmap; JAX's Explicit mesh axes reject it, so the programs
        # run on the same devices with Auto axes (GSPMD propagates the sharding).
        self.mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
        self.rule, self.tau, self.donate, self.warmup = rule, int(tau), donate, int(warmup_steps)
        self.shard_outer, self.fsdp, self.offload = bool(shard_outer), bool(fsdp), bool(offload_outer)
        self.fragments = check_fragments(fragments, self.tau, rule)
        # The rule's units: the params' {"root", "layers"} for a layer-wise rule, and for any rule
        # synced in staggered groups (Streaming DiLoCo); else the whole pytree is one unit.
        self.layered = rule.layerwise or self.fragments > 1
        # Which program each step runs: the trainer's schedule (methods.StepSchedule), the warmup first.
        self.schedule = StepSchedule(True, rule.layerwise, self.warmup, self.tau, fragments=self.fragments)
        self.inner_step, self.loss_fn, self.optimizer = inner_step, loss_fn, optimizer
        self.n = int(self.mesh.shape[REPLICA])
        self.batch_axes = tuple(a for a in self.mesh.axis_names if a != REPLICA and self.mesh.shape[a] > 1)
        self.outer_opt = make_outer_optimizer(rule.outer)
        self.key = base_key(seed)  # None: no key is passed
        self._programs: dict[Any, Callable] = {}
        self._nonfinite = NonFiniteWatch(rule.name)  # says when a sync was refused (θ̄ non-finite)
        self.nnx: NNXModel | None = None  # for_nnx: the NNX model's graph and RNG streams

    @classmethod
    def for_nnx(cls, rule: LocalSGDRule, mesh: Mesh, tau: int, model, optimizer, loss_fn: Callable, *,
                blocks: str | None = None, seed: int | jax.Array | None = None, donate: bool = True,
                shard_outer: bool = False, fsdp: bool = False, fragments: int = 1,
                offload_outer: bool = False) -> "LocalSGD":
        """A Flax NNX ``model`` (an ``nnx.Module``) trained with ``optimizer`` (optax, or an
        ``nnx.Optimizer``: its ``tx``) on ``loss_fn(model, batch) -> loss | (loss, metrics)``: its
        ``nnx.Param`` state is the params (``init()`` takes them from the model), its RNG streams
        reseeded per worker and step from ``seed`` (``nnx_model.py``); ``to_nnx(state)`` is the
        module at θ̄. Layer-wise rules need ``blocks``: the attribute holding the stacked blocks
        (built under ``nnx.vmap``), which the model runs with ``edit_jax.scan_blocks``."""
        if rule.layerwise and blocks is None:
            raise ValueError(f"blocks: rule {rule.name!r} syncs each block inside the forward; name the model's "
                             "attribute holding its stacked blocks (built under nnx.vmap, run with "
                             "edit_jax.scan_blocks(self.blocks, x)), or use a whole-model rule (diloco(), "
                             "edit(layerwise=False), co2(), ...)")
        wrapped = NNXModel(model, blocks if rule.layerwise else None)
        trainer = cls(rule, mesh, tau, loss_fn=wrapped.loss_fn(loss_fn), optimizer=transformation(optimizer),
                      seed=seed, donate=donate, shard_outer=shard_outer, fsdp=fsdp, fragments=fragments,
                      offload_outer=offload_outer)
        trainer.nnx = wrapped
        return trainer

    def to_nnx(self, state: LocalSGDState):
        """The NNX module at θ̄ (``for_nnx`` trainers)."""
        return self.nnx.merge(state.outer_params)

    # -- the public calls --------------------------------------------------------------------------

    def init(self, params: Any = None, opt_state: Any = None) -> LocalSGDState:
        """The state of N workers that all start from ``params`` (one copy, any pytree; layer-wise
        rules: ``{"root": ..., "layers": ...}``), with ``opt_state`` (one copy; default
        ``optimizer.init(params)``). θ̄ = ``params`` in float32, a fresh outer state, zero detectors.
        ``for_nnx``: ``params`` default to the model's."""
        if params is None:
            if self.nnx is None:
                raise ValueError("params: required (only a for_nnx trainer takes them from its model)")
            params = self.nnx.params
        if opt_state is None:
            if self.optimizer is None:
                raise ValueError("opt_state: required with inner_step (there is no optimizer to init it)")
            opt_state = self.optimizer.init(params)
        n_units = 1 + self._layer_count(params) if self.layered else 1
        if self.fragments > n_units:
            raise ValueError(f"fragments: at most the number of units (the root and {n_units - 1} layers), "
                             f"got {self.fragments}")

        def build(params, opt_state):
            stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (self.n,) + jnp.shape(x)), t)
            theta = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
            outer_state = self._fresh_outer_state(theta)
            det = Detector.zeros((self.n, n_units), max(2, self.rule.penalty.warmup))
            workers = stack(params)
            extra = self.rule.sync.init_extra(self._as_units(workers))  # the rule's own, per worker
            return LocalSGDState(workers, stack(opt_state), theta, outer_state, det, None, extra)

        shapes = jax.eval_shape(build, params, opt_state)
        state = jax.jit(build, out_shardings=self._shardings(shapes))(params, opt_state)
        return state._replace(step=np.int32(0))

    def step(self, state: LocalSGDState, batch: Any) -> tuple[LocalSGDState, dict]:
        """One inner step of every worker (and the rule's sync when due). ``batch``: a pytree whose
        leaves are stacked per worker, [N, B, ...] (``per_worker`` makes them from a global batch).
        Returns the new state and ``{"inner": the step's metrics, each [N, ...], "sync": the sync's
        figures (on sync steps only)}`` (``averaged`` gives the inner ones' means over the workers)."""
        k = int(state.step)
        kind = self.schedule.kind(k)
        self._nonfinite.check()  # the last sync's, read one call late (no wait on the device)
        state = state._replace(step=None)
        if self.schedule.init_outer_due(k):  # the first local step: θ̄ = the workers' (identical) params
            state = self._run("init_outer", state)
        new, metrics = self._run(str(kind) if kind.name in (SYNC_FORWARD, HSDP) else LOCAL, state,
                                 self._put_batch(batch), np.int32(k))
        if kind.name == LOCAL_THEN_SYNC:  # a second, small program: the sync alone (as ``sync``; a group's)
            new, metrics["sync"] = self._run(str(kind).replace(LOCAL_THEN_SYNC, "sync"), new)
        if "sync" in metrics:
            self._nonfinite.saw(k, metrics["sync"])
        return new._replace(step=np.int32(k + 1)), metrics

    @staticmethod
    def averaged(metrics: dict) -> dict:
        """A step's inner metrics averaged over the workers, as host floats (for a log line: it
        reads the device; the programs leave the mean out, so a local step crosses no worker)."""
        return {k: float(np.mean(np.asarray(jax.device_get(v), np.float64))) for k, v in metrics["inner"].items()}

    def sync(self, state: LocalSGDState) -> tuple[LocalSGDState, dict]:
        """A sync now, after the last step (unit by unit for layer-wise rules): every worker and
        ``outer_params`` at the new θ̄. For evaluation or saving at the end of training. (CO2:
        one more round, whose own pseudo gradients go in flight; ``flush`` lands the last.)"""
        return self._sync_call("sync", state)

    def flush(self, state: LocalSGDState) -> tuple[LocalSGDState, dict]:
        """Every worker and ``outer_params`` at θ̄ with what is in flight applied and no new round
        started: CO2's last round's all-reduce landed (the model to evaluate at the end); for the
        other rules the same as ``sync``. The rule's own state (in flight, residuals) is kept."""
        return self._sync_call("flush", state)

    def _sync_call(self, kind: str, state: LocalSGDState):
        new, metrics = self._run(kind, state._replace(step=None))
        self._nonfinite.saw(int(state.step), metrics)
        self._nonfinite.check()  # (the run's last sync, most likely: said now)
        return new._replace(step=state.step), metrics

    def kind_at(self, k: int) -> str:
        """The program of 0-based step ``k``: "hsdp" (the warmup: gradients averaged over the
        workers), "local", "local_then_sync" or "sync_forward" (counted from the warmup's end; with
        ``fragments`` the group it syncs, "local_then_sync@1"), as the trainer's schedule says."""
        return str(self.schedule.kind(k))

    def per_worker(self, batch: Any) -> Any:
        """A global batch [N * B, ...] as the stacked one [N, B, ...]: worker i gets rows [iB, (i+1)B)."""
        return per_worker(self.n, batch)

    # -- programs ----------------------------------------------------------------------------------

    def lower(self, kind: str, state: LocalSGDState, batch: Any = None):
        """The lowered (not run) program ``kind`` ("local", "sync_forward" or "sync": a
        "local_then_sync" step runs "local", then "sync") on ``state`` and ``batch``:
        ``.compile().as_text()`` is its HLO, ``.compile().memory_analysis()`` its memory."""
        args = (state._replace(step=None),) + (() if kind in ("sync", "flush") else (self._put_batch(batch),
                                                                                    np.int32(0)))
        with jax.set_mesh(self.mesh):
            return self._jitted(kind, args[0]).lower(*args)

    def _jitted(self, kind: str, state: LocalSGDState) -> Callable:
        """Program ``kind`` for states laid out as ``state`` (compiled once per kind and layout)."""
        key = (kind, jax.tree.structure(state))
        if key not in self._programs:
            name, _, group = kind.partition("@")  # a staggered group's sync: only its units (span)
            span = group_span(state.outer_params, self._layer_count(state.outer_params), self.fragments,
                              int(group)) if group else None
            body = {LOCAL: self._local, SYNC_FORWARD: partial(self._sync_forward, span=span),
                    "sync": partial(self._sync_now, span=span),
                    HSDP: lambda state, batch, k: self._local(state, batch, k, average=True),
                    "flush": lambda state: self._sync_now(state, flush=True), "init_outer": self._init_outer}[name]
            shardings = self._shardings(state) if kind == "init_outer" else (self._shardings(state), None)
            self._programs[key] = jax.jit(body, donate_argnums=(0,) if self.donate else (), out_shardings=shardings)
        return self._programs[key]

    def _run(self, kind: str, state: LocalSGDState, *args):
        if self.donate and any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array)):
            raise ValueError("state: its buffers were consumed (donated) by an earlier step or sync; pass the state "
                             "that call returned, or build LocalSGD with donate=False")  # (it crashed Python)
        with jax.set_mesh(self.mesh):  # bare PartitionSpecs in the user's code name this mesh's axes
            return self._jitted(kind, state)(state, *args)

    def _workers(self, fn: Callable, *args, in_axes=0, out_axes=0):
        if self.fsdp:  # (api_layout.py: a vmap would let GSPMD move activations across replicas)
            return manual_workers(self.mesh, fn, args, in_axes, out_axes)
        return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=REPLICA, spmd_axis_name=REPLICA)(*args)

    def _key_args(self, k) -> tuple:
        """The user function's last argument: this worker's key of step ``k`` (none without ``seed``)."""
        if self.key is None:
            return ()
        return (jax.random.fold_in(jax.random.fold_in(self.key, k), jax.lax.axis_index(REPLICA)),)

    def _worker_step(self, params, opt_state, batch, k, average: bool = False):
        if self.inner_step is not None:
            out = self.inner_step(params, opt_state, batch, *self._key_args(k))
            return checked_step_output(out, params, opt_state)
        params, opt_state, metrics, _ = self._loss_step(params, opt_state, batch, identity_hook, None, k,
                                                        average=average)
        return params, opt_state, metrics

    def _loss_step(self, params, opt_state, batch, hook, hook_xs, k, outer=None, spec=None, average=False,
                   span=None):
        """One worker's step from ``loss_fn``; with a sync in the forward (``hook_xs``: the rule's
        per-unit inputs, ``outer`` this worker's view of the outer state), the rule assembles the
        synced state (``SyncRule.assemble``: the params are θ̄, a worker gone non-finite restarts
        its optimizer) and the update applies to θ̄."""
        key = self._key_args(k)

        def loss(p):
            out = self.loss_fn(p, batch, hook, hook_xs, *key)
            if not (isinstance(out, tuple) and len(out) in (2, 3)) or (len(out) == 3 and not isinstance(out[2], dict)):
                raise ValueError("loss_fn: must return (loss, ys) or (loss, ys, metrics), ys the forward's hook "
                                 f"outputs and metrics a dict of scalars; got {type(out).__name__}"
                                 + (f" of {len(out)}" if isinstance(out, tuple) else ""))
            return out[0], (out[1], out[2] if len(out) == 3 else {})
        (value, (ys, user)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        if average:  # the synchronous warmup: every worker applies the workers' mean gradient
            grads = jax.lax.pmean(grads, REPLICA)
        synced = None
        if hook_xs is not None:
            check_ys(ys, span)
            synced, outer, opt_state, figures, _ = self.rule.sync.assemble(
                with_replica_dim(params), outer, with_replica_dim(opt_state), ys, spec, span)
            params = jax.tree.map(lambda s, p: s.astype(p.dtype), local_blocks(synced), params)
            opt_state, synced = local_blocks(opt_state), (outer, figures)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        return params, opt_state, {**user, "loss": value, "grad_norm": grad_norm}, synced

    def _local(self, state: LocalSGDState, batch, k, average: bool = False):
        params, opt_state, metrics = self._workers(partial(self._worker_step, average=average), state.params,
                                                   state.opt_state, batch, k, in_axes=(0, 0, 0, None))
        return state._replace(params=params, opt_state=opt_state), {"inner": metrics}

    def _fresh_outer_state(self, theta):
        """The outer optimizer's state of θ̄: per unit for layer-wise rules (the trainer's
        ``init_outer_opt_state``: the layers' stacked), else of the whole pytree."""
        return init_outer_opt_state(self.outer_opt, theta, self.layered)

    def _init_outer(self, state: LocalSGDState) -> LocalSGDState:
        """After the warmup: θ̄ = the workers' params (identical: every step averaged the gradients),
        a fresh outer optimizer state, zero detectors, the rule's own state reset (EDIT.md, k = W)."""
        theta = jax.tree.map(lambda x: x[0].astype(jnp.float32), state.params)
        outer_state = self._fresh_outer_state(theta)
        extra = self.rule.sync.reset_extra(state.extra) if state.extra is not None else None
        return state._replace(outer_params=theta, outer_opt_state=outer_state, extra=extra,
                              detector=jax.tree.map(jnp.zeros_like, state.detector))

    # -- the rule's sync, every worker in a vmap over ``replica`` ------------------------------------
    # The registry's rule (``rule.py``) runs as in the trainer's programs, on one worker's values
    # with their local replica dim ([1, ...]; ``with_replica_dim``) and collectives over ``replica``
    # (``ReplicaPsum``; each worker holds its whole unit, so no norm crosses another axis).

    def _as_units(self, tree):
        """A tree laid out as the rule's units: layer-wise, the params' own ``{"root", "layers"}``;
        else the whole pytree is one unit (the root of a model without layers)."""
        return as_units(tree, self.layered)

    def _of_units(self, tree):
        return of_units(tree, self.layered)

    def _layer_count(self, params) -> int:
        why = "" if self.rule.layerwise else f"with fragments={self.fragments}: "
        return stacked_layer_count(params, self.rule.name, why)

    def _spec(self, state: LocalSGDState) -> SyncSpec:
        n_layers = self._layer_count(state.outer_params) if self.layered else 0
        return SyncSpec(self.rule.penalty, self.rule.outer, self.outer_opt, n_layers, self.n,
                        reduction=WORKERS,
                        inner_opt_specs=jax.tree.map(lambda _: P(REPLICA), state.opt_state))

    def _outer(self, state: LocalSGDState, det, extra) -> OuterState:
        """One worker's view of the outer state: θ̄ and its optimizer state as the rule's units,
        this worker's detectors and own subtree with their replica dim."""
        return OuterState(self._as_units(state.outer_params), self._as_units(state.outer_opt_state),
                          with_replica_dim(det), jnp.int32(0), with_replica_dim(extra))

    def _new_state(self, state, per_worker, shared, figures):
        (params, opt_state, det, extra), (outer, outer_opt_state) = per_worker, shared
        new = state._replace(params=params, opt_state=opt_state, outer_params=self._of_units(outer),
                             outer_opt_state=self._of_units(outer_opt_state), detector=det, extra=extra)
        return refuse_nonfinite_sync(state, new, figures)

    def _sync_now(self, state: LocalSGDState, flush: bool = False, span=None):
        """Every unit synced after the step (``SyncRule.after_step``; ``span``: a staggered group's
        units only), or the in-flight flushed (``SyncRule.flush``): ``stacked.workers_sync``, the
        exchange's round too."""
        state = self._outer_on_device(state)
        outer = OuterState(self._as_units(state.outer_params), self._as_units(state.outer_opt_state), state.detector,
                           jnp.int32(0), state.extra)  # (detectors and the rule's own: per worker, [N])
        units, opt_state, outer, figures = workers_sync(self.rule.sync, self._spec(state), self._as_units(state.params),
                                                        state.opt_state, outer, flush=flush, spmd=True, span=span)
        params = jax.tree.map(lambda s, p: s.astype(p.dtype), self._of_units(units), state.params)
        return self._new_state(state, (params, opt_state, outer.detector, outer.extra),
                               (outer.params, outer.opt_state), figures)

    def _sync_forward(self, state: LocalSGDState, batch, k, span=None):
        """A step whose forward syncs each unit on its way into compute (EDiT: the rule's
        ``forward_inputs``, ``in_forward_sync``, ``assemble``)."""
        state = self._outer_on_device(state)
        spec, rule = self._spec(state), self.rule.sync

        def hook(unit, xs, which):
            if xs is None:
                return unit, None
            synced, res = rule.in_forward_sync(unit, xs, which, spec)
            if self.shard_outer or self.fsdp:  # the synced unit laid out as the worker's own, not as θ̄'s shards
                synced = jax.lax.with_sharding_constraint(synced, worker_unit_specs(self.mesh, synced, self.fsdp))
            return checkpoint_name(synced, HOOK_SAVED), res

        def worker(params, opt_state, batch, det, extra):
            outer = self._outer(state, det, extra)
            hook_xs, segments = rule.forward_inputs(outer, spec, span)
            if segments is not None:  # a staggered group: the layers in segments (layer_scan.py)
                hook_xs = {"root": hook_xs["root"], "layers": LayerSegments(tuple(segments))}
            params, opt_state, metrics, (outer, figures) = self._loss_step(params, opt_state, batch, hook, hook_xs,
                                                                           k, outer, spec, span=span)
            return ((params, opt_state, local_blocks(outer.detector), local_blocks(outer.extra)),
                    (outer.params, outer.opt_state), figures, metrics)

        per_worker, shared, figures, metrics = self._workers(
            worker, state.params, state.opt_state, batch, state.detector, state.extra, out_axes=(0, None, None, 0))
        new, figures = self._new_state(state, per_worker, shared, figures)
        return new, {"inner": metrics, "sync": figures}

    # -- layout ------------------------------------------------------------------------------------

    def _shardings(self, state: LocalSGDState) -> LocalSGDState:
        return state_shardings(self.mesh, state, self.shard_outer, self.layered, self.fsdp, self.offload)  # api_layout

    def _outer_on_device(self, state: LocalSGDState) -> LocalSGDState:
        """An offloaded θ̄ and outer state brought to the devices for a sync (inside its program)."""
        if not self.offload:
            return state
        home = self._shardings(state)
        return state._replace(outer_params=on_device(state.outer_params, home.outer_params),
                              outer_opt_state=on_device(state.outer_opt_state, home.outer_opt_state))

    def _put_batch(self, batch):
        return put_batch(self.mesh, self.n, self.batch_axes, batch)


__all__ = ["LocalSGD", "LocalSGDRule", "LocalSGDState", "diloco", "post_local_sgd", "edit", "co2", "compressed",
           "from_method", "identity_hook", "Penalty", "OuterSpec"]
