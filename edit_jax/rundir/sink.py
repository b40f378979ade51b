"""The one sink of a run's records: every line of ``metrics.jsonl`` (and its TensorBoard and W&B
tees) is written here, never by the loop itself.

    sink = RunRecords.open(run_dir, resumed_from, lead, cfg)
    sink.training(records, own_records, elapsed)   # an advance's training records
    sink.sync(step, metrics, extra, elapsed)        # a sync that ran
    sink.evaluation(step, loss, elapsed, seconds)   # a validation loss
    sink.event(record, elapsed)                     # a rollback, a spike that settled

What each record holds is ``records.py``'s (README, "Run dir"). Process 0 writes the run's
records (the other processes' sink writes nothing to the run's log); in A-EDiT's asynchronous
phase every worker also appends its own training records (``worker_log``). Records of a
multi-process run carry the wall time (``time``) and the global step (``global_step``).
"""

from __future__ import annotations

import math
import os

from edit_jax.config import Config
from edit_jax.rundir.records import open_log, read_records, sync_fields, worker_log
from edit_jax.rundir.wandb_log import WandbLog


class RunRecords:
    """Writes the run's records: ``log`` (process 0's ``metrics.jsonl``, tees) and ``own`` (this
    worker's own records, A-EDiT)."""

    def __init__(self, log, own, multi: bool, per_unit: bool):
        self.log, self.own, self.multi, self.per_unit = log, own, multi, per_unit

    @classmethod
    def open(cls, run_dir: str | None, resumed_from: int | None, lead: bool, cfg: Config) -> "RunRecords":
        """Process 0 truncates ``metrics.jsonl`` past the resumed step and tees to TensorBoard
        (``log.tensorboard``) and W&B (``log.wandb``; its history backfilled from the records)."""
        log = open_log(run_dir, resumed_from, lead, cfg.log.tensorboard)
        if cfg.log.wandb and run_dir and lead:
            try:
                log = WandbLog(log, run_dir, cfg, earlier=read_records(os.path.join(run_dir, "metrics.jsonl")))
            except Exception:
                log.close()
                raise
        return cls(log, worker_log(run_dir), cfg.mesh.processes > 1, cfg.sync.per_unit_metrics)

    def training(self, records: list[dict], own_records: list[dict], elapsed: float) -> list[dict]:
        """An advance's training records (the run's, and this worker's own); returns them as
        written (with ``time`` in a multi-process run: bench_straggler reads it)."""
        if self.multi:
            records = [{**rec, "time": elapsed} for rec in records]
            own_records = [{**rec, "time": elapsed} for rec in own_records]
        for rec in records:
            self.log.write(rec)
        for rec in own_records:
            self.own.write(rec)
        return records + own_records

    def sync(self, step: int, metrics: dict, extra: dict, elapsed: float) -> None:
        """The record of a sync that ran: its figures (``records.sync_fields``) and ``extra``."""
        rec = {"step": step, "sync": True, **extra, **sync_fields(metrics, self.per_unit)}
        self.log.write({**rec, "global_step": step, "time": elapsed} if self.multi else rec)

    def skipped(self, record: dict) -> None:
        """An A-EDiT meeting that skipped its sync."""
        self.log.write(record)

    def event(self, record: dict, elapsed: float) -> None:
        """What the loop did about the run's health: a ``rollback`` past a loss spike, a spike
        that settled (``spike_settled``)."""
        self.log.write({**record, "time": elapsed})

    def evaluation(self, step: int, loss: float, elapsed: float, seconds: float) -> dict:
        """A validation loss at ``step`` (``elapsed``: when it started; ``seconds``: how long it took)."""
        rec = {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "time": elapsed}
        if self.multi:
            rec.update(global_step=step, eval_seconds=seconds)
        self.log.write(rec)
        return rec

    def close(self) -> None:
        self.log.close()


__all__ = ["RunRecords"]
