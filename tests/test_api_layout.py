"""``LocalSGD(..., shard_outer=True)``: θ̄ and the outer optimizer state split over every device
(``localsgd/api_layout.py``). The same training as without it (DiLoCo after the step, EDiT inside
the forward, through a sync), each device holding 1/(N·S) of θ̄, and nothing crossing ``replica``
in a local step."""

from __future__ import annotations

import importlib.util
import os
import sys

import jax
import numpy as np
import optax
import pytest

import edit_jax
from edit_jax.tools import hlo
from tests.helpers import REPO
from tests.stages import one_stage

N, S = 2, 4


def _example():
    spec = importlib.util.spec_from_file_location("own_model_fsdp", os.path.join(REPO, "examples", "own_model.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _bytes_per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("rule", ["diloco", "edit"])
def test_sharded_outer_state_trains_as_without_it_on_a_fraction_of_the_memory(rule):
    one_stage("default" if rule == "diloco" else "3.12", f"θ̄ sharded with {rule}", 21,
              other="the same with " + ("edit" if rule == "diloco" else "diloco"))
    ex = _example()
    mesh = jax.make_mesh((N, S), ("replica", "shard"), devices=jax.devices()[: N * S])
    model = ex.make_model(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    loss_fn, tx = ex.make_loss(model), optax.adamw(3e-3)
    data = ex.load_bytes()
    params = model.init(jax.random.key(0), data[None, :16])
    runs = {}
    for shard_outer in (False, True):
        kw = {"loss_fn": loss_fn, "optimizer": tx} if rule == "edit" else {"inner_step": _step(loss_fn, tx)}
        trainer = edit_jax.LocalSGD(getattr(edit_jax, rule)(**ex.OUTER), mesh, 4, shard_outer=shard_outer, donate=False,
                                    **kw)
        state, losses = trainer.init(params, tx.init(params)), []
        for k in range(6):  # a sync at step 3 (DiLoCo, after it) or 4 (EDiT, in its forward)
            state, metrics = trainer.step(state, ex.batch_at(data, (N, 4), 16, 0, k))
            losses.append(np.asarray(metrics["inner"]["loss"]))
        runs[shard_outer] = trainer, state, np.stack(losses)
    (_, plain, plain_losses), (trainer, sharded, losses) = runs[False], runs[True]
    np.testing.assert_allclose(losses, plain_losses, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6)

    # Per device: θ̄ and the outer state 1/(N·S) (a few small leaves whole); each worker's state as before.
    for part in ("outer_params", "outer_opt_state"):
        ratio = _bytes_per_device(getattr(sharded, part)) / _bytes_per_device(getattr(plain, part))
        assert ratio <= 1 / (N * S) + 0.02, (part, ratio)
    assert _bytes_per_device(sharded.params) == _bytes_per_device(plain.params)

    # Between syncs the workers stay apart: no collective of the local step crosses `replica`.
    local = trainer.lower("local", sharded, ex.batch_at(data, (N, 4), 16, 0, 0)).compile().as_text()
    assert not hlo.replica_crossing(local, (N, S))


def _step(loss_fn, tx):
    def step(p, s, batch):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, {"loss": loss}
    return step
