"""``DataError``: the one exception every data problem raises (bad path, empty or too small corpus)."""

from __future__ import annotations


class DataError(ValueError):
    """The data cannot be loaded or does not fit the config: bad path, empty or too small corpus."""
