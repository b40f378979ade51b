"""Checkpoints with orbax: the whole train state, the data iterator position and a metadata record.

Layout: ``RUN_DIR/checkpoints/<step>/{state,data,meta}``. ``meta`` holds the config that wrote the checkpoint and the
state's format (``state.STATE_FORMAT``; absent: format 1), so that a resume with an incompatible config (other model
shape, shard count or method) is refused with a message naming the keys, instead of failing deep inside orbax. A
checkpoint that cannot be read is reported and left in place: nothing is written over it.

Integrity (see integrity.py): ``meta`` also holds a checksum of every array, computed on device
before the save; restores verify it (``UnreadableCheckpointError`` on a mismatch). Rotation is
done here, not by orbax's ``max_to_keep``: older checkpoints are deleted only after the new one
is finalised and its metadata (with the checksums) reads back, so the newest good checkpoint is
never deleted before a newer one exists. Checkpoints that fail verification are moved aside to
``RUN_DIR/checkpoints.bad/``, never deleted (``set_aside``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import shutil
import time
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from edit_jax.config import Config, to_dict
from edit_jax.config.renames import quiet, upgrade
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.state import STATE_FORMAT
from edit_jax.rundir.integrity import checksum_mismatches, state_checksums
from edit_jax.runtime.restarts import ENV_DEBUG

# Keys whose change makes a checkpoint's arrays unusable (their shapes or structure depend on them),
# beside the model family config's STRUCTURAL fields (Llama's: vocab_size, d_model, n_layers, ...).
# mesh.replica is absent on purpose: the number of workers may change across a restart (elastic).
STRUCTURAL_KEYS = ["mesh.shard", "sync.method", "sync.penalty.anomaly_warmup"]


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used; it is left untouched."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (disk full, permissions, ...); earlier ones are intact."""


def _save_reason(e: BaseException) -> str:
    """The cause of a failed save in a few words: a full disk is named as such."""
    cause, seen = e, 0
    while cause is not None and seen < 20:  # the OSError may be wrapped several times
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return "no space left on the device"
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    text = " ".join(str(e).split())
    if "RESOURCE_EXHAUSTED" in text or "No space left" in text or "ENOSPC" in text:
        return "no space left on the device"
    return _brief(e)


def data_checksum(data_state: dict) -> int:
    """A checksum of the data-stream state (JSON, keys sorted): a resume depends on every byte
    of it (the step, the seed), so it is verified like the arrays."""
    return zlib.crc32(json.dumps(data_state, sort_keys=True).encode())


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint cannot be read or its arrays do not match their checksums (damaged on disk).
    Unlike an incompatible config, an older checkpoint may still be good: callers may fall back.
    ``why``: what is wrong, in a few words (the fallback's one line); ``details``: the libraries'
    whole report, for ``--debug``."""

    def __init__(self, message: str, why: str | None = None, details: str | None = None):
        super().__init__(message)
        self.why, self.details = why, details


def debug_enabled() -> bool:
    """``--debug`` / ``EDIT_JAX_DEBUG=1``: the libraries' own reports are shown too."""
    return os.environ.get(ENV_DEBUG, "") not in ("", "0")


def _causes(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (or while handling), outermost first."""
    out, seen = [], set()
    while e is not None and id(e) not in seen and len(out) < 20:
        out.append(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return out


# TensorStore's own report of a failed read, deep in orbax's exception chain (orbax's wrapper
# around it carries the whole TensorStore spec: kilobytes of JSON):
#   OUT_OF_RANGE: Error reading "params.layers.attn.wo/0.0.0.3" in OCDBT database at local file
#   "/run/checkpoints/4/state/": Requested byte range [849462, 864722) is not valid for value of size 477814
_TS_READ = re.compile(r'Error reading "([^"]*)" in \S+ database at local file "[^"]*": (.*)')
_TS_STATUS = re.compile(r"^[A-Z][A-Z_]+: (.*)")


def _read_failure(e: BaseException, limit: int = 50) -> str:
    """A failed array read in a few words: the array and TensorStore's reason (its first clause,
    at most ``limit`` characters), else the innermost status message, else ``_brief``."""
    def cut(text: str) -> str:
        text = text.split("; ")[0].strip()
        return text if len(text) <= limit else text[:limit].rstrip() + "..."

    texts = [" ".join(str(c).split()) for c in _causes(e)]
    for text in texts:
        m = _TS_READ.search(text)
        if m:
            array = m[1].split("/")[0] or m[1]
            return f"{array}: {cut(m[2])}"
    for text in reversed(texts):  # innermost first: a status without the spec dumps
        m = _TS_STATUS.match(text)
        if m and "TensorStore(" not in text:
            return cut(m[1])
    return _brief(e, limit)


DRAIN_SECONDS = 10.0  # cancelled reads end within moments; one that ignores its cancellation is closed after this


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that, closed while tasks of it are still pending, first cancels them and runs
    them to their end (as ``asyncio.run`` does). orbax runs a restore in a fresh loop that it only
    closes (``asyncio_utils._run_sync_via_new_loop``): when one array read fails, the reads of the
    other arrays still pending stay behind, and each, collected later, prints an "Exception
    ignored in: <coroutine object _read_array_index_and_device_put>" traceback with its array's
    whole TensorStore spec (orbax turns the GeneratorExit of the collection into an Exception): up
    to hundreds, as many as were pending at that moment. Ended here instead, their errors retrieved."""

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            if pending:
                for task in pending:
                    task.cancel()
                self.run_until_complete(asyncio.wait(pending, timeout=DRAIN_SECONDS))
                for task in pending:
                    if task.done():
                        if not task.cancelled():
                            task.exception()  # retrieved: asyncio does not log it
                    else:  # one that ignored its cancellation: closed here, where what it raises is dropped
                        try:
                            task.get_coro().close()
                        except BaseException:
                            pass
        super().close()


@contextlib.contextmanager
def _reads_end_with_the_restore():
    """While inside, every new asyncio event loop (orbax makes one per restore, with
    ``asyncio.new_event_loop``) ends the tasks still pending when it is closed (``_DrainingLoop``):
    a failed restore leaves no reads behind. (Event loop policies are deprecated from Python 3.14:
    where they are gone, nothing changes.)"""
    base = getattr(asyncio, "DefaultEventLoopPolicy", None)
    if base is None or not hasattr(asyncio, "set_event_loop_policy"):
        yield
        return
    policy = type("_DrainingPolicy", (base,), {"_loop_factory": _DrainingLoop})()
    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(policy)
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(before)


def _brief(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line: orbax / TensorStore errors can carry kilobytes of spec dumps."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{' ...' if len(text) > limit else ''}"


def _details(e: BaseException) -> str:
    """The whole report, for ``--debug``: every exception of the chain, outermost first."""
    return " <- ".join(_brief(c, 100_000) for c in _causes(e))


def _restore_failed(path: str, e: BaseException) -> UnreadableCheckpointError:
    """The error for a checkpoint whose arrays could not be read: the array and TensorStore's reason
    in a few words; orbax's report with the TensorStore spec only as ``details`` (``--debug``)."""
    why = _read_failure(e)
    return UnreadableCheckpointError(f"checkpoint {path} could not be restored: {why}. It was left untouched; "
                                     "move it away to start over.", why=why, details=_details(e))


def check_checksums(path: str, saved: dict[str, int], now: dict[str, int]) -> None:
    """Raises ``UnreadableCheckpointError`` naming checkpoint ``path`` if the checksums of the arrays
    read (``now``) differ from those ``saved`` with it."""
    bad = checksum_mismatches(saved, now)
    if bad:
        why = (f"the checksums of {len(bad)} array(s) ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}) "
               "differ from those recorded when it was saved")
        raise UnreadableCheckpointError(f"checkpoint {path} is damaged: {why}", why=why)


def steps_on_disk(run_dir: str) -> list[int]:
    """Finalised checkpoint steps under ``run_dir`` (sorted), read from the directory names alone:
    cheap, no orbax (orbax's in-progress saves have a ``.orbax-checkpoint-tmp`` suffix)."""
    directory = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit() and os.path.isdir(os.path.join(directory, d)))


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else None
    return d


class Checkpointer:
    def __init__(self, run_dir: str, keep: int, asynchronous: bool = False):
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.keep, self.asynchronous = keep, asynchronous
        # max_to_keep=None: rotation is ours (``_rotate``), after the new checkpoint is verified.
        options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                               enable_async_checkpointing=asynchronous)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))
        # A background save not finalised yet (``finish``): its step, checksums, whether its dir
        # existed before it (then a failure leaves that dir alone) and whether it is healthy.
        self.pending: tuple[int, dict, bool, bool] | None = None

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, cfg: Config, healthy: bool = True) -> None:
        """Writes checkpoint ``step`` (``healthy``: no loss spike was under way, training/spike.py;
        a rerun prefers healthy ones). Asynchronous: returns once orbax has copied the arrays to
        host memory; the write goes on in the background and ``finish`` (the next save, the next
        ``poll`` that finds it written, ``close``) waits for it, then rotates. Until orbax renames
        its finished temporary dir the checkpoint is not on disk as ``checkpoints/<step>``: a
        crash before that leaves the previous checkpoints as the newest."""
        self.finish()  # one save at a time; the previous one counts (and rotates) first
        if int(step) in self.manager.all_steps():  # e.g. a signal right after a periodic save
            return
        meta = {"config": to_dict(cfg), "step": int(step), "state_format": STATE_FORMAT,
                "checksums": state_checksums(state), "data_checksum": data_checksum(data_state),
                "healthy": bool(healthy)}
        existed = os.path.isdir(os.path.join(self.directory, str(step)))
        try:
            self.manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # orbax / TensorStore wrap OS errors in many types
            self._failed(int(step), existed, e)
        self.pending = (int(step), meta["checksums"], existed, bool(healthy))
        if not self.asynchronous:
            self.finish()

    def finish(self) -> None:
        """Waits for the background save (if any) and finalises it: a failed write is removed and
        raised as ``CheckpointSaveError`` (earlier checkpoints intact), a good one rotates the
        older ones out."""
        if self.pending is None:
            return
        step, checksums, existed, healthy = self.pending
        self.pending = None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._failed(step, existed, e)
        self._rotate(step, checksums, healthy)

    def poll(self) -> None:
        """``finish`` if the background save is written already (never waits). One process only:
        with several, whether it is done differs between them, and they finish together instead
        (at the next save and at the end)."""
        if self.pending is not None and not self.manager.is_saving_in_progress():
            self.finish()

    def _failed(self, step: int, existed: bool, e: BaseException):
        """A save of ``step`` failed: its leftovers are removed, ``CheckpointSaveError`` raised."""
        try:  # let orbax's background writes of this save end first: they could recreate its dir
            self.manager.wait_until_finished()
        except Exception:  # the same failure again: the first one is reported
            pass
        self._remove_partial(step, final=not existed)
        raise CheckpointSaveError(f"could not save checkpoint {os.path.join(self.directory, str(step))}: "
                                  f"{_save_reason(e)}. Earlier checkpoints are intact "
                                  f"({', '.join(map(str, self.all_steps())) or 'none'}); fix that and "
                                  "re-run the same command to resume") from e

    def _remove_partial(self, step: int, final: bool) -> None:
        """After a failed save: what this save left of ``step`` is removed, so that it takes no
        space and no later run trips over it: orbax's unfinished temporary dir, and with ``final``
        the step's own dir too. The save can fail after orbax renamed the temporary dir (the
        rename is not the last write of a save), which leaves ``checkpoints/<step>`` on disk but
        not in orbax's list: a checkpoint nobody verified and the error message would not name.
        ``final`` is False when that dir existed before this save, which is then left alone."""
        def leftovers() -> list[str]:
            return [n for n in os.listdir(self.directory)
                    if n.startswith(f"{step}.orbax-checkpoint-tmp") or (final and n == str(step))]

        if jax.process_index() == 0 and os.path.isdir(self.directory):
            # TensorStore's writes of the other arrays may still be in flight after the first one
            # failed: they recreate files in the dir being removed. Removed until it stays gone
            # for a moment (at most ~3 s).
            for _ in range(30):
                for name in leftovers():
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                time.sleep(0.1)
                if not leftovers():
                    break
        # orbax's step list from the disk as it now is. No barrier here: after a failed save the
        # other processes may already be in the next step's collectives (the launcher ends them).
        self.reload()

    def _rotate(self, new_step: int, checksums: dict, healthy: bool) -> None:
        """Deletes checkpoints beyond the newest ``keep``, once ``new_step`` is finalised and its
        metadata (with these checksums) reads back; otherwise deletes nothing. While a loss spike
        is under way (``healthy`` False) the newest healthy checkpoint is kept too: the rollback's
        target is never rotated away by checkpoints of the spike."""
        try:
            ok = self.read_meta(new_step).get("checksums") == checksums
        except CheckpointError:
            ok = False
        if not ok:
            return
        old = self.all_steps()[:-self.keep]
        if not healthy:
            newest_healthy = next((s for s in reversed(self.all_steps()) if self.healthy(s)), None)
            old = [s for s in old if s != newest_healthy]
        for step in old:
            self.manager.delete(step)

    def healthy(self, step: int) -> bool | None:
        """What checkpoint ``step``'s metadata says of the loss when it was written (no flag:
        written before spikes were watched, healthy); None when the metadata cannot be read."""
        try:
            return self.read_meta(step).get("healthy", True) is not False
        except CheckpointError:
            return None

    def verify(self, step: int, state: Any, meta: dict | None = None) -> None:
        """Raises ``UnreadableCheckpointError`` if the arrays of ``state`` (restored from ``step``)
        do not match the checksums recorded at save time. Checkpoints written before checksums
        existed have none and pass."""
        meta = self.read_meta(step) if meta is None else meta
        saved = meta.get("checksums")
        if saved is None:
            return
        check_checksums(os.path.join(self.directory, str(step)), saved, state_checksums(state))

    def verify_data(self, step: int, data_state: dict, meta: dict | None = None) -> None:
        """Raises ``UnreadableCheckpointError`` if the data-stream state differs from the one saved
        (checkpoints written before this checksum existed pass)."""
        meta = self.read_meta(step) if meta is None else meta
        saved = meta.get("data_checksum")
        if saved is not None and saved != data_checksum(data_state):
            raise UnreadableCheckpointError(
                f"checkpoint {os.path.join(self.directory, str(step))} is damaged: its data-stream state "
                f"{json.dumps(data_state, sort_keys=True)[:200]} differs from the one recorded when it was saved",
                why="its data-stream state differs from the one recorded when it was saved")

    def set_aside(self, step: int, where: str = "checkpoints.bad", move: bool = True) -> str:
        """Moves checkpoint ``step`` to ``RUN_DIR/<where>/<step>`` (never deletes it); returns the new
        path. ``move=False`` (the other processes of a multi-process run, whose process 0 moves it)
        only names the path. Call ``reload`` after the moves."""
        dest_dir = os.path.join(os.path.dirname(self.directory), where)
        dest, i = os.path.join(dest_dir, str(step)), 1
        while os.path.exists(dest):
            dest, i = os.path.join(dest_dir, f"{step}.{i}"), i + 1
        if move:
            os.makedirs(dest_dir, exist_ok=True)
            shutil.move(os.path.join(self.directory, str(step)), dest)
        return dest

    def reload(self) -> None:
        """Re-reads the list of checkpoints on disk (after ``set_aside``)."""
        self.manager.reload()

    def read_meta(self, step: int) -> dict:
        path = os.path.join(self.directory, str(step))
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return out["meta"]
        except Exception as e:  # orbax raises many types; report them all the same way
            raise UnreadableCheckpointError(f"checkpoint {path} is unreadable (metadata): {_brief(e)}. "
                                            "It was left untouched; move it away to start over.",
                                            why=f"its metadata is unreadable ({_read_failure(e)})",
                                            details=_details(e)) from e

    def check_compatible(self, meta: dict, cfg: Config, step: int) -> None:
        saved, now = upgrade(meta.get("config", {}), quiet), to_dict(cfg)  # (keys since moved: as today's)
        saved.setdefault("model", {}).setdefault("family", "llama")  # (written before there were families)
        diffs = [f"{k}: checkpoint {_get(saved, k)!r}, config {_get(now, k)!r}" for k in
                 [f"model.{f}" for f in type(cfg.model).STRUCTURAL] + STRUCTURAL_KEYS if _get(saved, k) != _get(now, k)]
        diffs += Codec.from_sync(cfg.sync).resume_refusal(Codec.from_sync(saved.get("sync") or {}))  # the residual
        if diffs:
            raise CheckpointError(f"checkpoint {os.path.join(self.directory, str(step))} is incompatible with the "
                                  f"config ({'; '.join(diffs)}). Use another --run-dir, or the config that wrote it.")

    def restore(self, step: int, abstract_state: Any, meta: dict | None = None) -> tuple[Any, dict]:
        path = os.path.join(self.directory, str(step))
        try:
            with _reads_end_with_the_restore():
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as e:
            raise _restore_failed(path, e) from e
        meta = self.read_meta(step) if meta is None else meta  # read once for both checks
        self.verify(step, out["state"], meta)
        self.verify_data(step, out["data"], meta)
        return out["state"], out["data"]

    def restore_host(self, step: int, abstract_state: Any, meta: dict | None = None) -> tuple[Any, dict]:
        """Restores into host NumPy arrays of the saved shapes (for elastic restarts with another N)."""
        path = os.path.join(self.directory, str(step))
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract_state)
        # A manager of its own: orbax binds an item's handler type (here PyTree, not Standard) at
        # first use, and the run's manager must keep saving with StandardSave afterwards.
        reader = ocp.CheckpointManager(self.directory, item_names=("state", "data", "meta"),
                                       options=ocp.CheckpointManagerOptions(create=False, read_only=True))
        try:
            with _reads_end_with_the_restore():
                out = reader.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args),
                    data=ocp.args.JsonRestore()))
        except Exception as e:
            raise _restore_failed(path, e) from e
        finally:
            reader.close()
        meta = self.read_meta(step) if meta is None else meta  # read once for both checks
        self.verify(step, out["state"], meta)
        self.verify_data(step, out["data"], meta)
        return out["state"], out["data"]

    def close(self) -> None:
        """Waits for a background save. Its failure is not raised here (``close`` runs while the
        run already ends with its own error; the normal end calls ``finish`` first) but its
        leftovers are removed all the same."""
        try:
            self.finish()
        except CheckpointSaveError:
            pass
        finally:
            self.manager.close()
