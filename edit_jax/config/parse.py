"""Reading a config: ``key=value`` overrides with dotted keys, parsed by each field's declared type;
JSON dicts (a run dir's ``config.json``) checked key by key; a config as a dict and back. Every
error names the key."""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from typing import Any

from edit_jax.config.sections import RULE_SECTIONS, Config, ConfigError, FamilyConfig, SyncConfig, model_config_class

ALIASES = {"method": "sync.method"}  # `method=NAME` is shorthand for `sync.method=NAME`


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse_value(key: str, text: str, typ: Any) -> Any:
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
        if typ is str:
            return text
        if origin is tuple:
            if text.strip() in ("", "()", "[]"):
                return ()
            if text.strip().startswith("["):
                items = json.loads(text)
            else:
                items = [t for t in text.split(",") if t]
            (elem,) = {a for a in typing.get_args(typ) if a is not Ellipsis}
            return tuple(_parse_value(key, str(i), elem) for i in items)
    except (ValueError, json.JSONDecodeError):
        pass
    name = getattr(typ, "__name__", str(typ))
    raise ConfigError(f"config key '{key}': expected a value of type {name}, got {text!r}")


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Returns a copy of ``cfg`` with ``key=value`` overrides applied (dotted keys)."""
    cfg = from_dict(to_dict(cfg))
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. steps=100)")
        key, text = item.split("=", 1)
        pairs.append((ALIASES.get(key.strip(), key.strip()), text))
    # model.family first: it chooses the model section's class, whose fields the other keys name
    for key, text in sorted(pairs, key=lambda kv: kv[0] != "model.family"):
        if key == "model.family":
            cfg.model = _with_family(cfg.model, text)
            continue
        obj, parts = cfg, key.split(".")
        for depth, part in enumerate(parts):
            types_ = _field_types(type(obj))
            if isinstance(obj, SyncConfig) and part in RULE_SECTIONS and depth < len(parts) - 1:
                obj = obj.rule_sections.setdefault(part, RULE_SECTIONS[part]())  # a registered rule's section
                continue
            if isinstance(obj, SyncConfig):  # its own sections and the registered rules', not the dict
                types_ = {**{k: t for k, t in types_.items() if k != "rule_sections"}, **RULE_SECTIONS}
            if part not in types_:
                prefix = ".".join(parts[:depth])
                known = [f"{prefix}.{k}" if prefix else k for k in types_]
                close = difflib.get_close_matches(key, known, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(known)}"
                if isinstance(obj, FamilyConfig):  # the keys of the section the family chose
                    hint = f" (model.family={obj.family!r} takes {type(obj).__name__}){hint}"
                raise ConfigError(f"unknown config key '{key}'{hint}")
            if depth == len(parts) - 1:
                if dataclasses.is_dataclass(types_[part]):
                    raise ConfigError(f"config key '{key}' is a section; set one of its fields ({key}.NAME=VALUE)")
                setattr(obj, part, _parse_value(key, text, types_[part]))
            else:
                obj = getattr(obj, part)
                if not dataclasses.is_dataclass(obj):
                    raise ConfigError(f"config key '{'.'.join(parts[:depth + 1])}' is not a section")
    return cfg


def _family_class(d: Any, key: str) -> type:
    family = d.get("family", FamilyConfig.family) if isinstance(d, dict) else FamilyConfig.family
    if not isinstance(family, str):
        raise ConfigError(f"config key '{key}.family': expected str, got {family!r}")
    return model_config_class(family)


def _with_family(model: FamilyConfig, family: str) -> FamilyConfig:
    """``model`` as family ``family``'s config: the fields every family has carried over, the
    family's own at their defaults (the keys after ``model.family`` set them)."""
    cls = model_config_class(family)
    if type(model) is cls:
        return dataclasses.replace(model, family=family)
    common = {f.name: getattr(model, f.name) for f in dataclasses.fields(FamilyConfig)}
    return cls(**{**common, "family": family})


def to_dict(cfg) -> dict:
    d = dataclasses.asdict(cfg)
    sync = d.get("sync") if isinstance(cfg, Config) else d if isinstance(cfg, SyncConfig) else None
    if sync is not None:  # a registered rule's section is written as sync.NAME, as a field's is
        sync.update(sync.pop("rule_sections"))
    return d


def from_dict(d: dict, cls=Config, prefix: str = "") -> Any:
    """Builds a config from a (JSON) dict, checking keys and types; errors name the key. (A dict
    written before some keys moved into sections: ``renames.upgrade`` it first.)"""
    if not isinstance(d, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}': expected a mapping, "
                          f"got {type(d).__name__}")
    types_ = _field_types(cls)
    kwargs = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if cls is SyncConfig and k in RULE_SECTIONS:  # a registered rule's section
            kwargs.setdefault("rule_sections", {})[k] = from_dict(v, RULE_SECTIONS[k], key + ".")
            continue
        if k not in types_ or (cls is SyncConfig and k == "rule_sections"):
            if cls is SyncConfig and isinstance(v, dict):
                raise ConfigError(f"unknown config key '{key}': not a section of SyncConfig, nor of a rule registered "
                                  f"in this process ({', '.join(RULE_SECTIONS) or 'none'}; a rule from outside the "
                                  "library registers its section with its method, localsgd.methods.register, before "
                                  "the config is read)")
            if issubclass(cls, FamilyConfig):  # e.g. Llama's d_model given to a family of other fields
                family = d.get("family", "llama")
                llamas = family != "llama" and model_config_class(family) is model_config_class("llama")
                unregistered = " (a family with fields of its own registers its class first: models.family.register)" \
                    if llamas else ""
                raise ConfigError(f"unknown config key '{key}': model.family={family!r} takes "
                                  f"{cls.__name__}, whose fields are {', '.join(types_)}{unregistered}")
            raise ConfigError(f"unknown config key '{key}'")
        typ = types_[k]
        if typ is FamilyConfig:  # the model section: the class its family registered
            kwargs[k] = from_dict(v, _family_class(v, key), key + ".")
        elif dataclasses.is_dataclass(typ):
            kwargs[k] = from_dict(v, typ, key + ".")
        elif typing.get_origin(typ) is tuple:
            if not isinstance(v, (list, tuple)):
                raise ConfigError(f"config key '{key}': expected a list, got {v!r}")
            kwargs[k] = tuple(v)
        elif typ is float and isinstance(v, int) and not isinstance(v, bool):
            kwargs[k] = float(v)
        else:
            if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
                raise ConfigError(f"config key '{key}': expected {typ.__name__}, got {v!r}")
            kwargs[k] = v
    return cls(**kwargs)


# ----------------------------------------------------------------------------- checks of the fields


def require(cond: bool, key: str, msg: str) -> None:
    """Raises ``ConfigError`` naming ``key`` unless ``cond``: the one form of every config check."""
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def get_field(cfg: Any, key: str) -> Any:
    """``cfg``'s field at the dotted ``key`` (``"outer.lr"``: a section's field)."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def with_fields(cfg: Any, fields: dict) -> Any:
    """``cfg`` with the fields at the dotted keys of ``fields`` replaced, sections copied."""
    top, nested = {}, {}
    for key, value in fields.items():
        head, dot, rest = key.partition(".")
        if dot:
            nested.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, sub in nested.items():
        top[head] = with_fields(top.get(head, getattr(cfg, head)), sub)
    if isinstance(cfg, SyncConfig):  # a registered rule's section goes into rule_sections
        own = {k: top.pop(k) for k in list(top) if k in RULE_SECTIONS}
        if own:
            top["rule_sections"] = {**cfg.rule_sections, **own}
    return dataclasses.replace(cfg, **top)


def dumps(cfg: Config) -> str:
    return json.dumps(to_dict(cfg), indent=2)


__all__ = ["ALIASES", "apply_overrides", "from_dict", "to_dict", "dumps", "require", "get_field", "with_fields"]
