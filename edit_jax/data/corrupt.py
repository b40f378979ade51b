"""Testing knobs that inject faults: ``debug.corrupt`` (one worker trains on garbage for a window
of steps) and ``debug.lr_spike`` (the updates of a few steps blown up: a loss spike of the whole
run, for training/spike.py's rollback; ``LrSpike`` at the end).

``debug.corrupt="worker=W,steps=A-B"`` replaces worker (replica) W's rows of the global batch by
uniformly random token ids in ``[0, model.vocab_size)`` for every inner step k with
``A <= k <= B`` (both ends included). k is the 0-based index of the step the batch is fed to: the
training loop's ``k`` when it draws the batch (``stream.step``, ``schedule.kind(k)``), so the
training record of that step says ``"step": k + 1``. ``steps=A`` alone is the window ``A-A``.
With one process per worker (``mesh.processes > 1``) k is that worker's own step count, which
equals the global step except in A-EDiT after its warmup.

The garbage is a pure function of (seed, step, worker): runs are reproducible, and a resumed run
sees the same garbage as an uninterrupted one. Only the batch handed to the step is changed,
never the stream or its state (``TrainStream`` recomputes batch k from k alone), so checkpoints
and resumes stay exact. Used to test loss-spike suppression (benchmarks/spike_experiment.py): a
worker with corrupted data should produce anomalous pseudo gradients that EDiT's detector flags.
``validate`` checks the knob with the rest of the config, before any work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edit_jax.config import Config, ConfigError, require

_TAG = 0xC0FFEE  # separates this knob's random stream from every other use of the seed


@dataclass(frozen=True)
class CorruptSpec:
    worker: int
    first: int  # first corrupted step (0-based, included)
    last: int  # last corrupted step (included)

    def active(self, step: int) -> bool:
        return self.first <= step <= self.last


def parse_corrupt(text: str) -> CorruptSpec | None:
    """``"worker=1,steps=100-129"`` -> CorruptSpec(1, 100, 129); ``""`` -> None. Raises ValueError
    (with what was wrong) on a malformed spec; range checks against the mesh are ``validate``'s."""
    if not text.strip():
        return None
    fields: dict[str, str] = {}
    for item in (t.strip() for t in text.split(",")):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("worker", "steps"):
            raise ValueError(f"unknown item {item!r} (expected worker=W and steps=A-B)")
        if key in fields:
            raise ValueError(f"{key} given twice")
        fields[key] = value
    missing = [k for k in ("worker", "steps") if k not in fields]
    if missing:
        raise ValueError(f"missing {' and '.join(missing)}")
    first, sep, last = fields["steps"].partition("-")
    try:
        worker, a = int(fields["worker"]), int(first)
        b = int(last) if sep else a
    except ValueError:
        raise ValueError("worker and the step bounds must be integers") from None
    if worker < 0 or a < 0:
        raise ValueError("worker and steps must be >= 0")
    if a > b:
        raise ValueError(f"empty step window {a}-{b} (A must be <= B)")
    return CorruptSpec(worker, a, b)


def validate(cfg: Config) -> None:
    """``debug.corrupt`` parses (``parse_corrupt``) and names an existing worker; ``debug.lr_spike``
    parses. Neither with ``sync.exchange.url``: an exchange worker's local training (elastic/) has no
    hook for them, and a fault injection that silently does nothing would make a test pass."""
    parse_lr_spike(cfg.debug.lr_spike)
    for key, value in (("debug.lr_spike", cfg.debug.lr_spike), ("debug.corrupt", cfg.debug.corrupt)):
        require(not value or not cfg.sync.exchange.url, key,
                f"not with sync.exchange.url: the exchange's workers do not apply it (it would be silently "
                f"ignored); drop it or run in-program (no sync.exchange.url), got {value!r}")
    try:
        spec = parse_corrupt(cfg.debug.corrupt)
    except ValueError as e:
        raise ConfigError(f"config key 'debug.corrupt': expected worker=W,steps=A-B (0 <= A <= B, inner steps "
                          f"0-based, both included), got {cfg.debug.corrupt!r}: {e}") from None
    if spec is not None:
        require(spec.worker < cfg.mesh.replica, "debug.corrupt",
                f"worker {spec.worker} does not exist (workers 0..{cfg.mesh.replica - 1}, mesh.replica="
                f"{cfg.mesh.replica})")


def garbage_rows(shape: tuple[int, int], vocab: int, seed: int, step: int, worker: int) -> np.ndarray:
    """int32 ``shape`` of uniform token ids in ``[0, vocab)``, determined by (seed, step, worker)."""
    rng = np.random.default_rng(np.random.SeedSequence([_TAG, abs(int(seed)), int(seed < 0), int(step), int(worker)]))
    return rng.integers(0, vocab, size=shape, dtype=np.int32)


def corrupt_rows(rows: np.ndarray, spec: CorruptSpec | None, step: int, worker: int, vocab: int,
                 seed: int) -> np.ndarray:
    """Worker ``worker``'s rows of step ``step``: garbage if the spec corrupts them, else ``rows``
    itself (no copy). Never writes into ``rows``."""
    if spec is None or worker != spec.worker or not spec.active(step):
        return rows
    return garbage_rows(np.shape(rows), vocab, seed, step, worker)


def corrupt_batch(batch: np.ndarray, spec: CorruptSpec | None, step: int, num_replicas: int, vocab: int,
                  seed: int) -> np.ndarray:
    """The global batch ``[B, T+1]`` of step ``step`` with the corrupted worker's rows replaced.

    Rows ``[r*B/N, (r+1)*B/N)`` are replica r's (``TrainStream``; ``StepPrograms.put_batch`` puts
    them on replica r's devices). Returns ``batch`` itself when nothing is corrupted, else a copy:
    the caller's array (possibly the stream's) is never written."""
    if spec is None or not spec.active(step):
        return batch
    per = batch.shape[0] // num_replicas
    lo, hi = spec.worker * per, (spec.worker + 1) * per
    out = np.array(batch, copy=True)
    out[lo:hi] = corrupt_rows(batch[lo:hi], spec, step, spec.worker, vocab, seed)
    return out


@dataclass(frozen=True)
class LrSpike:
    """``debug.lr_spike="A-B:F"``: the updates of the steps that train on data batches A..B
    (0-based, both included) are multiplied by F. Batch, not step: step k reads the stream's batch
    k + the batches rollbacks skipped (``ReplicaStreams.offset``; in A-EDiT's asynchronous phase k is
    the worker's own step count), so a rollback past the spike, or a rerun from the checkpoint it
    left, does not bring it back, as with a spike the data caused."""

    first: int
    last: int
    factor: float

    def active(self, step: int) -> bool:
        return self.first <= step <= self.last


def parse_lr_spike(text: str) -> LrSpike | None:
    if not text:
        return None
    try:
        steps, factor = text.split(":")
        first, last = (int(x) for x in steps.split("-"))
        spike = LrSpike(first, last, float(factor))
    except ValueError:
        raise ConfigError(f"config key 'debug.lr_spike': expected 'A-B:FACTOR' (steps A..B, e.g. '20-22:100'), "
                          f"got {text!r}") from None
    require(0 <= spike.first <= spike.last, "debug.lr_spike", f"steps must satisfy 0 <= A <= B, got {text!r}")
    require(math.isfinite(spike.factor) and spike.factor > 0, "debug.lr_spike",
            f"the factor must be a positive number, got {text!r}")
    return spike


__all__ = ["CorruptSpec", "parse_corrupt", "validate", "garbage_rows", "corrupt_rows", "corrupt_batch", "LrSpike",
           "parse_lr_spike"]
