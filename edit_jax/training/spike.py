"""Loss spikes: the rule that finds them (``SpikeWatch``); the loop (loop.py) rolls back when the
watch says so. The testing knob that makes one, ``debug.lr_spike``, is ``data/corrupt.py``'s.

The rule, per training record (``train.spike.*``; why these defaults:
docs/benchmarks/spike.md):

- the record's loss is the smallest of the workers' (``replica_loss``), ignoring non-finite
  ones: a single worker's garbage is EDiT's penalty's job (its anomaly elimination and the
  non-finite reset at its sync), a spike of the run raises every worker's loss;
- it is a spike when it lies above the median of the last ``window`` healthy records by
  ``mads`` median absolute deviations *and* by ``margin`` x the median; before ``window``
  healthy records exist, only when it lies ``margin`` above ln(vocab_size), the loss of a uniform
  guess (a model worse than guessing is broken, whatever its history);
- a spike that lasts more than ``patience`` records (or a non-finite record of the run, which
  cannot settle) asks for a rollback.

The records are the lock-step driver's training records, and in A-EDiT's asynchronous phase one
per meeting (``drivers.Advance.watched``: every worker's newest loss, the sync's where one ran);
there the loop cannot roll back in-process, so a spike that does not settle ends the run (exit 3).

Which checkpoints are trusted: a training record at step r is the loss of the params of step
r - 1 (computed in that step's forward pass), so a healthy record at r vouches for checkpoint
r - 1 and older. ``trusted_through`` is the newest step so vouched for (the resumed checkpoint
at start); a rollback goes to the newest checkpoint at or before it and sets the newer ones
aside. The loop asks for a record right after every checkpoint, so each one is vouched for by
the next step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from edit_jax.config import Config


@dataclass(frozen=True)
class Verdict:
    spike: bool  # this record is above the threshold (or non-finite)
    roll_back: bool  # the spike did not settle: roll back now
    settled: int | None = None  # a spike that began at this step just settled (no rollback)
    threshold: float = math.inf  # what the loss was compared with
    loss: float = math.nan  # the record's loss as the rule sees it
    records: int = 0  # the spike's records so far (settled: how many it lasted)


def record_loss(record: dict) -> float:
    """The loss the rule looks at: the smallest finite worker loss (nan if none is finite)."""
    losses = np.atleast_1d(np.asarray(record.get("replica_loss", record["loss"]), np.float64))
    finite = losses[np.isfinite(losses)]
    return float(finite.min()) if finite.size else math.nan


class SpikeWatch:
    """Training records in, verdicts out; its state (recent healthy losses) travels in checkpoints."""

    def __init__(self, cfg: Config, history=(), trusted_through: int | None = None):
        s = cfg.train.spike
        self.enabled, self.mads, self.margin, self.patience = s.enabled, s.mads, s.margin, s.patience
        self.window = s.window
        self.ceiling = math.log(cfg.model.vocab_size) * (1.0 + s.margin)
        self.history: deque[float] = deque((float(x) for x in history), maxlen=s.window)
        self.trusted_through = trusted_through  # newest step whose params a healthy record vouched for
        self.spike_since: int | None = None  # step of the first record of the current spike
        self.spike_records = 0

    @property
    def healthy(self) -> bool:
        """No spike is under way (what a checkpoint written now records)."""
        return self.spike_since is None

    def threshold(self) -> float:
        if len(self.history) < self.window:
            return self.ceiling
        h = np.asarray(self.history)
        median = float(np.median(h))
        mad = float(np.median(np.abs(h - median)))
        return min(self.ceiling, median + max(self.mads * mad, self.margin * abs(median)))

    def observe(self, step: int, record: dict, nonfinite: bool = False) -> Verdict:
        """The verdict on the training record of ``step``; ``nonfinite``: the run's record is
        non-finite (the drivers' rule: any worker after a synchronous step, all after a local one)."""
        loss, limit = record_loss(record), self.threshold()
        if not self.enabled:
            return Verdict(spike=nonfinite, roll_back=False, threshold=limit, loss=loss)
        spike = nonfinite or not math.isfinite(loss) or loss > limit
        if not spike:
            settled, lasted = self.spike_since, self.spike_records
            self.spike_since, self.spike_records = None, 0
            self.history.append(loss)
            self.trusted_through = step - 1
            return Verdict(spike=False, roll_back=False, settled=settled, threshold=limit, loss=loss, records=lasted)
        if self.spike_since is None:
            self.spike_since = step
        self.spike_records += 1
        return Verdict(spike=True, roll_back=nonfinite or not math.isfinite(loss) or self.spike_records > self.patience,
                       threshold=limit, loss=loss, records=self.spike_records)

    def rewound(self, history, trusted_through: int) -> None:
        """After a rollback to checkpoint ``trusted_through``: its history, no spike under way."""
        self.history = deque((float(x) for x in history), maxlen=self.window)
        self.trusted_through, self.spike_since, self.spike_records = trusted_through, None, 0

    def state(self) -> list[float]:
        return [float(x) for x in self.history]


__all__ = ["SpikeWatch", "Verdict", "record_loss"]
