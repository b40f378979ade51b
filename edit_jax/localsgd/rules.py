"""The sync rules by name: what a ``METHODS`` row's ``rule`` means, and every rule's config rules.

``rule_for(plan, sync)`` builds the rule a method plan runs: the row's rule (``plan.rule``, with
EDiT's layer-wise sync resolved to the whole-model one under ``sync.layerwise=false``), wrapped in
``Timed`` for A-EDiT and in ``Compressed`` when ``sync.compress`` is set. ``validate(cfg)`` runs
the config rules each rule owns (``validate.py`` calls it, before JAX starts a backend).

A new kind of sync: one module with its ``SyncRule`` subclass, one line in ``RULES`` and one
``METHODS`` row naming it.
"""

from __future__ import annotations

from edit_jax.config import Config, SyncConfig
from edit_jax.localsgd.compressed import Compressed
from edit_jax.localsgd.layerwise import LayerwiseSync
from edit_jax.localsgd.methods import METHODS, Plan
from edit_jax.localsgd.rule import NoSync, SyncRule
from edit_jax.localsgd.stale import StaleSync
from edit_jax.localsgd.timed import Timed
from edit_jax.localsgd.whole_model import WholeModelSync

RULES: dict[str, type[SyncRule]] = {
    "none": NoSync,
    "whole_model": WholeModelSync,
    "layerwise": LayerwiseSync,
    "stale": StaleSync,
}
WRAPPERS = {"timed": Timed}  # a METHODS row's rule "timed:layerwise" is Timed(LayerwiseSync())


def rule_for(plan: Plan, sync: SyncConfig) -> SyncRule:
    """The rule of a method plan (``methods.plan_for(cfg).plan``) under its normalised sync config."""
    *wrappers, base = plan.rule.split(":")
    rule = RULES[base]()
    for name in reversed(wrappers):
        rule = WRAPPERS[name](rule)
    if sync.compress != "none" and rule.keeps_outer:
        rule = Compressed.of(rule, sync)
    return rule


def validate(cfg: Config) -> None:
    """Every rule's config rules: the fields a rule owns are checked whatever the method (a value set
    for a method that does not use it is a mistake), the method's own rule's relations with the rest
    of the config only for that method."""
    StaleSync.validate_fields(cfg.sync)
    Compressed.validate_fields(cfg.sync)
    Timed.validate_fields(cfg.sync)
    m = METHODS.get(cfg.sync.method)
    if m is None:
        return  # methods.validate names the field
    for part in m.rule.split(":"):
        (WRAPPERS.get(part) or RULES[part]).validate(cfg)


__all__ = ["RULES", "WRAPPERS", "rule_for", "validate"]
