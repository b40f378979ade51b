"""``LocalSGD(..., fsdp=True, shard_outer=True)`` (``localsgd/api_layout.py``): each worker's params
and optimizer state split over its own devices (FSDP within the worker), θ̄ and the outer state
over every device. The same training as without them (DiLoCo after the step, EDiT inside the
forward, through a sync: losses and states equal to float round-off), each device holding 1/S of
its worker and about 1/(N·S) of θ̄, and nothing crossing ``replica`` in a local step, where the
worker's devices do meet (the FSDP gathers)."""

from __future__ import annotations


import jax
import numpy as np
import optax
import pytest

import edit_jax
from edit_jax.analysis import hlo
from tests.helpers import load_example
from tests.stages import one_stage

N, S = 2, 4


def _bytes_per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _step(loss_fn, tx):
    def step(p, s, batch):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, {"loss": loss}
    return step


@pytest.mark.parametrize("rule", ["diloco", "edit"])
def test_fsdp_and_a_sharded_outer_state_train_as_without_them_on_a_fraction_of_the_memory(rule):
    one_stage("default" if rule == "diloco" else "3.12", f"FSDP within a worker with {rule}", 25,
              other="the same with " + ("edit" if rule == "diloco" else "diloco"))
    ex = load_example("own_model")
    mesh = jax.make_mesh((N, S), ("replica", "shard"), devices=jax.devices()[: N * S])
    model = ex.make_model(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    loss_fn, tx = ex.make_loss(model), optax.adamw(3e-3)
    data = ex.load_bytes()
    params = model.init(jax.random.key(0), data[None, :16])
    runs = {}
    for split in (False, True):
        kw = {"loss_fn": loss_fn, "optimizer": tx} if rule == "edit" else {"inner_step": _step(loss_fn, tx)}
        trainer = edit_jax.LocalSGD(getattr(edit_jax, rule)(**ex.OUTER), mesh, 4, fsdp=split, shard_outer=split,
                                    donate=False, **kw)
        state, losses = trainer.init(params, tx.init(params)), []
        for k in range(6):  # a sync at step 3 (DiLoCo, after it) or 4 (EDiT, in its forward)
            state, metrics = trainer.step(state, ex.batch_at(data, (N, 4), 16, 0, k))
            losses.append(np.asarray(metrics["inner"]["loss"]))
        runs[split] = trainer, state, np.stack(losses)
    (_, plain, plain_losses), (trainer, split, losses) = runs[False], runs[True]
    np.testing.assert_allclose(losses, plain_losses, rtol=2e-5)
    # Every array within float round-off as a whole, relative L2 (AdamW's g / sqrt(v) can turn a
    # last-bit change of a near-zero gradient into a visible change of one entry: under jax 0.12,
    # 2 of 12,288 entries of one kernel moved by 8e-5, and the outer momentum, a difference of
    # nearby params, carries it at 2.4e-4); a layout or sync error moves whole arrays, by 1e-2 or more.
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(split)[0], jax.tree.leaves(plain), strict=True):
        b = np.asarray(b, np.float64)
        err = np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-12)
        assert err < 2e-3, (jax.tree_util.keystr(path), err)

    # Per device: the worker's params and optimizer state 1/S (every leaf here has a dimension S
    # divides; the optimizer's step count stays whole), θ̄ and the outer state 1/(N·S) but for a few
    # small leaves.
    for part, most in (("params", 1 / S), ("opt_state", 1 / S + 0.01), ("outer_params", 1 / (N * S) + 0.02),
                       ("outer_opt_state", 1 / (N * S) + 0.02)):
        ratio = _bytes_per_device(getattr(split, part)) / _bytes_per_device(getattr(plain, part))
        assert ratio <= most, (part, ratio)

    # Between syncs the workers stay apart: the local step's collectives are all within a worker.
    local = trainer.lower("local", split, ex.batch_at(data, (N, 4), 16, 0, 0)).compile().as_text()
    assert not hlo.replica_crossing(local, (N, S))
    assert hlo.hlo_collectives(local, (N, S))["collectives"], "FSDP: the worker's shards meet in its step"
