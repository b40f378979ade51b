"""Documents, below every reader: the train / validation rule (``is_val``: the sha256 of a stable
key), a range of a parquet row group's rows as documents (``row_range_documents``, read without
the rest of the row group) and a batch of documents tokenized, split and packed
(``split_and_pack``). ``edit-jax tokenize``, the streamed parquet source and the
in-memory sources share them, so one document lands in the same split, with the same tokens,
on every path."""

from __future__ import annotations

import collections
import hashlib
import os
import threading

import numpy as np

from edit_jax.data.errors import DataError

SPLITS = ("train", "val")


def val_key(key: bytes) -> int:
    """The split key of ``key`` in [0, 2^64): the document is in val when it is < val_fraction * 2^64."""
    # sha256 of a stable key (not Python's salted hash()) so the split is identical on every machine,
    # in every process and regardless of the order files are listed in.
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")


def is_val(key: bytes, val_fraction: float) -> bool:
    return val_key(key) < val_fraction * 2.0**64


def pyarrow_parquet(who: str = "") -> object:
    try:
        import pyarrow.parquet as pq  # optional dependency
    except ImportError as e:
        raise DataError(f"{who}parquet inputs need pyarrow: pip install edit-jax[parquet] "
                        f"(or pip install pyarrow)") from e
    return pq


def parquet_row_groups(path: str, column: str, who: str, field: str) -> list[tuple[int, int, int, int]]:
    """(row group, rows, uncompressed bytes, uncompressed bytes of the text column) of every row
    group of a parquet file, from its footer alone; the file must be parquet with the text column
    ``column`` (the ``field`` that set it)."""
    pq = pyarrow_parquet(who)
    try:
        meta = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for bad files
        raise DataError(f"{who}parquet file {path!r}: cannot read it as parquet ({e})") from e
    names = meta.schema_arrow.names
    if column not in names:
        raise DataError(f"{who}parquet file {path!r}: no column {column!r} ({field}); columns are {', '.join(names)}")
    md = meta.metadata
    out = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        leaves = [rg.column(j) for j in range(rg.num_columns)]
        text = sum(c.total_uncompressed_size for c in leaves
                   if c.path_in_schema == column or c.path_in_schema.startswith(column + "."))
        out.append((g, rg.num_rows, rg.total_byte_size, text or rg.total_byte_size))
    return out


def _text_value(v, path: str, column: str, row_group: int, row: int, who: str) -> bytes | None:
    if v is None:
        return None
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    raise DataError(f"{who}parquet file {path!r}: column {column!r} must hold text, "
                    f"row group {row_group} row {row} is {type(v).__name__}")


# Reading rows [start, stop) of a row group without the rest of it: pyarrow's batch reader over
# that row group, with pre-buffering off and a read buffer (else pyarrow reads the whole column
# chunk at once), decoding BATCH_TEXT_BYTES of text at a time. Rows before ``start`` are decoded
# and dropped (parquet has no row index); a reader that goes on to the next rows of the same row
# group (a replica's slices of one row group come in order) continues where it stopped, so a row
# group is decoded about once per reader and replica, not once per slice.
READ_BUFFER = 1 << 20
BATCH_TEXT_BYTES = 4 << 20
_MAX_OPEN = 8  # open row-group readers kept per process (each: a file, its buffer, at most one batch)


class _RowReader:
    def __init__(self, batches):
        self.batches, self.next_row, self.pending = batches, 0, None  # pending: (first row, batch) not used up


_open_readers: "collections.OrderedDict[tuple, _RowReader]" = collections.OrderedDict()
_open_lock = threading.Lock()


def row_range_documents(path: str, row_group: int, column: str, start: int, stop: int, batch_rows: int,
                        key: str = "", who: str = "") -> list[tuple[str, bytes]]:
    """The non-empty documents of rows ``[start, stop)`` of one parquet row group, in row order
    (each named ``PATH[row group G, row I]``, I counted in the row group), reading
    ``batch_rows`` rows at a time. ``key`` names the reader's stream (one replica's): a later call
    with the same key for rows after ``stop`` continues from here."""
    pq = pyarrow_parquet(who)
    where = f"{who}parquet file {path!r}: row group {row_group} rows {start}-{stop - 1}"
    try:
        st = os.stat(path)
    except OSError as e:
        raise DataError(f"{where}: cannot read it ({e.strerror or e})") from e
    ident = (path, st.st_size, st.st_mtime_ns, row_group, column, int(batch_rows), key)
    with _open_lock:
        reader = _open_readers.pop(ident, None)
    docs: list[tuple[str, bytes]] = []
    try:
        if reader is None or (reader.pending[0] if reader.pending else reader.next_row) > start:
            f = pq.ParquetFile(path, buffer_size=READ_BUFFER, pre_buffer=False)
            reader = _RowReader(f.iter_batches(batch_size=max(1, int(batch_rows)), row_groups=[row_group],
                                               columns=[column], use_threads=False))
        while True:
            if reader.pending is not None:
                first, batch = reader.pending
                reader.pending = None
            else:
                if reader.next_row >= stop:
                    break
                batch = next(reader.batches, None)
                if batch is None:
                    raise DataError(f"{where}: the row group ends at row {reader.next_row} (the file changed?)")
                first = reader.next_row
                reader.next_row += batch.num_rows
            end = first + batch.num_rows
            if end <= start:
                continue
            if first >= stop:
                reader.pending = (first, batch)
                break
            lo, hi = max(start, first), min(stop, end)
            for i, v in enumerate(batch.column(0).slice(lo - first, hi - lo).to_pylist(), start=lo):
                raw = _text_value(v, path, column, row_group, i, who)
                if raw:
                    docs.append((f"{path}[row group {row_group}, row {i}]", raw))
            if end > stop:
                reader.pending = (first, batch)
                break
    except DataError:
        raise
    except Exception as e:  # pyarrow raises several types for bad files
        raise DataError(f"{where}: cannot read it ({e})") from e
    with _open_lock:
        _open_readers[ident] = reader
        while len(_open_readers) > _MAX_OPEN:
            _open_readers.popitem(last=False)
    return docs


def split_and_pack(tok, docs: list[tuple[str, bytes]], val_fraction: float, dtype) -> dict[str, tuple[np.ndarray, int]]:
    """Documents -> {split: (their tokens packed with an EOS after each, document count)}, split by
    the sha256 of each document's text (the rule every source shares: ``is_val``)."""
    encoded = tok.encode_documents(docs) if docs else []
    in_val = [is_val(raw, val_fraction) for _, raw in docs]
    out = {}
    for split in SPLITS:
        chosen = [e for v, e in zip(in_val, encoded, strict=True) if v == (split == "val")]
        packed = np.empty(sum(e.size for e in chosen) + len(chosen), dtype=dtype)
        pos = 0
        for e in chosen:
            packed[pos:pos + e.size] = e
            pos += e.size
            packed[pos] = tok.eos_id
            pos += 1
        out[split] = (packed, len(chosen))
    return out


__all__ = ["SPLITS", "is_val", "val_key", "pyarrow_parquet", "parquet_row_groups", "row_range_documents",
           "split_and_pack"]
