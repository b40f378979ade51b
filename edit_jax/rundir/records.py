"""What a run writes besides checkpoints: ``RUN_DIR/metrics.jsonl`` (and TensorBoard scalars).

One JSON object per line (docs/reference/records.md): training records (``step``, ``loss``,
``grad_norm``, ``tokens_per_s``, ``step_time``, ``kind``), sync records (``"sync": true`` and
the figures of ``sync_fields``) and evaluation records (``val_loss``, ``val_ppl``). In a
multi-process run process 0 writes the records of the one program; in A-EDiT's asynchronous
phase every worker also appends its own training records (``"worker": i``, ``global_step``).
"""

from __future__ import annotations

import errno
import json
import os

import numpy as np

from edit_jax.rundir.runlock import RunDirError
from edit_jax.rundir.tensorboard import TeeLog

TB_DIR = "tb"  # RUN_DIR/tb/: TensorBoard's event files (log.tensorboard)


def to_json(x):
    """A scalar or array (NumPy, JAX on the host) as a JSON value."""
    a = np.asarray(x)
    return a.item() if a.ndim == 0 else a.tolist()


def sync_fields(metrics: dict, per_unit: bool) -> dict:
    """The figures of a sync record (docs/reference/records.md), from a sync step's metrics."""
    names = ("pseudo_grad_norm", "weight", "flagged", "clip_factor", "outer_update_norm", "inner_reset")
    if per_unit:
        names += ("unit_pseudo_grad_norm", "unit_weight", "unit_flagged", "unit_clip_factor")
    return {name: to_json(metrics[name]) for name in names}


class MetricsLog:
    """Appends JSON lines; on resume drops records past the restored step (they will be redone).
    Records of multi-process runs carry the global mean step as ``global_step``: that is the step
    compared (a worker's own ``step`` may be ahead of it)."""

    def __init__(self, path: str | None, resume_step: int | None, truncate: bool = True):
        self.path = path
        if truncate and path and os.path.exists(path):
            keep = []
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut by a kill
                    if resume_step is not None and rec.get("global_step", rec.get("step", 0)) <= resume_step:
                        keep.append(line if line.endswith("\n") else line + "\n")
            replace_file(path, "".join(keep))

    def write(self, record: dict) -> None:
        """Appends one line with one ``write`` on an O_APPEND descriptor: the workers of a run that
        share the file (A-EDiT's processes, exchange-mode workers) never interleave their lines."""
        if self.path:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, (json.dumps(record) + "\n").encode())
                finally:
                    os.close(fd)
            except OSError as e:
                raise _write_error(self.path, e) from e

    def close(self) -> None:
        pass


def _write_error(path: str, e: OSError) -> RunDirError:
    """A failed write of a run-dir file (``metrics.jsonl``, ``config.json``) as one line (CLI exit
    2). The run stops there: going on would train steps whose records are lost. Checkpoints are
    written apart and untouched."""
    cause = "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return RunDirError(f"could not write {path}: {cause}. The run stopped; its checkpoints are as they were: "
                       "fix that and re-run the same command to resume")


def replace_file(path: str, text: str | bytes, tmp: str | None = None) -> None:
    """Writes ``text`` beside ``path`` (as ``tmp``, default PATH.tmp: writers of one file that may
    run at once each pass a name of their own) and renames it over: a write that fails (a full
    disk) leaves the old file as it was, never half-written or emptied (``RunDirError`` names it)."""
    tmp = tmp or path + ".tmp"
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.isfile(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass  # the error below is the one to report
        raise _write_error(path, e) from e


def open_log(run_dir: str | None, resumed_from: int | None, lead: bool, tensorboard: bool):
    """The log this process writes the run's records to: process 0 truncates ``metrics.jsonl``
    past the resumed step (and tees to TensorBoard in ``RUN_DIR/tb/`` with ``log.tensorboard``);
    the other processes write nothing through it."""
    if not (run_dir and lead):
        return MetricsLog(None, None)
    log = MetricsLog(os.path.join(run_dir, "metrics.jsonl"), resumed_from)
    if not tensorboard:
        return log
    return TeeLog(log, os.path.join(run_dir, TB_DIR), resumed_from, earlier=read_records(log.path))


def read_records(path: str) -> list[dict]:
    """The whole records of a ``metrics.jsonl`` ([] if there is none; a line cut by a kill is skipped)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def worker_log(run_dir: str | None) -> MetricsLog:
    """Appends this worker's own records (A-EDiT's asynchronous phase) without truncating."""
    return MetricsLog(os.path.join(run_dir, "metrics.jsonl") if run_dir else None, None, truncate=False)


__all__ = ["TB_DIR", "MetricsLog", "sync_fields", "to_json", "open_log", "worker_log", "replace_file", "read_records"]
