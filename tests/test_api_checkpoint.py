"""``save_local_sgd`` / ``restore_local_sgd`` (``rundir/localsgd_checkpoint.py``): a user's own loop
stopped and resumed from a checkpoint continues bit for bit as the uninterrupted one (DiLoCo on an
int8 wire with error feedback: the residuals in ``state.extra`` too; EDiT layer-wise); a damaged
checkpoint is reported naming it and left as it is; another trainer's checkpoint is refused."""

from __future__ import annotations

import os

import jax
import numpy as np
import optax
import pytest

import edit_jax
from edit_jax.localsgd.api import LocalSGD
from edit_jax.rundir.checkpoint import CheckpointError, UnreadableCheckpointError
from tests.helpers import damage_checkpoint_arrays
from tests.stages import one_stage
from tests.test_api import N, _linear_batch, _linear_params, _linear_step, _mesh, _scanned_loss, _scanned_params


def _run(trainer, state, steps, batch):
    for k in range(int(state.step), int(state.step) + steps):
        state, _ = trainer.step(state, batch(k))
    return state


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_resumed_loop_continues_exactly_and_a_damaged_checkpoint_is_reported(tmp_path):
    one_stage("3.12", "the API's exact resume of DiLoCo + int8, a damaged checkpoint", 20,
              other="test_model_family (a family of one's own, stopped and resumed)")
    tx = optax.adam(0.05)
    rule = edit_jax.compressed(edit_jax.diloco(), "int8")
    make = lambda: LocalSGD(rule, _mesh(), 2, inner_step=_linear_step(tx))
    params = _linear_params()
    trainer = make()
    straight = _run(trainer, trainer.init(params, tx.init(params)), 7, _linear_batch)

    first = make()
    half = _run(first, first.init(params, tx.init(params)), 3, _linear_batch)
    path = edit_jax.save_local_sgd(tmp_path / "ckpt", half)
    assert path.endswith(os.path.join("ckpt", "3"))
    again = make()  # a new process would build its trainer afresh
    resumed = edit_jax.restore_local_sgd(tmp_path / "ckpt", again.init(params, tx.init(params)))
    assert int(resumed.step) == 3 and np.abs(np.asarray(resumed.extra["residual"]["root"]["dense"]["w"])).max() > 0
    _equal(_run(again, resumed, 4, _linear_batch), straight)

    # Another trainer's state (EDiT, another model): refused before any array is read.
    tx2 = optax.sgd(0.1)
    other = LocalSGD(edit_jax.edit(), _mesh(), 2, loss_fn=_scanned_loss, optimizer=tx2)
    with pytest.raises(CheckpointError, match="another state than this trainer's"):
        edit_jax.restore_local_sgd(tmp_path / "ckpt", other.init(_scanned_params()))

    # A damaged array: reported naming the checkpoint, left on disk as it was.
    damage_checkpoint_arrays(path)
    with pytest.raises((UnreadableCheckpointError, CheckpointError), match=str(path).replace("\\", "\\\\")):
        edit_jax.restore_local_sgd(tmp_path / "ckpt", again.init(params, tx.init(params)))
    assert os.path.isdir(path)


def test_edit_layerwise_resumes_exactly(tmp_path):
    one_stage("default", "the API's exact resume of EDiT", 25, other="the API's exact resume of DiLoCo + int8")
    tx = optax.sgd(0.1)
    make = lambda: LocalSGD(edit_jax.edit(), _mesh(), 2, loss_fn=_scanned_loss, optimizer=tx)
    params = _scanned_params()
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(8, N, 4, 3)).astype(np.float32)
    batch = lambda k: {"x": xs[k], "y": np.tanh(xs[k].sum(-1, keepdims=True))}
    trainer = make()
    straight = _run(trainer, trainer.init(params), 7, batch)
    first = make()
    edit_jax.save_local_sgd(tmp_path / "c", _run(first, first.init(params), 4, batch))
    again = make()
    _equal(_run(again, edit_jax.restore_local_sgd(tmp_path / "c", again.init(params)), 3, batch), straight)
