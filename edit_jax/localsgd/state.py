"""The train state, its layout on the (replica, shard) mesh, creation, host offload, and the maps
from saved states (other worker counts, the pre-``opt_state`` format) onto this run's layout.

``StateLayout`` is built once per (method plan, mesh): every spec and sharding the steps, checkpoints
and evaluation use comes from it, so nothing else derives a layout (EDIT.md, "State and where it
lives"; the rules themselves are in ``sharding.py``):

- per-replica values (params θ_i, the inner optimizer state, the anomaly detectors) carry a
  leading replica dim of size N sharded over ``replica``;
- outer values (θ̄ and the outer optimizer state) have no replica dim and are sharded over
  ``shard`` like the params (with ``sync.outer_sharding=replica_shard`` over ``replica`` too), or
  live in host memory (``sync.cpu_offload``).

The outer optimizer state is any optax transformation's state, kept **per unit**: the root
unit's state from ``opt.init(root params)`` and the layers' from ``vmap(opt.init)`` over the
stacked layers, so the layer-wise sync scans over it with the layers (a per-unit step count for
Adam, say). Its specs are derived from the outer params' specs the way the inner optimizer's are
from the params' (``optax.tree_map_params``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from edit_jax.config import Config, ConfigError
from edit_jax.localsgd.methods import MethodPlan, Plan, plan_for
from edit_jax.localsgd.optim import inner_optimizer
from edit_jax.localsgd.outer import Detector, make_outer_optimizer, sgd_trace, with_sgd_trace
from edit_jax.localsgd.rule import SyncRule, SyncSpec
from edit_jax.localsgd.sharding import REPLICA, named, outer_specs, param_shard_dims, replica_specs, unit_dims
from edit_jax.models.family import model_family

# Format of the saved TrainState: 1 had OuterState.trace (SGD's momentum buffer only); 2 holds
# the outer optimizer's whole per-unit state in OuterState.opt_state, with the error-feedback
# residual and CO2's in-flight pseudo gradients as fields of their own; 3 holds those in the
# sync rule's own subtree, OuterState.extra.
STATE_FORMAT = 3


@struct.dataclass
class OuterState:
    params: Any  # θ̄: identical on every replica, sharded over `shard`
    opt_state: Any  # the outer optimizer's state, per unit: {"root": ..., "layers": ... (leading L)}
    detector: Detector  # per worker and unit: leaves [N, U] (window [N, U, K]); unit 0 is the root
    syncs: jax.Array  # int32: syncs applied (the initialising one not counted; with fragments: group-0 syncs)
    # The sync rule's own subtree (rule.py): None, or a dict such as {"pending": ...} (CO2's
    # pseudo gradients in flight) or {"residual": ...} (error feedback), laid out like the params.
    extra: Any = None

    @property
    def trace(self) -> Any:
        """The Nesterov/SGD momentum buffer, laid out like θ̄ (outer optimizer "nesterov" only)."""
        return {u: sgd_trace(self.opt_state[u]) for u in ("root", "layers")}

    def with_trace(self, trace: Any) -> "OuterState":
        return self.replace(opt_state={u: with_sgd_trace(self.opt_state[u], trace[u]) for u in ("root", "layers")})


@struct.dataclass
class TrainState:
    step: jax.Array  # int32: inner steps done
    params: Any  # per-replica params, leaves [N, ...]
    opt_state: Any  # per-replica inner AdamW state
    outer: OuterState | None  # None for the Baseline
    rng: jax.Array  # uint32 key data, saved with checkpoints for reproducible stochastic extensions


@struct.dataclass
class LegacyOuterState:
    """The outer state as checkpoints of format 1 hold it (restore target only)."""

    params: Any
    trace: Any
    detector: Detector
    syncs: jax.Array


@struct.dataclass
class OuterStateV2:
    """The outer state as checkpoints of format 2 hold it (restore target only)."""

    params: Any
    opt_state: Any
    detector: Detector
    syncs: jax.Array
    residual: Any = None
    pending: Any = None


def n_units(cfg: Config) -> int:
    return 1 + cfg.model.n_layers


def _is_spec(x) -> bool:
    return isinstance(x, P)


def init_outer_opt_state(opt: optax.GradientTransformation, params: Any, layerwise: bool = True) -> Any:
    """The outer optimizer's state per unit: the root's, and the stacked layers' (vmapped init);
    with ``layerwise=False`` (a whole-model rule over any pytree: the API, the exchange) of the whole tree."""
    if not layerwise:
        return opt.init(params)
    return {"root": opt.init(params["root"]), "layers": jax.vmap(opt.init)(params["layers"])}


def make_state(cfg: Config, plan: Plan, key: jax.Array, params: Any = None) -> TrainState:
    """A fresh state: every replica starts from the same params (``params``, or a random init);
    θ̄ = those params."""
    n = cfg.mesh.replica
    if params is None:
        params = model_family(cfg.model.family).init_params(cfg.model, key)
    rep = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), params)
    rule = plan.rule
    outer = None
    if rule.keeps_outer:
        outer = OuterState(params, init_outer_opt_state(make_outer_optimizer(plan.outer), params),
                           Detector.zeros((n, n_units(cfg)), cfg.sync.penalty.anomaly_warmup), jnp.int32(0),
                           rule.init_extra(rep))
    opt_state = inner_optimizer(cfg.optim, cfg.steps).init(rep)
    return TrainState(jnp.int32(0), rep, opt_state, outer, jax.random.key_data(jax.random.fold_in(key, 1)))


def state_shapes(cfg: Config) -> TrainState:
    """Shapes and dtypes of the state for ``cfg`` (no devices needed)."""
    return jax.eval_shape(partial(make_state, cfg, plan_for(cfg).plan), jax.random.key(0))


class StateLayout:
    """Every spec and sharding of the state for one (method plan, mesh), derived once.
    ``method_plan`` is ``methods.plan_for(cfg)``; ``.cfg`` (normalised), ``.plan`` and ``.schedule``
    are its."""

    def __init__(self, method_plan: MethodPlan, mesh: Mesh):
        cfg = method_plan.cfg
        self.cfg, self.plan, self.schedule, self.mesh = cfg, method_plan.plan, method_plan.schedule, mesh
        self.rule: SyncRule = self.plan.rule
        self.n, self.s = cfg.mesh.replica, cfg.mesh.shard
        self.inner_opt = inner_optimizer(cfg.optim, cfg.steps)
        self.outer_opt = make_outer_optimizer(self.plan.outer)
        abstract = jax.eval_shape(partial(model_family(cfg.model.family).init_params, cfg.model), jax.random.key(0))
        self.shard_dims = param_shard_dims(abstract, self.s)
        # FSDP dims as the hook sees each unit (a layer's params without their stacked axis).
        self.unit_dims = {"root": unit_dims(self.shard_dims["root"], False),
                          "layer": unit_dims(self.shard_dims["layers"], True)}
        self.param_specs = replica_specs(abstract, self.shard_dims)
        self.outer_over_replica = self.rule.keeps_outer and cfg.sync.outer_sharding == "replica_shard"
        if self.outer_over_replica:
            self._check_outer_divisible(abstract)
        self.outer_param_specs = outer_specs(abstract, self.shard_dims, self.outer_over_replica)
        self.state_specs = self._state_specs(abstract)
        self.state_shardings = named(mesh, self.state_specs)
        self.offload = self.rule.keeps_outer and cfg.sync.cpu_offload
        if self.rule.keeps_outer:
            # Where θ̄ and the outer optimizer state live while a step uses them (on the devices).
            o = self.state_specs.outer
            self.device_outer = named(mesh, {"params": o.params, "opt_state": o.opt_state})
        if self.offload:  # θ̄ and the outer optimizer state live in host memory between syncs
            host = lambda s: NamedSharding(mesh, s, memory_kind="pinned_host")
            outer = self.state_shardings.outer
            outer = outer.replace(params=jax.tree.map(host, self.state_specs.outer.params, is_leaf=_is_spec),
                                  opt_state=jax.tree.map(host, self.state_specs.outer.opt_state, is_leaf=_is_spec))
            self.state_shardings = self.state_shardings.replace(outer=outer)
        self.tokens_per_replica = cfg.batch_size // self.n * cfg.data.seq_len
        # What the rule's pure sync runs on (compression: the rule's wrapper sets it).
        self.sync_spec = SyncSpec(self.plan.penalty, self.plan.outer, self.outer_opt, cfg.model.n_layers, self.n,
                                  replica_dims={"root": self.unit_dims["root"], "layer": self.unit_dims["layer"]}
                                  if self.outer_over_replica else None,
                                  inner_opt_specs=self.state_specs.opt_state)

    def _check_outer_divisible(self, abstract):
        bad = [f"{jax.tree_util.keystr(path)} (dim {d} = {x.shape[d]})"
               for (path, x), d in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                                       jax.tree.leaves(self.shard_dims), strict=True)
               if x.shape[d] % (self.n * self.s)]
        if bad:
            raise ConfigError(f"config key 'sync.outer_sharding': 'replica_shard' needs each parameter's FSDP dim "
                              f"divisible by mesh.replica x mesh.shard = {self.n * self.s}; "
                              f"not so for {', '.join(bad)}")

    def _state_specs(self, abstract_params) -> TrainState:
        rep = jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.n,) + x.shape, x.dtype), abstract_params)
        opt_specs = _opt_specs(self.inner_opt, jax.eval_shape(self.inner_opt.init, rep), self.param_specs)
        outer = None
        if self.rule.keeps_outer:
            opt_abstract = jax.eval_shape(partial(init_outer_opt_state, self.outer_opt), abstract_params)
            outer_opt_specs = {u: _opt_specs(self.outer_opt, opt_abstract[u], self.outer_param_specs[u])
                               for u in ("root", "layers")}
            det = Detector(P(REPLICA), P(REPLICA), P(REPLICA), P(REPLICA))
            outer = OuterState(self.outer_param_specs, outer_opt_specs, det, P(),
                               self.rule.extra_specs(self.param_specs))
        return TrainState(P(), self.param_specs, opt_specs, outer, P())

    # -- states ---------------------------------------------------------------------------------

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state: the restore target of a checkpoint."""
        shapes = jax.eval_shape(partial(make_state, self.cfg, self.plan), jax.random.key(0))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                            self.state_shardings)

    def init_state(self, seed: int, params: Any = None) -> TrainState:
        """A fresh state from ``seed``; every worker and θ̄ start from ``params`` when given (full,
        θ̄-shaped, sharded like ``initial_params_shardings``: e.g. ``hf.load.initial_params`` for
        ``model.init_from``), else from the family's random init."""
        make = self.init_fn()
        return make(jax.random.key(seed)) if params is None else make(jax.random.key(seed), params)

    def init_fn(self):
        """The jitted ``(key[, params]) -> TrainState`` that ``init_state`` runs."""
        return jax.jit(partial(make_state, self.cfg, self.plan), out_shardings=self.state_shardings)

    def initial_params_shardings(self) -> tuple[Any, Any]:
        """(abstract params, shardings) of the starting params ``init_state`` accepts: θ̄-shaped,
        sharded over ``shard`` like θ̄, so no device holds a whole copy."""
        abstract = jax.eval_shape(partial(model_family(self.cfg.model.family).init_params, self.cfg.model),
                                  jax.random.key(0))
        return abstract, named(self.mesh, outer_specs(abstract, self.shard_dims))

    def outer_to_device(self, outer: OuterState) -> OuterState:
        """θ̄ and the outer optimizer state where a sync computes on them (inside jit)."""
        if not self.offload:
            return outer
        put = lambda x, s: jax.device_put(x, s)
        return outer.replace(params=jax.tree.map(put, outer.params, self.device_outer["params"]),
                             opt_state=jax.tree.map(put, outer.opt_state, self.device_outer["opt_state"]))

    def outer_to_home(self, outer: OuterState) -> OuterState:
        if not self.offload:
            return outer
        home = self.state_shardings.outer
        return outer.replace(params=jax.tree.map(jax.device_put, outer.params, home.params),
                             opt_state=jax.tree.map(jax.device_put, outer.opt_state, home.opt_state))

    # -- saved states of another shape ----------------------------------------------------------

    def abstract_state_of_format(self, fmt: int) -> TrainState:
        """The restore target of a checkpoint of state format ``fmt`` (1: ``outer.trace`` instead of
        ``opt_state``; 2: the rule's subtree as ``residual`` / ``pending`` fields), laid out like
        this run's state."""
        return as_format(self.abstract_state(), fmt, self.rule)

    def legacy_abstract_state(self) -> TrainState:
        """The restore target of a format-1 checkpoint."""
        return self.abstract_state_of_format(1)

    def upgrade(self, state: TrainState) -> TrainState:
        """A state restored in an older format (``abstract_state_of_format``) in this format."""
        if state.outer is None:
            return state
        if isinstance(state.outer, OuterStateV2):
            o = state.outer
            return state.replace(outer=OuterState(o.params, o.opt_state, o.detector, o.syncs,
                                                  self.rule.extra_from_format2(o.residual, o.pending)))
        if not isinstance(state.outer, LegacyOuterState):
            return state
        # Format 1: SGD momentum buffer only: the outer optimizer's state with that buffer as its
        # trace. Only the SGD/Nesterov outer optimizer had such a state.
        if self.plan.outer.name != "nesterov":
            raise ConfigError(f"config key 'sync.outer.optimizer': this checkpoint was written before outer "
                              f"optimizers were configurable and holds an SGD/Nesterov momentum buffer; resume it "
                              f"with sync.outer.optimizer=nesterov (got {self.plan.outer.name!r})")
        old = state.outer
        fresh = init_outer_opt_state(self.outer_opt, jax.tree.map(np.asarray, old.params))
        opt_state = {u: with_sgd_trace(fresh[u], old.trace[u]) for u in ("root", "layers")}
        return state.replace(outer=OuterState(old.params, opt_state, old.detector, old.syncs))

    upgrade_legacy = upgrade  # the name before format 3

    def elastic_state(self, host: TrainState, old_n: int) -> TrainState:
        """Maps a host state saved with ``old_n`` replicas onto this layout's N (same S): every
        replica restarts from θ̄ (EDIT.md, elasticity), the inner optimizer's moments become the
        mean of the old replicas', detectors of surviving workers are kept and new workers start
        fresh."""
        n, specs = self.n, self.state_specs

        def remap(x, spec, kind):
            if not spec or spec[0] != REPLICA:
                return x
            x = np.asarray(x)
            if kind == "detector":
                out = np.zeros((n,) + x.shape[1:], x.dtype)
                out[: min(n, old_n)] = x[: min(n, old_n)]
                return out
            return np.broadcast_to(x.mean(axis=0, keepdims=True).astype(x.dtype), (n,) + x.shape[1:])

        theta = host.outer.params if host.outer is not None else jax.tree.map(lambda x: np.asarray(x)[0], host.params)
        params = jax.tree.map(lambda t: np.broadcast_to(np.asarray(t), (n,) + np.shape(t)), theta)
        opt_state = jax.tree.map(lambda x, s: remap(x, s, "opt"), host.opt_state, specs.opt_state)
        outer = host.outer
        if outer is not None:
            outer = outer.replace(detector=jax.tree.map(lambda x, s: remap(x, s, "detector"), outer.detector,
                                                        specs.outer.detector))
            if outer.extra is not None:  # the rule's own subtree (error feedback, CO2's pending: per worker)
                outer = outer.replace(extra=self.rule.remap_extra(outer.extra, n))
        state = TrainState(host.step, params, opt_state, outer, host.rng)
        return put_host(state, self.state_shardings)


def put_host(tree: Any, shardings: Any) -> Any:
    """Host arrays (identical on every process) as arrays of ``shardings``, built per device: works
    for meshes that span several processes, where ``device_put`` of a host value may not."""
    def one(x, sh):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


def _opt_specs(opt: optax.GradientTransformation, opt_abstract: Any, param_specs: Any) -> Any:
    """Specs of an optax state: its param-shaped leaves like the params, the rest replicated."""
    return optax.tree_map_params(opt, lambda _, spec: spec, opt_abstract, param_specs,
                                 transform_non_params=lambda _: P(), is_leaf=_is_spec)


def state_shapes_of_format(cfg: Config, fmt: int) -> TrainState:
    """Shapes of a state of format ``fmt`` for ``cfg`` (host restores of older checkpoints, and the
    leaves their checksums were computed over)."""
    mp = plan_for(cfg)
    return as_format(state_shapes(cfg), fmt, mp.plan.rule)


def legacy_state_shapes(cfg: Config) -> TrainState:
    """Shapes of a format-1 state for ``cfg``."""
    return state_shapes_of_format(cfg, 1)


def as_format(state: TrainState, fmt: int, rule: SyncRule) -> TrainState:
    """``state`` (shapes or abstract arrays) as a checkpoint of format ``fmt`` holds it: 1 with the
    trace laid out like θ̄; 2 with the rule's subtree as ``residual`` / ``pending``; 3 as it is."""
    if state.outer is None or fmt >= STATE_FORMAT:
        return state
    o = state.outer
    if fmt == 1:
        return state.replace(outer=LegacyOuterState(o.params, o.params, o.detector, o.syncs))
    fields = rule.extra_as_format2(o.extra) if o.extra is not None else {}
    return state.replace(outer=OuterStateV2(o.params, o.opt_state, o.detector, o.syncs, **fields))


def with_residual_dtype(state: TrainState, dtype) -> TrainState:
    """``state`` (arrays or abstract ones, format 2 or 3) with its error-feedback residual in
    ``dtype`` (``sync.wire.residual_dtype``): a checkpoint is restored as it was written (its checksums are of
    those bytes), then cast to the config's dtype. No residual: ``state`` itself."""
    o, dtype = state.outer, jax.numpy.dtype(dtype)

    def cast(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)
    if isinstance(o, OuterStateV2) and o.residual is not None:
        return state.replace(outer=o.replace(residual=jax.tree.map(cast, o.residual)))
    if isinstance(o, OuterState) and isinstance(o.extra, dict) and "residual" in o.extra:
        return state.replace(outer=o.replace(extra={**o.extra, "residual": jax.tree.map(cast, o.extra["residual"])}))
    return state


__all__ = ["TrainState", "OuterState", "LegacyOuterState", "OuterStateV2", "StateLayout", "STATE_FORMAT", "make_state",
           "state_shapes", "put_host", "state_shapes_of_format", "legacy_state_shapes", "as_format",
           "init_outer_opt_state", "n_units", "with_residual_dtype"]
