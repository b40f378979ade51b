"""What the drivers see of a training stream (``ReplicaStreams``): replica ``r``'s rows of step
``k`` (``replica_batch``), the global batch of the stream's ``step`` (``peek`` / ``next``), a JSON
position (``get_state`` / ``set_state``) and ``close``. Two streams have it: ``streams.TrainStream``
(random access over a packed token array) and ``parquet_stream.ParquetStream`` (per-replica
streams of parquet row groups). The checks and the global batch they share live here."""

from __future__ import annotations

import numpy as np

from edit_jax.data.errors import DataError


class ReplicaStreams:
    """Global batches ``[batch_size, seq_len + 1]`` whose rows ``[r*B/N, (r+1)*B/N)`` are replica
    ``r``'s. Subclasses provide ``replica_batch``, ``get_state`` and ``set_state``."""

    def __init__(self, seq_len: int, batch_size: int, num_replicas: int, seed: int):
        if seq_len <= 0 or batch_size <= 0 or num_replicas <= 0:
            raise DataError(f"train stream: seq_len, batch_size and num_replicas must be positive, got "
                            f"{seq_len}, {batch_size}, {num_replicas}")
        if batch_size % num_replicas:
            raise DataError(f"train stream: batch_size {batch_size} must be divisible by num_replicas {num_replicas}")
        self.seq_len, self.batch_size, self.num_replicas, self.seed = seq_len, batch_size, num_replicas, int(seed)
        self.step = 0
        # Batches skipped by loss-spike rollbacks: step k trains on the stream's batch k + offset
        # (training/loop.py moves it past the batches a spike consumed).
        self.offset = 0

    def replica_batch(self, replica: int, step: int | None = None) -> np.ndarray:
        raise NotImplementedError

    def peek(self) -> np.ndarray:
        """The batch ``next()`` would return, without advancing."""
        return np.concatenate([self.replica_batch(r) for r in range(self.num_replicas)], axis=0)

    def next(self) -> np.ndarray:
        batch = self.peek()
        self.step += 1
        return batch

    __next__ = next

    def __iter__(self):
        return self

    def close(self) -> None:
        """Releases what the stream holds (reader processes); nothing by default."""

    def _check_same(self, state: dict, keys: tuple[str, ...], corpus_keys: tuple[str, ...], corpus_what: str,
                    required: bool) -> None:
        """Each of ``keys`` in a saved state equals this stream's attribute, else DataError names it
        (a key missing from the state is a mismatch only when ``required``)."""
        for key in keys:
            if (required or key in state) and state.get(key) != getattr(self, key):
                what = corpus_what if key in corpus_keys else "the config changed"
                raise DataError(f"train stream state: saved {key}={state.get(key)} but this stream has "
                                f"{key}={getattr(self, key)} ({what}); cannot resume at the same position")

    def skip(self, batches: int) -> None:
        """From now on step k reads what step k + ``batches`` would have read (a rollback)."""
        self.offset += int(batches)

    @staticmethod
    def _saved_offset(state: dict) -> int:
        offset = state.get("offset", 0)  # absent: saved before rollbacks existed
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise DataError(f"train stream state: 'offset' must be a non-negative int, got {offset!r}")
        return offset

    @staticmethod
    def _saved_step(state: dict) -> int:
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise DataError(f"train stream state: 'step' must be a non-negative int, got {step!r}")
        return step


__all__ = ["ReplicaStreams"]
