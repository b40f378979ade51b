"""Documents, below every reader: the train / validation rule (``is_val``: the sha256 of a stable
key), a parquet row group's documents (``row_group_documents``) and a batch of documents tokenized,
split and packed (``split_and_pack``). ``edit-jax tokenize``, the streamed parquet source and the
in-memory sources share them, so one document lands in the same split, with the same tokens,
on every path."""

from __future__ import annotations

import hashlib

import numpy as np

from edit_jax.data.errors import DataError

SPLITS = ("train", "val")


def is_val(key: bytes, val_fraction: float) -> bool:
    # sha256 of a stable key (not Python's salted hash()) so the split is identical on every machine,
    # in every process and regardless of the order files are listed in.
    h = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return h < val_fraction * 2.0**64


def pyarrow_parquet(who: str = "") -> object:
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise DataError(f"{who}parquet inputs need pyarrow: pip install edit-jax[parquet] (or pip install pyarrow)") from e
    return pq


def parquet_row_groups(path: str, column: str, who: str, field: str) -> list[tuple[int, int, int]]:
    """(row group, rows, uncompressed bytes) of every row group of a parquet file, from its footer
    alone; the file must be parquet with the text column ``column`` (the ``field`` that set it)."""
    pq = pyarrow_parquet(who)
    try:
        meta = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DataError(f"{who}parquet file {path!r}: cannot read it as parquet ({e})") from e
    names = meta.schema_arrow.names
    if column not in names:
        raise DataError(f"{who}parquet file {path!r}: no column {column!r} ({field}); columns are {', '.join(names)}")
    md = meta.metadata
    return [(g, md.row_group(g).num_rows, md.row_group(g).total_byte_size) for g in range(md.num_row_groups)]


def row_group_documents(path: str, row_group: int, column: str, who: str = "") -> list[tuple[str, bytes]]:
    """The non-empty documents (name, raw UTF-8 bytes) of one parquet row group, in row order;
    ``who`` prefixes error messages ("tokenize: ")."""
    pq = pyarrow_parquet(who)
    try:
        table = pq.ParquetFile(path).read_row_group(row_group, columns=[column])
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DataError(f"{who}parquet file {path!r}: cannot read row group {row_group} ({e})") from e
    docs = []
    for i, v in enumerate(table.column(column).to_pylist()):
        if v is None:
            continue
        if isinstance(v, str):
            raw = v.encode("utf-8")
        elif isinstance(v, (bytes, bytearray)):
            raw = bytes(v)
        else:
            raise DataError(f"{who}parquet file {path!r}: column {column!r} must hold text, "
                            f"row group {row_group} row {i} is {type(v).__name__}")
        if raw:
            docs.append((f"{path}[row group {row_group}, row {i}]", raw))
    return docs


def split_and_pack(tok, docs: list[tuple[str, bytes]], val_fraction: float, dtype) -> dict[str, tuple[np.ndarray, int]]:
    """Documents -> {split: (their tokens packed with an EOS after each, document count)}, split by
    the sha256 of each document's text (the rule every source shares: ``is_val``)."""
    encoded = tok.encode_documents(docs) if docs else []
    in_val = [is_val(raw, val_fraction) for _, raw in docs]
    out = {}
    for split in SPLITS:
        chosen = [e for v, e in zip(in_val, encoded) if v == (split == "val")]
        packed = np.empty(sum(e.size for e in chosen) + len(chosen), dtype=dtype)
        pos = 0
        for e in chosen:
            packed[pos:pos + e.size] = e
            pos += e.size
            packed[pos] = tok.eos_id
            pos += 1
        out[split] = (packed, len(chosen))
    return out


__all__ = ["SPLITS", "is_val", "pyarrow_parquet", "parquet_row_groups", "row_group_documents", "split_and_pack"]
