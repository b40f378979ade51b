"""Source ``parquet``: parquet files with a string column ``data.text_column``; every non-empty row
is a document. Split at row level by the hash of the row's text (duplicates land in the same split,
so they cannot leak from train into validation). Needs pyarrow (``pip install edit-jax[parquet]``)."""

from __future__ import annotations

from edit_jax.data.errors import DataError
from edit_jax.data.sources.base import SourceResult, _is_val, _pack, _token_dtype


def load(tok, files: list[str], cfg) -> SourceResult:
    column, val_fraction = cfg.text_column, cfg.val_fraction
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise DataError("data.source='parquet' needs pyarrow: pip install edit-jax[parquet] (or pip install pyarrow)") from e
    train_docs, val_docs, nbytes, rows = [], [], 0, 0
    for p in files:
        try:
            schema = pq.read_schema(p)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise DataError(f"parquet file {p!r}: cannot read it as parquet ({e})") from e
        if column not in schema.names:
            raise DataError(f"parquet file {p!r}: no column {column!r} (data.text_column); "
                            f"columns are {', '.join(schema.names)}")
        try:
            values = pq.read_table(p, columns=[column]).column(column).to_pylist()
        except Exception as e:  # noqa: BLE001
            raise DataError(f"parquet file {p!r}: cannot read column {column!r} ({e})") from e
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, str):
                raw = v.encode("utf-8")
            elif isinstance(v, (bytes, bytearray)):
                raw = bytes(v)
            else:
                raise DataError(f"parquet file {p!r}: column {column!r} must hold text, row {i} is "
                                f"{type(v).__name__}")
            if raw:
                rows += 1
                nbytes += len(raw)
                (val_docs if _is_val(raw, val_fraction) else train_docs).append((f"{p}[row {i}]", raw))
    if rows == 0:
        raise DataError(f"parquet files {files!r}: column {column!r} holds no non-empty text; expected documents")
    dtype = _token_dtype(tok.vocab_size)
    train = _pack(tok.encode_documents(train_docs), tok.eos_id, dtype)
    val = _pack(tok.encode_documents(val_docs), tok.eos_id, dtype)
    return SourceResult(train, val, what=f"{len(files)} parquet file{'s' if len(files) != 1 else ''}, {rows} rows",
                        split="row-level (sha256 of row text)", files=len(files), bytes=nbytes,
                        info=dict(rows=rows, train_rows=len(train_docs), val_rows=len(val_docs)))
