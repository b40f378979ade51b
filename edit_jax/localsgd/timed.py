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
    """``rule``'s sync every ``sync.tau_time`` seconds; workers step at their own pace."""

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
        require(s.tau_time > 0, "sync.tau_time", f"must be positive, got {s.tau_time}")
        require(s.min_total_steps >= 1, "sync.min_total_steps", f"must be >= 1, got {s.min_total_steps}")
        require(0.0 <= s.step_weight_ratio <= 1.0, "sync.step_weight_ratio",
                f"must be in [0, 1], got {s.step_weight_ratio}")
        require(s.grace > 0, "sync.grace", f"must be positive (seconds a round waits for posts), got {s.grace}")
        require(s.late_posts in ("carry", "drop"), "sync.late_posts", f"expected carry or drop, got {s.late_posts!r}")
        require(s.progress_every >= 0, "sync.progress_every", f"must be >= 0 seconds (0: off), got {s.progress_every}")
        require(0.0 <= s.carried_weight <= 1.0, "sync.carried_weight",
                f"must be in [0, 1] (1: carried steps count as fresh ones), got {s.carried_weight}")
        require(not s.progress_every or s.exchange, "sync.progress_every",
                "saves an exchange worker's unposted steps: set sync.exchange too, or 0")

    @staticmethod
    def validate(cfg: Config) -> None:
        """One process per worker, and its asynchronous phase moves each worker's state between its
        own mesh and the global one by reference (multihost.to_local / to_global): that needs the
        outer state on the devices and split over `shard` only. Staggered fragments follow the step
        count, which no longer paces the syncs."""
        mesh, s = cfg.mesh, cfg.sync
        require(s.fragments == 1, "sync.fragments",
                f"staggered fragments follow the step count (every tau steps); method {s.method} syncs by wall clock")
        if s.exchange:  # workers as separate programs: the exchange's rules (``rules.validate_exchange``)
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
