"""Every program of a run compiled before step 1 (``training/ahead.py``): no training record's time
includes a compile, in one process and in two, where without it the first step of each kind does
(``includes_compile`` comes from JAX's own compile events, ``runtime/compiles.py``); the losses are
the same either way; the record's learning rate, computed on the host, is optax's."""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
import pytest

from edit_jax.config import OptimConfig
from edit_jax.localsgd.optim import host_lr, lr_schedule
from edit_jax.training.ahead import compile_ahead
from edit_jax.training.train import train
from edit_jax.validate import load_config
from tests.helpers import run_session
from tests.stages import one_stage
from tests.test_edit_sync import TINY

RUN = ["mesh.replica=2", "mesh.shard=2", "batch_size=8", "data.seq_len=32", "log_every=1", "steps=9",
       "sync.warmup_steps=2", "sync.tau=3", "eval_every=5", "checkpoint_every=5"]


def _records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_no_step_compiles_once_the_run_compiled_ahead(tmp_path, monkeypatch):
    one_stage("default", "compiling ahead against compiling at first use, EDiT, one process", 50,
              other="the two-process run of test_compile_ahead")
    cfg = load_config(TINY, ["method=edit", *RUN])
    devs = jax.devices()[:4]
    monkeypatch.setenv("EDIT_JAX_COMPILE_AHEAD", "0")
    first_use = train(cfg, str(tmp_path / "first_use"), progress=False, devices=devs)
    monkeypatch.setenv("EDIT_JAX_COMPILE_AHEAD", "1")
    timings = []
    ahead = train(cfg, str(tmp_path / "ahead"), progress=False, devices=devs, on_timing=timings.append)
    steps = [r for r in ahead.history if "loss" in r]
    late = [r for r in first_use.history if r.get("includes_compile")]
    # without compiling ahead, the first step of each kind compiles (the flag can fire) ...
    assert {r["kind"] for r in late} >= {"hsdp", "local", "sync_forward"}, late
    # ... with it, no training record's time holds a compile, the first step's included
    assert len(steps) == 9 and not [r for r in steps if r.get("includes_compile")]
    np.testing.assert_array_equal([r["loss"] for r in steps], [r["loss"] for r in first_use.history if "loss" in r])
    assert ahead.final_val_loss == first_use.final_val_loss
    (timing,) = [t for t in timings if t["timing"] == "compile_ahead"]
    # (every evaluation, at steps 5 and 9, falls after the warmup of 2: θ̄'s, none of the replicas')
    assert set(timing["seconds"]) == {"step hsdp", "step local", "step sync_forward", "outer init",
                                      "evaluation sync", "evaluation of θ̄", "save report", "save checksums"}
    assert timing["wall_s"] <= sum(timing["seconds"].values()) + 1.0


def test_two_processes_compile_ahead_too(tmp_path):
    one_stage("3.12", "compiling ahead in two processes (DiLoCo)", 40,
              other="compiling ahead against first use in one process")
    env = {**os.environ, "EDIT_JAX_COMPILE_AHEAD": "1"}
    cmd = [sys.executable, "-m", "edit_jax", "train", "--config", "configs/tiny.py", "--no-progress",
           "--run-dir", str(tmp_path / "run"), "method=diloco", "mesh.processes=2", *RUN]
    rc, out = run_session(cmd, 420, env=env)
    assert rc == 0, out
    assert "programs ahead in" in out, out
    steps = [r for r in _records(tmp_path / "run") if "loss" in r and "step" in r]
    assert len(steps) == 9 and not [r for r in steps if r.get("includes_compile")], steps


@pytest.mark.parametrize("optim", [OptimConfig(), OptimConfig(warmup_steps=0), OptimConfig(warmup_steps=500),
                                   OptimConfig(warmup_steps=10, decay_steps=30, min_lr_ratio=0.1)])
def test_the_records_learning_rate_is_optaxs(optim):
    total = 200
    schedule = lr_schedule(optim, total)
    want = np.asarray(jax.vmap(schedule)(np.arange(total + 5)))
    got = np.array([host_lr(optim, total, k) for k in range(total + 5)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_a_resumed_run_compiles_only_what_it_will_run(tmp_path):
    """Past the warmup a resumed run compiles no warmup step and no first-sync outer init; the
    replicas' evaluation is compiled only when an evaluation falls within the warmup."""
    from edit_jax.localsgd.methods import step_kinds
    from edit_jax.training.ahead import _evaluations

    cfg = load_config(TINY, ["method=edit", *RUN])  # warmup 2, tau 3, evaluations at 5 and 9
    schedule = train_schedule(cfg)
    assert step_kinds(schedule, cfg) == ["hsdp", "local", "sync_forward"]
    assert step_kinds(schedule, cfg, start=6) == ["local", "sync_forward"]  # resumed at step 6
    assert step_kinds(schedule, cfg, start=10**6) == step_kinds(schedule, cfg, start=6)  # periodic after it
    assert _evaluations(cfg, schedule, 0) == (False, True)  # 5 and 9 after the warmup: θ̄ only
    early = load_config(TINY, ["method=edit", *RUN, "eval_every=2"])  # step 2 is the warmup's last
    assert _evaluations(early, train_schedule(early), 0) == (True, True)
    assert _evaluations(early, train_schedule(early), 2) == (False, True)
    base = load_config(TINY, ["method=baseline", *RUN])
    assert _evaluations(base, train_schedule(base), 0) == (True, False)


def train_schedule(cfg):
    from edit_jax.localsgd.methods import plan_for

    return plan_for(cfg).schedule


def test_a_program_that_fails_ahead_is_named_and_left_to_its_first_use():
    def broken():
        raise ValueError("no such shape")
    ahead = compile_ahead({"step local": lambda: None, "step sync_forward": broken})
    assert set(ahead.seconds) == {"step local"} and ahead.failed == {"step sync_forward": "ValueError: no such shape"}
    assert "not ahead, compiled at first use instead: step sync_forward (ValueError: no such shape)" in ahead.line()
    stopped = compile_ahead({f"p{i}": lambda: time.sleep(0.05) for i in range(40)}, threads=1, stopped=lambda: True)
    assert len(stopped.seconds) < 10 and stopped.wall_s < 1.0  # a signal drops the programs not yet started
