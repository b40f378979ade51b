"""Checkpoints of ``LocalSGD``'s state for a user's own loop (``edit_jax.save_local_sgd`` /
``restore_local_sgd``): every worker's params and optimizer state, θ̄ and the outer state, the
detectors, the rule's own state (CO2's in flight, a wire's residuals) and the step.

    edit_jax.save_local_sgd("ckpt", state)                  # ckpt/<step>, the newest `keep` kept
    state = edit_jax.restore_local_sgd("ckpt", trainer.init(params))   # the newest, onto init's layout

The guarantees of the trainer's checkpoints (``checkpoint.py``): written with orbax, whose
temporary directory is renamed to ``<step>`` only once complete (a crash mid-save leaves the older
checkpoints as the newest); a checksum of every array recorded at save time and verified on
restore (a damaged checkpoint is an ``UnreadableCheckpointError`` naming it and the arrays, and
is left as it is); restored bit for bit onto the layout of the state given (``trainer.init``'s), so
a run resumed from it continues exactly as the uninterrupted one. A checkpoint of another rule or
model (another pytree structure, shapes or dtypes) is a ``CheckpointError`` naming the first
difference, before any array is read. The arrays are saved as one flat list (orbax then never sees
the empty nodes a state may hold: optax's ``EmptyState``, a whole-model rule's empty layers).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from edit_jax.rundir.checkpoint import CheckpointError, UnreadableCheckpointError, _restore_failed, check_checksums
from edit_jax.rundir.integrity import state_checksums

FORMAT = 1  # of the saved LocalSGDState (meta "format")


def _arrays(state) -> Any:
    """The state's arrays as a tree (the host step aside)."""
    return state._replace(step=None)


def _layout(tree: Any) -> list[str]:
    """Each array's path, shape and dtype: what a checkpoint must match to be restored onto ``tree``."""
    return [f"{jax.tree_util.keystr(p)}: {tuple(np.shape(x))} {x.dtype}"
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _named(err: UnreadableCheckpointError, tree: Any) -> UnreadableCheckpointError:
    """``err`` with the saved arrays' flat names ("00006") given as the state's paths."""
    text, why = str(err), err.why or ""
    for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        text, why = (t.replace(f"{i:05d}:", f"state{jax.tree_util.keystr(p)}:") for t in (text, why))
    return UnreadableCheckpointError(text, why=why, details=err.details)


def _manager(directory: str, keep: int | None, create: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=("state", "meta"))


def save_local_sgd(directory: str, state, keep: int | None = 3) -> str:
    """Writes ``state`` (a ``LocalSGDState``) as ``directory/<state.step>``; keeps the newest
    ``keep`` (None: all). A step saved already is left as it is. Returns the checkpoint's path."""
    step, tree = int(state.step), _arrays(state)
    path = os.path.join(os.path.abspath(directory), str(step))
    manager = _manager(directory, keep, create=True)
    try:
        if step in manager.all_steps():
            return path
        leaves = jax.tree.leaves(tree)
        meta = {"format": FORMAT, "step": step, "layout": _layout(tree), "checksums": state_checksums(tree)}
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({f"{i:05d}": x for i, x in enumerate(leaves)}), meta=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()
    finally:
        manager.close()
    return path


def saved_local_sgd_steps(directory: str) -> list[int]:
    """The steps of the complete checkpoints in ``directory``, oldest first; [] when there are none
    or no such directory (a save cut short is no step). A loop that resumes when it can:
    ``if saved_local_sgd_steps(d): state = restore_local_sgd(d, state)``."""
    if not os.path.isdir(directory):
        return []
    manager = _manager(directory, None, create=False)
    try:
        return sorted(int(s) for s in manager.all_steps())
    finally:
        manager.close()


def restore_local_sgd(directory: str, like, step: int | None = None):
    """The checkpoint ``step`` of ``directory`` (default: the newest) as a ``LocalSGDState`` laid out
    as ``like`` (a state of the same trainer, e.g. ``trainer.init(params)``: its shardings are the
    restored arrays'). Raises ``CheckpointError`` (none there, or another structure) or
    ``UnreadableCheckpointError`` (damaged); nothing is written."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
    manager = _manager(directory, None, create=False)
    try:
        steps = sorted(manager.all_steps())
        if not steps or (step is not None and step not in steps):
            raise CheckpointError(f"{directory}: no checkpoint {'of step ' + str(step) if step is not None else ''}"
                                  f"(steps there: {steps or 'none'})")
        step = steps[-1] if step is None else step
        path = os.path.join(os.path.abspath(directory), str(step))
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises many types
            raise _restore_failed(path, e) from e
        tree = _arrays(like)
        if meta.get("format") != FORMAT or meta.get("layout") != _layout(tree):
            saved, now = meta.get("layout") or [], _layout(tree)
            first = next((f"{a!r} there, {b!r} here" for a, b in zip(saved, now, strict=False) if a != b),
                         f"{len(saved)} arrays there, {len(now)} here")
            raise CheckpointError(f"checkpoint {path} holds another state than this trainer's (another rule, model "
                                  f"or optimizer): {first}")
        abstract = {f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for i, x in enumerate(jax.tree.leaves(tree))}
        try:
            arrays = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:
            raise _named(_restore_failed(path, e), tree) from e
    finally:
        manager.close()
    restored = jax.tree.unflatten(jax.tree.structure(tree), [arrays[k] for k in sorted(arrays)])
    check_checksums(path, meta["checksums"], state_checksums(restored))
    return restored._replace(step=np.int32(meta["step"]))


__all__ = ["save_local_sgd", "saved_local_sgd_steps", "restore_local_sgd", "FORMAT"]
