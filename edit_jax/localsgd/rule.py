"""A sync rule: one object per kind of sync, and the narrow spec its pure sync runs on.

Each kind of sync is one module of ``localsgd/`` holding one ``SyncRule`` subclass:

| module              | rule                 | methods                                  | runs                |
|---------------------|----------------------|------------------------------------------|---------------------|
| ``rule.py``         | ``NoSync``           | baseline (gradients every step)          | never               |
| ``whole_model.py``  | ``WholeModelSync``   | DiLoCo, Post Local SGD, EDiT unlayered   | after the step      |
| ``layerwise.py``    | ``LayerwiseSync``    | EDiT                                     | inside the forward  |
| ``stale.py``        | ``StaleSync``        | CO2                                      | after the step, one round stale |
| ``timed.py``        | ``Timed(rule)``      | A-EDiT (``Timed(LayerwiseSync())``)      | as the rule, by wall clock, workers apart |
| ``compressed.py``   | ``Compressed(rule)`` | any of them with ``sync.wire.kind``       | as the rule it wraps |

A rule owns:

- its part of the outer state: ``OuterState.extra`` is the rule's own subtree (None for most; CO2's
  in-flight pseudo gradients; the compressed wrapper's error-feedback residuals), with its
  ``init_extra``, ``extra_specs``, ``remap_extra`` (elastic resume), ``extra_from_format2``
  (checkpoints written before rules owned their subtree) and ``pooled_extra`` / ``spread_extra``
  (what the exchange's round state keeps of it between rounds whose workers differ);
- its hyperparameters (CO2's staleness-gap penalty and momentum clamp: ``build`` reads them from
  the sync config, ``outer_spec`` adds the clamp to the outer optimizer);
- its timing: where it runs (``in_forward``: inside the forward, else after the step) and when
  (``asynchronous``: by wall clock, workers apart); ``methods.plan_for`` picks the schedule and
  its step kinds from them;
- its pure sync over a ``SyncSpec`` (the penalty, the outer optimizer, the compression, the unit
  count and the reduction; no ``StateLayout``, no config);
- its config rules (``validate``, checked on the rule as built by ``check_config``; run by
  ``rules.validate``).

A ``METHODS`` row (``methods.py``) names its rule's factory (``LayerwiseSync.build``,
``Timed.around(LayerwiseSync.build)``); ``methods.plan_for`` builds it and wraps it in
``Compressed`` when ``sync.wire.kind`` is set. ``programs.py`` calls the protocol declared on
``SyncRule``; no method flag is read outside ``methods.py`` and the rule modules.
"""  # noqa: E501 - the table of rules above is wider than a line

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax

from edit_jax.config import Config, SyncConfig
from edit_jax.localsgd.codec import NONE, Codec
from edit_jax.localsgd.outer_spec import OuterSpec, Penalty
from edit_jax.localsgd.reduction import Reduction, ReplicaPsum

Span = tuple[bool, int, int]  # (root in the group, first layer, end layer): fragments.fragment_layers


@dataclass(frozen=True)
class SyncSpec:
    """What a rule's pure sync needs, and nothing else.

    ``replica_dims``: with θ̄ split over ``replica`` too (``sync.outer_sharding=replica_shard``),
    the FSDP dim of each leaf of a unit, ``{"root": ..., "layer": ...}``; else None."""

    penalty: Penalty
    outer: OuterSpec
    opt: optax.GradientTransformation = field(compare=False)
    n_layers: int
    n_workers: int
    codec: Codec = NONE  # how Δ crosses ``replica`` (the compressed wrapper sets it)
    replica_dims: Any = None
    reduction: Reduction = ReplicaPsum()
    inner_opt_specs: Any = None  # the inner optimizer state's specs (which leaves are per worker)

    def dims(self, which: str):
        """The FSDP dims of a unit ("root" | "layer") when θ̄ is split over ``replica``, else None."""
        return None if self.replica_dims is None else self.replica_dims[which]


class SyncRule:
    """The base rule: keeps θ̄ and the outer optimizer state; subclasses say where and how they
    sync. Instances are immutable after construction and hold only static facts: their own
    hyperparameters (CO2's Λ), never a method's name. A ``METHODS`` row names a rule's factory
    (``build``); the drivers read its timing (``in_forward``, ``asynchronous``) and call the
    protocol below."""

    name = "rule"
    keeps_outer = True  # holds θ̄, the outer optimizer state and the detectors
    # Where it syncs: inside the forward, unit by unit (``forward_inputs``, ``in_forward_sync``,
    # ``assemble``), else after the step's inner update (``after_step``). ``methods.plan_for``
    # picks the step kinds from it.
    in_forward = False
    # When: False, every tau steps with the workers in lock step (``methods.StepSchedule``); True,
    # by wall clock with each worker at its own pace after the warmup (``methods.TimeSchedule``).
    asynchronous = False
    # Whether its units may sync in staggered groups (``sync.fragments`` > 1, a ``span`` per sync):
    # CO2's stale all-reduce spans the whole model, so not it (``rules.validate``, the API's check).
    streams = True
    codec: Codec = NONE  # the wire, and the state it carries (the compressed wrapper's)
    # Its own hyperparameters' config section, ``sync.<owned_section>`` ("": none; CO2's is
    # "co2"), set away from its defaults for a method of another rule is refused (``rules.py``).
    # ``section_type``: its dataclass, for a rule from outside the library, whose section is not a
    # field of ``SyncConfig`` (``methods.register`` registers it); ``build`` reads it as
    # ``sync.<owned_section>`` all the same.
    owned_section = ""
    section_type: type | None = None

    # A rule is a value: two rules of one class with the same attributes are equal (two plans of
    # one config compare equal, as they did when a plan named its rule by a string).
    def __eq__(self, other) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    @classmethod
    def build(cls, sync: SyncConfig) -> "SyncRule":
        """The rule for the sync config ``sync`` (a rule with hyperparameters reads its own fields)."""
        return cls()

    # -- config rules ----------------------------------------------------------------------------

    @staticmethod
    def validate(cfg: Config) -> None:
        """This rule's config rules (raise ``ConfigError`` naming the field)."""

    @staticmethod
    def validate_fields(s: SyncConfig) -> None:
        """Its own section's ranges, whatever the method (``rules.validate`` calls it for every
        rule of the method table that owns a section)."""

    def check_config(self, cfg: Config) -> None:
        """The config rules of this rule as built (a wrapper's, then its rule's)."""
        type(self).validate(cfg)

    def outer_spec(self, outer: OuterSpec) -> OuterSpec:
        """The outer optimizer this rule runs, from the configured one (CO2 adds its clamp)."""
        return outer

    # -- its subtree of the outer state ----------------------------------------------------------

    def init_extra(self, rep_params: Any) -> Any:
        """The rule's own outer-state subtree for per-replica params ``rep_params`` ([N, ...])."""
        return None

    def extra_specs(self, param_specs: Any) -> Any:
        return None

    def reset_extra(self, extra: Any) -> Any:
        """The subtree at the initialising sync (k == W)."""
        return extra

    def remap_extra(self, extra: Any, n: int) -> Any:
        """The subtree of a host state saved with another worker count, for N workers."""
        return extra

    def extra_from_format2(self, residual: Any, pending: Any) -> Any:
        """The subtree from a format-2 checkpoint's ``residual`` / ``pending`` fields."""
        return None

    def extra_as_format2(self, extra: Any) -> dict:
        """The inverse: the format-2 fields this rule's subtree was saved as."""
        return {}

    def pooled_extra(self, extra: Any) -> Any:
        """The subtree of a sync's N workers ([N, ...]) as the one value a driver whose workers
        change from sync to sync keeps until the next (the exchange's round state). None: nothing to
        keep (no subtree, or one that stays with each worker, as error feedback's residual does)."""
        return None

    def spread_extra(self, pooled: Any, n: int) -> Any:
        """``pooled_extra``'s value as the subtree of the next sync's ``n`` workers."""
        return None

    # -- the sync --------------------------------------------------------------------------------

    def after_step(self, params, outer, opt_state, spec: SyncSpec, shares=None, span: Span | None = None,
                   residual=None):
        """The sync after the step's inner update: (params, outer, opt_state, metrics, residual),
        ``metrics["inner_reset"]`` included; ``residual`` is a wrapper's error-feedback tree."""
        raise NotImplementedError(f"rule {self.name} does not sync after the step")

    def forward_inputs(self, outer, spec: SyncSpec, span: Span | None = None, residual=None):
        """A sync inside the forward: what the model's hook is given per unit, (hook_xs, segments)."""
        raise NotImplementedError(f"rule {self.name} does not sync inside the forward")

    def in_forward_sync(self, unit, xs, which: str, spec: SyncSpec, shares=None):
        """The hook's sync of one unit ("root" | "layer"): (synced unit, what ``assemble`` reads)."""
        raise NotImplementedError(f"rule {self.name} does not sync inside the forward")

    def assemble(self, params, outer, opt_state, ys, spec: SyncSpec, span: Span | None = None, residual=None):
        """After a forward that synced: the step's (params, outer, opt_state, metrics, residual)."""
        raise NotImplementedError(f"rule {self.name} does not sync inside the forward")

    def flush(self, params, outer, spec: SyncSpec, residual=None):
        """A whole-model sync of a state (evaluation on a fresh θ̄, tests): (params, outer,
        metrics, residual)."""
        raise NotImplementedError(f"rule {self.name} has no whole-model sync")


def worker_zeros(tree: Any, n: int) -> Any:
    """Host zeros for ``n`` workers shaped like the per-worker ``tree`` ([old N, ...]): a rule's
    per-worker subtree after an elastic resume, where every worker starts afresh."""
    return jax.tree.map(lambda x: np.zeros((n,) + np.shape(x)[1:], np.asarray(x).dtype), tree)


class NoSync(SyncRule):
    """Synchronous HSDP (the Baseline): gradients cross ``replica`` every step; no outer state."""

    name = "none"
    keeps_outer = False


class RuleWrapper(SyncRule):
    """A rule around another (``Compressed``, ``Timed``): everything it does not override is the
    wrapped rule's."""

    def __init__(self, rule: SyncRule):
        self.rule = rule
        self.keeps_outer, self.in_forward = rule.keeps_outer, rule.in_forward
        self.asynchronous, self.codec, self.streams = rule.asynchronous, rule.codec, rule.streams

    def check_config(self, cfg: Config) -> None:
        type(self).validate(cfg)
        self.rule.check_config(cfg)

    def outer_spec(self, outer: OuterSpec) -> OuterSpec:
        return self.rule.outer_spec(outer)

    def init_extra(self, rep_params):
        return self.rule.init_extra(rep_params)

    def extra_specs(self, param_specs):
        return self.rule.extra_specs(param_specs)

    def reset_extra(self, extra):
        return self.rule.reset_extra(extra)

    def remap_extra(self, extra, n: int):
        return self.rule.remap_extra(extra, n)

    def extra_from_format2(self, residual, pending):
        return self.rule.extra_from_format2(residual, pending)

    def extra_as_format2(self, extra):
        return self.rule.extra_as_format2(extra)

    def pooled_extra(self, extra):
        return self.rule.pooled_extra(extra)

    def spread_extra(self, pooled, n: int):
        return self.rule.spread_extra(pooled, n)

    def after_step(self, *args, **kw):
        return self.rule.after_step(*args, **kw)

    def forward_inputs(self, *args, **kw):
        return self.rule.forward_inputs(*args, **kw)

    def in_forward_sync(self, *args, **kw):
        return self.rule.in_forward_sync(*args, **kw)

    def assemble(self, *args, **kw):
        return self.rule.assemble(*args, **kw)

    def flush(self, *args, **kw):
        return self.rule.flush(*args, **kw)


__all__ = ["SyncRule", "SyncSpec", "NoSync", "RuleWrapper", "Span", "worker_zeros"]
