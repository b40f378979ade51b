"""Reading a config from a .py / .json file or a preset name, then the overrides.

* ``read_config``: the file (or preset, or run dir) loaded, then ``key=value`` overrides, unchecked.
* where a name is looked for: the path itself, a run dir's config.json, configs/NAME.py here or in the repo.
* ``_load_json``: a config as every run writes it to RUN_DIR/config.json.
* ``_load_file``: a Python file's ``get_config()``, its failures (sys.exit included) as ``ConfigError``.

``edit_jax.validate.load_config`` is ``read_config`` plus every check. ``_repo_configs_dir`` finds
the repo's configs/ from this file's place (edit_jax/config/).
"""

from __future__ import annotations

import importlib.util
import json
import os

from edit_jax.config.parse import apply_overrides, from_dict, to_dict
from edit_jax.config.sections import Config, ConfigError
from edit_jax.config.renames import hint_for, override, upgrade


def read_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Loads ``path`` (a Python file with ``get_config()``, or a preset name) and applies overrides,
    unchecked: ``edit_jax.validate.load_config`` is this plus every check."""
    if path is None:
        cfg = Config()
    else:
        path = _resolve_config_path(path)
        cfg = _load_json(path) if path.endswith(".json") else _load_file(path)
    return apply_overrides(cfg, [override(item) for item in overrides])  # a key that moved: its new name


def _resolve_config_path(path: str) -> str:
    if os.path.isfile(path):
        return path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.join(path, "config.json")  # a run dir: relaunch what it ran
    candidates = [os.path.join("configs", path + ".py"), os.path.join(_repo_configs_dir(), path + ".py")]
    for c in candidates:
        if os.path.isfile(c):
            return c
    looked = []  # each place once (from the repo root, configs/X.py and REPO/configs/X.py are one file)
    for c in [path] + candidates:
        if os.path.abspath(c) not in [os.path.abspath(x) for x in looked]:
            looked.append(c)
    raise ConfigError(f"config file {path!r} not found (looked for {', '.join(map(repr, looked))})")


def _repo_configs_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def _exit_call(e: SystemExit) -> str:
    """``sys.exit(7)`` / ``sys.exit('why')``: how the user's code asked to exit."""
    return f"sys.exit({e.code!r})" if e.code is not None else "sys.exit()"


def _load_json(path: str) -> Config:
    """A config as JSON: what every run writes to ``RUN_DIR/config.json``, so that
    ``--config runs/x/config.json --run-dir runs/y`` relaunches run x's setup."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} is not valid JSON ({e}); expected a config as written to "
                          "RUN_DIR/config.json") from e
    try:
        return from_dict(upgrade(d, what=f"config file {path!r}"))
    except ConfigError as e:
        raise ConfigError(f"config file {path!r}: {e}") from e


def _load_file(path: str) -> Config:
    if not path.endswith(".py"):
        raise ConfigError(f"config file {path!r}: expected a Python file with get_config() (.py) or a JSON config "
                          "(.json, as a run dir's config.json)")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"config file {path!r} cannot be read (permission denied)")
    spec = importlib.util.spec_from_file_location(f"edit_jax_user_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:  # a BaseException: it would end the CLI with its code and no message
        raise ConfigError(f"config file {path!r} called {_exit_call(e)} while loading "
                          "(expected it to define get_config())") from e
    except Exception as e:  # report any failure of the user's file with its path
        raise ConfigError(f"config file {path!r} failed to load: {type(e).__name__}: {e}") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} has no get_config() function")
    try:
        cfg = module.get_config()
    except SystemExit as e:
        raise ConfigError(f"config file {path!r}: get_config() called {_exit_call(e)} "
                          "(expected it to return a Config)") from e
    except Exception as e:  # the user's code: report it with its file
        hint = hint_for(str(e)) if isinstance(e, TypeError) else ""  # an old keyword: its new key
        raise ConfigError(f"config file {path!r}: get_config() raised {type(e).__name__}: {e}{hint}") from e
    if not isinstance(cfg, Config):
        raise ConfigError(f"config file {path!r}: get_config() returned {type(cfg).__name__}, "
                          f"expected edit_jax.config.Config")
    try:  # every section its dataclass, every field its type (a section given a plain value: an old keyword)
        from_dict(to_dict(cfg))
    except ConfigError as e:
        raise ConfigError(f"config file {path!r}: {e}{hint_for(str(e))}") from e
    return cfg


__all__ = ["read_config"]
