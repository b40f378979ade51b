"""Evaluation: the mean validation token loss of the model a run has now.

The model is θ̄ after a fresh, uncommitted whole-model sync (EDIT.md, Algorithm 1 step 5: never
one worker's local params) once the outer state is live, and the replicas' (identical) params
before that (Baseline, synchronous warmup). Each batch's loss runs under ``shard_map`` on the
same mesh and layout as training, with the plain FSDP gather as the hook.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.sharding import BATCH_SPEC, REPLICA, SHARD, gather_unit
from edit_jax.localsgd.state import TrainState
from edit_jax.runtime.multihost import local_value


class Evaluator:
    """Compiled validation loss for one set of step programs (compiled once per kind of params)."""

    def __init__(self, programs: StepPrograms):
        self.m = programs
        self.schedule = programs.schedule
        self._compiled: dict[bool, object] = {}

    def loss_fn(self, over_outer: bool):
        """``(params, batch) -> mean token loss`` for per-replica params ([N, ...], each replica
        its rows of the batch) or for outer params θ̄ (no replica dim)."""
        if over_outer not in self._compiled:
            m, lay = self.m, self.m.layout
            cfg = m.cfg
            dtype = jnp.dtype(cfg.model.compute_dtype)
            dims = lay.unit_dims

            def body(params, batch):
                local = params if over_outer else jax.tree.map(lambda x: x[0], params)
                if over_outer and lay.outer_over_replica:  # θ̄ is split over replica too: reassemble
                    local = jax.tree.map(lambda x, d: jax.lax.all_gather(x, REPLICA, axis=d, tiled=True), local,
                                         {"root": dims["root"], "layers": lay.shard_dims["layers"]})
                fused = cfg.mesh.fused_gather
                hook = lambda unit, xs, which: (gather_unit(unit, dims[which], dtype, fused), None)
                if hasattr(m.model, "loss_sum"):  # chunked logits, as in training
                    total, _ = m.model.loss_sum(cfg.model, local, batch[:, :-1], batch[:, 1:], hook)
                else:
                    logits, _ = m.model.forward(cfg.model, local, batch[:, :-1], hook)
                    total = m.model.token_loss_sum(logits, batch[:, 1:])
                count = jnp.float32(batch.shape[0] * (batch.shape[1] - 1))
                return jax.lax.psum(total, (REPLICA, SHARD)) / jax.lax.psum(count, (REPLICA, SHARD))

            spec = lay.outer_param_specs if over_outer else lay.param_specs
            mapped = jax.shard_map(body, mesh=m.mesh, in_specs=(spec, BATCH_SPEC), out_specs=P())
            to_device = (lambda p: jax.device_put(p, lay.device_outer["params"])) if over_outer and lay.offload \
                else (lambda p: p)
            self._compiled[over_outer] = jax.jit(lambda p, b: mapped(to_device(p), b))
        return self._compiled[over_outer]

    def params_for(self, state: TrainState):
        """(params, over_outer): θ̄ after a fresh (uncommitted) sync, or the replicas' params while
        they are kept identical (Baseline, warmup)."""
        if state.outer is None or not self.schedule.outer_is_live(int(local_value(state.step))):
            return state.params, False
        synced, _ = self.m.sync_fn()(state)
        return synced.outer.params, True

    def __call__(self, state: TrainState, batches) -> float:
        params, over_outer = self.params_for(state)
        fn = self.loss_fn(over_outer)
        losses = [float(local_value(fn(params, self.m.put_batch(b)))) for b in batches]
        return sum(losses) / len(losses)


__all__ = ["Evaluator"]
