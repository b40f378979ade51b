"""``LocalSGD.for_nnx``: a Flax NNX model (``nnx.Module``) trained with a whole-model rule as it
is: its ``nnx.Param`` state split and merged by the library, its dropout stream reseeded per worker
and step from ``seed``, θ̄ back as a module; what a functional step cannot keep (BatchNorm's
statistics) and a layer-wise rule are refused, naming them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import edit_jax
from edit_jax.localsgd.api import LocalSGD
from tests.test_api import N, _mesh


class Regressor(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, norm=None):
        self.l1 = nnx.Linear(3, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.norm = norm
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.l1(x))
        return self.l2(self.drop(h if self.norm is None else self.norm(h)))


def _loss(model, batch):
    err = model(batch["x"]) - batch["y"]
    return jnp.mean(err ** 2), {"max_err": jnp.max(jnp.abs(err))}


def _batch(k):
    rng = np.random.default_rng(k)
    x = rng.normal(size=(N, 8, 3)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(-1, keepdims=True))}


def _train(rule, steps=12, seed=0, same_batch=False):
    model = Regressor(nnx.Rngs(0, dropout=1))
    trainer = LocalSGD.for_nnx(rule, _mesh(), 4, model, nnx.Optimizer(model, optax.adam(0.02), wrt=nnx.Param),
                               _loss, seed=seed)
    state, losses = trainer.init(), []
    for k in range(steps):
        b = _batch(0 if same_batch else k)
        if same_batch:  # every worker the same rows: only their dropout masks differ
            b = jax.tree.map(lambda x: np.broadcast_to(x[:1], x.shape).copy(), b)
        state, metrics = trainer.step(state, b)
        losses.append(np.asarray(metrics["inner"]["loss"]))
    return trainer, state, losses


def test_an_nnx_model_trains_with_diloco_and_comes_back_as_a_module():
    trainer, state, losses = _train(edit_jax.diloco())
    means = [float(x.mean()) for x in losses]
    assert all(math.isfinite(x) for x in means) and np.mean(means[-3:]) < means[0] * 0.7, means
    model = trainer.to_nnx(state)
    assert isinstance(model, Regressor)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(state.outer_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model.eval()  # dropout off: the module works as any NNX model
    assert np.isfinite(np.asarray(_loss(model, jax.tree.map(lambda x: x[0], _batch(99)))[0]))


def test_dropout_streams_differ_per_worker_and_step_and_repeat_with_the_seed():
    _, _, a = _train(edit_jax.diloco(), steps=2, same_batch=True)
    _, _, b = _train(edit_jax.diloco(), steps=2, same_batch=True)
    assert len({round(float(x), 6) for x in a[0]}) == N  # same rows, another mask per worker
    np.testing.assert_array_equal(np.stack(a), np.stack(b))  # the seed gives the same masks again


def test_what_a_functional_step_cannot_keep_is_refused():
    model = Regressor(nnx.Rngs(0, dropout=1), norm=nnx.BatchNorm(16, rngs=nnx.Rngs(2)))
    with pytest.raises(ValueError, match="BatchStat"):
        LocalSGD.for_nnx(edit_jax.diloco(), _mesh(), 4, model, optax.adam(0.01), _loss)
    with pytest.raises(ValueError, match="whole-model rule"):
        LocalSGD.for_nnx(edit_jax.edit(), _mesh(), 4, Regressor(nnx.Rngs(0)), optax.adam(0.01), _loss)
    with pytest.raises(ValueError, match="optimizer"):
        LocalSGD.for_nnx(edit_jax.diloco(), _mesh(), 4, Regressor(nnx.Rngs(0)), "adam", _loss)
