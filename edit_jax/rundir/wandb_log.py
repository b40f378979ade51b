"""Weights & Biases logging of a run (``log.wandb=true``; ``pip install edit-jax[wandb]``).

    edit-jax train --config configs/demo.py --run-dir runs/demo_wb log.wandb=true
    WANDB_MODE=offline edit-jax train ...   # no account: files under RUN_DIR/wandb/, `wandb sync` later

Every record of ``metrics.jsonl`` goes to W&B too, at its ``step``, under the tags TensorBoard uses
(``train/loss``, ``sync/weight/0``, ``eval/val_loss``, ...: ``tensorboard.record_scalars``). The W&B
run is named after the run dir, carries the whole config, and keeps its id in ``RUN_DIR/wandb_id``:
a resumed run continues the same W&B run (``resume="allow"``). The steps a resume redoes are
logged again; they equal what W&B holds (resumes are exact) and W&B keeps the first. W&B turned on
when resuming a run first logs the records ``metrics.jsonl`` already holds. Only process 0 logs.
The project is ``log.wandb_project``; entity, mode, API key and the rest come from W&B's own
environment variables (``WANDB_ENTITY``, ``WANDB_MODE``, ``WANDB_API_KEY``, ``WANDB_DIR``).

A W&B that cannot start (not logged in, no network in online mode) is one line naming
``log.wandb`` (exit 2) before the first step; ``validate`` checks that the package is installed
with the rest of the config.
"""

from __future__ import annotations

import importlib.util
import os
import uuid

from edit_jax.config import Config, ConfigError, require, to_dict
from edit_jax.rundir.records import replace_file
from edit_jax.rundir.tensorboard import record_scalars

ID_FILE = "wandb_id"


def run_id(run_dir: str) -> tuple[str, bool]:
    """The W&B run id of ``run_dir`` (made and stored on first use) and whether it is new."""
    path = os.path.join(run_dir, ID_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            found = f.read().strip()
        if found:
            return found, False
    new = uuid.uuid4().hex[:16]
    replace_file(path, new + "\n")
    return new, True


class WandbLog:
    """A metrics log that also logs every record to W&B (wraps the run's log, like ``TeeLog``).
    ``earlier``: the records the run wrote before, logged first when the run dir had no W&B run."""

    def __init__(self, log, run_dir: str, cfg: Config, earlier: list[dict] = ()):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError("config key 'log.wandb': needs the wandb package: pip install edit-jax[wandb] "
                              "(or pip install wandb)") from e
        self.log = log
        rid, new = run_id(run_dir)
        try:
            self.run = wandb.init(project=cfg.log.wandb_project, name=os.path.basename(os.path.abspath(run_dir)),
                                  id=rid, resume="allow", dir=run_dir, config=to_dict(cfg),
                                  tags=[cfg.sync.method])
        except Exception as e:  # wandb raises its own types (UsageError, CommError, ...)
            raise ConfigError(f"config key 'log.wandb': W&B could not start ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else e}); log in (`wandb login` "
                              "or WANDB_API_KEY), or set WANDB_MODE=offline") from e
        for record in (earlier if new else ()):
            self._log(record)

    def _log(self, record: dict) -> None:
        scalars = dict(record_scalars(record))
        if scalars:
            self.run.log(scalars, step=int(record.get("step", 0)))

    def write(self, record: dict) -> None:
        self.log.write(record)
        self._log(record)

    def close(self) -> None:
        self.log.close()
        self.run.finish()


def validate(cfg: Config) -> None:
    """``log.wandb`` needs the wandb package: said before the run starts."""
    if cfg.log.wandb:
        require(importlib.util.find_spec("wandb") is not None, "log.wandb",
                "needs the wandb package: pip install edit-jax[wandb] (or pip install wandb)")
        require(bool(cfg.log.wandb_project.strip()), "log.wandb_project", "must name a W&B project")


__all__ = ["WandbLog", "run_id", "validate", "ID_FILE"]
