"""How many programs this process compiled, as JAX itself reports them.

JAX records an event around every backend compile (``/jax/core/compile/backend_compile_duration``:
XLA's compile, or a load from the persistent compilation cache, of a jitted program or of an eager
op's). A listener counts them, so a training record says that its steps included a compile from
what happened (``Compiles.since``), not from which step kinds ran for the first time: a record
carries ``includes_compile`` exactly when a program compiled inside the time it reports.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class Compiles:
    """The process's compile count (every thread's: compiles ahead run in threads)."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def _heard(self, event: str, duration: float, **_) -> None:
        del duration
        if event == BACKEND_COMPILE:
            with self._lock:
                self.count += 1

    def mark(self) -> int:
        """The count now: a mark for ``since``."""
        return self.count

    def since(self, mark: int) -> int:
        """Programs compiled since ``mark``."""
        return self.count - mark


_COUNTER: Compiles | None = None
_LOCK = threading.Lock()


def compiles() -> Compiles:
    """The process's counter (its listener registered with JAX once, on first use)."""
    global _COUNTER
    with _LOCK:
        if _COUNTER is None:
            _COUNTER = Compiles()
            jax.monitoring.register_event_duration_secs_listener(_COUNTER._heard)
    return _COUNTER


__all__ = ["BACKEND_COMPILE", "Compiles", "compiles"]
