"""What the loop says and returns: its start-up lines (``announce``), ``TrainResult``, and the
layout of its own timing records: what ``train(..., on_timing=...)`` receives, so benchmarks time
saves, hooks, data and steps without patching the loop."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import jax


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    final_val_loss: float | None
    final_val_ppl: float | None
    tokens: int
    seconds: float
    run_dir: str | None
    interrupted: bool = False
    resumed_from: int | None = None
    history: list[dict] = field(default_factory=list)  # training records of this invocation
    rollbacks: int = 0  # loss-spike rollbacks in this invocation
    already_finished: bool = False  # the run dir's checkpoint was already at cfg.steps: nothing done


# The ``timing`` records the sink hands to ``on_timing`` listeners (not written to metrics.jsonl:
# its schema stays as documented). Times in s; ``at``: since this invocation started (perf clock).
#   {"timing": "advance", "step", "at" (its end), "advance_s" (dispatch + any wait for the device),
#    "data_s" (building the batch), "hooks_s" ({hook name: s}), "includes_compile"}
#   {"timing": "save", "step", "at" (its start), "save_s" (time the loop was blocked), "final"}
#   {"timing": "written", "step", "at"}: the save's (background) write found finished
#   {"timing": "compile_ahead", "at" (its start), "wall_s", "seconds" ({program: s})}: training/ahead.py
TIMING_KINDS = ("advance", "save", "written", "compile_ahead")


def announce(setup, run_dir: str | None, say) -> None:
    """The start-up lines: method, mesh, data; the fields the method overrode that the user set
    (``MethodPlan.user_changes``; the rest shows only in ``config.json``); the resumed checkpoint."""
    cfg, method_plan = setup.method_plan.cfg, setup.method_plan
    devices = (f"{cfg.mesh.processes} worker processes x {cfg.mesh.shard}" if cfg.mesh.processes > 1 else
               f"replica={cfg.mesh.replica} x shard={cfg.mesh.shard}")
    say(f"edit-jax: {cfg.sync.method} on mesh {devices} ({jax.devices()[0].platform}); data {setup.description}")
    if method_plan.user_changes():  # defaults the method does not use are not the user's doing: config.json has them
        say(f"edit-jax: method {cfg.sync.method} fixes " + ", ".join(
            f"{key}={v} (config had {old})" for key, old, v in method_plan.user_changes()))
    if setup.resumed_from is not None:
        say(f"edit-jax: resumed from {os.path.join(run_dir, 'checkpoints', str(setup.resumed_from))}")


__all__ = ["TrainResult", "TIMING_KINDS", "announce"]
