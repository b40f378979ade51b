"""Every rule's config rules. ``validate(cfg)`` runs the fields each rule owns whatever the method
(a value set for a method that does not use it is a mistake), then the config rules of the rule
the method builds (``SyncRule.check_config``: a wrapper's and its rule's); ``validate.py`` calls
it, before JAX starts a backend. The rules themselves are the ``METHODS`` rows' factories
(``methods.py``); a new kind of sync is one module with its ``SyncRule`` subclass and the
``METHODS`` row that names its ``build``.
"""

from __future__ import annotations

import dataclasses

from edit_jax.config import Config, SyncConfig, require
from edit_jax.localsgd.compressed import Compressed
from edit_jax.localsgd.methods import METHODS, section_owners
from edit_jax.localsgd.rule import RuleWrapper, SyncRule
from edit_jax.localsgd.timed import Timed


def validate(cfg: Config) -> None:
    """Every rule's field rules, then the method's own rule's relations with the rest of the config."""
    s = cfg.sync
    owners = section_owners()  # the rules with a config section of their own (CO2's, a registered rule's)
    for owner in owners.values():
        owner.validate_fields(s)
    Compressed.validate_fields(s)
    Timed.validate_fields(s)
    m = METHODS.get(s.method)
    if m is None:
        return  # methods.validate names the field
    rule = m.rule(s)
    for name, owner in owners.items():  # a section is set for the methods whose rule owns it only
        if not _holds(rule, owner):
            section = getattr(s, name)
            users = _methods_of(lambda r: _holds(r, owner))  # noqa: B023 - called at once
            for f in dataclasses.fields(section):
                value, default = getattr(section, f.name), getattr(type(section)(), f.name)
                require(value == default, f"sync.{name}.{f.name}",
                        f"is used by method {users} only (method is {s.method!r}); "
                        f"got {value}")
    if s.exchange.url:
        validate_exchange(cfg, rule)
    require(s.fragments == 1 or rule.streams, "sync.fragments",  # (CO2: its stale all-reduce spans the whole model)
            f"method {s.method} syncs every unit together; got {s.fragments}")
    rule.check_config(cfg)


def validate_exchange(cfg: Config, rule: SyncRule) -> None:
    """Workers as separate programs meeting through an exchange (``elastic/``): ``mesh.replica``
    worker slots (each its rows of the global batch), ``mesh.processes`` of them started by the
    launcher, the rest by hand. A round's outer step is the rule's, on the host: rounds by wall
    clock for a timed rule (A-EDiT), else after ``sync.tau`` steps of each worker (DiLoCo, EDiT,
    Post Local SGD, CO2: its pseudo gradients in flight kept in the round state as their mean,
    ``SyncRule.pooled_extra``)."""
    mesh, s = cfg.mesh, cfg.sync
    def exchangeable(r: SyncRule) -> bool:
        return r.keeps_outer
    require(exchangeable(rule), "sync.exchange.url",
            f"workers meeting through an exchange run method {_methods_of(exchangeable)}, got method={s.method}")
    require(1 <= mesh.processes <= mesh.replica, "mesh.processes",
            f"with sync.exchange.url: the workers the launcher starts, 1..mesh.replica={mesh.replica} (the worker "
            f"slots), got {mesh.processes}")
    require(s.warmup_steps == 0, "sync.warmup_steps",
            "must be 0 with sync.exchange.url: the synchronous warmup is a collective across all workers, which the "
            f"exchange exists to avoid (a fault in it stops everyone); got {s.warmup_steps}")
    require(s.fragments == 1, "sync.fragments", f"with sync.exchange.url a round syncs every unit; got {s.fragments}")
    require(cfg.max_seconds == 0, "max_seconds", "not with sync.exchange.url: stop a worker with a signal (the "
            "others go on), the run ends at its token budget (steps x mesh.replica)")
    require(s.wire.kind in ("none", "topk2", "topk4"), "sync.wire.kind",
            "with sync.exchange.url a post is float32 (none) or the sparse wire's packed rows (topk2, topk4; "
            "elastic/packed.py); int8 / bf16 posts are not built (in-program int8 at N >= 3 requantizes the "
            f"reduced chunk, which has no counterpart when every worker sums the posts itself), got {s.wire.kind}")
    require(s.outer_sharding == "shard" and not s.cpu_offload, "sync.outer_sharding",
            "with sync.exchange.url θ̄ and the outer state live in each worker's host memory (leave sync.outer_sharding"
            "=shard, sync.cpu_offload=false)")


def _holds(rule: SyncRule, cls: type) -> bool:
    """``rule`` is a ``cls``, or wraps one."""
    while isinstance(rule, RuleWrapper) and not isinstance(rule, cls):
        rule = rule.rule
    return isinstance(rule, cls)


def _methods_of(pred) -> str:
    """The names of the methods whose rule (built from the default sync config) satisfies ``pred``."""
    return " | ".join(name for name, m in METHODS.items() if pred(m.rule(SyncConfig())))


__all__ = ["validate", "validate_exchange"]
