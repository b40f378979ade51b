"""Leaves the runtime's connection chatter out of a cluster process's standard output.

gloo (JAX's CPU collectives across processes) prints "[Gloo] Rank 0 is connected to 1 peer
ranks..." from C++ straight to file descriptor 1 each time it connects a group: a dozen lines per
process per run, which nothing in Python can turn off. Processes started by ``launch.py`` are
filtered by the launcher (it reads their output); a ``--distributed`` process has no such parent,
so it filters its own descriptor 1 through a pipe. ``--debug`` (``EDIT_JAX_DEBUG=1``) keeps it.
"""

from __future__ import annotations

import os
import sys
import threading

DROPPED = (b"[Gloo] ",)


class StdoutFilter:
    """From construction to ``close()``, lines written to descriptor 1 (by Python or native code)
    pass through a thread that drops those starting with one of ``DROPPED``."""

    def __init__(self, drop: tuple[bytes, ...] = DROPPED):
        self.drop = drop
        sys.stdout.flush()
        self.original = os.dup(1)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.close(write_end)
        self.read_end = read_end
        self.thread = threading.Thread(target=self._pump, name="stdout-filter", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        pending = b""
        while True:
            chunk = os.read(self.read_end, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not line.startswith(self.drop))
            if kept:
                os.write(self.original, kept)
        if pending and not pending.startswith(self.drop):
            os.write(self.original, pending)
        os.close(self.read_end)

    def close(self) -> None:
        """Puts descriptor 1 back and waits until everything written before is passed on (call it
        before ``os._exit``, which would drop what is still in the pipe)."""
        if self.original is None:
            return
        sys.stdout.flush()
        os.dup2(self.original, 1)  # the pipe's only writer is gone: the thread reads to its end
        self.thread.join(timeout=5)
        os.close(self.original)
        self.original = None


__all__ = ["StdoutFilter", "DROPPED"]
