"""The parquet corpus of a streamed run (``data.source=parquet``): its units and their readers.

Start-up reads only the files' footers (``list_row_groups``): a unit is a row group, or, for a
row group holding more than ``data.unit_bytes`` of text (its text column's uncompressed size in the
footer; pandas' and pyarrow's defaults put up to a million rows in one), a slice of consecutive
rows of about that size (``slice_row_groups``). ``ParquetCorpus`` reads a unit when asked, in
background worker processes (``data.workers``; 0: a thread of the training process) that read its
rows in pyarrow batches without the rest of the row group, split its documents train /
validation and tokenize them (``read_unit``); it also reads the validation documents at start.
How the units become each replica's stream is ``parquet_stream.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import threading
import time
import zlib
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np

from edit_jax.data.documents import BATCH_TEXT_BYTES, parquet_row_groups, row_range_documents, split_and_pack
from edit_jax.data.errors import DataError
from edit_jax.data.shards import TRACE_ENV, tokenizer_identity, trace_read
from edit_jax.data.tokenizers import cached_tokenizer


@dataclass(frozen=True)
class RowGroup:
    path: str
    row_group: int
    rows: int
    bytes: int  # its uncompressed size, from the footer
    text_bytes: int = 0  # the uncompressed size of its text column, from the footer (0: ``bytes``)


@dataclass(frozen=True)
class Unit:
    """What a reader reads at once: rows ``[start, stop)`` of a row group (all of it when it holds
    at most ``data.unit_bytes`` of text), decoded ``batch_rows`` rows at a time."""

    group: RowGroup
    start: int
    stop: int
    batch_rows: int

    @property
    def path(self) -> str:
        return self.group.path

    @property
    def row_group(self) -> int:
        return self.group.row_group

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.group.rows

    def describe(self) -> str:
        rows = "" if self.whole else f" rows {self.start}-{self.stop - 1}"
        return f"parquet file {self.path!r} row group {self.row_group}{rows}"


def list_row_groups(files: list[str], column: str) -> list[RowGroup]:
    """Every row group of ``files``, in file order; reads footers only. Each file must be parquet
    with a column ``column`` (``data.text_column``)."""
    groups: list[RowGroup] = []
    for p in files:
        groups += [RowGroup(p, *g) for g in parquet_row_groups(p, column, "", "data.text_column")]
    return groups


def slice_row_groups(groups: list[RowGroup], unit_bytes: int, min_units: int = 1) -> list[Unit]:
    """The units of ``groups``, in file order: a row group of at most ``unit_bytes`` of text (its
    text column's uncompressed size, from the footer) is one unit, a larger one is cut into
    ``ceil(text / unit_bytes)`` slices of consecutive rows (row counts differ by at most one).
    With ``min_units`` (the replica count) above the number that gives, the row groups are cut
    further, in proportion to their rows, so each replica has a unit."""
    total_rows = sum(g.rows for g in groups)
    units: list[Unit] = []
    for g in groups:
        text = g.text_bytes or g.bytes
        n = max(1, math.ceil(text / max(1, int(unit_bytes))))
        if min_units > 1 and total_rows:
            n = max(n, math.ceil(min_units * g.rows / total_rows))
        n = max(1, min(n, g.rows))
        per_batch = max(1, int(g.rows * BATCH_TEXT_BYTES / max(1, text)))
        bounds = [j * g.rows // n for j in range(n + 1)]
        units += [Unit(g, a, b, min(per_batch, max(1, b - a))) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return units


def read_unit(path: str, row_group: int, column: str, tokenizer: str, val_fraction: float,
              dtype: str, rows: tuple[int, int], batch_rows: int, key: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of one row group -> (train tokens, validation tokens), each its documents
    packed with an EOS after each one, in row order. Runs in a reader process (or thread);
    ``key`` (the replica's stream) lets consecutive slices of a row group continue one reader."""
    tok = cached_tokenizer(tokenizer)
    docs = row_range_documents(path, row_group, column, rows[0], rows[1], batch_rows, key)
    packed = split_and_pack(tok, docs, val_fraction, np.dtype(dtype))
    return packed["train"][0], packed["val"][0]


def _reader_init(parent: int) -> None:
    """In each reader process: end it when the training process that started it is gone. A killed
    (SIGKILL) training process shuts nothing down, and a reader waiting for work would wait forever."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="edit-jax-parent-watch").start()


class ParquetCorpus:
    """The row groups of a parquet corpus, its units (row groups, or slices of the large ones, of
    at most about ``unit_bytes`` of text each) and the readers that tokenize them (shared by the
    training stream and the validation batches)."""

    # Validation reads at most this many units at start (FineWeb-Edu's row groups hold about 1 M
    # tokens each: some 250 M tokens of text, 12 M validation tokens at val_fraction 0.05). A run that
    # asks for more evaluates on what they hold, and says so.
    VAL_MAX_UNITS = 256

    def __init__(self, groups: list[RowGroup], column: str, tokenizer, val_fraction: float, workers: int,
                 dtype, unit_bytes: int = 8 * 2**20):
        if not groups:
            raise DataError("data.source='parquet': the files hold no row groups; expected documents")
        if not isinstance(unit_bytes, int) or unit_bytes <= 0:
            raise DataError(f"data.unit_bytes must be a positive int (bytes of text a reader reads at a time), "
                            f"got {unit_bytes!r}")
        self.groups, self.unit_bytes = groups, unit_bytes
        self.units = slice_row_groups(groups, unit_bytes)
        self.column, self.val_fraction, self.workers = column, float(val_fraction), int(workers)
        self.tokenizer_spec = tokenizer.name  # "byte" or the tokenizer.json path (the readers make their own)
        self.dtype = np.dtype(dtype).name
        self._pool: cf.Executor | None = None
        self._val: list[np.ndarray] = []  # validation tokens of units [0, len(_val))
        self._identity = [column, tokenizer_identity(tokenizer)["sha256"], self.val_fraction]
        self.fingerprint = self.fingerprint_of(self.units)
        self.trace = os.environ.get(TRACE_ENV) or None

    def fingerprint_of(self, units: list[Unit]) -> int:
        """crc32 of the units (file names, row groups, their sizes and, for a slice, its rows), the
        column, the tokenizer and ``val_fraction``: what a saved position depends on. A corpus of
        whole row groups has the fingerprint it had before units could be slices."""
        identity = [[os.path.basename(u.path), u.row_group, u.group.rows, u.group.bytes]
                    + ([] if u.whole else [u.start, u.stop]) for u in units]
        return zlib.crc32(json.dumps([identity, *self._identity]).encode())

    def units_for(self, num_replicas: int) -> list[Unit]:
        """The units a stream of ``num_replicas`` replicas deals out: ``units``, or, when there are
        fewer than replicas, the row groups cut further so each replica has one."""
        if len(self.units) >= num_replicas:
            return self.units
        units = slice_row_groups(self.groups, self.unit_bytes, num_replicas)
        if len(units) < num_replicas:
            raise DataError(f"data.source='parquet': the files hold {sum(g.rows for g in self.groups)} rows for "
                            f"mesh.replica={num_replicas} replicas; each replica needs at least one row. Add data")
        return units

    def describe(self) -> str:
        files = len({g.path for g in self.groups})
        sliced = len(self.units) - len(self.groups)
        return (f"{files} parquet file{'s' if files != 1 else ''}, {len(self.groups)} row groups"
                + (f" ({len(self.units)} units of about {self.unit_bytes / 2**20:g} MiB of text)" if sliced else "")
                + f", {sum(g.rows for g in self.groups)} rows, streamed")

    def _executor(self) -> cf.Executor:
        if self._pool is None:
            if self.workers == 0:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="edit-jax-parquet")
            else:  # spawn: the training process has started JAX's threads, so fork is unsafe
                self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                                    initializer=_reader_init, initargs=(os.getpid(),))
        return self._pool

    def submit(self, index: int, purpose: str, replica: int = -1, units: list[Unit] | None = None) -> cf.Future:
        """Starts reading unit ``index`` (of ``units``, default ``self.units``) in the background."""
        u = (units or self.units)[index]
        if self.trace:  # shards.TRACE_ENV: what each process reads (tests); names the file, row group and rows
            trace_read(self.trace, {"unit": index, "purpose": purpose, "replica": replica, "file": u.path,
                                    "row_group": u.row_group, "rows": [u.start, u.stop]})
        try:
            return self._executor().submit(read_unit, u.path, u.row_group, self.column, self.tokenizer_spec,
                                           self.val_fraction, self.dtype, (u.start, u.stop), u.batch_rows,
                                           f"{purpose}:{replica}")
        except BrokenProcessPool as e:  # a reader died earlier and the pool knows it already
            raise self._reader_died(u) from e

    @staticmethod
    def _reader_died(u: Unit) -> DataError:
        return DataError(f"{u.describe()}: the reader process died while tokenizing it (out of memory?); lower "
                         f"data.workers or data.unit_bytes, or use data.workers=0")

    def result(self, future: cf.Future, index: int, units: list[Unit] | None = None) -> tuple[np.ndarray, np.ndarray]:
        u = (units or self.units)[index]
        try:
            return future.result()
        except DataError:
            raise
        except BrokenProcessPool as e:
            raise self._reader_died(u) from e
        except Exception as e:
            raise DataError(f"{u.describe()}: cannot read it ({e})") from e

    def val_tokens(self, count: int | None) -> np.ndarray:
        """At least ``count`` validation tokens (None: all), from the units in file order, or what
        the first ``VAL_MAX_UNITS`` units hold if that is fewer; read once and kept (the same
        every call)."""
        have, limit = sum(v.size for v in self._val), min(len(self.units), self.VAL_MAX_UNITS)
        while (count is None or have < count) and len(self._val) < limit:
            first = len(self._val)
            batch = range(first, min(limit, first + max(1, self.workers)))  # the readers in parallel
            futures = [(i, self.submit(i, "val")) for i in batch]
            for i, fut in futures:
                self._val.append(self.result(fut, i)[1])
                have += self._val[-1].size
        return np.concatenate(self._val) if self._val else np.zeros(0, self.dtype)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


__all__ = ["RowGroup", "Unit", "list_row_groups", "slice_row_groups", "read_unit", "ParquetCorpus", "TRACE_ENV"]
