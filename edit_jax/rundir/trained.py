"""A trained model read back from a run dir: its config, the model params and its tokenizer.

    model = load_trained("runs/demo")            # latest checkpoint
    model = load_trained("runs/demo", step=200)  # a given one

The params are θ̄, the outer params (``state.outer.params``), for the methods that keep one, and
the replicas' params (``state.params[0]``, identical on every replica) for the Baseline and for
a checkpoint taken during the synchronous warmup (step <= W, before θ̄ is first set). θ̄ is the
model as of the last sync: with EDiT's layer-wise sync it can be up to ``sync.tau`` inner steps
behind the replicas (the val_loss records of training use a fresh, uncommitted sync instead).

Only those arrays are read from the checkpoint (orbax partial restore), as host NumPy arrays of
their logical shapes, whatever the mesh, ``sync.outer_sharding`` or ``sync.cpu_offload`` of the
run: no devices, no mesh. The config is the one stored in the checkpoint's metadata (the one that
wrote it), so a run resumed with another number of replicas still loads. The arrays read are
verified against the checksums saved with the checkpoint (``TrainedModelError`` naming it, and the
older checkpoints, if they differ: damaged on disk).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from edit_jax.config import Config, ConfigError, from_dict
from edit_jax.config.renames import quiet, upgrade
from edit_jax.data import DataError, make_tokenizer
from edit_jax.localsgd.state import state_shapes, state_shapes_of_format
from edit_jax.rundir.checkpoint import UnreadableCheckpointError, check_checksums
from edit_jax.rundir.integrity import leaves_hash, part_checksums, unpack_arrays


class TrainedModelError(RuntimeError):
    """A run dir, checkpoint or tokenizer that cannot be used; the message names the path."""


@dataclass
class TrainedModel:
    cfg: Config  # the config stored with the checkpoint
    step: int
    params: Any  # host NumPy tree: {"root": ..., "layers": ...} (model.init_params layout)
    source: str  # "outer" (θ̄) or "replica" (state.params[0])
    checkpoint: str  # path of the checkpoint read
    run_dir: str = ""  # the run dir it was read from (its tokenizer.json copy, if any)


def checkpoint_steps(run_dir: str) -> tuple[str, list[int]]:
    """(checkpoints dir, steps with a complete checkpoint, ascending); errors name the path."""
    if not os.path.isdir(run_dir):
        raise TrainedModelError(f"run dir {run_dir!r} not found (expected the --run-dir of an `edit-jax train` run)")
    directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    steps = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            # orbax writes into a temporary name and renames on commit: only finished steps are digits.
            if name.isdigit() and os.path.isdir(os.path.join(directory, name, "state")):
                steps.append(int(name))
    if not steps:
        raise TrainedModelError(f"run dir {run_dir!r} has no checkpoint (expected {directory}/<step>/state, "
                                "written by `edit-jax train` every checkpoint_every steps and at the end)")
    return directory, sorted(steps)


def _older_hint(steps: list[int], step: int) -> str:
    """What to do about an unusable checkpoint ``step``: name the older ones to pass with --step."""
    older = [s for s in steps if s < step]
    if not older:
        return " (no older checkpoint to fall back on)"
    return f"; pass --step {older[-1]} to use an older checkpoint (on disk: {', '.join(map(str, older))})"


def load_exchange_state(run_dir: str) -> TrainedModel:
    """θ̄ of an exchange-mode A-EDiT run (``sync.exchange.url``): its closer saves the newest round state
    as ``RUN_DIR/exchange_state.npz`` every ``checkpoint_every`` steps and at the end
    (elastic/worker.py): the leaves of (θ̄, outer state, detectors) and their hash, checked here."""
    path = os.path.join(run_dir, "exchange_state.npz")
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            cfg = from_dict(upgrade(json.load(f), quiet))  # (a run dir of an older version: its keys as today's)
        with open(path, "rb") as f:
            leaves, meta = unpack_arrays(f.read(), path)
    except (OSError, ValueError, KeyError, ConfigError) as e:
        raise TrainedModelError(f"{path}: cannot be read ({type(e).__name__}: {e})") from e
    if leaves_hash(leaves) != meta.get("hash"):
        raise TrainedModelError(f"{path}: its arrays do not match the hash saved with them (damaged on disk)")
    template = state_shapes(cfg).outer.params
    n = len(jax.tree.leaves(template))
    params = jax.tree.unflatten(jax.tree.structure(template), leaves[:n])
    if any(np.shape(a) != b.shape for a, b in zip(leaves[:n], jax.tree.leaves(template), strict=True)):
        raise TrainedModelError(f"{path}: its θ̄ does not fit the run's config.json model")
    step = int(meta["tally"]) // cfg.mesh.replica
    return TrainedModel(cfg, step, params, "outer", path, run_dir)


def load_trained(run_dir: str, step: int | None = None) -> TrainedModel:
    """Reads the model params of checkpoint ``step`` (default: the latest) of ``run_dir``; of an
    exchange-mode run (no checkpoints/, an ``exchange_state.npz``), its newest saved θ̄."""
    import orbax.checkpoint as ocp

    if step is None and os.path.exists(os.path.join(run_dir, "exchange_state.npz")) \
            and not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        return load_exchange_state(run_dir)
    directory, steps = checkpoint_steps(run_dir)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise TrainedModelError(f"run dir {run_dir!r} has no checkpoint for step {step} "
                                f"(expected one of {', '.join(map(str, steps))} in {directory})")
    path = os.path.join(directory, str(step))
    try:
        meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(os.path.join(path, "meta"))
        cfg = from_dict(upgrade(meta["config"], quiet))
    except (ConfigError, KeyError, TypeError) as e:
        raise TrainedModelError(f"checkpoint {path}: its stored config cannot be read: {e}") from e
    except Exception as e:  # orbax raises many types
        raise TrainedModelError(f"checkpoint {path} is unreadable (metadata): {type(e).__name__}: {e}") from e
    shapes = state_shapes(cfg)
    # The shapes the checkpoint's checksums were computed over (as its format laid them out).
    whole = state_shapes_of_format(cfg, meta.get("state_format", 1))
    use_outer = shapes.outer is not None and step > cfg.sync.warmup_steps
    item = {"outer": {"params": shapes.outer.params}} if use_outer else {"params": shapes.params}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    try:
        out = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(os.path.join(path, "state"), args=(
            ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)))
    except Exception as e:
        raise TrainedModelError(f"checkpoint {path} could not be read: {type(e).__name__}: {e}"
                                f"{_older_hint(steps, step)}") from e
    # The same checksums a resume verifies, over the arrays read here: damaged bytes would
    # otherwise become an export with wild weights or garbage samples.
    part, prefix = (out["outer"]["params"], ".outer.params") if use_outer else (out["params"], ".params")
    saved = meta.get("checksums")  # absent: written before checksums existed
    if saved is not None:
        now = part_checksums(part, prefix, whole)
        try:
            check_checksums(path, {k: saved.get(k) for k in now}, now)
        except UnreadableCheckpointError as e:
            raise TrainedModelError(f"{e}{_older_hint(steps, step)}") from e
    if use_outer:
        params = out["outer"]["params"]
    else:
        params = jax.tree.map(lambda x: np.asarray(x)[0], out["params"])
    return TrainedModel(cfg, int(step), params, "outer" if use_outer else "replica", path, run_dir)


def load_tokenizer(cfg: Config, override: str | None = None, run_dir: str = ""):
    """The run's tokenizer, or ``override``; checked against the model's vocabulary. The run's is
    the copy in ``RUN_DIR/tokenizer.json`` that training stores (``run_tokenizer_copy``), else
    ``data.tokenizer`` ("byte", or a tokenizer.json path as given at training time, relative to
    the current dir: runs from before the copy existed)."""
    spec = tokenizer_spec(cfg, override, run_dir)
    if spec != "byte" and not os.path.isfile(spec):
        hint = "" if override else " (the run's data.tokenizer, relative to the current directory)"
        raise TrainedModelError(f"tokenizer file {spec!r}{hint} not found: expected a tokenizer.json; "
                                "pass its path with --tokenizer")
    try:
        tok = make_tokenizer(spec)
    except DataError as e:
        raise TrainedModelError(str(e)) from e
    if tok.vocab_size > cfg.model.vocab_size:
        raise TrainedModelError(f"tokenizer {spec!r} has {tok.vocab_size} ids but the model's vocabulary is "
                                f"{cfg.model.vocab_size}: not the tokenizer this model was trained with")
    return tok


def tokenizer_spec(cfg: Config, override: str | None = None, run_dir: str = "") -> str:
    """``override``, else the run dir's tokenizer.json copy, else ``data.tokenizer``."""
    if override:
        return override
    copy = os.path.join(run_dir, RUN_TOKENIZER) if run_dir else ""
    if cfg.data.tokenizer != "byte" and copy and os.path.isfile(copy):
        return copy
    return cfg.data.tokenizer


def tokenizer_file(cfg: Config, override: str | None = None, run_dir: str = "") -> str | None:
    """The tokenizer.json path to ship with the model, or None for the byte tokenizer."""
    spec = tokenizer_spec(cfg, override, run_dir)
    return None if spec == "byte" else spec


RUN_TOKENIZER = "tokenizer.json"


def store_run_tokenizer(cfg: Config, run_dir: str) -> None:
    """Copies the run's tokenizer.json into ``run_dir`` (training, process 0), so that the run dir
    is self-contained: ``sample`` / ``export`` from any directory use the tokenizer it was trained
    with, even when ``data.tokenizer`` was a relative path. A copy that differs from
    ``data.tokenizer`` (this run dir was trained with another tokenizer) is an error, never
    overwritten."""
    if cfg.data.tokenizer == "byte":
        return
    copy = os.path.join(run_dir, RUN_TOKENIZER)
    with open(cfg.data.tokenizer, "rb") as f:
        data = f.read()
    if os.path.isfile(copy):
        with open(copy, "rb") as f:
            if f.read() != data:
                raise DataError(f"{copy} differs from data.tokenizer={cfg.data.tokenizer!r}: this run dir was trained "
                                "with another tokenizer; use a new --run-dir (or the tokenizer it was trained with)")
        return
    tmp = copy + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, copy)


__all__ = ["TrainedModel", "TrainedModelError", "checkpoint_steps", "load_trained", "load_tokenizer",
           "tokenizer_file", "tokenizer_spec", "store_run_tokenizer", "RUN_TOKENIZER"]
