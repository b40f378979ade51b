"""Every rule's config rules. ``validate(cfg)`` runs the fields each rule owns whatever the method
(a value set for a method that does not use it is a mistake), then the config rules of the rule
the method builds (``SyncRule.check_config``: a wrapper's and its rule's); ``validate.py`` calls
it, before JAX starts a backend. The rules themselves are the ``METHODS`` rows' factories
(``methods.py``); a new kind of sync is one module with its ``SyncRule`` subclass and the
``METHODS`` row that names its ``build``.
"""

from __future__ import annotations

from edit_jax.config import Config, SyncConfig, require
from edit_jax.localsgd.compressed import Compressed
from edit_jax.localsgd.methods import METHODS
from edit_jax.localsgd.rule import RuleWrapper, SyncRule
from edit_jax.localsgd.stale import StaleSync
from edit_jax.localsgd.timed import Timed

OWNING = (StaleSync,)  # rules with fields of their own (``owned_fields``), used by no other rule


def validate(cfg: Config) -> None:
    """Every rule's field rules, then the method's own rule's relations with the rest of the config."""
    s = cfg.sync
    StaleSync.validate_fields(s)
    Compressed.validate_fields(s)
    Timed.validate_fields(s)
    m = METHODS.get(s.method)
    if m is None:
        return  # methods.validate names the field
    rule = m.rule(s)
    for owner in OWNING:
        if not _holds(rule, owner):
            for key in owner.owned_fields:
                require(getattr(s, key) == getattr(SyncConfig, key), f"sync.{key}",
                        f"is used by method {_methods_of(lambda r: _holds(r, owner))} only (method is {s.method!r}); "
                        f"got {getattr(s, key)}")
    # Workers meeting through an exchange post and apply rounds by wall clock, each at its own pace.
    require(not s.exchange or rule.asynchronous, "sync.exchange", "workers meeting through an exchange run "
            f"an asynchronous rule (method={_methods_of(lambda r: r.asynchronous)}), got method={s.method}")
    rule.check_config(cfg)


def _holds(rule: SyncRule, cls: type) -> bool:
    """``rule`` is a ``cls``, or wraps one."""
    while isinstance(rule, RuleWrapper) and not isinstance(rule, cls):
        rule = rule.rule
    return isinstance(rule, cls)


def _methods_of(pred) -> str:
    """The names of the methods whose rule (built from the default sync config) satisfies ``pred``."""
    return " | ".join(name for name, m in METHODS.items() if pred(m.rule(SyncConfig())))


__all__ = ["validate"]
