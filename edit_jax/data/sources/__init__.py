"""Data sources and their registry. ``SOURCES`` maps each ``data.source`` name to a ``Source``: a
``load(tokenizer, files, data_config) -> SourceResult`` function and whether it reads
``data.paths``. ``load_corpus`` and config validation both ask this registry.

To add a source: one module in this folder with a ``load`` function, and one line in ``SOURCES``.
"""

from __future__ import annotations

from edit_jax.data.sources import parquet, stdlib, text, tokens
from edit_jax.data.sources.base import Source, SourceResult

SOURCES: dict[str, Source] = {
    "stdlib": Source(stdlib.load, needs_paths=False),
    "text": Source(text.load),
    "tokens": Source(tokens.load),
    "parquet": Source(parquet.load),
}

__all__ = ["SOURCES", "Source", "SourceResult"]
