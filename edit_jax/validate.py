"""A whole config checked before any work: every rule, composed from the parts that own them.

    cfg = load_config("configs/demo.py", ["steps=100", "method=diloco"])  # read, then validate

``config`` is a leaf package (dataclasses, overrides, serialisation; ``config.files`` reads files);
its ``check_fields`` checks what the fields say on their own. A rule that needs a part of the package lives with that
part as its ``validate(cfg)``, next to what it checks against:

- ``data.sources``: ``data.source`` (the ``SOURCES`` registry), ``data.paths``, ``data.token_dtype``;
- ``models.family``: ``model.family``;
- ``hf.load``: ``model.init_from`` (its config.json; ``load_config`` first adopts its architecture);
- ``localsgd.methods``: ``sync.method``, ``sync.outer.optimizer``, what a method allows (CO2's
  fields; an asynchronous method's processes and outer state: A-EDiT);
- ``placement``: the ``mesh.placement`` file;
- ``runtime.multihost``: ``mesh.processes`` and the multi-process rules, ``debug.slowdown``;
- ``data.corrupt``: ``debug.corrupt``, ``debug.lr_spike``;
- ``rundir.tensorboard``: ``log.tensorboard`` (tensorboardX installed);
- ``rundir.wandb_log``: ``log.wandb`` (wandb installed), ``log.wandb_project``;
- ``runtime.compile_cache``: ``train.compile_cache`` and ``$EDIT_JAX_COMPILE_CACHE`` can be directories.

``validate`` runs ``check_fields`` first (so a part may assume ranges hold, e.g. ``mesh.replica
> 0``), then each part in that order; the first broken rule raises ``ConfigError`` naming its key.
To add a check: a field-only one goes into ``config.checks.check_fields``; one that asks a part goes into
that part's ``validate`` (a new part: a ``validate(cfg)`` there and one line below).

Nothing here needs devices or data, or starts a JAX backend: ``edit-jax train`` validates before
it sets the CPU device count (importing the data package imports JAX, which reads the count only
when its first backend starts; tests/test_imports.py checks this).
"""

from __future__ import annotations

from edit_jax.config import Config, ConfigError
from edit_jax.config.checks import check_fields
from edit_jax.config.files import read_config
from edit_jax.data import corrupt, sources
from edit_jax.hf import load as hf_load
from edit_jax.localsgd import methods, rules
from edit_jax.models import family
from edit_jax.placement import validate as placement_rules
from edit_jax.rundir import tensorboard, wandb_log
from edit_jax.runtime import compile_cache, multihost


def validate(cfg: Config) -> None:
    """Checks every constraint that can be checked without devices or data."""
    check_fields(cfg)
    sources.validate(cfg)
    family.validate(cfg)
    hf_load.validate(cfg)
    methods.validate(cfg)
    rules.validate(cfg)
    placement_rules(cfg)
    multihost.validate(cfg)
    corrupt.validate(cfg)
    tensorboard.validate(cfg)
    wandb_log.validate(cfg)
    compile_cache.validate(cfg)


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Loads ``path`` (a Python file with ``get_config()``, or a preset name), applies overrides,
    takes the architecture from ``model.init_from`` where set, and validates the result."""
    cfg = hf_load.adopt_architecture(read_config(path, overrides), overrides)
    validate(cfg)
    return cfg


__all__ = ["validate", "load_config", "ConfigError"]
