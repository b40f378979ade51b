"""One run per run dir: a lock file held for the run's life, and a writability check before any work.

``RUN_DIR/run.lock`` holds a JSON record ``{"pid", "host", "started"}`` and an exclusive
``flock`` on it. The kernel drops the flock when the holder dies, however it dies (kill -9
included), so a lock file whose flock can be taken belongs to a dead process: it is taken over,
with a message naming the old pid and host. A live holder's lock cannot be taken: the second run
is refused (``RunLockError``) before it writes anything. The file is removed on a clean release.

Why flock rather than "is that pid alive": pids are reused, and a pid on another host cannot be
checked. (Network file systems that do not support flock make every lock look free; the pid and
host in the file still say who wrote it.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import time
from typing import Callable

LOCK_NAME = "run.lock"


class RunLockError(RuntimeError):
    """Another live run holds the run dir."""


class RunDirError(RuntimeError):
    """The run dir cannot be created or written."""


def check_writable(run_dir: str, deepest: bool = True) -> None:
    """Creates ``run_dir`` if needed and checks that it, its ``checkpoints/`` and the files a run
    appends to can be written, so that a permission problem is one message up front, not a
    traceback after minutes of compilation. ``deepest``: also probe the deepest path a checkpoint
    save writes (process 0 of a multi-process run does it for all)."""
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create run dir {run_dir!r}: {e.strerror or e}") from e
    probe = os.path.join(run_dir, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise RunDirError(f"run dir {run_dir!r} is not writable: {e.strerror or e}; "
                          "use another --run-dir or fix its permissions") from e
    for name, want_dir in (("config.json", False), ("metrics.jsonl", False), ("checkpoints", True)):
        path = os.path.join(run_dir, name)
        # Another process's probe can remove checkpoints/ between two looks (process 0 of a
        # multi-process run creates and removes it in _check_deepest_path): one stat decides the
        # kind, and a path gone by the access check was not unwritable.
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except FileNotFoundError:
            continue
        if is_dir != want_dir:
            raise RunDirError(f"{path!r} is a {'directory' if is_dir else 'file'}, expected a "
                              f"{'directory' if want_dir else 'file'}; move it away or use another --run-dir")
        if not os.access(path, os.W_OK | (os.X_OK if want_dir else 0)) and os.path.exists(path):
            raise RunDirError(f"{path!r} exists but is not writable; fix its permissions or use another --run-dir")
    if deepest:  # one process per run dir: two probing at once would race on creating checkpoints/
        _check_deepest_path(run_dir)


# The deepest path a checkpoint save writes, below the run dir: orbax's temporary dirs (a step and a
# timestamp), OCDBT's data dir and a 32-character data file name. Probed with the same lengths.
_DEEPEST = ("checkpoints", "9999999999.orbax-checkpoint-tmp-1234567890123456", "state.orbax-checkpoint-tmp-"
            "1234567890123456", "ocdbt.process_0", "d", "0123456789abcdef0123456789abcdef")


def _check_deepest_path(run_dir: str) -> None:
    """Creates (and removes) a file as deep and as long-named as a checkpoint save will, so that a
    path the file system refuses (too long) is found before any work, not at the first save."""
    checkpoints = os.path.join(run_dir, _DEEPEST[0])
    made_checkpoints = not os.path.exists(checkpoints)  # then it goes again: the probe leaves nothing
    probe = os.path.join(checkpoints, f".probe-{os.getpid()}"[:len(_DEEPEST[1])].ljust(len(_DEEPEST[1]), "x"))
    deepest = os.path.join(probe, *_DEEPEST[2:])
    try:
        os.makedirs(os.path.dirname(deepest), exist_ok=True)
        with open(deepest, "w") as f:
            f.write("ok")
    except OSError as e:
        raise RunDirError(f"run dir {run_dir!r}: a checkpoint's files would not fit below it ({e.strerror or e}; "
                          f"the deepest is {len(os.path.abspath(deepest))} characters long); use a shorter --run-dir"
                          ) from e
    finally:
        shutil.rmtree(probe, ignore_errors=True)
        if made_checkpoints:
            try:
                os.rmdir(checkpoints)
            except OSError:
                pass


def first_missing(run_dir: str) -> str | None:
    """The outermost directory of ``run_dir``'s path that does not exist yet (``check_writable``
    will create it and everything below), or None when the run dir exists."""
    path, missing = os.path.abspath(run_dir), None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def remove_if_unused(run_dir: str, created: str) -> None:
    """Removes what a run created for ``run_dir`` (its ``checkpoints/``, the run dir, and the
    parents up to ``created``) while they are empty: an input error found after the run dir was
    checked leaves nothing behind. Only empty directories go (``os.rmdir``)."""
    path = os.path.abspath(run_dir)
    paths = [os.path.join(path, "checkpoints"), path]
    while path != created and os.path.dirname(path) != path:
        path = os.path.dirname(path)
        paths.append(path)
    for p in paths:
        if not os.path.isdir(p):
            continue
        try:
            os.rmdir(p)
        except OSError:
            return  # not empty: everything above it stays too


def _read_record(path: str) -> dict:
    try:
        with open(path) as f:
            return json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}


class RunLock:
    """``with RunLock(run_dir, say):`` holds the run dir's lock (see the module docstring)."""

    def __init__(self, run_dir: str, say: Callable[[str], None] = lambda msg: None):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.say = say
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        for _ in range(10):  # retried only if the file is replaced between open and flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                rec = _read_record(self.path)
                who = f"pid {rec.get('pid', '?')} on host {rec.get('host', '?')}, started {rec.get('started', '?')}"
                raise RunLockError(f"run dir {os.path.dirname(self.path)!r} is in use by another run ({who}); "
                                   f"wait for it, stop it, or use another --run-dir") from None
            # The holder may have released and removed the file between our open and our flock:
            # then we hold a lock on an unlinked file; start again on the current one.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            old = _read_record(self.path)
            if old.get("pid") is not None:
                self.say(f"edit-jax: taking over a stale lock {self.path} (pid {old.get('pid')} on host "
                         f"{old.get('host')}, started {old.get('started')}, is gone)")
            record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            os.ftruncate(fd, 0)
            os.pwrite(fd, (record + "\n").encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return self
        raise RunLockError(f"could not take the lock {self.path}: it keeps being replaced")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.remove(self.path)  # while still holding the flock: nobody can take it in between
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["RunLock", "RunLockError", "RunDirError", "check_writable", "first_missing", "remove_if_unused", "LOCK_NAME"]
