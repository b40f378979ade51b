"""The rules ``LocalSGD`` runs: the registry's sync rules (``rule.py``: the objects the trainer's
step programs call), each with the penalty and the outer optimizer it runs with.

    diloco()  post_local_sgd()  edit()  edit(layerwise=False)  co2()    # the paper's methods
    compressed(diloco(), "topk2")                                      # any of them on a lossy wire
    from_method("co2", outer=OuterConfig(lr=0.5), co2=CO2Config(gap_penalty=2.0))  # any METHODS row

A ``LocalSGDRule`` is a value: its ``sync`` is the rule object itself (``WholeModelSync``,
``LayerwiseSync``, ``StaleSync``, or one of them inside ``Compressed``), so the API runs the same
sync, written once, that ``edit-jax train`` runs; ``from_method`` builds it from the method table
exactly as ``methods.plan_for`` does for a config. What needs processes of their own (A-EDiT's
wall-clock timing: one controller per worker) or stepping apart from the other workers is refused
with the reason; the synchronous baseline has no sync to wrap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edit_jax.config import RULE_SECTIONS, CO2Config, Config, OuterConfig, SyncConfig, WireConfig
from edit_jax.config.renames import RENAMED, new_key
from edit_jax.localsgd import methods, rules
from edit_jax.localsgd.codec import KINDS
from edit_jax.localsgd.compressed import Compressed
from edit_jax.localsgd.layerwise import LayerwiseSync
from edit_jax.localsgd.outer import make_outer_optimizer
from edit_jax.localsgd.outer_spec import OuterSpec, Penalty
from edit_jax.localsgd.rule import SyncRule
from edit_jax.localsgd.stale import StaleSync
from edit_jax.localsgd.whole_model import WholeModelSync


_BY_WALL_CLOCK = ("{what}: syncs by wall clock with every worker at its own pace, which needs one process per worker "
                  "(edit-jax train, or the exchange: docs/guides/elastic.md); in one program use edit()")


@dataclass(frozen=True)
class LocalSGDRule:
    """What a sync does: ``sync`` the registry's rule (where it runs: inside the forward, unit by
    unit, when the rule says ``in_forward``; else after the step, the whole params as one unit), the
    pseudo-gradient ``penalty`` (``Penalty.off()``: the plain mean) and the ``outer`` optimizer."""

    name: str
    sync: SyncRule
    penalty: Penalty
    outer: OuterSpec

    def __post_init__(self):
        if not isinstance(self.sync, SyncRule) or not self.sync.keeps_outer:
            raise ValueError(f"sync: expected a sync rule that keeps θ̄ (rule.py), got {self.sync!r}")
        if self.sync.asynchronous:
            raise ValueError(_BY_WALL_CLOCK.format(what=f"rule {self.name!r}"))
        if self.penalty.anomaly and self.penalty.warmup < 2:
            raise ValueError(f"penalty.warmup: must be >= 2 (the z-score window needs an unbiased std), "
                             f"got {self.penalty.warmup}")
        make_outer_optimizer(self.outer)  # an unknown or inconsistent outer optimizer fails here

    @property
    def layerwise(self) -> bool:
        """Syncs inside the forward, unit by unit (the model's hook)."""
        return self.sync.in_forward


def diloco(outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True) -> LocalSGDRule:
    """DiLoCo: the whole model after the step, plain mean of the pseudo gradients, Nesterov SGD."""
    return LocalSGDRule("diloco", WholeModelSync(), Penalty.off(),
                        OuterSpec("nesterov", outer_lr, outer_momentum, nesterov))


def post_local_sgd() -> LocalSGDRule:
    """Post Local SGD: θ̄ = the plain mean of the workers (outer SGD with lr 1, no momentum)."""
    return LocalSGDRule("post_local_sgd", WholeModelSync(), Penalty.off(), OuterSpec("nesterov", 1.0, 0.0, False))


def edit(outer_lr: float = 0.8, outer_momentum: float = 0.85, nesterov: bool = True,
         penalty: Penalty | None = None, layerwise: bool = True) -> LocalSGDRule:
    """EDiT: the sync layer by layer inside the forward, pseudo gradients penalised (anomaly
    elimination, softmax(−g/T) weights, per-unit clip; ``Penalty()`` by default), Nesterov SGD.
    The paper's outer lr 0.8 and momentum 0.85."""
    return LocalSGDRule("edit", LayerwiseSync() if layerwise else WholeModelSync(),
                        Penalty() if penalty is None else penalty,
                        OuterSpec("nesterov", outer_lr, outer_momentum, nesterov))


def co2(outer_lr: float = 0.8, outer_momentum: float = 0.85, gap_penalty: float = 1.0,
        momentum_clip: float = 0.0) -> LocalSGDRule:
    """CO2 (docs/design/CO2.md): heavy-ball outer momentum on the *previous* round's mean pseudo
    gradient, so its all-reduce never waits for this round's steps; ``gap_penalty`` is Λ,
    ``momentum_clip`` the clamp φ of the stored momentum (0: off). ``LocalSGD.flush`` applies
    the round still in flight (the model to evaluate at the end)."""
    return from_method("co2", outer=OuterConfig(lr=outer_lr, momentum=outer_momentum),
                       co2=CO2Config(gap_penalty=gap_penalty, momentum_clip=momentum_clip))


def compressed(rule: LocalSGDRule, wire: str = "topk2", error_feedback: bool = True, decay: float = 1.0,
               **options) -> LocalSGDRule:
    """``rule`` with its pseudo gradients crossing the workers on a lossy ``wire`` ("bf16", "int8",
    "topk2", "topk4"; ``options``: ``chunk``, ``k``, ``residual_dtype``: ``sync.wire``'s), each worker's
    quantization error carried to its next sync (``error_feedback``, decayed by ``decay``)."""
    if not isinstance(rule, LocalSGDRule):
        raise ValueError(f"rule: expected a LocalSGDRule (diloco(), edit(), co2(), ...), got {rule!r}")
    if wire not in KINDS or wire == "none":
        raise ValueError(f"wire: expected one of {', '.join(k for k in KINDS if k != 'none')}, got {wire!r}")
    if isinstance(rule.sync, StaleSync):
        raise ValueError("rule: co2 exchanges float32 pseudo gradients (its stale all-reduce is not built for a "
                         "lossy wire)")
    options = {_OLD_OPTIONS.get(k, k): v for k, v in options.items()}  # (the names before sync.wire)
    bad = sorted(set(options) - {"chunk", "k", "residual_dtype"})
    if bad:
        raise ValueError(f"compressed: unknown option(s) {bad}; expected chunk, k, residual_dtype")
    s = SyncConfig(wire=WireConfig(kind=wire, error_feedback=error_feedback, decay=decay, **options))
    Compressed.validate_fields(s)  # ConfigError (a ValueError) naming the field
    return dataclasses.replace(rule, name=f"{rule.name}+{wire}", sync=Compressed.of(rule.sync, s))


_OLD_OPTIONS = {"sparse_chunk": "chunk", "sparse_k": "k", "ef_dtype": "residual_dtype"}


def from_method(method: str, **sync_fields) -> LocalSGDRule:
    """The rule of ``METHODS[method]`` with ``sync_fields`` (``SyncConfig``'s fields: ``anomaly``,
    ``outer=OuterConfig(...)``, ``wire=WireConfig(...)``, ``co2=CO2Config(...)``, ...; a field that
    moved into a section, ``outer_lr=`` or ``compress=`` say, is read as its new key), built as
    ``methods.plan_for`` builds the trainer's: the fields the method fixes take their fixed values,
    the rule's config rules run (a ``ConfigError`` naming ``sync.<field>``)."""
    if method not in methods.METHODS:
        raise ValueError(f"method: expected one of {', '.join(methods.METHODS)}, got {method!r}")
    for key in [k for k in sync_fields if f"sync.{k}" in RENAMED  # a field that moved into a section
                and not dataclasses.is_dataclass(sync_fields[k])]:  # (not the section named as it was: exchange)
        _, section, name = new_key(f"sync.{key}").split(".")
        value = sync_fields.pop(key)  # (first: the URL's old key is its section's name)
        current = sync_fields.get(section, getattr(SyncConfig(), section))
        sync_fields[section] = dataclasses.replace(current, **{name: value})
    fields = {f.name for f in dataclasses.fields(SyncConfig)} - {"rule_sections"}
    bad = sorted(set(sync_fields) - fields - set(RULE_SECTIONS))
    if bad:
        raise ValueError(f"from_method: unknown sync field(s) {bad} (SyncConfig's fields, or a registered rule's "
                         f"section: {', '.join(RULE_SECTIONS) or 'none registered'})")
    own = {k: sync_fields.pop(k) for k in list(sync_fields) if k in RULE_SECTIONS}  # a registered rule's section
    for k, v in own.items():
        if not isinstance(v, RULE_SECTIONS[k]):
            raise ValueError(f"sync.{k}: expected a {RULE_SECTIONS[k].__name__}, got {v!r}")
    if own:
        sync_fields["rule_sections"] = own
    default = SyncConfig()
    for key, why in (("fragments", "streaming fragments"), ("warmup_steps", "a synchronous warmup"),
                     ("exchange", "the exchange")):
        if key in sync_fields and sync_fields[key] != getattr(default, key):
            raise ValueError(f"sync.{key}: {why} is the trainer's (edit-jax train), not built into LocalSGD")
    cfg = Config(sync=SyncConfig(method=method, **sync_fields))
    if not methods.keeps_outer(method):
        raise ValueError(f"method {method!r}: syncs gradients every step (no local steps to wrap); use "
                         "your own jax.jit step with a mean over the workers")
    if methods.method(method).rule(cfg.sync).asynchronous:  # (before rules.validate: its mesh.processes rule)
        raise ValueError(_BY_WALL_CLOCK.format(what=f"method {method!r}"))
    methods.validate(cfg)
    rules.validate(cfg)
    plan = methods.plan_for(cfg).plan
    return LocalSGDRule(method, plan.rule, plan.penalty, plan.outer)


__all__ = ["LocalSGDRule", "diloco", "post_local_sgd", "edit", "co2", "compressed", "from_method"]
