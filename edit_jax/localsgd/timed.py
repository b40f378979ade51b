"""A-EDiT's timing (``Timed(rule)``; EDIT.md, "A-EDiT"): the sync of the rule it wraps (EDiT's
layer-wise one, or the whole-model one with ``sync.layerwise=false``), due by wall clock per
worker instead of every tau steps, with every worker stepping at its own pace after the warmup, one
process per worker (``training/drivers.AsyncWorkers``).

The wrapper owns A-EDiT's config rules: the timing fields, one process per worker, and the outer
state that can move between a worker's own mesh and the global one by reference. Its schedule is
``methods.TimeSchedule`` (the method table's, like every schedule).
"""

from __future__ import annotations

from collections.abc import Callable

from edit_jax.config import Config, SyncConfig, require
from edit_jax.localsgd.rule import RuleWrapper, SyncRule


class Timed(RuleWrapper):
    """``rule``'s sync every ``sync.time.tau`` seconds; workers step at their own pace."""

    def __init__(self, rule: SyncRule):
        super().__init__(rule)
        self.name = f"timed({rule.name})"
        self.asynchronous = True

    @staticmethod
    def around(factory: Callable[[SyncConfig], SyncRule]) -> Callable[[SyncConfig], SyncRule]:
        """The factory of ``factory``'s rule, timed (a ``METHODS`` row's: A-EDiT's is
        ``Timed.around(LayerwiseSync.build)``)."""
        def build(sync: SyncConfig) -> Timed:
            return Timed(factory(sync))
        return build

    @staticmethod
    def validate_fields(s: SyncConfig) -> None:
        """The timing fields' ranges (whatever the method: a bad value is a mistake either way)."""
        t = s.time
        require(t.tau > 0, "sync.time.tau", f"must be positive, got {t.tau}")
        require(t.min_total_steps >= 1, "sync.time.min_total_steps", f"must be >= 1, got {t.min_total_steps}")
        require(0.0 <= t.step_weight_ratio <= 1.0, "sync.time.step_weight_ratio",
                f"must be in [0, 1], got {t.step_weight_ratio}")

    @staticmethod
    def validate(cfg: Config) -> None:
        """One process per worker, and its asynchronous phase moves each worker's state between its
        own mesh and the global one by reference (multihost.to_local / to_global): that needs the
        outer state on the devices and split over `shard` only. Staggered fragments follow the step
        count, which no longer paces the syncs."""
        mesh, s = cfg.mesh, cfg.sync
        require(s.fragments == 1, "sync.fragments",
                f"staggered fragments follow the step count (every tau steps); method {s.method} syncs by wall clock")
        if s.exchange.url:  # workers as separate programs: the exchange's rules (``rules.validate_exchange``)
            return
        require(mesh.processes == mesh.replica and mesh.replica > 1, "mesh.processes",
                f"method {s.method} runs one process per worker: set mesh.processes=mesh.replica={mesh.replica} "
                f"(with mesh.replica >= 2), got {mesh.processes}")
        require(s.outer_sharding == "shard", "sync.outer_sharding",
                f"method {s.method} keeps the outer state sharded over `shard` only (each worker holds a whole "
                "copy between syncs); 'replica_shard' is for the lock-step methods")
        require(not s.cpu_offload, "sync.cpu_offload", f"not supported with method {s.method} (each worker's "
                "state moves between its own mesh and the global one by reference)")


__all__ = ["Timed"]
