"""A model family is one module and one registry line (``models/family.py``): a family written in
``tests/toy_family.py`` (nothing of Llama's), registered with one line, trains with EDiT's
layer-wise sync inside its forward, FSDP over ``shard``, checkpoints and an exact resume."""

from __future__ import annotations

import math

import jax
import numpy as np

from edit_jax.models import family
from edit_jax.training.train import train
from edit_jax.validate import load_config
from tests.stages import one_stage
from tests.test_edit_sync import TINY


def test_a_family_of_ones_own_trains_with_every_guarantee(tmp_path, monkeypatch):
    one_stage("default", "a model family of one's own, trained, stopped and resumed", 30,
              other="test_api_checkpoint's exact resume of DiLoCo + int8")
    monkeypatch.setitem(family.FAMILIES, "toy", "tests.toy_family")  # the one line
    cfg = load_config(TINY, ["model.family=toy", "model.n_layers=2", "mesh.replica=2", "mesh.shard=2",
                             "sync.method=edit", "sync.warmup_steps=2", "sync.tau=3", "steps=14", "batch_size=8",
                             "data.seq_len=32", "log_every=1", "eval_every=7", "checkpoint_every=7"])
    run = str(tmp_path / "run")
    devs = jax.devices()[:4]
    half = train(cfg, run, progress=False, stop_after=7, devices=devs)
    assert half.interrupted and half.steps == 7
    done = train(cfg, run, progress=False, devices=devs)
    assert done.resumed_from == 7 and done.steps == 14
    straight = train(cfg, str(tmp_path / "straight"), progress=False, devices=devs)
    np.testing.assert_array_equal(done.final_loss, straight.final_loss)  # resumed exactly
    losses = [r["loss"] for r in straight.history if "loss" in r]
    assert all(math.isfinite(x) for x in losses) and np.mean(losses[-3:]) < losses[0] - 0.3, losses
    kinds = {r.get("kind") for r in straight.history}
    assert {"hsdp", "local", "sync_forward"} <= kinds, kinds  # warmup, local steps, EDiT's sync in the forward
    assert straight.final_val_loss is not None and math.isfinite(straight.final_val_loss)  # evaluated by its forward
