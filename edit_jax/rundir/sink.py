"""The one sink of a run's records: every line of ``metrics.jsonl`` (and its TensorBoard and W&B
tees) is written here, never by the loop itself.

    sink = RunRecords.open(run_dir, resumed_from, lead, cfg)
    sink.training(records, own_records, elapsed)   # an advance's training records
    sink.sync(step, metrics, extra, elapsed)        # a sync that ran
    sink.evaluation(step, loss, elapsed, seconds)   # a validation loss
    sink.event(record, elapsed)                     # a rollback, a spike that settled

What each record holds is ``records.py``'s (docs/reference/records.md). Process 0 writes the run's
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

    def __init__(self, log, own, multi: bool, per_unit: bool, on_timing=None, time_offset: float = 0.0):
        self.log, self.own, self.multi, self.per_unit = log, own, multi, per_unit
        self.on_timing = on_timing  # the loop's timing records go there (none written to the log)
        self.time_offset = time_offset  # ``time`` goes on across resumes: the kept records' newest

    @classmethod
    def open(cls, run_dir: str | None, resumed_from: int | None, lead: bool, cfg: Config,
             on_timing=None) -> "RunRecords":
        """Process 0 truncates ``metrics.jsonl`` past the resumed step and tees to TensorBoard
        (``log.tensorboard``) and W&B (``log.wandb``; its history backfilled from the records).
        A resumed run's ``time`` starts where the kept records' newest ``time`` left off."""
        log = open_log(run_dir, resumed_from, lead, cfg.log.tensorboard)
        kept = read_records(os.path.join(run_dir, "metrics.jsonl")) if run_dir and resumed_from is not None else []
        offset = max((r["time"] for r in kept if isinstance(r.get("time"), (int, float))), default=0.0)
        if cfg.log.wandb and run_dir and lead:
            try:
                log = WandbLog(log, run_dir, cfg, earlier=read_records(os.path.join(run_dir, "metrics.jsonl")))
            except Exception:
                log.close()
                raise
        return cls(log, worker_log(run_dir), cfg.mesh.processes > 1, cfg.sync.per_unit_metrics, on_timing, offset)

    def timing(self, record: dict) -> None:
        """One of the loop's timing records (``training/result.py``: advance, save, written) to
        the ``on_timing`` listener (``train(..., on_timing=...)``; benchmarks), if any."""
        if self.on_timing is not None:
            self.on_timing(record)

    def training(self, records: list[dict], own_records: list[dict], elapsed: float) -> list[dict]:
        """An advance's training records (the run's, and this worker's own); returns them as
        written (with ``time`` in a multi-process run: bench_straggler reads it)."""
        if self.multi:
            records = [{**rec, "time": self.time_offset + elapsed} for rec in records]
            own_records = [{**rec, "time": self.time_offset + elapsed} for rec in own_records]
        for rec in records:
            self.log.write(rec)
        for rec in own_records:
            self.own.write(rec)
        return records + own_records

    def sync(self, step: int, metrics: dict, extra: dict, elapsed: float) -> None:
        """The record of a sync that ran: its figures (``records.sync_fields``) and ``extra``."""
        rec = {"step": step, "sync": True, **extra, **sync_fields(metrics, self.per_unit)}
        self.log.write({**rec, "global_step": step, "time": self.time_offset + elapsed} if self.multi else rec)

    def skipped(self, record: dict) -> None:
        """An A-EDiT meeting that skipped its sync."""
        self.log.write(record)

    def event(self, record: dict, elapsed: float) -> None:
        """What the loop did about the run's health: a ``rollback`` past a loss spike, a spike
        that settled (``spike_settled``)."""
        self.log.write({**record, "time": self.time_offset + elapsed})

    def evaluation(self, step: int, loss: float, elapsed: float, seconds: float) -> dict:
        """A validation loss at ``step`` (``elapsed``: when it started; ``seconds``: how long it took)."""
        rec = {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "time": self.time_offset + elapsed}
        if self.multi:
            rec.update(global_step=step, eval_seconds=seconds)
        self.log.write(rec)
        return rec

    def close(self) -> None:
        self.log.close()


__all__ = ["RunRecords"]
