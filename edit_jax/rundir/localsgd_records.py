"""Records of ``LocalSGD``'s steps in the run-dir format ``edit-jax train`` writes, for a user's own
loop (``edit_jax.LocalSGDRecords``), so ``edit-jax plot`` draws their loss, their syncs' pseudo-
gradient norms, weights and clip factors beside the trainer's runs:

    records = edit_jax.LocalSGDRecords("runs/mine", trainer, batch_size=256, seq_len=1024)
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        records.step(state, metrics)                # every step, or every few: it reads the device
    records.evaluation(state, val_loss)

``RUN_DIR/config.json`` says what ran: the rule (its name, τ, the warmup, the outer optimizer, the
penalty and the wire; the plot labels runs by it), the workers (``mesh.replica``) and, when given,
``batch_size`` and ``data.seq_len`` (tokens on the plot's x axis; without them, ``--x step``).
``RUN_DIR/metrics.jsonl`` holds the records of docs/reference/records.md: training (``step``,
``loss``, ``grad_norm``, ``replica_loss``, the loss function's own metrics averaged over the
workers, ``step_time``, ``tokens_per_s``), sync (``"sync": true``, the sync's figures per worker)
and evaluation (``val_loss``, ``val_ppl``).

A run dir already holding records is refused unless ``resume_step`` says where the state given to
the loop was restored from (the records past it are dropped, as the trainer's resume does); one
written for another rule is refused, naming both. Nothing is written before these checks pass.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import jax
import numpy as np

from edit_jax.rundir.records import MetricsLog, replace_file, sync_fields

CONFIG, METRICS = "config.json", "metrics.jsonl"


def rule_config(trainer) -> dict:
    """What ``config.json`` says of a ``LocalSGD`` trainer's rule and workers."""
    rule = trainer.rule
    codec = getattr(rule.sync, "codec", None)
    return {"sync": {"method": rule.name, "tau": trainer.tau, "warmup_steps": trainer.warmup,
                     "layerwise": rule.layerwise, "outer": dataclasses.asdict(rule.outer),
                     "penalty": dataclasses.asdict(rule.penalty), "wire": codec.name if codec is not None else "none"},
            "mesh": {"replica": trainer.n, "shard": int(trainer.mesh.shape.get("shard", 1))}}


class LocalSGDRecords:
    """``trainer``'s records in ``run_dir`` (see the module docstring). ``batch_size`` (rows per
    step, all workers together) and ``seq_len`` count tokens; ``resume_step`` continues a run dir
    whose records go up to a restored state's step."""

    def __init__(self, run_dir: str, trainer, *, batch_size: int | None = None, seq_len: int | None = None,
                 resume_step: int | None = None):
        for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("resume_step", resume_step)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
                raise ValueError(f"{name}: expected a non-negative integer, got {v!r}")
        config = rule_config(trainer)
        if batch_size is not None:
            config["batch_size"] = int(batch_size)
        if seq_len is not None:
            config["data"] = {"seq_len": int(seq_len)}
        metrics, config_path = os.path.join(run_dir, METRICS), os.path.join(run_dir, CONFIG)
        if os.path.exists(metrics) and resume_step is None:
            raise ValueError(f"{metrics}: already holds records; pass resume_step=int(state.step) of the state you "
                             "restored to continue them, or give another run_dir")
        if os.path.exists(config_path):
            theirs = _read_config(config_path).get("sync", {})
            mine = config["sync"]
            if (theirs.get("method"), theirs.get("tau")) != (mine["method"], mine["tau"]):
                raise ValueError(f"{config_path}: written for rule {theirs.get('method')!r} with tau "
                                 f"{theirs.get('tau')}, this trainer runs {mine['method']!r} with tau {mine['tau']}: "
                                 "give another run_dir")
        os.makedirs(run_dir, exist_ok=True)
        replace_file(config_path, json.dumps(config, indent=2) + "\n")
        self.path, self.config = run_dir, config
        self.tokens_per_step = batch_size * seq_len if batch_size and seq_len else None
        self.log = MetricsLog(metrics, resume_step)
        self._last: tuple[float, int] | None = None  # (when, step) of the last training record
        self._t0 = time.perf_counter()

    def step(self, state, metrics: dict) -> dict:
        """The records of the step that made ``state`` (``metrics``: ``trainer.step``'s): a
        training record, and a sync record when the step synced. Reads the device (a wait for
        the steps in flight): call it every few steps in a fast loop. Returns the training record."""
        k = int(state.step)
        now = time.perf_counter()
        inner = {name: np.asarray(jax.device_get(v), np.float64) for name, v in metrics["inner"].items()}
        rec: dict[str, Any] = {"step": k, "loss": float(np.mean(inner["loss"])),
                               "grad_norm": float(np.mean(inner["grad_norm"])),
                               "replica_loss": [float(x) for x in np.ravel(inner["loss"])]}
        rec.update({name: float(np.mean(v)) for name, v in inner.items() if name not in ("loss", "grad_norm")})
        if self._last is not None and k > self._last[1]:
            rec["step_time"] = (now - self._last[0]) / (k - self._last[1])
            if self.tokens_per_step:
                rec["tokens_per_s"] = self.tokens_per_step / rec["step_time"]
        self._last = (now, k)
        rec["time"] = now - self._t0
        self.log.write(rec)
        if metrics.get("sync"):
            figures = jax.device_get(metrics["sync"])
            self.log.write({"step": k, "sync": True, "time": rec["time"],
                            **sync_fields(figures, per_unit=False)})
        return rec

    def evaluation(self, state, val_loss: float) -> dict:
        """An evaluation record at ``state``'s step."""
        loss = float(val_loss)
        rec = {"step": int(state.step), "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
               "time": time.perf_counter() - self._t0}
        self.log.write(rec)
        return rec


def _read_config(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable config.json ({e}); give another run_dir") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object (a run's config), got {type(out).__name__}")
    return out


__all__ = ["LocalSGDRecords", "rule_config"]
