"""The compiled steps, all under ``shard_map`` over the (replica, shard) mesh.

One machinery, several kinds of step (the method's schedule, ``methods.py``, picks one per step):

- ``hsdp``: gradients averaged over ``shard`` and ``replica`` (Baseline; EDiT's warmup).
- ``local``: gradients averaged over ``shard`` only; nothing crosses ``replica``.
- ``sync_forward``: EDiT's sync step. Inside the scanned forward, each unit (root first, then layer
  by layer) is synced across replicas (outer.sync_unit) just before its FSDP gather; the gradient
  is taken at the synced params (the sync is the identity in the backward pass) and the inner
  AdamW update applies to them.
- ``local_then_sync``: a local step followed by a whole-model sync of every unit (DiLoCo, Post
  Local SGD, or EDiT with ``sync.layerwise=false``).

Streaming (``sync.fragments=F > 1``): the units are split into F contiguous groups
(``fragments.py``) and the two sync kinds carry the group, ``"sync_forward@f"`` and
``"local_then_sync@f"``: one compiled program per group, holding only that group's collectives
(the forward scans the layer stack segment by segment, the due segment with the sync hook).
With ``sync.compress`` the pseudo gradients cross ``replica`` quantized (compress.py).

Besides the steps: the initialising sync (θ̄ <- the replicas' params after warmup) and a whole-model
sync of a state (for evaluation on a fresh θ̄, and tests). Layouts come from ``state.StateLayout``;
the model is reached only through its family's forward-with-hook contract (``family.py``).

Loss normalisation: each device sums its tokens' losses and divides by the tokens of its replica,
so the sum over ``shard`` (what the all-gather's transpose does to the gradient) is the replica's
mean gradient; ``hsdp`` then averages over replicas.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from edit_jax.config import Config
from edit_jax.family import model_family
from edit_jax.fragments import fragment_layers, fragment_of_unit
from edit_jax.methods import STEP_KINDS, StepKind, plan_for
from edit_jax.outer import sgd_trace, stale_outer_step, sync_unit
from edit_jax.profile import SYNC_SCOPE
from edit_jax.sharding import BATCH_SPEC, REPLICA, SHARD, gather_unit, named, replica_gather, shard_sq_norm
from edit_jax.state import OuterState, StateLayout, TrainState, init_outer_opt_state

# Sync figures (identical on every device); "loss" and "grad_norm" come back per replica, [N].
SYNC_METRICS = ("pseudo_grad_norm", "unit_pseudo_grad_norm", "weight", "unit_weight", "flagged", "unit_flagged",
                "clip_factor", "unit_clip_factor", "outer_update_norm", "inner_reset")


def _is_spec(x) -> bool:
    return isinstance(x, P)


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


class Machinery:
    """Compiles and holds the steps for one (config, mesh). Pure functions inside; this class only
    binds the static facts (the layout, the optimizers) so callers need not pass them around."""

    def __init__(self, cfg: Config, mesh: Mesh):
        self.layout = StateLayout(cfg, mesh)
        lay = self.layout
        self.cfg, self.mesh, self.plan = lay.cfg, mesh, lay.plan  # cfg: normalised by the method table
        self.n, self.s = lay.n, lay.s
        self.model = model_family(self.cfg.model.family)
        self.state_specs, self.state_shardings = lay.state_specs, lay.state_shardings
        self.compress = self.cfg.sync.compress
        # Streaming sync: group of each unit (None: one group, every unit syncs together).
        self.groups = fragment_of_unit(self.cfg) if self.plan.uses_outer and self.cfg.sync.fragments > 1 else None
        self._compiled: dict[str, Any] = {}
        self.schedule = plan_for(self.cfg).schedule  # TODO(merge): from the MethodPlan passed in

    @classmethod
    def for_config(cls, cfg: Config, mesh: Mesh) -> "Machinery":
        return cls(cfg, mesh)

    def abstract_state(self) -> TrainState:
        return self.layout.abstract_state()

    def init_state(self, seed: int) -> TrainState:
        return self.layout.init_state(seed)

    def put_batch(self, batch):
        """A global batch [B, T+1] (host array, the same on every process) on the mesh, rows of
        replica r on replica r's devices. Built from per-device slices, so it also works when the
        mesh spans several processes."""
        batch = np.asarray(batch)
        return jax.make_array_from_callback(batch.shape, named(self.mesh, BATCH_SPEC), lambda idx: batch[idx])

    # -- the compiled steps -----------------------------------------------------------------------

    def step_fn(self, kind: StepKind | str):
        """The jitted step ``(state, batch) -> (state, metrics)`` of ``kind`` (compiled once); a
        string is parsed (``"local"``, ``"sync_forward@2"``)."""
        kind = StepKind.parse(kind)
        if (kind.group is not None) != (self.groups is not None and kind.syncs) \
                or (kind.group is not None and not kind.group < self.cfg.sync.fragments):
            raise ValueError(f"step kind {str(kind)!r} does not fit this config: expected one of {STEP_KINDS} (sync "
                             f"kinds with '@f', 0 <= f < sync.fragments, when sync.fragments > 1)")
        if kind not in self._compiled:
            uses_outer_here = kind.syncs
            specs = self.state_specs if uses_outer_here else self.state_specs.replace(outer=None)
            metric_specs = {"loss": P(REPLICA), "grad_norm": P(REPLICA)}
            if uses_outer_here:
                metric_specs.update({k: P() for k in SYNC_METRICS})
            mapped = jax.shard_map(partial(self._local_step, kind=kind), mesh=self.mesh,
                                   in_specs=(specs, BATCH_SPEC, P()), out_specs=(specs, metric_specs))

            def step(state: TrainState, batch, shares=None):
                """``shares`` ([N], A-EDiT syncs only): each worker's share of the steps since the
                last sync, mixed into the sync weights (outer.mix_step_weights)."""
                if not uses_outer_here:  # the outer state does not enter local steps at all
                    new, metrics = mapped(state.replace(outer=None), batch, shares)
                    return new.replace(outer=state.outer), metrics
                new, metrics = mapped(state.replace(outer=self.layout.outer_to_device(state.outer)), batch, shares)
                return new.replace(outer=self.layout.outer_to_home(new.outer)), metrics

            self._compiled[kind] = jax.jit(step, donate_argnums=0, out_shardings=(self.state_shardings, None))
        return self._compiled[kind]

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

            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, BATCH_SPEC), out_specs=(P(), self.layout.param_specs))
            self._compiled[key] = jax.jit(lambda st, b: mapped(st.replace(outer=None), b))
        return self._compiled[key]

    def lowered(self, kind: StepKind | str, state, batch):
        """The lowered (not executed) step, for HLO inspection and memory analysis."""
        return self.step_fn(kind).lower(state, batch)

    def _local_step(self, state: TrainState, batch: jax.Array, shares=None, *, kind: StepKind | str):
        cfg, plan = self.cfg, self.plan
        inputs, targets = batch[:, :-1], batch[:, 1:]
        dtype = jnp.dtype(cfg.model.compute_dtype)
        dims_of = self.layout.unit_dims
        fused = cfg.mesh.fused_gather
        # "grads_only" (grads_fn): the gradient path alone; else a StepKind, by name from here on
        kind, group = (kind, None) if kind == "grads_only" else (StepKind.parse(kind).name, StepKind.parse(kind).group)
        sync_in_forward = kind == "sync_forward"

        def hook(unit, xs, which):
            if not sync_in_forward or xs is None:  # xs None: a unit outside the due group
                return gather_unit(unit, dims_of[which], dtype, fused), None
            outer_p, opt_st, det, *residual = xs
            rdims = dims_of[which] if self.layout.outer_over_replica else None
            with jax.named_scope(SYNC_SCOPE):  # the profile files these ops under "sync"
                res = sync_unit(jax.lax.stop_gradient(unit), outer_p, opt_st, det, plan.penalty,
                                self.layout.outer_opt, rdims, shares, self.compress, residual[0] if residual else None)
                synced = _with_value(unit, _varying(res.params))
            return gather_unit(synced, dims_of[which], dtype, fused), res

        hook_xs = None
        if sync_in_forward:
            o = state.outer
            det = jax.tree.map(lambda x: x[0], o.detector)  # this replica's detectors: [U, ...]
            hook_xs = {"root": (o.params["root"], o.opt_state["root"], jax.tree.map(lambda x: x[0], det)),
                       "layers": (o.params["layers"], o.opt_state["layers"], jax.tree.map(lambda x: x[1:], det))}
            if o.residual is not None:
                res = jax.tree.map(lambda x: x[0], o.residual)
                hook_xs = {k: v + (res[k],) for k, v in hook_xs.items()}
        segments = None
        if sync_in_forward and group is not None:
            hook_xs, segments = self._group_xs(hook_xs, group)

        def loss_fn(params):
            local = jax.tree.map(lambda x: x[0], params)  # drop the (size 1) local replica dim
            logits, ys = self.model.forward(cfg.model, local, inputs, hook, hook_xs, segments)
            return self.model.token_loss_sum(logits, targets) / self.layout.tokens_per_replica, ys

        (loss, ys), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        if kind == "hsdp":
            grads = jax.tree.map(lambda g: jax.lax.pmean(g, REPLICA), grads)
        if kind == "grads_only":
            return jax.lax.pmean(jax.lax.psum(loss, SHARD), REPLICA), grads
        metrics = {}
        params, outer = state.params, state.outer
        opt_state = state.opt_state
        with jax.named_scope(SYNC_SCOPE):
            if sync_in_forward and group is not None:
                _, lo, hi = fragment_layers(self.groups, group)
                params, outer, metrics = self._assemble_group_sync(state.params, state.outer, ys["root"],
                                                                   ys["layers"][1] if hi > lo else None, lo, hi)
                opt_state, metrics["inner_reset"] = self._reset_nonfinite_workers(opt_state, metrics)
            elif sync_in_forward:
                params, outer, metrics = self._assemble_sync(state, ys["root"], ys["layers"])
                opt_state, metrics["inner_reset"] = self._reset_nonfinite_workers(opt_state, metrics)
        grad_norm = jnp.sqrt(shard_sq_norm(grads))
        updates, opt_state = self.layout.inner_opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        with jax.named_scope(SYNC_SCOPE):
            if kind == "local_then_sync" and plan.stale:
                params, outer, metrics = self._sync_stale(params, outer)
            elif kind == "local_then_sync":
                params, outer, metrics = self._sync_whole(params, outer, shares, group)
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
        residual = None
        if root.residual is not None:
            residual = jax.tree.map(lambda x: x[None], _varying({"root": root.residual, "layers": layers.residual}))
        outer = OuterState({"root": root.outer_params, "layers": layers.outer_params},
                           {"root": root.opt_state, "layers": layers.opt_state}, det, state.outer.syncs + 1, residual)
        unit_metrics = jax.tree.map(cat, root.metrics, layers.metrics)
        return params, outer, self._sync_metrics(unit_metrics)

    def _group_xs(self, hook_xs, group: int):
        """The forward's inputs for a sync of fragment ``group`` only: the root's sync inputs if the
        root is in the group (else None: it is only gathered), and the layer segments
        [before, group, after] with the group's slice of the per-layer sync inputs."""
        root_in, lo, hi = fragment_layers(self.groups, group)
        n_layers = self.cfg.model.n_layers
        layer_xs = jax.tree.map(lambda x: x[lo:hi], hook_xs["layers"])
        segments = [(lo, None), (hi - lo, layer_xs if hi > lo else None), (n_layers - hi, None)]
        return {"root": hook_xs["root"] if root_in else None, "layers": None}, segments

    def _assemble_group_sync(self, params, outer: OuterState, root, layers, lo: int, hi: int):
        """Like ``_assemble_sync`` for a sync of one fragment: the root's result (or None when the
        root is not in the group) and the stacked results of layers [lo, hi) (None if no layer) are
        written over the state's values; every other unit keeps its local params and outer state."""
        def put(full, part):  # [L, ...] with rows [lo, hi) replaced
            return full if part is None else full.at[lo:hi].set(part.astype(full.dtype))

        def merge(full, root_new, layers_new):
            return {"root": full["root"] if root is None else root_new,
                    "layers": jax.tree.map(put, full["layers"], layers_new) if layers is not None else full["layers"]}

        pick = lambda r, name: getattr(r, name) if r is not None else None  # noqa: E731
        local = jax.tree.map(lambda x: x[0], params)
        new_params = jax.tree.map(lambda x: x[None], _varying(merge(local, pick(root, "params"), pick(layers, "params"))))
        det = jax.tree.map(lambda x: x[0], outer.detector)  # [U, ...]
        if root is not None:
            det = jax.tree.map(lambda full, r: full.at[0].set(r), det, root.detector)
        if layers is not None:
            det = jax.tree.map(lambda full, l: full.at[1 + lo:1 + hi].set(l), det, layers.detector)
        residual = outer.residual
        if residual is not None:
            residual = jax.tree.map(lambda x: x[None], _varying(merge(jax.tree.map(lambda x: x[0], residual),
                                                                      pick(root, "residual"), pick(layers, "residual"))))
        new_outer = OuterState(merge(outer.params, pick(root, "outer_params"), pick(layers, "outer_params")),
                               merge(outer.opt_state, pick(root, "opt_state"), pick(layers, "opt_state")),
                               jax.tree.map(lambda x: x[None], det), outer.syncs + (1 if root is not None else 0),
                               residual)
        parts = [r.metrics for r in (root, layers) if r is not None]
        if root is not None:
            parts[0] = jax.tree.map(lambda x: x[None], parts[0])
        unit_metrics = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)
        return new_params, new_outer, self._sync_metrics(unit_metrics)

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

    def _sync_whole(self, params, outer: OuterState, shares=None, group: int | None = None):
        """Syncs every unit after the step: the root, then the layers one by one (a scan, so that
        the per-unit numerics are those of the layer-wise sync). With ``group``: only the units of
        that fragment (streaming sync)."""
        local = jax.tree.map(lambda x: x[0], params)
        det = jax.tree.map(lambda x: x[0], outer.detector)
        over = self.layout.outer_over_replica
        root_dims = self.layout.unit_dims["root"] if over else None
        layer_dims = self.layout.unit_dims["layer"] if over else None
        one = partial(sync_unit, p=self.plan.penalty, opt=self.layout.outer_opt, shares=shares, compress=self.compress)
        res = jax.tree.map(lambda x: x[0], outer.residual) if outer.residual is not None else None
        root_in, lo, hi = fragment_layers(self.groups, group) if group is not None else (True, 0, self.cfg.model.n_layers)
        root = None
        if root_in:
            root = one(local["root"], outer.params["root"], outer.opt_state["root"], jax.tree.map(lambda x: x[0], det),
                       replica_dims=root_dims, residual=res["root"] if res is not None else None)

        def body(_, xs):
            *xs, r = xs
            return None, one(*xs, replica_dims=layer_dims, residual=r)

        cut = (lambda x: x[lo:hi]) if group is not None else (lambda x: x)  # noqa: E731
        layers = None
        if hi > lo:
            _, layers = jax.lax.scan(body, None, jax.tree.map(cut, (
                local["layers"], outer.params["layers"], outer.opt_state["layers"], jax.tree.map(lambda x: x[1:], det),
                res["layers"] if res is not None else None)))
        if group is not None:
            return self._assemble_group_sync(params, outer, root, layers, lo, hi)
        state_like = TrainState(None, None, None, outer, None)
        return self._assemble_sync(state_like, root, layers)

    def _sync_stale(self, params, outer: OuterState, flush: bool = False):
        """CO2's sync after the round's last step (CO2.md section 1): the outer update consumes the
        pseudo gradients every worker sent at the *previous* sync (``outer.pending``), so their
        all-reduce does not depend on this round's steps and a GPU can run it while they compute;
        then each worker's new pending is a_t - x^i_t, and every worker restarts from a_{t+1}.
        The inner optimizer states stay local (CO2 never averages or resets them).

        ``flush``: the update of the last round's pending only (for evaluation: the model after
        the final all-reduce lands); the pending is kept as it was.

        Unit by unit like the other syncs (root; layers vmapped with their per-unit outer state),
        so the figures are per unit; one all-reduce of the whole pending tree first."""
        n, opt, lam = self.n, self.layout.outer_opt, self.plan.gap_penalty
        local = jax.tree.map(lambda x: x[0], params)
        pending = jax.tree.map(lambda x: x[0], outer.pending)
        # The exchange, one all-reduce over `replica`: the pending pseudo gradients and, in slot r
        # of an [N, U] table, worker r's per-unit squared norms of its block. It reads only what
        # the last sync left in the state. Nothing else crosses `replica` in this program, so XLA's
        # all-reduce combiner cannot tie it to a value of this round (it once merged the norms'
        # psum over `shard` with the step's gradient norm, making the exchange wait for the step).
        slot = jax.nn.one_hot(jax.lax.axis_index(REPLICA), n, dtype=jnp.float32)[:, None] > 0
        table = jnp.where(slot, self._unit_sq_sums(pending)[None, :], 0.0)  # where: NaN * 0 is NaN
        pending_sum, table = jax.lax.psum((pending, table), REPLICA)
        sent = jnp.sqrt(jax.lax.psum(table, SHARD)).T  # [U, N]: each worker's stale pseudo gradient
        one = lambda ps, lo, op, st: stale_outer_step(ps, n, lo, op, st, opt, lam)  # noqa: E731
        root = one(pending_sum["root"], local["root"], outer.params["root"], outer.opt_state["root"])
        layers = jax.vmap(one)(pending_sum["layers"], local["layers"], outer.params["layers"],
                               outer.opt_state["layers"])
        new_outer = {"root": root[0], "layers": layers[0]}
        new_opt = {"root": root[1], "layers": layers[1]}

        unit_norms = lambda tree: jnp.sqrt(jax.lax.psum(self._unit_sq_sums(tree), SHARD))  # noqa: E731
        clip = jnp.ones(sent.shape[0], jnp.float32)
        if self.plan.outer.momentum_clip > 0:  # how much of the momentum survived the clamp, per unit
            beta = self.plan.outer.momentum
            old_m = {u: sgd_trace(outer.opt_state[u]) for u in ("root", "layers")}
            g = {"root": root[3], "layers": layers[3]}  # Delta_{t-1} / Lambda_t
            raw = jax.tree.map(lambda g, m: g + beta * m, g, old_m)
            new_m = {u: sgd_trace(new_opt[u]) for u in ("root", "layers")}
            raw_norm = unit_norms(raw)
            clip = jnp.where(raw_norm > 0, unit_norms(new_m) / jnp.where(raw_norm > 0, raw_norm, 1.0), 1.0)
        unit = {"pseudo_grad_norm": sent, "weight": jnp.full_like(sent, 1.0 / n),
                "flagged": jnp.zeros(sent.shape, bool), "clip_factor": clip,
                "update_norm": unit_norms(jax.tree.map(lambda a, b: a - b, new_outer, outer.params))}
        new_pending = outer.pending if flush else jax.tree.map(
            lambda x: x[None], {"root": root[2], "layers": layers[2]})
        new_params = jax.tree.map(lambda x: x[None], _varying(new_outer))
        new_state = outer.replace(params=new_outer, opt_state=new_opt, syncs=outer.syncs + 1, pending=new_pending)
        metrics = self._sync_metrics(unit)
        # CO2 has no anomaly handling, so nothing to roll back (and no flag exchange over `replica`).
        metrics["inner_reset"] = jnp.zeros((n,), bool)
        return new_params, new_state, metrics

    @staticmethod
    def _unit_sq_sums(tree) -> jax.Array:
        """[U]: this device's sum of squares of the root unit's blocks, then of each layer's."""
        root = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree["root"]))
        layers = sum(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
                     for x in jax.tree.leaves(tree["layers"]))
        return jnp.concatenate([jnp.reshape(root, (1,)), layers])

    # -- outside the step --------------------------------------------------------------------------

    def init_outer_fn(self):
        """θ̄ <- the replicas' params (identical after synchronous warmup), outer optimizer state
        <- fresh. The first sync of EDIT.md (k == W): it changes no parameter."""
        if "init_outer" not in self._compiled:
            def body(state: TrainState):
                theta = jax.tree.map(lambda x: x[0], state.params)
                outer = state.outer.replace(params=theta, opt_state=init_outer_opt_state(self.layout.outer_opt, theta))
                if outer.pending is not None:  # CO2: nothing in flight yet (Delta_{-1} = 0)
                    outer = outer.replace(pending=jax.tree.map(jnp.zeros_like, outer.pending))
                return state.replace(outer=outer)

            self._compiled["init_outer"] = jax.jit(body, out_shardings=self.state_shardings, donate_argnums=0)
        return self._compiled["init_outer"]

    def sync_fn(self):
        """A whole-model sync of ``state`` (not donated): for evaluation on a fresh θ̄ and for tests."""
        if "sync" not in self._compiled:
            def body(state: TrainState):
                if self.plan.stale:  # CO2: the model once the last all-reduce has landed (a flush)
                    params, outer, metrics = self._sync_stale(state.params, state.outer, flush=True)
                else:
                    params, outer, metrics = self._sync_whole(state.params, state.outer)
                return state.replace(params=params, outer=outer), metrics

            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(self.state_specs,),
                                   out_specs=(self.state_specs, P()))

            def sync(state: TrainState):
                new, metrics = mapped(state.replace(outer=self.layout.outer_to_device(state.outer)))
                return new.replace(outer=self.layout.outer_to_home(new.outer)), metrics

            self._compiled["sync"] = jax.jit(sync, out_shardings=(self.state_shardings, None))
        return self._compiled["sync"]


__all__ = ["Machinery", "STEP_KINDS", "SYNC_METRICS"]
