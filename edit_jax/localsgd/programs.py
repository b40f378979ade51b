"""The compiled step programs, all under ``shard_map`` over the (replica, shard) mesh: one
program per kind of step (the method's schedule, ``methods.py``, picks one per step):

- ``hsdp``: gradients averaged over ``shard`` and ``replica`` (Baseline; EDiT's warmup).
- ``local``: gradients averaged over ``shard`` only; nothing crosses ``replica``.
- ``sync_forward``: EDiT's sync step. Inside the scanned forward, each unit (root first, then layer
  by layer) is synced across replicas (outer.sync_unit) just before its FSDP gather; the gradient
  is taken at the synced params (the sync is the identity in the backward pass) and the inner
  AdamW update applies to them.
- ``local_then_sync``: a local step followed by a whole-model sync of every unit (DiLoCo, Post
  Local SGD, or EDiT with ``sync.layerwise=false``; CO2's one-round-stale sync).

The syncs are the method's sync rule's (``rule.py``: one module per kind of sync, pure functions
over a narrow ``SyncSpec``); this module asks the rule where it runs and puts its sync into the
step bodies, compiles and caches them. It never tests a method flag.

Streaming (``sync.fragments=F > 1``): the units are split into F contiguous groups
(``fragments.py``) and the two sync kinds carry the group, ``"sync_forward@f"`` and
``"local_then_sync@f"``: one compiled program per group, holding only that group's collectives
(the forward scans the layer stack segment by segment, the due segment with the sync hook).
With ``sync.wire.kind`` the pseudo gradients cross ``replica`` quantized (quantize.py).

Besides the steps: the initialising sync (θ̄ <- the replicas' params after warmup) and a whole-model
sync of a state (for evaluation on a fresh θ̄, and tests). The method's plan comes in computed
(``methods.plan_for``), layouts from ``state.StateLayout``; the model is reached only through its
family's forward-with-hook contract (``family.py``).

Loss normalisation: each device sums its tokens' losses and divides by the tokens of its replica,
so the sum over ``shard`` (what the all-gather's transpose does to the gradient) is the replica's
mean gradient; ``hsdp`` then averages over replicas.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec as P

from edit_jax.config import Config
from edit_jax.localsgd.fragments import fragment_layers, fragment_of_unit, unit_param_counts
from edit_jax.localsgd.methods import STEP_KINDS, MethodPlan, StepKind, plan_for
from edit_jax.localsgd.sharding import BATCH_SPEC, REPLICA, SHARD, gather_unit, named, shard_sq_norm
from edit_jax.localsgd.rule import Span
from edit_jax.localsgd.state import StateLayout, TrainState, init_outer_opt_state
from edit_jax.localsgd.sync import SYNC_METRICS, SYNC_SCOPE
from edit_jax.localsgd.xla_options import compiler_options
from edit_jax.models.family import HOOK_SAVED, SplitHook, model_family


class StepPrograms:
    """The compiled programs of one (method plan, mesh): one per kind of step, plus the
    initialising and whole-model syncs, compiled on first use. The steps are pure functions
    (the syncs are ``sync.py``'s); this class binds the static facts (the plan, the layout, the
    optimizers) and caches the compiled programs, so callers need not pass them around.

    ``method_plan`` is ``methods.plan_for(cfg)``, computed once by the caller: ``.cfg`` (normalised
    by the method table), ``.plan`` and ``.schedule`` are its. ``StepPrograms.for_config(cfg, mesh)``
    builds the plan for callers that start from a config (tests, scripts)."""

    def __init__(self, method_plan: MethodPlan, mesh: Mesh):
        if not isinstance(method_plan, MethodPlan):  # never normalise a caller's config behind its back
            raise TypeError(f"StepPrograms(method_plan, mesh): expected methods.plan_for(cfg), got "
                            f"{type(method_plan).__name__} (StepPrograms.for_config(cfg, mesh) builds the plan)")
        self.method_plan = method_plan
        self.cfg, self.plan, self.schedule = method_plan.cfg, method_plan.plan, method_plan.schedule
        self.mesh = mesh
        self.layout = lay = StateLayout(method_plan, mesh)
        self.n, self.s = lay.n, lay.s
        self.model = model_family(self.cfg.model.family)
        # The model config the steps trace with: model.attention resolved for the mesh's devices
        # (auto: cuDNN on GPUs), not for the process's default backend, which is the CPU when the
        # programs are compiled for a GPU target without one (``edit-jax plan --target``).
        # model.attention=cudnn off a GPU is an error here, before any work.
        self.model_cfg = self.cfg.model
        if hasattr(self.model, "attention_impl"):
            impl = self.model.attention_impl(self.cfg.model, mesh.devices.flat[0].platform)
            self.model_cfg = dataclasses.replace(self.cfg.model, attention=impl)
        # XLA options for the mesh's platform: on GPUs, a layer's sync in about four all-reduces
        # (xla_options.py: the widest window under the layer's compute); f32 per device
        platform = mesh.devices.flat[0].platform
        layer_sync = 4 * unit_param_counts(self.cfg)[1] // self.cfg.mesh.shard \
            if platform != "cpu" and self.cfg.model.n_layers else None
        self.compiler_options = compiler_options(platform, layer_sync_bytes=layer_sync)
        # The layer loop issues each layer's sync one layer ahead (family.SplitHook) on GPUs only:
        # XLA:CPU runs independent collectives concurrently and their rendezvous collide. A test
        # may set it on a one-device mesh (no collective), before the first step is compiled.
        self.pipelined_layers = platform == "gpu"
        self.state_specs, self.state_shardings = lay.state_specs, lay.state_shardings
        # Streaming sync: group of each unit (None: one group, every unit syncs together).
        self.rule = lay.rule  # the method's sync rule (rule.py): every sync below is its
        self.groups = fragment_of_unit(self.cfg) if self.rule.keeps_outer and self.cfg.sync.fragments > 1 else None
        self._compiled: dict[Any, Any] = {}

    @classmethod
    def for_config(cls, cfg: Config, mesh: Mesh) -> "StepPrograms":
        """``StepPrograms(methods.plan_for(cfg), mesh)``: for tests and scripts that hold a config."""
        return cls(plan_for(cfg), mesh)

    def abstract_state(self) -> TrainState:
        return self.layout.abstract_state()

    def init_state(self, seed: int, params: Any = None) -> TrainState:
        return self.layout.init_state(seed, params)

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
            syncs_here = kind.syncs
            specs = self.state_specs if syncs_here else self.state_specs.replace(outer=None)
            metric_specs = {"loss": P(REPLICA), "grad_norm": P(REPLICA)}
            if syncs_here:
                metric_specs.update({k: P() for k in SYNC_METRICS})
            mapped = jax.shard_map(partial(self.local_step, kind=kind), mesh=self.mesh,
                                   in_specs=(specs, BATCH_SPEC, P()), out_specs=(specs, metric_specs))

            def step(state: TrainState, batch, shares=None):
                """``shares`` ([N], A-EDiT syncs only): each worker's share of the steps since the
                last sync, mixed into the sync weights (outer.mix_step_weights)."""
                if not syncs_here:  # the outer state does not enter local steps at all
                    new, metrics = mapped(state.replace(outer=None), batch, shares)
                    return new.replace(outer=state.outer), metrics
                new, metrics = mapped(state.replace(outer=self.layout.outer_to_device(state.outer)), batch, shares)
                return new.replace(outer=self.layout.outer_to_home(new.outer)), metrics

            self._compiled[kind] = jax.jit(step, donate_argnums=0, out_shardings=(self.state_shardings, None),
                                           compiler_options=self.compiler_options or None)
        return self._compiled[kind]

    def grads_fn(self, sync_over_replica: bool):
        """``(state, batch) -> (mean loss, per-replica grads)`` of the step's gradient path (for
        tests: the gradient an "hsdp" (True) or "local" (False) step hands to the optimizer)."""
        key = f"grads_{sync_over_replica}"
        if key not in self._compiled:
            specs = self.state_specs.replace(outer=None)

            def body(state, batch):
                k = self.cfg.optim.grad_accum
                micro = batch.reshape(k, batch.shape[0] // k, batch.shape[1])
                (loss, _), grads = self._loss_and_grads(state.params, micro[0])
                if k > 1:
                    loss, grads = self._accumulated(state.params, micro[1:], loss, grads)
                loss = jax.lax.pmean(jax.lax.psum(loss, SHARD), REPLICA)
                if sync_over_replica:
                    grads = jax.tree.map(lambda g: jax.lax.pmean(g, REPLICA), grads)
                return loss, grads

            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, BATCH_SPEC),
                                   out_specs=(P(), self.layout.param_specs))
            self._compiled[key] = jax.jit(lambda st, b: mapped(st.replace(outer=None), b))
        return self._compiled[key]

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        """The global batch's shape, dtype and sharding (``put_batch``'s result, without data)."""
        shape = (self.cfg.batch_size, self.cfg.data.seq_len + 1)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=named(self.mesh, BATCH_SPEC))

    def lowered(self, kind: StepKind | str, state=None, batch=None):
        """The lowered (not executed) step ``kind``, for HLO inspection, memory analysis and
        compile timing (``.compile()``): the public lowering entry point. ``state`` and ``batch``
        may be real arrays or shapes (``jax.ShapeDtypeStruct``); left out, the abstract state and
        batch of this config (``abstract_state``, ``abstract_batch``): nothing is allocated."""
        state = self.abstract_state() if state is None else state
        return self.step_fn(kind).lower(state, self.abstract_batch() if batch is None else batch)

    # -- the step body (per device, under shard_map) ---------------------------------------------

    def _span(self, kind: StepKind) -> Span | None:
        """The units a sync of ``kind`` covers: its fragment group's, or None (every unit)."""
        return fragment_layers(self.groups, kind.group) if kind.group is not None else None

    def _loss_and_grads(self, params, batch, hook_xs=None, segments=None, shares=None):
        """``((loss, ys), grads)`` of this device's tokens. Every unit passes the hook on its way
        into compute: a unit with sync inputs in ``hook_xs`` is synced first (the rule's ``in_forward_sync``;
        ``ys`` holds its result), then every unit is FSDP-gathered over ``shard``."""
        cfg, lay = self.cfg, self.layout
        dtype = jnp.dtype(cfg.model.compute_dtype)
        fused = cfg.mesh.fused_gather

        def sync_part(unit, xs, which):
            res = None
            if xs is not None:  # xs None: no sync in this step, or a unit outside the due group
                with jax.named_scope(SYNC_SCOPE):  # the profile files these ops under "sync"
                    unit, res = self.rule.in_forward_sync(unit, xs, which, lay.sync_spec, shares)
                # The synced unit's shard, in the compute dtype, is kept for the backward (the
                # model's remat saves HOOK_SAVED): recomputing it would run the sync's all-reduce
                # across `replica` again. The gather within `shard` after it is still recomputed.
                unit = checkpoint_name(jax.tree.map(lambda x: x.astype(dtype), unit), HOOK_SAVED)
            return unit, res

        def gather_part(unit, which):
            return gather_unit(unit, lay.unit_dims[which], dtype, fused)

        # On GPUs in two halves, so that the family issues a layer's sync one layer ahead of its
        # gather and compute, where the all-reduce can overlap the previous layer (family.SplitHook;
        # docs/developer/gpu-program.md). Not on XLA:CPU (``pipelined_layers``).
        hook = SplitHook(sync_part, gather_part)
        if not self.pipelined_layers:
            hook = hook.__call__

        def loss_fn(params):
            local = jax.tree.map(lambda x: x[0], params)  # drop the (size 1) local replica dim
            mcfg = self.model_cfg
            if hasattr(self.model, "loss_sum"):  # the family computes the loss itself (chunked logits)
                total, ys = self.model.loss_sum(mcfg, local, batch[:, :-1], batch[:, 1:], hook, hook_xs, segments)
            else:
                logits, ys = self.model.forward(mcfg, local, batch[:, :-1], hook, hook_xs, segments)
                total = self.model.token_loss_sum(logits, batch[:, 1:])
            return total / lay.tokens_per_replica, ys

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    def _accumulated(self, params, micro_batches, loss, grads):
        """``(loss, grads)`` plus those of each micro-batch of ``micro_batches`` [k, rows, T+1]
        at ``params`` (no sync), one micro-batch's activations alive at a time (a scan). Each
        micro-batch's loss is already divided by the replica's whole token count: the sums are the
        whole batch's loss and gradient."""
        def body(carry, micro):
            total, acc = carry
            (micro_loss, _), g = self._loss_and_grads(params, micro)
            return (total + micro_loss, jax.tree.map(jnp.add, acc, g)), None

        (loss, grads), _ = jax.lax.scan(body, (loss, grads), micro_batches)
        return loss, grads

    def local_step(self, state: TrainState, batch: jax.Array, shares=None, *, kind: StepKind | str):
        """One step of ``kind`` on this device's blocks: forward and backward (EDiT's sync inside
        the forward for ``sync_forward``), the gradient mean over replicas for ``hsdp``, the inner
        AdamW update, and the sync after it for ``local_then_sync``.

        The per-device body ``step_fn`` maps over the mesh; public for experiments that build
        their own program from it (``benchmarks/bench_step.py``: one program for both of EDiT's
        kinds). Call it under ``jax.shard_map(mesh=self.mesh)`` with in_specs ``(state_specs,
        BATCH_SPEC, P())`` (a kind without a sync: ``state_specs.replace(outer=None)`` and a state
        whose ``outer`` is None) and out_specs ``(state specs, {"loss": P(REPLICA), "grad_norm":
        P(REPLICA)}`` plus ``P()`` for each of ``SYNC_METRICS`` when the kind syncs)."""
        kind = StepKind.parse(kind)
        lay, span, rule = self.layout, self._span(kind), self.rule
        sync_in_forward = kind.name == "sync_forward"
        hook_xs, segments = rule.forward_inputs(state.outer, lay.sync_spec, span) if sync_in_forward else (None, None)
        # Gradient accumulation (optim.grad_accum = k): this device's rows as k micro-batches. The
        # first carries EDiT's sync in its forward, exactly once per step as without accumulation;
        # the others then run at the synced params (θ̄ for the synced units), which is what the
        # first micro-batch's forward used too, so the summed gradient is the whole batch's.
        k = self.cfg.optim.grad_accum
        micro = batch.reshape(k, batch.shape[0] // k, batch.shape[1]) if k > 1 else batch[None]
        (loss, ys), grads = self._loss_and_grads(state.params, micro[0], hook_xs, segments, shares)
        params, outer, opt_state, metrics = state.params, state.outer, state.opt_state, {}
        if sync_in_forward:  # the synced units' params are θ̄: the inner update applies to them
            with jax.named_scope(SYNC_SCOPE):
                params, outer, opt_state, metrics, _ = rule.assemble(params, outer, opt_state, ys, lay.sync_spec, span)
        if k > 1:
            loss, grads = self._accumulated(params, micro[1:], loss, grads)
        if kind.name == "hsdp":
            grads = jax.tree.map(lambda g: jax.lax.pmean(g, REPLICA), grads)
        grad_norm = jnp.sqrt(shard_sq_norm(grads))
        updates, opt_state = lay.inner_opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if kind.name == "local_then_sync":
            with jax.named_scope(SYNC_SCOPE):  # the rule's sync after the step (CO2: last round's exchange)
                params, outer, opt_state, metrics, _ = rule.after_step(params, outer, opt_state, lay.sync_spec, shares,
                                                                       span)
        # Per-replica figures leave the step sharded over `replica` ([N] globally) and are averaged
        # on the host: a pmean here would put an all-reduce across replicas into every local step.
        metrics.update(loss=jax.lax.psum(loss, SHARD)[None], grad_norm=grad_norm[None])
        return TrainState(state.step + 1, params, opt_state, outer, state.rng), metrics

    # -- outside the step --------------------------------------------------------------------------

    def init_outer_fn(self):
        """θ̄ <- the replicas' params (identical after synchronous warmup), outer optimizer state
        <- fresh. The first sync of EDIT.md (k == W): it changes no parameter."""
        if "init_outer" not in self._compiled:
            def body(state: TrainState):
                theta = jax.tree.map(lambda x: x[0], state.params)
                outer = state.outer.replace(params=theta, opt_state=init_outer_opt_state(self.layout.outer_opt, theta))
                if outer.extra is not None:  # the rule's own subtree (CO2: nothing in flight yet)
                    outer = outer.replace(extra=self.rule.reset_extra(outer.extra))
                return state.replace(outer=outer)

            self._compiled["init_outer"] = jax.jit(body, out_shardings=self.state_shardings, donate_argnums=0)
        return self._compiled["init_outer"]

    def sync_fn(self):
        """A whole-model sync of ``state`` (not donated): for evaluation on a fresh θ̄ and for tests."""
        if "sync" not in self._compiled:
            def body(state: TrainState):  # CO2: the model once the last all-reduce has landed
                params, outer, metrics, _ = self.rule.flush(state.params, state.outer, self.layout.sync_spec)
                return state.replace(params=params, outer=outer), metrics

            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(self.state_specs,),
                                   out_specs=(self.state_specs, P()))

            def sync_state(state: TrainState):
                new, metrics = mapped(state.replace(outer=self.layout.outer_to_device(state.outer)))
                return new.replace(outer=self.layout.outer_to_home(new.outer)), metrics

            self._compiled["sync"] = jax.jit(sync_state, out_shardings=(self.state_shardings, None))
        return self._compiled["sync"]


__all__ = ["StepPrograms", "STEP_KINDS", "SYNC_METRICS"]
