"""What both exchange backends share (``exchange.py``, ``s3.py``): the key rule and the error. A leaf
below both, so that ``exchange.open_exchange`` can import the S3 backend at the top without a circle
(tests/test_imports.py)."""

from __future__ import annotations


class ExchangeError(RuntimeError):
    """The exchange cannot be used (unreachable, not writable, a malformed URL). ``transient``: the
    cause may pass by itself (the store unreachable, a 5xx, throttling): ``patience.py`` retries it."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class ExchangeUnavailable(ExchangeError):
    """The exchange kept failing for a transient reason past ``sync.exchange.patience`` (exit 75: retry)."""


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") or p.startswith(".tmp") for p in parts):
        raise ValueError(f"exchange key: expected a relative 'a/b/c' key, got {key!r}")
    return key


__all__ = ["ExchangeError", "ExchangeUnavailable"]
