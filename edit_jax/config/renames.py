"""Config keys that moved into a section, and how an old key is still read (by the readers of
configs: ``files.py``, a checkpoint's and a run dir's readers; ``sections.py`` and ``parse.py`` know nothing of it).

A config's fields are grouped in sections, one per concern (``sync.wire``: the codec). What a run
wrote before a key moved keeps working: a command line or a ``config.json`` (a run dir's, or a
checkpoint's metadata) with the flat key is read as the new one, and the reader is told once per
key and process, one line naming the new name. A Python config file that passes an old keyword
(``SyncConfig(compress="int8")``) fails with the new name in the message (``files.py``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from edit_jax.config.sections import SyncConfig

# old dotted key -> new dotted key (2026-11-28: the wire's six fields became the sync.wire section)
RENAMED = {
    "sync.compress": "sync.wire.kind",
    "sync.error_feedback": "sync.wire.error_feedback",
    "sync.ef_decay": "sync.wire.decay",
    "sync.ef_dtype": "sync.wire.residual_dtype",
    "sync.sparse_chunk": "sync.wire.chunk",
    "sync.sparse_k": "sync.wire.k",
    # (the same day: CO2's own fields became its section)
    "sync.co2_gap_penalty": "sync.co2.gap_penalty",
    "sync.co2_momentum_clip": "sync.co2.momentum_clip",
    # (2026-11-29: the outer optimizer's five fields became the sync.outer section)
    "sync.outer_optimizer": "sync.outer.optimizer",
    "sync.outer_lr": "sync.outer.lr",
    "sync.outer_momentum": "sync.outer.momentum",
    "sync.nesterov": "sync.outer.nesterov",
    "sync.outer_b2": "sync.outer.b2",
    # (the same day: EDiT's penalty became the sync.penalty section)
    "sync.anomaly": "sync.penalty.anomaly",
    "sync.anomaly_alpha": "sync.penalty.anomaly_alpha",
    "sync.anomaly_warmup": "sync.penalty.anomaly_warmup",
    "sync.anomaly_threshold": "sync.penalty.anomaly_threshold",
    "sync.weighting": "sync.penalty.weighting",
    "sync.temperature": "sync.penalty.temperature",
    "sync.clip": "sync.penalty.clip",
    "sync.clip_threshold": "sync.penalty.clip_threshold",
    # (the same day: A-EDiT's timing and the exchange became the sync.time and sync.exchange sections;
    # sync.exchange itself, the URL, is now the section's url)
    "sync.tau_time": "sync.time.tau",
    "sync.min_total_steps": "sync.time.min_total_steps",
    "sync.step_weight_ratio": "sync.time.step_weight_ratio",
    "sync.exchange": "sync.exchange.url",
    "sync.grace": "sync.exchange.grace",
    "sync.late_posts": "sync.exchange.late_posts",
    "sync.progress_every": "sync.exchange.progress_every",
    "sync.exchange_patience": "sync.exchange.patience",
    "sync.carried_weight": "sync.exchange.carried_weight",
}
_TOLD: set[str] = set()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def new_key(key: str, say: Callable[[str], None] | None = None) -> str:
    """``key``, or its new name if it moved (said once per key and process)."""
    new = RENAMED.get(key)
    if new is None:
        return key
    if key not in _TOLD:
        _TOLD.add(key)
        (say or _say)(f"edit-jax: config key '{key}' is now '{new}' (read as that)")
    return new


def override(item: str) -> str:
    """A ``key=value`` override with its key's new name, if it moved."""
    key, eq, value = item.partition("=")
    new = new_key(key.strip()) if eq else key
    return f"{new}={value}" if eq and new != key.strip() else item


def upgrade(d: dict, say: Callable[[str], None] | None = None, what: str = "a config") -> dict:
    """A config dict (``config.json``'s, a checkpoint's ``meta["config"]``) with its moved keys in
    their sections; a copy, the input untouched. One line says which keys were read under their
    new names (``say``; None: stderr; ``what`` names the source). A dict holding a key under both
    names keeps the new one."""
    if not isinstance(d, dict):
        return d
    out, moved = _copy(d), []
    for old, new in RENAMED.items():
        *head, name = old.split(".")
        parent = _walk(out, head)
        if not isinstance(parent, dict) or name not in parent or isinstance(parent[name], dict):
            continue  # absent, or already the section of that name (sync.exchange: the URL's old key)
        value = parent.pop(name)
        *new_head, new_name = new.split(".")
        target = out
        for part in new_head:
            target = target.setdefault(part, {}) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            parent[name] = value
            continue  # a malformed section: from_dict names it
        target.setdefault(new_name, value)
        moved.append(f"{old} -> {new}")
    if moved:
        (say or _say)(f"edit-jax: {what} written before its keys moved, read as today's: {', '.join(moved)}")
    return out


def quiet(_: str) -> None:
    """A ``say`` for readers of internal metadata (a checkpoint's), where the line would be noise."""


def _walk(d: dict, parts: list[str]):
    for part in parts:
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def _copy(d):
    return {k: _copy(v) for k, v in d.items()} if isinstance(d, dict) else d


def hint_for(message: str) -> str:
    """For a Python config's error naming an old keyword (a TypeError: an unexpected keyword; a
    ``ConfigError``: a section given a plain value, ``SyncConfig(exchange="DIR")``): the sentence
    naming its new key."""
    for old in RENAMED:
        if ("unexpected keyword argument" in message and f"'{old.rsplit('.', 1)[1]}'" in message) or \
                f"config section '{old}': expected a mapping" in message:
            return _moved(old)
    return ""


def _moved(old: str) -> str:
    new = RENAMED[old]
    _, section, field = new.split(".")
    sections = {f.name: f.default_factory.__name__ for f in dataclasses.fields(SyncConfig)
                if f.default_factory is not dataclasses.MISSING}
    return f" ('{old}' is now '{new}': pass {section}={sections[section]}({field}=...) from edit_jax.config)"


__all__ = ["RENAMED", "new_key", "override", "upgrade", "quiet", "hint_for"]
