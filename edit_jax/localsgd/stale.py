"""CO2's one-round-stale sync (``StaleSync``; Sun et al., ICLR 2024; docs/design/CO2.md).

The all-reduce of round t's pseudo gradients is applied at the end of round t + 1, so it never
waits for the current round's steps and a GPU can run it while they compute. The rule's own part
of the outer state is each worker's pseudo gradient of the last round, a_{t-1} - x^i_{t-1}, in
flight (``extra = {"pending": tree laid out like the params, [N, ...]}``; zeros = Delta_{-1} = 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from edit_jax.config import Config, SyncConfig, require
from edit_jax.localsgd.outer import sgd_trace, stale_outer_step
from edit_jax.localsgd.outer_spec import OuterSpec
from edit_jax.localsgd.rule import Span, SyncRule, SyncSpec, worker_zeros
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.localsgd.sync import as_varying, local_blocks, sync_metrics, unit_sq_sums, with_replica_dim


def sync_stale(params, outer, spec: SyncSpec, gap_penalty: float, flush: bool = False):
    """CO2's sync after the round's last step (CO2.md section 1): the outer update consumes the
    pseudo gradients every worker sent at the *previous* sync (``outer.extra["pending"]``), so their
    all-reduce does not depend on this round's steps and a GPU can run it while they compute;
    then each worker's new pending is a_t - x^i_t, and every worker restarts from a_{t+1}.
    The inner optimizer states stay local (CO2 never averages or resets them).

    ``gap_penalty``: CO2's staleness-gap penalty Λ (``outer.staleness_gap_penalty``).
    ``flush``: the update of the last round's pending only (for evaluation: the model after
    the final all-reduce lands); the pending is kept as it was.

    Unit by unit like the other syncs (root; layers vmapped with their per-unit outer state),
    so the figures are per unit; one all-reduce of the whole pending tree first.
    Returns (params, outer, metrics)."""
    n, opt, lam = spec.n_workers, spec.opt, gap_penalty
    local = local_blocks(params)
    pending = local_blocks(outer.extra["pending"])
    # The exchange, one all-reduce over `replica`: the pending pseudo gradients and, in slot r
    # of an [N, U] table, worker r's per-unit squared norms of its block. It reads only what
    # the last sync left in the state. Nothing else crosses `replica` in this program, so XLA's
    # all-reduce combiner cannot tie it to a value of this round (it once merged the norms'
    # psum over `shard` with the step's gradient norm, making the exchange wait for the step).
    slot = jax.nn.one_hot(jax.lax.axis_index(REPLICA), n, dtype=jnp.float32)[:, None] > 0
    table = jnp.where(slot, unit_sq_sums(pending)[None, :], 0.0)  # where: NaN * 0 is NaN
    pending_sum, table = jax.lax.psum((pending, table), REPLICA)
    over_blocks = spec.reduction.norm_axes  # the axes a worker's unit is split over (FSDP: ``shard``)
    block_sum = (lambda x: jax.lax.psum(x, over_blocks)) if over_blocks else (lambda x: x)
    sent = jnp.sqrt(block_sum(table)).T  # [U, N]: each worker's stale pseudo gradient
    one = lambda ps, lo, op, st: stale_outer_step(ps, n, lo, op, st, opt, lam)
    root = one(pending_sum["root"], local["root"], outer.params["root"], outer.opt_state["root"])
    if jax.tree.leaves(local["layers"]):
        layers = jax.vmap(one)(pending_sum["layers"], local["layers"], outer.params["layers"],
                               outer.opt_state["layers"])
    else:  # a model without layers (the public API's: any pytree is the root unit)
        layers = (outer.params["layers"], outer.opt_state["layers"], local["layers"], local["layers"])
    new_outer = {"root": root[0], "layers": layers[0]}
    new_opt = {"root": root[1], "layers": layers[1]}

    unit_norms = lambda tree: jnp.sqrt(block_sum(unit_sq_sums(tree)))
    clip = jnp.ones(sent.shape[0], jnp.float32)
    if spec.outer.momentum_clip > 0:  # how much of the momentum survived the clamp, per unit
        beta = spec.outer.momentum
        trace = lambda st: {u: sgd_trace(st[u]) if jax.tree.leaves(st[u]) else {}
                            for u in ("root", "layers")}
        g = {"root": root[3], "layers": layers[3]}  # Delta_{t-1} / Lambda_t
        raw = jax.tree.map(lambda g, m: g + beta * m, g, trace(outer.opt_state))
        new_m = trace(new_opt)
        raw_norm = unit_norms(raw)
        clip = jnp.where(raw_norm > 0, unit_norms(new_m) / jnp.where(raw_norm > 0, raw_norm, 1.0), 1.0)
    unit = {"pseudo_grad_norm": sent, "weight": jnp.full_like(sent, 1.0 / n),
            "flagged": jnp.zeros(sent.shape, bool), "clip_factor": clip,
            "update_norm": unit_norms(jax.tree.map(lambda a, b: a - b, new_outer, outer.params))}
    new_pending = outer.extra["pending"] if flush else with_replica_dim({"root": root[2], "layers": layers[2]})
    new_params = with_replica_dim(as_varying(new_outer))
    new_state = outer.replace(params=new_outer, opt_state=new_opt, syncs=outer.syncs + 1,
                              extra={"pending": new_pending})
    metrics = sync_metrics(unit)
    # CO2 has no anomaly handling, so nothing to roll back (and no flag exchange over `replica`).
    metrics["inner_reset"] = jnp.zeros((n,), bool)
    return new_params, new_state, metrics


class StaleSync(SyncRule):
    """CO2: heavy-ball outer momentum on the previous round's mean pseudo gradient, every tau.
    Its hyperparameters: the staleness-gap penalty Λ (``gap_penalty``) and the clamp φ of the
    stored outer momentum (``momentum_clip``, 0: off)."""

    name = "stale"
    streams = False  # the stale all-reduce of round t is the whole model's

    def __init__(self, gap_penalty: float = 1.0, momentum_clip: float = 0.0):
        self.gap_penalty, self.momentum_clip = float(gap_penalty), float(momentum_clip)

    @classmethod
    def build(cls, sync: SyncConfig) -> StaleSync:
        return cls(sync.co2.gap_penalty, sync.co2.momentum_clip)

    def outer_spec(self, outer: OuterSpec) -> OuterSpec:
        return dataclasses.replace(outer, momentum_clip=self.momentum_clip)

    @staticmethod
    def validate(cfg: Config) -> None:
        s = cfg.sync
        # CO2's stale sync is the whole model after the step, one all-reduce of the pending pseudo
        # gradients; the quantized and replica-sharded exchanges are not built for it (nor the
        # streaming one: ``streams`` above, which rules.validate reads).
        require(s.wire.kind == "none", "sync.wire.kind",
                f"method {s.method} exchanges float32 pseudo gradients; got {s.wire.kind!r}")
        require(s.outer_sharding == "shard", "sync.outer_sharding",
                f"method {s.method} needs 'shard' (the outer state is not split over replica); "
                f"got {s.outer_sharding!r}")

    # Its own config section: set away from its defaults for a method whose rule is another, a
    # mistake (``rules.validate`` says so, naming the methods that use it).
    owned_section = "co2"

    @staticmethod
    def validate_fields(s: SyncConfig) -> None:
        """CO2's own section's ranges, whatever the method."""
        require(s.co2.gap_penalty > 0, "sync.co2.gap_penalty", f"must be positive, got {s.co2.gap_penalty}")
        require(s.co2.momentum_clip >= 0, "sync.co2.momentum_clip",
                f"must be >= 0 (0: off), got {s.co2.momentum_clip}")

    # -- the in-flight pseudo gradients ----------------------------------------------------------

    def init_extra(self, rep_params):
        return {"pending": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), rep_params)}

    def extra_specs(self, param_specs):
        return {"pending": param_specs}

    def reset_extra(self, extra):  # at the initialising sync nothing is in flight yet (Delta_{-1} = 0)
        return {"pending": jax.tree.map(jnp.zeros_like, extra["pending"])}

    def remap_extra(self, extra, n: int):  # another worker count: the old round is dropped
        return {"pending": worker_zeros(extra["pending"], n)}

    def extra_from_format2(self, residual, pending):
        return {"pending": pending}

    def extra_as_format2(self, extra):
        return {"pending": extra["pending"]}

    # The exchange's rounds (elastic/outer_round.py) change workers from round to round: what the
    # next round applies is the mean of this round's pending (sync_stale sums the workers' and
    # divides by their count), so the round state keeps the mean and hands each worker of the next
    # round a copy. With the same workers in both rounds, the trainer's result (up to rounding).
    def pooled_extra(self, extra):
        return {"pending": jax.tree.map(lambda x: jnp.mean(x, axis=0), extra["pending"])}

    def spread_extra(self, pooled, n: int):
        return {"pending": jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), pooled["pending"])}

    # -- the sync --------------------------------------------------------------------------------

    def after_step(self, params, outer, opt_state, spec: SyncSpec, shares=None, span: Span | None = None,
                   residual=None):
        params, outer, metrics = sync_stale(params, outer, spec, self.gap_penalty)
        return params, outer, opt_state, metrics, residual

    def flush(self, params, outer, spec: SyncSpec, residual=None):
        params, outer, metrics = sync_stale(params, outer, spec, self.gap_penalty, flush=True)
        return params, outer, metrics, residual


__all__ = ["StaleSync", "sync_stale"]
