"""Streaming parquet (``data.source=parquet``): train on parquet text without tokenizing it first.

Start-up reads only the files' footers: the corpus is a list of units (``slice_row_groups``), a
unit being a row group, or, for a row group holding more than ``data.unit_bytes`` of text (its
text column's uncompressed size in the footer; pandas' and pyarrow's defaults put up to a million
rows in one), a slice of consecutive rows of about that size. Training reads a unit when a
replica's stream reaches it, in background worker processes (``data.workers``; 0: a thread of the
training process) that read its rows in pyarrow batches without the rest of the row group
(``documents.row_range_documents``), split its documents train / validation by the sha256 of
their text (the rule of every source and of ``edit-jax tokenize``) and tokenize them; one or two
units per replica are read ahead, so memory is bounded by a few units, whatever the file layout.

Each replica has a stream of its own (``ParquetStream``), disjoint from the others': in epoch
``e`` the row groups are permuted by (``data.seed``, ``e``), each expanded into its units in row
order, and replica ``r`` of ``N`` takes every ``N``-th unit from ``r`` (``replica_units``); its
stream is their train tokens concatenated (an EOS after each document), cut into windows of
``seq_len + 1`` tokens, ``B/N`` windows a step. A replica's position is a cursor
``(k, epoch, pos, offset)``: the next step, the epoch, the unit's place in the replica's order and
the token offset in it. The cursor is all a resume needs (one unit is read again, no replay from
the start), and it is O(1). With several processes each process reads only the units of the
replicas it trains; at a checkpoint the processes exchange their cursors (``get_state(gather)``),
so process 0 writes every replica's position.

What this source does not do, by design: random access to an arbitrary step (a replica asks for
its steps in order, as the drivers do), and elastic restarts with another ``mesh.replica`` (the
unit -> replica assignment depends on N). ``edit-jax tokenize`` then ``data.source=tokens`` has
both, and reads nothing at start.

Validation: the validation documents of the units in file order, read at start until the run's
``eval_batches`` are full (about ``1/val_fraction`` times their tokens of text is read), from at
most ``ParquetCorpus.VAL_MAX_UNITS`` units.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
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

from edit_jax.data.batches import ReplicaStreams
from edit_jax.data.documents import BATCH_TEXT_BYTES, parquet_row_groups, row_range_documents, split_and_pack
from edit_jax.data.errors import DataError
from edit_jax.data.shards import TRACE_ENV, tokenizer_identity, trace_read
from edit_jax.data.tokenizers import cached_tokenizer

PREFETCH_UNITS = 2  # units read ahead per replica (each at most about data.unit_bytes of text)


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
        units += [Unit(g, a, b, min(per_batch, max(1, b - a))) for a, b in zip(bounds[:-1], bounds[1:])]
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
        except Exception as e:  # noqa: BLE001
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


def _order_seed(seed: int) -> list[int]:
    return [abs(int(seed)), int(seed < 0), 0xED17]


def unit_order(slices, seed: int, epoch: int) -> np.ndarray:
    """All units in epoch ``epoch``'s order: the row groups permuted by (seed, epoch), each one's
    units (``slices[g]`` of them, consecutive ids; an int: that many row groups of one unit each)
    in row order."""
    counts = [1] * int(slices) if isinstance(slices, (int, np.integer)) else [int(c) for c in slices]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(_order_seed(seed) + [int(epoch)])))
    perm = rng.permutation(len(counts))
    if all(c == 1 for c in counts):
        return perm
    starts = np.concatenate([[0], np.cumsum(counts)])
    return np.concatenate([np.arange(starts[g], starts[g + 1]) for g in perm])


def replica_units(slices, seed: int, epoch: int, replica: int, num_replicas: int) -> np.ndarray:
    """Replica ``replica``'s units in epoch ``epoch``: every ``num_replicas``-th unit of
    ``unit_order`` from ``replica``, so the replicas' units are disjoint in an epoch and together
    all of them, and a row group cut in slices is dealt to the replicas slice by slice (each
    replica reads its slices of it in row order)."""
    return unit_order(slices, seed, epoch)[replica::num_replicas]


@dataclass
class Cursor:
    """A replica's position: the next step ``k`` it produces, and where its tokens continue (the
    unit ``pos`` of its epoch ``epoch`` order, token ``offset`` in that unit's train tokens)."""

    k: int = 0
    epoch: int = 0
    pos: int = 0
    offset: int = 0

    def as_list(self) -> list[int]:
        return [self.k, self.epoch, self.pos, self.offset]


class _Replica:
    """One replica's stream: its cursor, the unit it is in, its read-ahead and its last batch."""

    def __init__(self):
        self.cursor = Cursor()
        self.tokens: np.ndarray | None = None  # the train tokens of the cursor's unit, once read
        self.ahead: collections.deque = collections.deque()  # ((epoch, pos), future)
        self.last: tuple[int, np.ndarray] | None = None
        self.touched = False  # this process produced batches for it


class ParquetStream(ReplicaStreams):
    """Per-replica streams of windows over a ``ParquetCorpus``, the drivers' ``ReplicaStreams``
    interface. A replica's steps are produced in order; ``replica_batch(r, k)`` for the step just
    produced returns it again."""

    STATE_VERSION = 1
    KIND = "parquet-stream"

    def __init__(self, corpus: ParquetCorpus, seq_len: int, batch_size: int, num_replicas: int, seed: int):
        super().__init__(seq_len, batch_size, num_replicas, seed)
        self.corpus = corpus
        self.unit_list = corpus.units_for(num_replicas)
        self.slices = [sum(1 for _ in grp) for _, grp in itertools.groupby(self.unit_list, key=lambda u: u.group)]
        self.rows = batch_size // num_replicas
        self.units, self.fingerprint = len(self.unit_list), corpus.fingerprint_of(self.unit_list)
        self._replicas = [_Replica() for _ in range(num_replicas)]
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    # ------------------------------------------------------------------ positions and units

    def _order(self, replica: int, epoch: int) -> np.ndarray:
        key = (replica, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * self.num_replicas:
                self._orders.clear()
            self._orders[key] = replica_units(self.slices, self.seed, epoch, replica, self.num_replicas)
        return self._orders[key]

    def _unit(self, replica: int, epoch: int, pos: int) -> int:
        return int(self._order(replica, epoch)[pos])

    def _following(self, replica: int, epoch: int, pos: int) -> tuple[int, int]:
        return (epoch, pos + 1) if pos + 1 < len(self._order(replica, epoch)) else (epoch + 1, 0)

    def _read_ahead(self, r: int) -> None:
        rep, c = self._replicas[r], self._replicas[r].cursor
        want, key = [], (c.epoch, c.pos)
        for _ in range(PREFETCH_UNITS):
            key = self._following(r, *key)
            want.append(key)
        have = [k for k, _ in rep.ahead]
        if have != want[:len(have)]:  # the position jumped (restore): drop what was read ahead
            for _, fut in rep.ahead:
                fut.cancel()
            rep.ahead.clear()
        for key in want[len(rep.ahead):]:
            rep.ahead.append((key, self.corpus.submit(self._unit(r, *key), "train", r, self.unit_list)))

    def _load(self, r: int) -> np.ndarray:
        """The train tokens of replica ``r``'s current unit (from the read-ahead when it has them)."""
        rep, c = self._replicas[r], self._replicas[r].cursor
        if rep.tokens is None:
            unit = self._unit(r, c.epoch, c.pos)
            if rep.ahead and rep.ahead[0][0] == (c.epoch, c.pos):
                fut = rep.ahead.popleft()[1]
            else:
                fut = self.corpus.submit(unit, "train", r, self.unit_list)
            rep.tokens = self.corpus.result(fut, unit, self.unit_list)[0]
            if c.offset > rep.tokens.size:  # only a restored cursor can be here
                raise DataError(f"train stream state: replica {r}'s cursor is at token {c.offset} of "
                                f"{self.unit_list[unit].describe()}, which holds {rep.tokens.size} training tokens "
                                f"(the file changed since the checkpoint?)")
            self._read_ahead(r)
        return rep.tokens

    def _produce(self, r: int) -> np.ndarray:
        """Replica ``r``'s next batch [B/N, seq_len + 1]; advances its cursor."""
        rep, c = self._replicas[r], self._replicas[r].cursor
        need = self.rows * (self.seq_len + 1)
        out = np.empty(need, np.int32)
        filled, empty_run = 0, 0
        while filled < need:
            tokens = self._load(r)
            take = min(need - filled, tokens.size - c.offset)
            out[filled:filled + take] = tokens[c.offset:c.offset + take]
            filled, c.offset = filled + take, c.offset + take
            empty_run = 0 if take else empty_run + 1
            if empty_run > len(self.unit_list):
                raise DataError(f"data.source='parquet': replica {r}'s row groups hold no training documents "
                                f"(every row empty or in the validation split); add data or lower data.val_fraction")
            if c.offset >= tokens.size:  # the cursor never rests at a unit's end: positions are canonical
                c.epoch, c.pos = self._following(r, c.epoch, c.pos)
                c.offset, rep.tokens = 0, None
        c.k += 1
        return out.reshape(self.rows, self.seq_len + 1)

    # ------------------------------------------------------------------ ReplicaStreams' interface

    def replica_batch(self, replica: int, step: int | None = None) -> np.ndarray:
        """Replica ``replica``'s rows of step ``step`` (default: the stream's ``step``)."""
        k = self.step if step is None else int(step)
        rep = self._replicas[replica]
        if rep.last is not None and rep.last[0] == k:
            return rep.last[1]
        if k < rep.cursor.k:
            raise DataError(f"data.source='parquet' streams forward: replica {replica} was asked for step {k} after "
                            f"step {rep.cursor.k - 1}; a streamed replica cannot go back (data.source=tokens can)")
        rep.touched = True
        while rep.cursor.k < k:  # skipping ahead (not done by the drivers): read and drop
            self._produce(replica)
        batch = self._produce(replica)
        rep.last = (k, batch)
        return batch

    def local_cursors(self) -> list[int]:
        """What this process knows, flat: ``[touched, k, epoch, pos, offset]`` per replica, where
        ``touched`` says this process produced the replica's batches."""
        return [x for rep in self._replicas for x in [int(rep.touched), *rep.cursor.as_list()]]

    def get_state(self, gather=None) -> dict:
        """The stream's position: every replica's cursor. ``gather`` (several processes: a
        collective that stacks every process's vector, ``multihost.exchange_floats``) merges the
        processes' ``local_cursors``, each replica's from the process that trains it."""
        mine = self.local_cursors()
        table = np.asarray([mine] if gather is None else np.rint(np.asarray(gather(mine), np.float64)), np.int64)
        table = table.reshape(-1, self.num_replicas, 5)
        cursors = []
        for r in range(self.num_replicas):
            owners = [p for p in range(table.shape[0]) if table[p, r, 0]]
            cursors.append([int(x) for x in table[owners[0] if owners else 0, r, 1:]])
        return {"version": self.STATE_VERSION, "kind": self.KIND, "step": self.step, "seed": self.seed,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "num_replicas": self.num_replicas,
                "units": self.units, "fingerprint": self.fingerprint,
                "cursors": cursors}

    def set_state(self, state: dict) -> None:
        """Resumes every replica at its saved cursor. The seed, batch size, seq_len, replica count
        and corpus must match, else DataError names the mismatch."""
        if not isinstance(state, dict) or state.get("kind") != self.KIND:
            raise DataError("train stream state: the checkpoint's data position is not a streamed parquet one "
                            f"(data.source changed?); got {str(state)[:200]}")
        if state.get("version") != self.STATE_VERSION:
            raise DataError(f"train stream state: version {state.get('version')} is not {self.STATE_VERSION}")
        if state.get("num_replicas") != self.num_replicas:
            raise DataError(f"train stream state: saved with mesh.replica={state.get('num_replicas')}, this run has "
                            f"{self.num_replicas}; a streamed parquet corpus assigns row groups to replicas and "
                            f"cannot change their number (tokenize it and use data.source=tokens for that)")
        self._check_same(state, ("seed", "batch_size", "seq_len", "units", "fingerprint"), ("units", "fingerprint"),
                         "the parquet files, data.text_column, data.tokenizer, data.val_fraction or data.unit_bytes changed",
                         required=True)
        cursors = state.get("cursors")
        if (not isinstance(cursors, list) or len(cursors) != self.num_replicas
                or not all(isinstance(c, list) and len(c) == 4 and all(isinstance(x, int) and x >= 0 for x in c)
                           for c in cursors)):
            raise DataError(f"train stream state: 'cursors' must be {self.num_replicas} lists of 4 non-negative "
                            f"ints, got {cursors!r}")
        step = self._saved_step(state)
        for r, c in enumerate(cursors):
            if c[2] >= len(self._order(r, c[1])):
                raise DataError(f"train stream state: replica {r}'s cursor {c} is past its epoch's "
                                f"{len(self._order(r, c[1]))} units (row groups or slices of them)")
            rep = self._replicas[r]
            for _, fut in rep.ahead:
                fut.cancel()
            self._replicas[r] = _Replica()
            self._replicas[r].cursor = Cursor(*c)
        self.step = step

    def close(self) -> None:
        self.corpus.close()


__all__ = ["RowGroup", "Unit", "list_row_groups", "slice_row_groups", "read_unit", "ParquetCorpus", "ParquetStream",
           "Cursor", "unit_order", "replica_units", "PREFETCH_UNITS"]
