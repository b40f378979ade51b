"""The exchange waits out its storage: ``PatientExchange`` wraps a backend (``exchange.py``,
``s3.py``) and retries an operation that failed for a reason that may pass by itself, for up to
``sync.exchange.patience`` seconds, with backoff (0.2 s doubling to 10 s, jittered).

Transient: for a directory, an ``OSError`` whose errno says the file system is read-only, full,
over quota, failing (EIO), stale (NFS), refusing permissions, or whose root is gone (unmounted,
renamed away); for S3, what ``S3Exchange`` marks ``transient`` (the endpoint unreachable, a
timeout, a 5xx, throttling). Permanent (raised at once): a bad key (``ValueError``), a missing
bucket, refused credentials, anything else.

It says once on stderr what it waits for and once when the storage answers again; past the
patience it raises ``ExchangeUnavailable`` (a worker exits 75: its launcher starts it again later).
A ``create`` retried after a failed attempt that may have written the object (the answer lost)
reports True when the key holds exactly its bytes: writers put their identity in what they create.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time

from edit_jax.elastic.exchange import open_exchange
from edit_jax.elastic.keys import ExchangeError, ExchangeUnavailable

TRANSIENT_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EIO, errno.ESTALE, errno.EACCES, errno.EPERM, errno.EDQUOT}
BACKOFF_S, BACKOFF_CAP_S = 0.2, 10.0
_WRITES = ("put", "create", "delete")


def transient_reason(ex, err: BaseException) -> str | None:
    """Why ``err`` (raised by backend ``ex``) may pass by itself, in a few words; None: permanent."""
    if isinstance(err, ExchangeError):
        text = str(err)
        return (text.split(": ", 1)[-1] if text.startswith("sync.exchange.url") else text) if err.transient else None
    if isinstance(err, OSError) and not isinstance(err, (FileExistsError, IsADirectoryError)):
        if err.errno in TRANSIENT_ERRNOS:
            return os.strerror(err.errno).lower()
        root = getattr(ex, "root", None)
        if err.errno in (errno.ENOENT, errno.ENOTDIR) and root is not None and not os.path.isdir(root):
            return f"its directory {root} is missing"
    return None


class PatientExchange:
    """``inner`` with each operation retried through transient failures for ``patience_s`` seconds
    (0: none: the first one raises ``ExchangeUnavailable``). ``who`` starts its lines ("edit-jax
    worker 1"). Any other attribute (``url``, ``poll_s``, ``root``) is the backend's."""

    def __init__(self, inner, patience_s: float, say=print, who: str = "edit-jax",
                 backoff_s: float = BACKOFF_S, cap_s: float = BACKOFF_CAP_S):
        self.inner, self.patience_s, self.say, self.who = inner, float(patience_s), say, who
        self.backoff_s, self.cap_s = backoff_s, cap_s
        self._lock = threading.Lock()
        self._failing: str | None = None  # what the current outage's line said (None: no outage)
        self._since = 0.0
        self.stopped = lambda: False  # a worker's stop flag: a signal ends the wait (its owner sets it)

    def __getattr__(self, name):  # (only for names not set here)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"PatientExchange({self.inner!r}, {self.patience_s:g} s)"

    def put(self, key: str, data: bytes) -> None:
        return self._call("put", key, data)

    def create(self, key: str, data: bytes) -> bool:
        return self._call("create", key, data)

    def get(self, key: str) -> bytes | None:
        return self._call("get", key)

    def list(self, prefix: str) -> list[str]:
        return self._call("list", prefix)

    def delete(self, key: str) -> None:
        return self._call("delete", key)

    def _call(self, op: str, *args):
        deadline, pause, failed = time.monotonic() + self.patience_s, self.backoff_s, False
        while True:
            try:
                out = getattr(self.inner, op)(*args)
            except (OSError, ExchangeError) as e:
                why = transient_reason(self.inner, e)
                if why is None:
                    raise
                failed = True
                left = deadline - time.monotonic()
                self._note(op, why)
                if left <= 0 or self.stopped():
                    raise ExchangeUnavailable(
                        f"sync.exchange.url {self.url}: {op} failed for {self.patience_s:g} s "
                        f"(sync.exchange.patience): {why}", transient=True) from e
                until = time.monotonic() + min(left, pause * (0.5 + 0.5 * random.random()))
                while time.monotonic() < until and not self.stopped():  # (in slices: SIGTERM ends it soon)
                    time.sleep(min(0.1, max(0.0, until - time.monotonic())))
                pause = min(pause * 2, self.cap_s)
                continue
            if op == "create" and failed and not out:
                out = self.get(args[0]) == bytes(args[1])  # our own first attempt, its answer lost
            self._recovered()
            return out

    def _note(self, op: str, why: str) -> None:
        with self._lock:
            if self._failing is not None:
                return
            self._failing, self._since = why, time.monotonic()
        what = "writes" if op in _WRITES else "reads"
        self.say(f"{self.who}: exchange {self.url}: {what} fail ({why}); retrying for up to {self.patience_s:g} s")

    def _recovered(self) -> None:
        if self._failing is None:
            return
        with self._lock:
            if self._failing is None:
                return
            self._failing, took = None, time.monotonic() - self._since
        self.say(f"{self.who}: exchange {self.url}: answering again after {took:.1f} s")


def open_patient(url: str, patience_s: float, say=print, who: str = "edit-jax", opener=None) -> PatientExchange:
    """``open_exchange(url)`` retried through transient failures for ``patience_s`` s, wrapped."""
    probe = PatientExchange(_Opener(url, opener or open_exchange), patience_s, say, who)
    return PatientExchange(probe.get(""), patience_s, say, who)


class _Opener:
    """``get`` opens the exchange: ``PatientExchange``'s retry loop for the open itself."""

    def __init__(self, url: str, opener):
        self.url, self._open = url, opener

    def get(self, _key):
        return self._open(self.url)


__all__ = ["PatientExchange", "open_patient", "transient_reason", "ExchangeUnavailable"]
