"""Data sources and their registry. ``SOURCES`` maps each ``data.source`` name to a ``Source``: a
``load(tokenizer, files, data_config) -> SourceResult`` function and whether it reads
``data.paths``. ``load_corpus`` and config validation (``validate`` below) both ask this registry.

To add a source: one module in this folder with a ``load`` function, and one line in ``SOURCES``.
"""

from __future__ import annotations

from edit_jax.config import Config, require
from edit_jax.data.sources import parquet, stdlib, text, tokens
from edit_jax.data.sources.base import Source, SourceResult

SOURCES: dict[str, Source] = {
    "stdlib": Source(stdlib.load, needs_paths=False),
    "text": Source(text.load),
    "tokens": Source(tokens.load),
    "parquet": Source(parquet.load),
}


def validate(cfg: Config) -> None:
    """``data.source`` is a source of ``SOURCES``, given the paths it needs; ``data.token_dtype``
    is a dtype the ``tokens`` source reads."""
    d = cfg.data
    require(d.source in SOURCES, "data.source", f"expected one of {', '.join(SOURCES)}; got {d.source!r}")
    require(not SOURCES[d.source].needs_paths or len(d.paths) > 0, "data.paths",
            f"data.source={d.source!r} needs at least one path or glob")
    require(isinstance(d.workers, int) and not isinstance(d.workers, bool) and d.workers >= 0, "data.workers",
            f"expected a non-negative int (reader processes; 0: a thread), got {d.workers!r}")
    require(d.token_dtype in tokens.TOKEN_DTYPES, "data.token_dtype",
            f"expected {', '.join(tokens.TOKEN_DTYPES[:-1])} or {tokens.TOKEN_DTYPES[-1]}, got {d.token_dtype!r}")


__all__ = ["SOURCES", "Source", "SourceResult", "validate"]
