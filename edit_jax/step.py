"""Train state and the compiled steps, all under ``shard_map`` over the (replica, shard) mesh.

One machinery, several kinds of step (chosen per step by ``schedule.py``):

- ``hsdp``: gradients averaged over ``shard`` and ``replica`` (Baseline; EDiT's warmup).
- ``local``: gradients averaged over ``shard`` only; nothing crosses ``replica``.
- ``sync_forward``: EDiT's sync step. Inside the scanned forward, each unit (root first, then layer
  by layer) is synced across replicas (outer.sync_unit) just before its FSDP gather; the gradient
  is taken at the synced params (the sync is the identity in the backward pass) and the inner
  AdamW update applies to them.
- ``local_then_sync``: a local step followed by a whole-model sync of every unit (DiLoCo, Post
  Local SGD, or EDiT with ``sync.layerwise=false``).

Loss normalisation: each device sums its tokens' losses and divides by the tokens of its replica,
so the sum over ``shard`` (what the all-gather's transpose does to the gradient) is the replica's
mean gradient; ``hsdp`` then averages over replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from edit_jax import model as model_lib
from edit_jax.config import Config, ConfigError
from edit_jax.optim import inner_optimizer
from edit_jax.outer import Detector, Penalty, outer_optimizer, sync_unit
from edit_jax.sharding import (BATCH_SPEC, REPLICA, SHARD, gather_unit, named, outer_specs, param_shard_dims,
                               replica_gather, replica_specs, shard_sq_norm, unit_dims)

STEP_KINDS = ("hsdp", "local", "sync_forward", "local_then_sync")
# Sync figures (identical on every device); "loss" and "grad_norm" come back per replica, [N].
SYNC_METRICS = ("pseudo_grad_norm", "unit_pseudo_grad_norm", "weight", "unit_weight", "flagged", "unit_flagged",
                "clip_factor", "unit_clip_factor", "outer_update_norm", "inner_reset")


@struct.dataclass
class OuterState:
    params: Any  # θ̄: identical on every replica, sharded over `shard`
    trace: Any  # Nesterov momentum buffer, laid out like θ̄
    detector: Detector  # per worker and unit: leaves [N, U] (window [N, U, K]); unit 0 is the root
    syncs: jax.Array  # int32: syncs applied (the initialising one not counted)


@struct.dataclass
class TrainState:
    step: jax.Array  # int32: inner steps done
    params: Any  # per-replica params, leaves [N, ...]
    opt_state: Any  # per-replica inner AdamW state
    outer: OuterState | None  # None for the Baseline
    rng: jax.Array  # uint32 key data, saved with checkpoints for reproducible stochastic extensions


@dataclass(frozen=True)
class Plan:
    """The static facts the compiled steps need, derived once from the config."""

    method: str
    uses_outer: bool
    layerwise: bool
    penalty: Penalty
    outer_lr: float
    outer_momentum: float
    nesterov: bool

    @staticmethod
    def from_config(cfg: Config) -> "Plan":
        s = cfg.sync
        if s.method == "baseline":
            return Plan("baseline", False, False, Penalty.off(), 1.0, 0.0, False)
        if s.method == "post_local_sgd":  # θ̄ = plain mean of the workers: SGD with lr 1, no momentum.
            return Plan("post_local_sgd", True, False, Penalty.off(), 1.0, 0.0, False)
        if s.method == "diloco":
            return Plan("diloco", True, False, Penalty.off(), s.outer_lr, s.outer_momentum, s.nesterov)
        return Plan("edit", True, s.layerwise, Penalty.from_config(s), s.outer_lr, s.outer_momentum, s.nesterov)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def n_units(cfg: Config) -> int:
    return 1 + cfg.model.n_layers


@jax.custom_vjp
def _with_value(x, value):
    """Returns ``value`` in the forward pass and passes the cotangent to ``x`` unchanged: the sync
    acts as the identity in the backward pass, so the gradient is taken at the synced point."""
    return value


def _with_value_fwd(x, value):
    return value, None


def _with_value_bwd(_, g):
    return g, jax.tree.map(jnp.zeros_like, g)


_with_value.defvjp(_with_value_fwd, _with_value_bwd)


def _varying(x):
    """Marks values computed identically on every replica (θ̄) as per-replica, as local params are."""
    def one(v):
        aval = jax.typeof(v)  # the varying-axes set is `.mat.varying` in recent JAX, `.vma` before
        mat = getattr(aval, "mat", None)
        varying = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
        return v if REPLICA in varying else jax.lax.pcast(v, REPLICA, to="varying")

    return jax.tree.map(one, x)


def make_state(cfg: Config, plan: Plan, inner_opt: optax.GradientTransformation, key: jax.Array) -> TrainState:
    """A fresh state: every replica starts from the same params; θ̄ = those params, trace = 0."""
    n = cfg.mesh.replica
    params = model_lib.init_params(cfg.model, key)
    outer = None
    if plan.uses_outer:
        outer = OuterState(params, jax.tree.map(jnp.zeros_like, params),
                           Detector.zeros((n, n_units(cfg)), cfg.sync.anomaly_warmup), jnp.int32(0))
    rep = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), params)
    return TrainState(jnp.int32(0), rep, inner_opt.init(rep), outer, jax.random.key_data(jax.random.fold_in(key, 1)))


def state_shapes(cfg: Config) -> TrainState:
    """Shapes and dtypes of the state for ``cfg`` (no devices needed)."""
    plan = Plan.from_config(cfg)
    return jax.eval_shape(partial(make_state, cfg, plan, inner_optimizer(cfg.optim, cfg.steps)), jax.random.key(0))


def step_kind(cfg: Config, k: int) -> str:
    """Which step inner step k (0-based) is (EDIT.md, Algorithm 1)."""
    plan, w, tau = Plan.from_config(cfg), cfg.sync.warmup_steps, cfg.sync.tau
    if plan.method == "baseline" or k < w:
        return "hsdp"
    if plan.layerwise:  # the sync of the window [k - tau, k) runs inside step k's forward
        return "sync_forward" if k > w and (k - w) % tau == 0 else "local"
    return "local_then_sync" if (k + 1 - w) % tau == 0 else "local"  # the same window, synced after step k - 1


def init_outer_due(cfg: Config, k: int) -> bool:
    """The first sync (k == W > 0) only sets θ̄ to the (identical) replicas' params."""
    return Plan.from_config(cfg).uses_outer and cfg.sync.warmup_steps > 0 and k == cfg.sync.warmup_steps


# ----------------------------------------------------------------------------- the machinery


class Machinery:
    """Compiles and holds the steps for one (config, mesh). Pure functions inside; this class only
    binds the static facts (shapes, specs, optimizers) so callers need not pass them around."""

    def __init__(self, cfg: Config, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.plan = Plan.from_config(cfg)
        self.n, self.s = cfg.mesh.replica, cfg.mesh.shard
        self.inner_opt = inner_optimizer(cfg.optim, cfg.steps)
        self.outer_opt = outer_optimizer(self.plan.outer_lr, self.plan.outer_momentum, self.plan.nesterov)
        abstract = jax.eval_shape(partial(model_lib.init_params, cfg.model), jax.random.key(0))
        self.shard_dims = param_shard_dims(abstract, self.s)
        # FSDP dims as the hook sees each unit (a layer's params without their stacked axis).
        self.unit_dims = {"root": unit_dims(self.shard_dims["root"], False),
                          "layer": unit_dims(self.shard_dims["layers"], True)}
        self.param_specs = replica_specs(abstract, self.shard_dims)
        self.outer_over_replica = self.plan.uses_outer and cfg.sync.outer_sharding == "replica_shard"
        if self.outer_over_replica:
            self._check_outer_divisible(abstract)
        self.outer_param_specs = outer_specs(abstract, self.shard_dims, self.outer_over_replica)
        self.state_specs = self._state_specs(abstract)
        self.state_shardings = named(mesh, self.state_specs)
        self.offload = self.plan.uses_outer and cfg.sync.cpu_offload
        if self.offload:  # θ̄ and the trace live in host memory; a sync step brings them in
            host = lambda s: NamedSharding(mesh, s, memory_kind="pinned_host")  # noqa: E731
            outer = self.state_shardings.outer
            outer = outer.replace(params=jax.tree.map(host, self.outer_param_specs, is_leaf=_is_spec),
                                  trace=jax.tree.map(host, self.outer_param_specs, is_leaf=_is_spec))
            self.state_shardings = self.state_shardings.replace(outer=outer)
        self.device_outer_shardings = named(mesh, self.outer_param_specs)
        self.tokens_per_replica = cfg.batch_size // self.n * cfg.data.seq_len
        self._compiled: dict[str, Any] = {}

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state: the restore target of a checkpoint."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state_shapes(self.cfg), self.state_shardings)

    # -- specs --------------------------------------------------------------------------------

    def _check_outer_divisible(self, abstract):
        bad = [f"{jax.tree_util.keystr(path)} (dim {d} = {x.shape[d]})"
               for (path, x), d in zip(jax.tree_util.tree_flatten_with_path(abstract)[0], jax.tree.leaves(self.shard_dims))
               if x.shape[d] % (self.n * self.s)]
        if bad:
            raise ConfigError(f"config key 'sync.outer_sharding': 'replica_shard' needs each parameter's FSDP dim "
                              f"divisible by mesh.replica x mesh.shard = {self.n * self.s}; not so for {', '.join(bad)}")

    def _state_specs(self, abstract_params):
        rep = jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.n,) + x.shape, x.dtype), abstract_params)
        opt_abstract = jax.eval_shape(self.inner_opt.init, rep)
        opt_specs = optax.tree_map_params(self.inner_opt, lambda _, spec: spec, opt_abstract, self.param_specs,
                                          transform_non_params=lambda _: P(), is_leaf=_is_spec)
        outer = None
        if self.plan.uses_outer:
            det = Detector(P(REPLICA), P(REPLICA), P(REPLICA), P(REPLICA))
            outer = OuterState(self.outer_param_specs, self.outer_param_specs, det, P())
        return TrainState(P(), self.param_specs, opt_specs, outer, P())

    # -- state creation -------------------------------------------------------------------------

    def init_state(self, seed: int) -> TrainState:
        make = partial(make_state, self.cfg, self.plan, self.inner_opt)
        return jax.jit(make, out_shardings=self.state_shardings)(jax.random.key(seed))

    # -- the compiled steps -----------------------------------------------------------------------

    def step_fn(self, kind: str):
        """The jitted step ``(state, batch) -> (state, metrics)`` of ``kind`` (compiled once)."""
        if kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {kind!r}; expected one of {STEP_KINDS}")
        if kind not in self._compiled:
            uses_outer_here = kind in ("sync_forward", "local_then_sync")
            specs = self.state_specs if uses_outer_here else self.state_specs.replace(outer=None)
            metric_specs = {"loss": P(REPLICA), "grad_norm": P(REPLICA)}
            if uses_outer_here:
                metric_specs.update({k: P() for k in SYNC_METRICS})
            mapped = jax.shard_map(partial(self._local_step, kind=kind), mesh=self.mesh,
                                   in_specs=(specs, BATCH_SPEC), out_specs=(specs, metric_specs))

            def step(state: TrainState, batch):
                if not uses_outer_here:  # the outer state does not enter local steps at all
                    new, metrics = mapped(state.replace(outer=None), batch)
                    return new.replace(outer=state.outer), metrics
                new, metrics = mapped(state.replace(outer=self._outer_to_device(state.outer)), batch)
                return new.replace(outer=self._outer_to_home(new.outer)), metrics

            self._compiled[kind] = jax.jit(step, donate_argnums=0, out_shardings=(self.state_shardings, None))
        return self._compiled[kind]

    def _outer_to_device(self, outer: OuterState) -> OuterState:
        if not self.offload:
            return outer
        put = lambda x, s: jax.device_put(x, s)  # noqa: E731
        return outer.replace(params=jax.tree.map(put, outer.params, self.device_outer_shardings),
                             trace=jax.tree.map(put, outer.trace, self.device_outer_shardings))

    def _outer_to_home(self, outer: OuterState) -> OuterState:
        if not self.offload:
            return outer
        home = self.state_shardings.outer
        return outer.replace(params=jax.tree.map(jax.device_put, outer.params, home.params),
                             trace=jax.tree.map(jax.device_put, outer.trace, home.trace))

    def grads_fn(self, sync_over_replica: bool):
        """``(state, batch) -> (mean loss, per-replica grads)`` of the step's gradient path (for
        tests: the gradient an "hsdp" (True) or "local" (False) step hands to the optimizer)."""
        key = f"grads_{sync_over_replica}"
        if key not in self._compiled:
            specs = self.state_specs.replace(outer=None)

            def body(state, batch):
                loss, grads = self._local_step(state, batch, kind="grads_only")
                if sync_over_replica:
                    grads = jax.tree.map(lambda g: jax.lax.pmean(g, REPLICA), grads)
                return loss, grads

            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, BATCH_SPEC), out_specs=(P(), self.param_specs))
            self._compiled[key] = jax.jit(lambda st, b: mapped(st.replace(outer=None), b))
        return self._compiled[key]

    def lowered(self, kind: str, state, batch):
        """The lowered (not executed) step, for HLO inspection and memory analysis."""
        self.step_fn(kind)
        return self._compiled[kind].lower(state, batch)

    def _local_step(self, state: TrainState, batch: jax.Array, *, kind: str):
        cfg, plan = self.cfg, self.plan
        inputs, targets = batch[:, :-1], batch[:, 1:]
        dtype = jnp.dtype(cfg.model.compute_dtype)
        dims_of = self.unit_dims
        sync_in_forward = kind == "sync_forward"

        def hook(unit, xs, which):
            if not sync_in_forward:
                return gather_unit(unit, dims_of[which], dtype), None
            outer_p, trace, det = xs
            rdims = dims_of[which] if self.outer_over_replica else None
            res = sync_unit(jax.lax.stop_gradient(unit), outer_p, trace, det, plan.penalty, self.outer_opt, rdims)
            synced = _with_value(unit, _varying(res.params))
            return gather_unit(synced, dims_of[which], dtype), res

        hook_xs = None
        if sync_in_forward:
            o = state.outer
            det = jax.tree.map(lambda x: x[0], o.detector)  # this replica's detectors: [U, ...]
            hook_xs = {"root": (o.params["root"], o.trace["root"], jax.tree.map(lambda x: x[0], det)),
                       "layers": (o.params["layers"], o.trace["layers"], jax.tree.map(lambda x: x[1:], det))}

        def loss_fn(params):
            local = jax.tree.map(lambda x: x[0], params)  # drop the (size 1) local replica dim
            logits, ys = model_lib.forward(cfg.model, local, inputs, hook, hook_xs)
            return model_lib.token_loss_sum(logits, targets) / self.tokens_per_replica, ys

        (loss, ys), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        if kind == "hsdp":
            grads = jax.tree.map(lambda g: jax.lax.pmean(g, REPLICA), grads)
        if kind == "grads_only":
            return jax.lax.pmean(jax.lax.psum(loss, SHARD), REPLICA), grads
        metrics = {}
        params, outer = state.params, state.outer
        opt_state = state.opt_state
        if sync_in_forward:
            params, outer, metrics = self._assemble_sync(state, ys["root"], ys["layers"])
            opt_state, metrics["inner_reset"] = self._reset_nonfinite_workers(opt_state, metrics)
        grad_norm = jnp.sqrt(shard_sq_norm(grads))
        updates, opt_state = self.inner_opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if kind == "local_then_sync":
            params, outer, metrics = self._sync_whole(params, outer)
            opt_state, metrics["inner_reset"] = self._reset_nonfinite_workers(opt_state, metrics)
        # Per-replica figures leave the step sharded over `replica` ([N] globally) and are averaged
        # on the host: a pmean here would put an all-reduce across replicas into every local step.
        metrics.update(loss=jax.lax.psum(loss, SHARD)[None], grad_norm=grad_norm[None])
        new = TrainState(state.step + 1, params, opt_state, outer, state.rng)
        return new, metrics

    # -- sync plumbing ---------------------------------------------------------------------------

    def _reset_nonfinite_workers(self, opt_state, metrics):
        """After a sync: a worker whose pseudo gradient (any unit) or inner optimizer state is
        non-finite was flagged and rolled back to θ̄, but its AdamW moments would stay NaN and make
        every later local step NaN. Its per-worker optimizer leaves are zeroed (the shared step
        count is kept, so the learning-rate schedule and bias correction go on); see BUILD_NOTES,
        decisions. Returns (opt_state, [N] bool: which workers were reset, identical everywhere)."""
        g_ok = jnp.all(jnp.isfinite(metrics["unit_pseudo_grad_norm"][:, jax.lax.axis_index(REPLICA)]))

        def per_worker(spec, x) -> bool:  # a leaf with the worker axis (AdamW's μ, ν), not the shared count
            return bool(spec) and spec[0] == REPLICA and jnp.issubdtype(x.dtype, jnp.inexact)
        leaves = [x for spec, x in zip(jax.tree.leaves(self.state_specs.opt_state, is_leaf=_is_spec),
                                       jax.tree.leaves(opt_state)) if per_worker(spec, x)]
        n_bad = sum((jnp.sum(~jnp.isfinite(x)) for x in leaves), jnp.int32(0))
        bad = ~g_ok | (jax.lax.psum(n_bad, SHARD) > 0)
        opt_state = jax.tree.map(lambda spec, x: jnp.where(bad, jnp.zeros_like(x), x) if per_worker(spec, x) else x,
                                 self.state_specs.opt_state, opt_state, is_leaf=_is_spec)
        return opt_state, replica_gather(bad) > 0.5

    def _assemble_sync(self, state: TrainState, root, layers):
        """Reassembles per-unit sync results (root + scanned layers) into state and metrics."""
        cat = lambda r, l: jnp.concatenate([r[None], l], axis=0)  # noqa: E731  (unit axis first)
        params = _varying({"root": root.params, "layers": layers.params})
        params = jax.tree.map(lambda x: x[None], params)  # restore the local replica dim
        det = jax.tree.map(cat, root.detector, layers.detector)
        det = jax.tree.map(lambda x: x[None], det)
        outer = OuterState({"root": root.outer_params, "layers": layers.outer_params},
                           {"root": root.trace, "layers": layers.trace}, det, state.outer.syncs + 1)
        unit_metrics = jax.tree.map(cat, root.metrics, layers.metrics)
        return params, outer, self._sync_metrics(unit_metrics)

    def _sync_metrics(self, unit):  # keys: SYNC_METRICS
        """Per-sync figures: per-worker norms over the whole model and per unit, weights, flags."""
        g_units = unit["pseudo_grad_norm"]  # [U, N]
        return {
            "pseudo_grad_norm": jnp.sqrt(jnp.sum(jnp.square(g_units), axis=0)),  # [N] whole-model norm
            "unit_pseudo_grad_norm": g_units,
            "weight": jnp.mean(unit["weight"], axis=0),  # [N] mean over units
            "unit_weight": unit["weight"],
            "flagged": jnp.sum(unit["flagged"].astype(jnp.int32), axis=0),  # [N] units flagged
            "unit_flagged": unit["flagged"],
            "clip_factor": jnp.min(unit["clip_factor"]),
            "unit_clip_factor": unit["clip_factor"],
            "outer_update_norm": jnp.sqrt(jnp.sum(jnp.square(unit["update_norm"]))),
        }

    def _sync_whole(self, params, outer: OuterState):
        """Syncs every unit after the step: the root, then the layers one by one (a scan, so that
        the per-unit numerics are those of the layer-wise sync)."""
        local = jax.tree.map(lambda x: x[0], params)
        det = jax.tree.map(lambda x: x[0], outer.detector)
        over = self.outer_over_replica
        root_dims = self.unit_dims["root"] if over else None
        layer_dims = self.unit_dims["layer"] if over else None
        one = partial(sync_unit, p=self.plan.penalty, opt=self.outer_opt)
        root = one(local["root"], outer.params["root"], outer.trace["root"], jax.tree.map(lambda x: x[0], det),
                   replica_dims=root_dims)

        def body(_, xs):
            return None, one(*xs, replica_dims=layer_dims)

        _, layers = jax.lax.scan(body, None, (local["layers"], outer.params["layers"], outer.trace["layers"],
                                              jax.tree.map(lambda x: x[1:], det)))
        state_like = TrainState(None, None, None, outer, None)
        return self._assemble_sync(state_like, root, layers)

    # -- outside the step --------------------------------------------------------------------------

    def init_outer_fn(self):
        """θ̄ <- the replicas' params (identical after synchronous warmup), trace <- 0. The first
        sync of EDIT.md (k == W): it changes no parameter."""
        if "init_outer" not in self._compiled:
            def body(state: TrainState):
                theta = jax.tree.map(lambda x: x[0], state.params)
                outer = state.outer.replace(params=theta, trace=jax.tree.map(jnp.zeros_like, theta))
                return state.replace(outer=outer)

            self._compiled["init_outer"] = jax.jit(body, out_shardings=self.state_shardings, donate_argnums=0)
        return self._compiled["init_outer"]

    def sync_fn(self):
        """A whole-model sync of ``state`` (not donated): for evaluation on a fresh θ̄ and for tests."""
        if "sync" not in self._compiled:
            def body(state: TrainState):
                params, outer, metrics = self._sync_whole(state.params, state.outer)
                return state.replace(params=params, outer=outer), metrics

            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(self.state_specs,),
                                   out_specs=(self.state_specs, P()))

            def sync(state: TrainState):
                new, metrics = mapped(state.replace(outer=self._outer_to_device(state.outer)))
                return new.replace(outer=self._outer_to_home(new.outer)), metrics

            self._compiled["sync"] = jax.jit(sync, out_shardings=(self.state_shardings, None))
        return self._compiled["sync"]

    def eval_fn(self, over_outer: bool):
        """Mean token loss of a batch for per-replica params ([N, ...], each replica its rows) or for
        outer params θ̄ (no replica dim)."""
        key = f"eval_{over_outer}"
        if key not in self._compiled:
            cfg = self.cfg
            dtype = jnp.dtype(cfg.model.compute_dtype)
            dims = self.unit_dims

            def body(params, batch):
                local = params if over_outer else jax.tree.map(lambda x: x[0], params)
                if over_outer and self.outer_over_replica:  # θ̄ is split over replica too: reassemble
                    local = jax.tree.map(lambda x, d: jax.lax.all_gather(x, REPLICA, axis=d, tiled=True), local,
                                         {"root": dims["root"], "layers": self.shard_dims["layers"]})
                hook = lambda unit, xs, which: (gather_unit(unit, dims[which], dtype), None)  # noqa: E731
                logits, _ = model_lib.forward(cfg.model, local, batch[:, :-1], hook)
                total = model_lib.token_loss_sum(logits, batch[:, 1:])
                count = jnp.float32(batch.shape[0] * (batch.shape[1] - 1))
                return jax.lax.psum(total, (REPLICA, SHARD)) / jax.lax.psum(count, (REPLICA, SHARD))

            spec = self.outer_param_specs if over_outer else self.param_specs
            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(spec, BATCH_SPEC), out_specs=P())
            to_device = (lambda p: jax.device_put(p, self.device_outer_shardings)) if over_outer and self.offload \
                else (lambda p: p)
            self._compiled[key] = jax.jit(lambda p, b: mapped(to_device(p), b))
        return self._compiled[key]

    def eval_params(self, state: TrainState):
        """What evaluation runs on: θ̄ after a fresh (uncommitted) sync, or the replicas' params
        while they are kept identical (Baseline, warmup)."""
        if state.outer is None or int(state.step) <= self.cfg.sync.warmup_steps:
            return state.params, False
        synced, _ = self.sync_fn()(state)
        return synced.outer.params, True

    def evaluate(self, state: TrainState, batches) -> float:
        params, over_outer = self.eval_params(state)
        fn = self.eval_fn(over_outer)
        losses = [float(fn(params, self.put_batch(b))) for b in batches]
        return sum(losses) / len(losses)

    def put_batch(self, batch):
        return jax.device_put(batch, named(self.mesh, BATCH_SPEC))
