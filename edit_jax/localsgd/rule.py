"""A sync rule: one object per kind of sync, and the narrow spec its pure sync runs on.

Each kind of sync is one module of ``localsgd/`` holding one ``SyncRule`` subclass:

| module              | rule                 | methods                                  | runs                |
|---------------------|----------------------|------------------------------------------|---------------------|
| ``rule.py``         | ``NoSync``           | baseline (gradients every step)          | never               |
| ``whole_model.py``  | ``WholeModelSync``   | DiLoCo, Post Local SGD, EDiT unlayered   | after the step      |
| ``layerwise.py``    | ``LayerwiseSync``    | EDiT                                     | inside the forward  |
| ``stale.py``        | ``StaleSync``        | CO2                                      | after the step, one round stale |
| ``timed.py``        | ``Timed(rule)``      | A-EDiT (``Timed(LayerwiseSync())``)      | as the rule, by wall clock, workers apart |
| ``compressed.py``   | ``Compressed(rule)`` | any of them with ``sync.compress``       | as the rule it wraps |

A rule owns:

- its part of the outer state: ``OuterState.extra`` is the rule's own subtree (None for most; CO2's
  in-flight pseudo gradients; the compressed wrapper's error-feedback residuals), with its
  ``init_extra``, ``extra_specs``, ``remap_extra`` (elastic resume) and ``extra_from_format2``
  (checkpoints written before rules owned their subtree);
- where it runs (``in_forward``: inside the forward, else after the step; the schedule that says
  which step kind runs at step k is the method table's, ``methods.plan_for``);
- its pure sync over a ``SyncSpec`` (the penalty, the outer optimizer, the compression, the unit
  count and the reduction; no ``StateLayout``, no config);
- its config rules (``validate``), run by ``rules.validate``.

``programs.py`` asks the rule (``keeps_outer``, ``in_forward``, ``after_step``, ``flush``); no
method flag is read outside ``methods.py`` and the rule modules. ``rules.py`` maps a ``METHODS``
row's rule name to its class and wraps it for compression.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax

from edit_jax.config import Config
from edit_jax.localsgd.codec import NONE, Codec
from edit_jax.localsgd.methods import OuterSpec, Penalty
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
    gap_penalty: float = 1.0  # CO2's staleness-gap penalty Lambda
    replica_dims: Any = None
    reduction: Reduction = ReplicaPsum()
    inner_opt_specs: Any = None  # the inner optimizer state's specs (which leaves are per worker)

    def dims(self, which: str):
        """The FSDP dims of a unit ("root" | "layer") when θ̄ is split over ``replica``, else None."""
        return None if self.replica_dims is None else self.replica_dims[which]


class SyncRule:
    """The base rule: keeps θ̄ and the outer optimizer state; subclasses say where and how they
    sync. Instances are immutable after construction and hold only static facts."""

    name = "rule"
    keeps_outer = True  # holds θ̄, the outer optimizer state and the detectors
    in_forward = False  # the sync runs inside the forward (layer by layer), else after the step
    asynchronous = False  # after the warmup each worker steps at its own pace (one process per worker)
    after_step_kind = "local_then_sync"
    codec: Codec = NONE  # the wire, and the state it carries (the compressed wrapper's)

    # -- config rules ----------------------------------------------------------------------------

    @staticmethod
    def validate(cfg: Config) -> None:
        """This rule's config rules (raise ``ConfigError`` naming the field)."""

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

    # -- the sync --------------------------------------------------------------------------------

    def after_step(self, params, outer, opt_state, spec: SyncSpec, shares=None, span: Span | None = None,
                   residual=None):
        """The sync after the step's inner update: (params, outer, opt_state, metrics, residual),
        ``metrics["inner_reset"]`` included; ``residual`` is a wrapper's error-feedback tree."""
        raise NotImplementedError(f"rule {self.name} does not sync after the step")

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
        self.asynchronous, self.codec = rule.asynchronous, rule.codec

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
