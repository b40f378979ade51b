"""edit-jax: EDiT / A-EDiT Local-SGD training of Llama-style models on a (replica, shard) mesh.

The public API (optax / flax style)::

    import edit_jax

    cfg = edit_jax.load_config("configs/demo.py", ["steps=100", "method=diloco"])
    result = edit_jax.train(cfg, run_dir="runs/api")      # a TrainResult
    model = edit_jax.load_trained("runs/api")              # θ̄, config and tokenizer of a run

    # or around your own model, optax optimizer and loop (docs/api.md):
    trainer = edit_jax.LocalSGD(edit_jax.diloco(), mesh, tau=16, inner_step=train_step)
    state = trainer.init(params, opt_state)
    state, metrics = trainer.step(state, batch)            # batch stacked per worker: [N, B, ...]

The packages are the architecture: ``localsgd/`` (the algorithm and its compiled step),
``training/`` (the loop and its hooks), ``runtime/`` (devices, processes, the mesh), ``rundir/``
(what a run leaves on disk), ``models/``, ``hf/``, ``data/``, ``placement/`` and ``tools/``; at
the root only what every part uses (``config``, ``validate``, ``presets``) and
the command line (``cli``).

The names below load on first use (PEP 562), so ``import edit_jax`` imports no JAX: the command
line and a user's script can still set the CPU device count (``set_cpu_device_count``) first.
"""

from __future__ import annotations

import importlib

__version__ = "0.8.0"

# name -> the module that defines it
_API = {
    "train": "edit_jax.training.train",
    "TrainResult": "edit_jax.training.result",
    "load_config": "edit_jax.validate",
    "Config": "edit_jax.config",
    "ModelConfig": "edit_jax.config",
    "FamilyConfig": "edit_jax.config",
    "LlamaConfig": "edit_jax.config",
    "MeshConfig": "edit_jax.config",
    "DataConfig": "edit_jax.config",
    "OptimConfig": "edit_jax.config",
    "SyncConfig": "edit_jax.config",
    "LogConfig": "edit_jax.config",
    "DebugConfig": "edit_jax.config",
    "TrainConfig": "edit_jax.config",
    "SpikeConfig": "edit_jax.config",
    "ConfigError": "edit_jax.config",
    "DivergedError": "edit_jax.training.resume",
    "CheckpointError": "edit_jax.rundir.checkpoint",
    "RunLockError": "edit_jax.rundir.runlock",
    "load_trained": "edit_jax.rundir.trained",
    "TrainedModel": "edit_jax.rundir.trained",
    "set_cpu_device_count": "edit_jax.runtime.mesh",
    # DiLoCo / EDiT around your own model, optimizer and loop (docs/api.md)
    "LocalSGD": "edit_jax.localsgd.api",
    "scan_blocks": "edit_jax.localsgd.nnx_model",
    "scan_layers": "edit_jax.localsgd.layer_scan",
    "LocalSGDState": "edit_jax.localsgd.api",
    "LocalSGDRule": "edit_jax.localsgd.api",
    "diloco": "edit_jax.localsgd.api",
    "post_local_sgd": "edit_jax.localsgd.api",
    "edit": "edit_jax.localsgd.api",
    "co2": "edit_jax.localsgd.api",
    "compressed": "edit_jax.localsgd.api",
    "from_method": "edit_jax.localsgd.api",
    "Penalty": "edit_jax.localsgd.api",
    "OuterSpec": "edit_jax.localsgd.api",
    "identity_hook": "edit_jax.localsgd.api",
    "LayerStack": "edit_jax.localsgd.layer_stack",
    "save_local_sgd": "edit_jax.rundir.localsgd_checkpoint",
    "LocalSGDRecords": "edit_jax.rundir.localsgd_records",
    "restore_local_sgd": "edit_jax.rundir.localsgd_checkpoint",
    "saved_local_sgd_steps": "edit_jax.rundir.localsgd_checkpoint",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'edit_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


def api_modules() -> dict[str, str]:
    """The root API: each name with the module that defines it (what the docs' API page lists)."""
    return dict(_API)
