"""Where A-EDiT's workers meet when they are separate programs: a key-value store of whole objects.

An ``Exchange`` holds bytes under ``/``-separated keys (``posts/r00000003/w0002.npz``). Every write
is whole or absent (a reader never sees half an object), and ``create`` is create-exclusive: of
several workers creating the same key exactly one succeeds, which is what fixes a round's members
(``rounds.py``). Two backends:

- ``DirExchange``: a directory on a shared file system. ``put`` writes a temporary file in the
  same directory, fsyncs it and renames it over the key (rename is atomic on POSIX);
  ``create`` links the finished temporary file to the key (``os.link`` fails if the key exists: the
  same guarantee as ``O_EXCL``, with the content complete before the name appears).
- ``S3Exchange`` (``s3.py``): object storage over the S3 API; ``create`` is a conditional put
  (``If-None-Match: *``).

``open_exchange(url)``: a path or ``file://PATH`` gives a ``DirExchange``; ``s3://bucket/prefix``
an ``S3Exchange`` (endpoint from ``?endpoint=`` or ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from typing import Protocol

from edit_jax.elastic.keys import ExchangeError, _check_key
from edit_jax.elastic.s3 import S3Exchange  # boto3 loads when one opens

STALE_TMP_S = 600.0  # a ``.tmp-*`` file this old is a killed writer's (DirExchange.sweep_temporaries)
_PASSING = {errno.EROFS, errno.ENOSPC, errno.EIO, errno.ESTALE, errno.EACCES, errno.EPERM, errno.EDQUOT}


class Exchange(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None:
        """Write ``key`` (replacing it), atomically: readers see the old object or the new one."""

    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist; True if this call created it."""

    def get(self, key: str) -> bytes | None:
        """The object at ``key``, or None if there is none."""

    def list(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix``, sorted."""

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is absent)."""


class DirExchange:
    """The exchange as a directory (shared between the workers' machines: NFS, Lustre, a local disk
    for workers on one machine)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = self.root
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:  # a file there or above: a config error; a read-only or full disk: may pass
            why = {errno.EEXIST: "it is a file, not a directory", errno.ENOTDIR: "a part of its path is a file"}
            raise ExchangeError(f"sync.exchange.url: cannot use {self.root!r} as the exchange directory: "
                                f"{why.get(e.errno) or e.strerror or e}", transient=e.errno in _PASSING) from None
        if not os.access(self.root, os.W_OK):
            raise ExchangeError(f"sync.exchange.url: directory {self.root!r} is not writable", transient=True)
        self.sweep_temporaries()

    def sweep_temporaries(self, older_than_s: float = STALE_TMP_S) -> int:
        """Removes the ``.tmp-*`` files of writers killed before their rename, older than
        ``older_than_s`` (a live writer's is seconds old). Best effort: never raises. Returns how many."""
        gone, cutoff = 0, time.time() - older_than_s
        try:
            for folder, _dirs, files in os.walk(self.root):
                for name in files:
                    path = os.path.join(folder, name)
                    try:
                        if name.startswith(".tmp-") and os.lstat(path).st_mtime < cutoff:
                            os.unlink(path)
                            gone += 1
                    except OSError:
                        pass
        except OSError:
            pass
        return gone

    def _root_is_there(self) -> None:
        """Raises ENOENT naming the root when it is gone (unmounted, renamed away): never made anew
        under a missing mount point, nor read as "no such key"."""
        if not os.path.isdir(self.root):
            raise FileNotFoundError(errno.ENOENT, "the exchange directory is missing", self.root)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *_check_key(key).split("/"))

    def _staged(self, path: str, data: bytes) -> str:
        folder = os.path.dirname(path)
        self._root_is_there()
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._staged(path, data)
        os.replace(tmp, path)

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if os.path.exists(path):
            return False
        tmp = self._staged(path, data)
        try:
            os.link(tmp, path)  # fails if the key exists, and the key appears with its whole content
            return True
        except FileExistsError:
            return False
        finally:
            _unlink_quietly(tmp)  # (a failure here must not turn a created key into an error)

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            self._root_is_there()
            return None

    def list(self, prefix: str) -> list[str]:
        # Walk only the folder the prefix names (keys are a few levels deep).
        head, _, _ = prefix.rpartition("/")
        base = os.path.join(self.root, *head.split("/")) if head else self.root
        self._root_is_there()
        keys = []
        for folder, _dirs, files in os.walk(base):
            rel = os.path.relpath(folder, self.root)
            for name in files:
                if name.startswith(".tmp"):
                    continue
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            self._root_is_there()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def open_exchange(url: str) -> Exchange:
    """The exchange ``url`` names (``sync.exchange.url``)."""
    if url.startswith("s3://"):
        return S3Exchange.from_url(url)
    if "://" in url and not url.startswith("file://"):
        raise ExchangeError(f"sync.exchange.url: expected a directory, file://PATH or s3://BUCKET/PREFIX, got {url!r}")
    return DirExchange(url[len("file://"):] if url.startswith("file://") else url)


__all__ = ["Exchange", "DirExchange", "ExchangeError", "open_exchange"]
