"""Source ``parquet``: parquet files with a string column ``data.text_column``; every non-empty row
is a document, split at row level by the hash of its text (duplicates land in the same split, so
they cannot leak from train into validation). Streamed: start-up reads the footers only, and the
row groups (or slices of ``data.unit_bytes`` of text of the large ones) are read and tokenized as
training reaches them (``parquet_stream``). Needs pyarrow
(``pip install edit-jax[parquet]``)."""

from __future__ import annotations

import os

from edit_jax.data.parquet_units import ParquetCorpus, list_row_groups
from edit_jax.data.sources.base import SourceResult, _token_dtype


def load(tok, files: list[str], cfg) -> SourceResult:
    groups = list_row_groups(files, cfg.text_column)
    streamed = ParquetCorpus(groups, cfg.text_column, tok, cfg.val_fraction, cfg.workers, _token_dtype(tok.vocab_size),
                             cfg.unit_bytes)
    return SourceResult(None, None, what=streamed.describe(), split="row-level (sha256 of row text)",
                        files=len(files), bytes=sum(os.path.getsize(p) for p in files),
                        info=dict(row_groups=len(groups), rows=sum(g.rows for g in groups), units=len(streamed.units)),
                        streamed=streamed)
