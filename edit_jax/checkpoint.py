"""Checkpoints with orbax: the whole train state, the data iterator position and a metadata record.

Layout: ``RUN_DIR/checkpoints/<step>/{state,data,meta}``. ``meta`` holds the config that wrote the
checkpoint and the state's format (``state.STATE_FORMAT``; absent: format 1), so that a resume with an incompatible config (other model shape, shard count or
method) is refused with a message naming the keys, instead of failing deep inside orbax.
A checkpoint that cannot be read is reported and left in place: nothing is written over it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from edit_jax.config import Config, to_dict
from edit_jax.state import STATE_FORMAT

# Keys whose change makes a checkpoint's arrays unusable (their shapes or structure depend on them).
# mesh.replica is absent on purpose: the number of workers may change across a restart (elastic).
STRUCTURAL_KEYS = ["model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                   "model.ffn_dim", "model.tie_embeddings", "mesh.shard", "sync.method", "sync.anomaly_warmup"]


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used; it is left untouched."""


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else None
    return d


class Checkpointer:
    def __init__(self, run_dir: str, keep: int):
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, cfg: Config) -> None:
        if int(step) in self.manager.all_steps():  # e.g. a signal right after a periodic save
            return
        meta = {"config": to_dict(cfg), "step": int(step), "state_format": STATE_FORMAT}
        self.manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        path = os.path.join(self.directory, str(step))
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return out["meta"]
        except Exception as e:  # noqa: BLE001 - orbax raises many types; report them all the same way
            raise CheckpointError(f"checkpoint {path} is unreadable (metadata): {type(e).__name__}: {e}. "
                                  "It was left untouched; move it away to start over.") from e

    def check_compatible(self, meta: dict, cfg: Config, step: int) -> None:
        saved, now = meta.get("config", {}), to_dict(cfg)
        diffs = [f"{k}: checkpoint {_get(saved, k)!r}, config {_get(now, k)!r}"
                 for k in STRUCTURAL_KEYS if _get(saved, k) != _get(now, k)]
        if diffs:
            raise CheckpointError(f"checkpoint {os.path.join(self.directory, str(step))} is incompatible with the "
                                  f"config ({'; '.join(diffs)}). Use another --run-dir, or the config that wrote it.")

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        path = os.path.join(self.directory, str(step))
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {path} could not be restored: {type(e).__name__}: {e}. "
                                  "It was left untouched; move it away to start over.") from e
        return out["state"], out["data"]

    def restore_host(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores into host NumPy arrays of the saved shapes (for elastic restarts with another N)."""
        path = os.path.join(self.directory, str(step))
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract_state)
        # A manager of its own: orbax binds an item's handler type (here PyTree, not Standard) at
        # first use, and the run's manager must keep saving with StandardSave afterwards.
        reader = ocp.CheckpointManager(self.directory, item_names=("state", "data", "meta"),
                                       options=ocp.CheckpointManagerOptions(create=False, read_only=True))
        try:
            out = reader.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args),
                data=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {path} could not be restored: {type(e).__name__}: {e}. "
                                  "It was left untouched; move it away to start over.") from e
        finally:
            reader.close()
        return out["state"], out["data"]

    def close(self) -> None:
        self.manager.close()
