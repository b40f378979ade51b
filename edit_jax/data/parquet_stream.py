"""Streaming parquet (``data.source=parquet``): train on parquet text without tokenizing it first.

Start-up reads only the files' footers: the corpus (``parquet_units.py``) is a list of units, a
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
import itertools
from dataclasses import dataclass

import numpy as np

from edit_jax.data.batches import ReplicaStreams
from edit_jax.data.errors import DataError
from edit_jax.data.parquet_units import ParquetCorpus

PREFETCH_UNITS = 2  # units read ahead per replica (each at most about data.unit_bytes of text)


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
        k = (self.step if step is None else int(step)) + self.offset  # the batch's index in the stream
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
                "cursors": cursors, "offset": self.offset}

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
                         "the parquet files, data.text_column, data.tokenizer, data.val_fraction or "
                         "data.unit_bytes changed",
                         required=True)
        cursors = state.get("cursors")
        if (not isinstance(cursors, list) or len(cursors) != self.num_replicas
                or not all(isinstance(c, list) and len(c) == 4 and all(isinstance(x, int) and x >= 0 for x in c)
                           for c in cursors)):
            raise DataError(f"train stream state: 'cursors' must be {self.num_replicas} lists of 4 non-negative "
                            f"ints, got {cursors!r}")
        step, offset = self._saved_step(state), self._saved_offset(state)
        for r, c in enumerate(cursors):
            if c[2] >= len(self._order(r, c[1])):
                raise DataError(f"train stream state: replica {r}'s cursor {c} is past its epoch's "
                                f"{len(self._order(r, c[1]))} units (row groups or slices of them)")
            rep = self._replicas[r]
            for _, fut in rep.ahead:
                fut.cancel()
            self._replicas[r] = _Replica()
            self._replicas[r].cursor = Cursor(*c)
        self.step, self.offset = step, offset

    def close(self) -> None:
        self.corpus.close()


__all__ = ["ParquetStream", "Cursor", "unit_order", "replica_units", "PREFETCH_UNITS"]
