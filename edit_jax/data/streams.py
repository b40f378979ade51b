"""Windows and batches over a ``Corpus``: a split's packed stream cut into windows of
``seq_len + 1`` tokens, the per-replica grain datasets, the resumable ``TrainStream`` of global
batches and the fixed validation batches."""

from __future__ import annotations

import zlib

import grain
import numpy as np

from edit_jax.data.batches import ReplicaStreams
from edit_jax.data.corpus import Corpus
from edit_jax.data.errors import DataError
from edit_jax.data.parquet_stream import ParquetStream


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
    return tokens.size // (seq_len + 1)


def window(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    """Window ``index`` of a packed stream: tokens ``[i*(L+1), (i+1)*(L+1))`` as int32."""
    start = index * (seq_len + 1)
    return np.asarray(tokens[start:start + seq_len + 1], dtype=np.int32)


def fingerprint(tokens: np.ndarray) -> int:
    """Cheap identity of a token stream (crc32 of its length and <= ~1M evenly spaced tokens), so a
    restored stream can tell that the corpus changed under it."""
    stride = max(1, tokens.size // (1 << 20))
    sample = np.ascontiguousarray(tokens[::stride]).astype(np.uint32)
    return zlib.crc32(sample.tobytes(), zlib.crc32(str(tokens.size).encode()))


def _shuffle_seed(seed: int) -> int:
    # grain's shuffle uses seed + epoch for epoch e, so raw seeds s and s+1 would share permutations
    # one epoch apart; mixing the user seed first avoids that and maps any int into [0, 2**32).
    return int(np.random.SeedSequence([abs(int(seed)), int(seed < 0), 0xED17]).generate_state(1, np.uint32)[0])


class _Window:
    """Picklable index -> window map (a lambda would not survive grain's multiprocessing paths)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __call__(self, index: int) -> np.ndarray:
        return window(self.tokens, int(index), self.seq_len)


def replica_dataset(tokens: np.ndarray, seq_len: int, batch_size: int, num_replicas: int, seed: int,
                    replica: int) -> grain.MapDataset:
    """Replica ``replica``'s infinite grain MapDataset of ``[batch_size/num_replicas, seq_len+1]`` batches.

    Pipeline: window ids -> shuffle (new permutation each epoch) -> keep the first
    ``steps_per_epoch * batch_size`` (every step is a full global batch) -> windows -> chunks of
    ``B/N`` -> chunk ``r::N`` -> repeat. Chunk ``k*N + r`` is rows ``[r*B/N, (r+1)*B/N)`` of global
    step ``k``, so the N replicas' element ``k`` stacked in order is the same global batch whatever
    ``N`` is, and within an epoch every window is used at most once (replicas are disjoint).
    """
    per = batch_size // num_replicas
    steps = num_windows(tokens, seq_len) // batch_size
    return (grain.MapDataset.range(num_windows(tokens, seq_len))
            .shuffle(seed=_shuffle_seed(seed))
            .slice(slice(0, steps * batch_size))
            .map(_Window(tokens, seq_len))
            .batch(per, drop_remainder=True)
            .slice(slice(replica, None, num_replicas))
            .repeat(None))


class TrainStream(ReplicaStreams):
    """Infinite, deterministic, resumable stream of global training batches.

    ``next()`` returns int32 ``[batch_size, seq_len + 1]``; rows ``[r*B/N, (r+1)*B/N)`` are replica
    ``r``'s. The state is just the global step (plus identity fields checked on restore), because a
    grain MapDataset is random access: batch ``k`` is recomputed, not replayed.
    """

    STATE_VERSION = 1

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, num_replicas: int, seed: int):
        super().__init__(seq_len, batch_size, num_replicas, seed)
        n = num_windows(corpus.train_tokens, seq_len)
        if n < batch_size:
            raise DataError(f"train split of corpus ({corpus.description}) has {corpus.train_tokens.size} tokens = "
                            f"{n} windows of seq_len+1 = {seq_len + 1}; one batch needs batch_size = {batch_size} "
                            f"windows. Add data or lower batch_size / data.seq_len")
        self.num_windows = n
        self.steps_per_epoch = n // batch_size
        self.fingerprint = (corpus.train_fingerprint if corpus.train_fingerprint is not None
                            else fingerprint(corpus.train_tokens))
        self._sampled = corpus.train_tokens if corpus.sampled_fingerprint_ok else None
        self._datasets = [replica_dataset(corpus.train_tokens, seq_len, batch_size, num_replicas, seed, r)
                          for r in range(num_replicas)]

    @property
    def epoch(self) -> int:
        return (self.step + self.offset) // self.steps_per_epoch

    def replica_batch(self, replica: int, step: int | None = None) -> np.ndarray:
        """Replica ``replica``'s rows of global step ``step`` (default: the next one), without advancing."""
        return np.asarray(self._datasets[replica][(self.step if step is None else step) + self.offset], dtype=np.int32)

    def get_state(self, gather=None) -> dict:
        """The global step and the identity fields; the same in every process (``gather``, used by
        per-replica streams, is not needed)."""
        return {"version": self.STATE_VERSION, "step": self.step, "epoch": self.epoch, "seed": self.seed,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "num_replicas": self.num_replicas,
                "num_windows": self.num_windows, "fingerprint": self.fingerprint, "offset": self.offset}

    def set_state(self, state: dict) -> None:
        """Resumes at ``state["step"]``. The seed, batch size, seq_len and corpus (window count and
        fingerprint) must match, else DataError names the mismatch. ``num_replicas`` may differ
        (elastic restart): the global batches are the same for any N, so the stream continues at the
        same global position with the same batches; only the row -> replica assignment changes."""
        if not isinstance(state, dict) or "step" not in state:
            raise DataError(f"train stream state: expected a dict from get_state() with a 'step', got {state!r}")
        if state.get("version", self.STATE_VERSION) != self.STATE_VERSION:
            raise DataError(f"train stream state: version {state.get('version')} is not {self.STATE_VERSION}")
        if (self._sampled is not None and state.get("fingerprint") not in (None, self.fingerprint)
                and state.get("fingerprint") == fingerprint(self._sampled)):
            state = {**state, "fingerprint": self.fingerprint}  # saved before loose arrays had their identity
        self._check_same(state, ("seed", "batch_size", "seq_len", "num_windows", "fingerprint"),
                         ("num_windows", "fingerprint"), "the corpus changed", required=False)
        self.step, self.offset = self._saved_step(state), self._saved_offset(state)


def make_train_stream(corpus: Corpus, seq_len: int, batch_size: int, num_replicas: int, seed: int):
    """See TrainStream (or ``ParquetStream`` for a streamed corpus: per-replica streams with the same
    interface). ``batch_size`` is global and must be divisible by ``num_replicas``."""
    if corpus.streamed is not None:
        return ParquetStream(corpus.streamed, seq_len, batch_size, num_replicas, seed)
    return TrainStream(corpus, seq_len, batch_size, num_replicas, seed)


def val_batches(corpus: Corpus, seq_len: int, batch_size: int, max_batches: int | None = None) -> list[np.ndarray]:
    """Validation windows in stream order, ``min(max_batches, available)`` full batches of int32
    ``[batch_size, seq_len + 1]``; the same list every call (no shuffle, no overlap)."""
    if seq_len <= 0 or batch_size <= 0:
        raise DataError(f"val batches: seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    val_tokens = corpus.val_tokens
    if corpus.streamed is not None:  # read the validation documents of the first units, as many as needed
        want = None if max_batches is None else max(1, int(max_batches)) * batch_size * (seq_len + 1)
        val_tokens = corpus.streamed.val_tokens(want)
    n = num_windows(val_tokens, seq_len)
    avail = n // batch_size
    if avail == 0:
        raise DataError(f"validation split of corpus ({corpus.description}) has {val_tokens.size} tokens = "
                        f"{n} windows of seq_len+1 = {seq_len + 1}; one batch needs batch_size = {batch_size} "
                        f"windows. Raise data.val_fraction, add data or lower the batch size / data.seq_len"
                        + (f" (streamed parquet reads validation documents from the first "
                           f"{corpus.streamed.VAL_MAX_UNITS} row groups at most, or slices of data.unit_bytes of "
                           f"them; or tokenize the corpus)"
                           if corpus.streamed is not None else ""))
    count = avail if max_batches is None else max(0, min(int(max_batches), avail))
    w = seq_len + 1
    flat = np.asarray(val_tokens[:count * batch_size * w], dtype=np.int32)
    return [b for b in flat.reshape(count, batch_size, w)]


def inputs_targets(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[B, L+1]`` windows -> (inputs ``[B, L]``, targets ``[B, L]``), targets shifted by one."""
    return batch[:, :-1], batch[:, 1:]
