"""Typed configuration: nested dataclasses, one section per concern (``sections.py``), read from
dotted ``key=value`` overrides and JSON (``parse.py``), from files and presets (``files.py``), with
keys that moved into sections still read (``renames.py``) and the fields' own checks (``checks.py``).

A config file is a Python file with a ``get_config()`` function returning a ``Config``; reading one
is ``edit_jax.config.files.read_config``. Overrides are ``key=value`` strings with dotted keys
(``mesh.replica=4``, ``steps=100``); values are parsed according to the field's declared type.
Every error names the key.

A leaf package (it imports nothing from the rest of ``edit_jax``: every part imports it).
``checks.check_fields`` checks the fields on their own; a rule needing a part of the package is its
``validate(cfg)``; ``validate.load_config`` runs them all.
"""

from edit_jax.config.parse import (ALIASES, apply_overrides, dumps, from_dict, get_field, require, to_dict,
                                   with_fields)
from edit_jax.config.sections import (COMPRESS, MODEL_CONFIGS, CO2Config, Config, ConfigError, DataConfig, DebugConfig,
                                      ExchangeConfig, FamilyConfig, LlamaConfig, LogConfig, MeshConfig, ModelConfig,
                                      OptimConfig, OuterConfig, PenaltyConfig, RULE_SECTIONS, SpikeConfig, SyncConfig,
                                      TimeConfig, TrainConfig, WireConfig, model_config_class,
                                      register_rule_section)

__all__ = ["Config", "FamilyConfig", "ModelConfig", "LlamaConfig", "MODEL_CONFIGS", "model_config_class", "MeshConfig",
           "DataConfig", "OptimConfig", "SyncConfig", "PenaltyConfig", "OuterConfig", "WireConfig", "CO2Config",
           "TimeConfig", "ExchangeConfig", "DebugConfig", "LogConfig", "TrainConfig", "SpikeConfig", "ConfigError",
           "COMPRESS", "ALIASES", "apply_overrides", "require", "to_dict", "from_dict", "dumps", "get_field",
           "with_fields", "RULE_SECTIONS", "register_rule_section"]
