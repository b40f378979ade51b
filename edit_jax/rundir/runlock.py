"""One run per run dir: a lock file held for the run's life, and a writability check before any work
(of the run dir; of any command's output path: ``output_path_problem``).

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

from edit_jax.config.renames import quiet, upgrade

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


def nearest_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists (what ``os.makedirs`` would create under)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def output_path_problem(path: str, flag: str, *, directory: bool, force: bool = False) -> str | None:
    """Why the output ``path`` (given as option ``flag``) cannot be written, or None: a command
    checks it before any work (``export --out``, ``plan --json``), so a bad path is one line at
    once, not a traceback after minutes of loading or compiling.

    ``directory``: a new or empty directory (non-empty with ``force``), created with its missing
    parents. Otherwise a file, new or replaced, in a directory that exists."""
    parent = os.path.dirname(os.path.abspath(path))
    if directory:
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{flag} {path!r} exists and is not a directory (expected a new or empty directory)"
        if os.path.isdir(path) and os.listdir(path) and not force:
            return (f"{flag} {path!r} exists and is not empty (expected a new or empty directory; "
                    "pass --force to write over it)")
        parent = nearest_existing(parent)
        if not os.path.isdir(parent):
            return f"{flag} {path!r} cannot be created: {parent!r} is not a directory"
        target = path if os.path.isdir(path) else parent  # the dir a file or a subdir goes into first
    else:
        if os.path.isdir(path):
            return f"{flag} {path!r} is a directory (expected a file path)"
        if not os.path.isdir(parent):
            found = nearest_existing(parent)
            why = f"directory {parent!r} does not exist" if os.path.isdir(found) else f"{found!r} is not a directory"
            return f"{flag} {path!r} cannot be written: {why} (expected a file path in an existing directory)"
        if os.path.exists(path):
            if not os.access(path, os.W_OK):
                return f"{flag} {path!r} cannot be written: no write permission on it"
            return None
        target = parent
    if not os.access(target, os.W_OK | os.X_OK):
        return f"{flag} {path!r} cannot be written: no write permission in {target!r}"
    return None


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


def listing(run_dir: str) -> set[str] | None:
    """The names in ``run_dir`` now (empty when it does not exist; None when it cannot be listed)."""
    try:
        return set(os.listdir(run_dir)) if os.path.isdir(run_dir) else set()
    except OSError:
        return None


def remove_new_files(run_dir: str, before: set[str], dirs: tuple[str, ...] = ()) -> None:
    """Removes what a run wrote at the top of ``run_dir`` that was not there before it (``before``:
    ``listing`` then), for an input error found when no checkpoint exists: its new files
    (``config.json``, ``metrics.jsonl``, ``tokenizer.json``, ...) and of its new directories those
    named in ``dirs``, whole (records of its own, e.g. TensorBoard's); other new directories only
    while empty (``checkpoints*`` may hold checkpoints moved aside, a compile cache may be the
    user's). Anything that was there before stays. Called while the run holds the lock (which is
    never removed here)."""
    for name in sorted(set(listing(run_dir) or ()) - before - {LOCK_NAME}):
        path = os.path.join(run_dir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                if name in dirs:
                    shutil.rmtree(path)
                else:
                    os.rmdir(path)  # only while empty (e.g. checkpoints/ before any save)
            else:
                os.remove(path)
        except OSError:
            pass  # best effort: the error that ended the run is what gets reported


def _same_exchange(a: str, b: str) -> bool:
    def norm(url: str) -> str:
        if url.startswith("s3://"):
            return url.rstrip("/")
        return os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)
    return a == b or (bool(a) and bool(b) and norm(a) == norm(b))


def exchange_problem(run_dir: str, exchange: str) -> str | None:
    """Why ``run_dir`` is not the dir of a run on ``exchange`` (``sync.exchange.url``; "": an in-program
    run): its ``config.json`` names another exchange, or none (an in-program run's), or one (for an
    in-program run). A run dir holds one run's records: an exchange run's launcher and workers write
    it (elastic/admission.py), an in-program run its own. None when it has no readable config.json."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            theirs = upgrade(json.load(f), quiet).get("sync", {}).get("exchange", {}).get("url", "") or ""
    except (OSError, ValueError, AttributeError):
        return None
    if _same_exchange(theirs, exchange):
        return None
    what = f"sync.exchange.url={theirs}" if theirs else "no sync.exchange.url (an in-program run)"
    mine = exchange or "an in-program run (no sync.exchange.url)"
    return (f"sync.exchange.url: run dir {run_dir!r} belongs to another run ({what}, its config.json), not "
            f"{mine}; use another --run-dir, or that exchange")


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


__all__ = ["RunLock", "RunLockError", "RunDirError", "exchange_problem", "check_writable", "first_missing",
           "remove_if_unused", "listing", "remove_new_files", "nearest_existing", "output_path_problem", "LOCK_NAME"]
