"""TensorBoard scalars of a run (``log.tensorboard=true``): the records of ``metrics.jsonl`` as
event files in ``RUN_DIR/tb/``, written with ``tensorboardX`` (``pip install edit-jax[tensorboard]``).

    tensorboard --logdir runs/demo/tb

Tags, one per number of a record, at the record's ``step``:

- training records: ``train/loss``, ``train/grad_norm``, ``train/tokens_per_s``, ``train/step_time``,
  ``train/replica_loss/<i>`` (replica i);
- sync records: ``sync/<name>/<i>`` for per-worker lists (``pseudo_grad_norm``, ``weight``,
  ``flagged``, ``clip_factor``), ``sync/<name>`` for scalars (``outer_update_norm``), and
  ``sync/<name>/<i>/<u>`` for the per-unit figures (worker i, unit u; unit 0 is the root);
- evaluation records: ``eval/val_loss``, ``eval/val_ppl``.

Strings and flags (``kind``, ``includes_compile``) are not scalars and are skipped. tensorboardX
writes from a background thread and flushes every ``FLUSH_SECS`` seconds, so a dashboard follows a
live run a few seconds behind; the files are complete when training returns. On resume from step K, ``purge_step=K + 1``
tells TensorBoard to drop what earlier event files hold past K (``metrics.jsonl`` drops those
records too; they are redone). A run that turns TensorBoard on when resumed (no event file yet)
first writes the records ``metrics.jsonl`` already holds. Every process may write records, but in
a multi-process run only process 0 tees them (``records.open_log``).

``validate`` checks, with the rest of the config, that tensorboardX is installed when asked for.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from typing import Iterator

from edit_jax.config import Config, require

_SKIP = ("step", "sync", "kind", "includes_compile")
FLUSH_SECS = 5


def record_group(record: dict) -> str:
    if record.get("sync"):
        return "sync"
    if "val_loss" in record:
        return "eval"
    return "train"


def record_scalars(record: dict) -> Iterator[tuple[str, float]]:
    """(tag, value) for every number of a metrics record (lists flattened with their indices)."""
    group = record_group(record)

    def walk(tag, value):
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return
        if isinstance(value, numbers.Number):
            yield tag, float(value)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from walk(f"{tag}/{i}", v)

    for key, value in record.items():
        if key not in _SKIP:
            yield from walk(f"{group}/{key}", value)


class TensorBoardWriter:
    """Writes metrics records as scalars into ``log_dir`` (an event file per writer)."""

    def __init__(self, log_dir: str, purge_step: int | None = None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ImportError("log.tensorboard=true needs the `tensorboardX` package: "
                              "pip install edit-jax[tensorboard] (or pip install tensorboardX)") from e
        self.log_dir = log_dir
        self._writer = SummaryWriter(logdir=log_dir, purge_step=purge_step, flush_secs=FLUSH_SECS)

    def write(self, record: dict) -> None:
        step = int(record.get("step", 0))
        for tag, value in record_scalars(record):  # a NaN loss is written too: TensorBoard shows it
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


def has_events(tb_dir: str) -> bool:
    return os.path.isdir(tb_dir) and any(n.startswith("events.out.tfevents") for n in os.listdir(tb_dir))


class TeeLog:
    """A metrics log that also writes every record to TensorBoard (wraps train.MetricsLog).
    ``earlier``: the records the run wrote before (``metrics.jsonl`` up to the resumed step),
    written first when ``tb_dir`` holds no event file yet: TensorBoard turned on for a resumed
    run shows its whole history, not only what follows."""

    def __init__(self, log, tb_dir: str, resumed_from: int | None, earlier: list[dict] = ()):
        self.log = log
        backfill = list(earlier) if not has_events(tb_dir) else []
        self.tb = TensorBoardWriter(tb_dir, purge_step=None if resumed_from is None else resumed_from + 1)
        for record in backfill:
            self.tb.write(record)

    def write(self, record: dict) -> None:
        self.log.write(record)
        self.tb.write(record)

    def close(self) -> None:
        self.tb.close()


def validate(cfg: Config) -> None:
    """``log.tensorboard`` needs tensorboardX: said before the run starts, not at its first record."""
    if cfg.log.tensorboard:
        require(importlib.util.find_spec("tensorboardX") is not None, "log.tensorboard",
                "needs the tensorboardX package: pip install edit-jax[tensorboard] (or pip install tensorboardX)")


__all__ = ["TensorBoardWriter", "TeeLog", "record_scalars", "record_group", "validate", "has_events"]
