"""Staggered fragments and an offloaded θ̄ through the public API (issue 58: what the trainer has,
for a user's own loop): ``LocalSGD(..., fragments=F)`` syncs the units (the root, then each layer
of a ``{"root", "layers"}`` pytree) in F contiguous groups balanced by parameter count, group f at
step f·tau/F of each window (the trainer's ``sync.fragments``: Streaming DiLoCo);
``offload_outer=True`` keeps θ̄ and the outer optimizer state in pinned host memory between syncs
(the trainer's ``sync.cpu_offload``). Checked against NumPy (the group's DiLoCo step on θ̄, the other
units untouched) and against the same run without the offload (bit for bit)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from edit_jax.localsgd.api import LocalSGD, Penalty, co2, diloco, edit
from edit_jax.localsgd.outer import sgd_trace
from tests.stages import one_stage
from tests.test_api import N, _close, _f64, _mesh, _scanned_batch, _scanned_loss, _scanned_params, np_edit_sync


def _loss(p, batch, hook, hook_xs):
    return _scanned_loss(p, batch, hook, hook_xs)


def _keep(old, new, unsynced, axis: int = 0):
    """``new`` where a group synced, ``old`` on the units it did not (``unsynced``: the root?, the
    layers [lo, hi), the layer axis ``axis``)."""
    skip_root, lo, hi = unsynced
    def layers(o, n):
        return np.concatenate([n.take(range(lo), axis), o.take(range(lo, hi), axis),
                               n.take(range(hi, n.shape[axis]), axis)], axis)
    return {"root": old["root"] if skip_root else new["root"], "layers": jax.tree.map(layers, old["layers"],
                                                                                     new["layers"])}


def test_streaming_diloco_syncs_each_group_on_its_step_as_numpy_says():
    # units: the root (3·4 + 4 = 16 params), three layers (16 + 4 = 20 each): of the two-group splits
    # [16 | 60], [36 | 40], [56 | 20] the second has the smallest largest group, so group 0 is the root
    # and layer 0, group 1 layers 1 and 2. tau 4, F 2: group 1 after steps 1, 5; group 0 after 3, 7.
    tx, rule, tau = optax.sgd(0.2), diloco(outer_lr=0.7, outer_momentum=0.9), 4
    trainer = LocalSGD(rule, _mesh(), tau, loss_fn=_loss, optimizer=tx, fragments=2, donate=False)
    no_sync = LocalSGD(rule, _mesh(), 10**6, loss_fn=_loss, optimizer=tx, donate=False)  # the workers' own step
    params = _scanned_params(layers=3, h=4)
    state = trainer.init(params)
    assert [trainer.kind_at(k) for k in range(8)] == ["local", "local_then_sync@1", "local", "local_then_sync@0"] * 2
    group = {1: (True, 0, 1), 0: (False, 1, 3)}  # the units NOT synced: root?, layers [lo, hi)
    theta = _f64(params)
    trace = jax.tree.map(lambda x: np.zeros(np.shape(x)), params)
    for k in range(8):
        batch = _scanned_batch(k)
        kind = trainer.kind_at(k)
        if kind != "local":
            workers = _f64(no_sync.step(no_sync.init(params)._replace(params=state.params, opt_state=state.opt_state),
                                        batch)[0].params)
            avg = jax.tree.map(lambda t, w: np.mean(t[None] - w, axis=0), theta, workers)
            new_trace = jax.tree.map(lambda b, d: 0.9 * b + d, trace, avg)
            new_theta = jax.tree.map(lambda t, d, b: t - 0.7 * (d + 0.9 * b), theta, avg, new_trace)
            unsynced = group[int(kind[-1])]
            theta, trace = _keep(theta, new_theta, unsynced), _keep(trace, new_trace, unsynced)
            synced = jax.tree.map(lambda t: np.broadcast_to(t, (N,) + t.shape), theta)
            want_workers = _keep(workers, synced, unsynced, axis=1)  # [N, L, ...]
        state, metrics = trainer.step(state, batch)
        assert ("sync" in metrics) == (kind != "local"), k
        if kind != "local":
            _close(state.outer_params, theta, f"θ̄ after step {k} ({kind})")
            _close({u: sgd_trace(state.outer_opt_state[u]) for u in ("root", "layers")}, trace,
                   f"outer momentum after step {k}")
            _close(state.params, want_workers, f"workers after step {k}")
    assert int(state.step) == 8


@pytest.mark.parametrize("rule", ["diloco", "edit"])
def test_an_offloaded_theta_waits_in_host_memory_and_trains_bit_for_bit_as_without(rule):
    # the sync after the step under the default Python, the sync inside the forward under 3.12
    one_stage("default" if rule == "diloco" else "3.12", f"the offloaded θ̄ with {rule}",
              {"diloco": 4, "edit": 11}[rule], other="the same with the other rule")
    make = {"diloco": lambda: diloco(outer_lr=0.7, outer_momentum=0.9), "edit": edit}[rule]
    params, steps, tau = _scanned_params(layers=2), 5, 2
    runs = []
    for offload in (False, True):
        trainer = LocalSGD(make(), _mesh(), tau, loss_fn=_loss, optimizer=optax.adam(0.02), donate=False,
                           shard_outer=True, offload_outer=offload)
        state = trainer.init(params)
        for k in range(steps):
            state, _ = trainer.step(state, _scanned_batch(k))
        state, _ = trainer.sync(state)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state.outer_params, state.outer_opt_state))}
        assert kinds == ({"pinned_host"} if offload else {"device"}), kinds
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
        runs.append(jax.device_get(state._replace(step=None)))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(runs[0])[0], jax.tree.leaves(runs[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_fragments_are_refused_where_they_cannot_run():
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match="fragments: must divide tau=4"):
        LocalSGD(diloco(), _mesh(), 4, loss_fn=_loss, optimizer=tx, fragments=3)
    with pytest.raises(ValueError, match="fragments: rule 'co2' syncs every unit together"):
        LocalSGD(co2(), _mesh(), 4, loss_fn=_loss, optimizer=tx, fragments=2)
    with pytest.raises(ValueError, match="fragments: expected an integer >= 1"):
        LocalSGD(diloco(), _mesh(), 4, loss_fn=_loss, optimizer=tx, fragments=0)
    trainer = LocalSGD(diloco(), _mesh(), 4, loss_fn=_loss, optimizer=tx, fragments=4)
    with pytest.raises(ValueError, match=r"fragments: at most the number of units \(the root and 2 layers\)"):
        trainer.init(_scanned_params(layers=2))
    with pytest.raises(ValueError, match="with fragments=2: rule 'diloco' syncs in groups of units and needs"):
        LocalSGD(diloco(), _mesh(), 4, loss_fn=_loss, optimizer=tx, fragments=2).init({"w": np.zeros(3, np.float32)})


def _segmented_loss(p, batch, hook, hook_xs):
    """``_scanned_loss`` with its layers run by ``edit_jax.scan_layers`` (a staggered group's sync)."""
    return _scanned_loss(p, batch, hook, hook_xs, segmented=True)


def test_streaming_edit_syncs_each_group_inside_the_forward_as_numpy_says():
    # units: the root (3·8 + 8 = 32 params), two layers (64 + 8 = 72 each): [32 | 144] or [104 | 72],
    # so group 0 is the root and layer 0, group 1 layer 1. tau 2, F 2: group 1 in step 1's forward,
    # group 0 in step 2's; each the first sync of its units (NumPy's first-sync EDiT on them).
    penalty = Penalty(warmup=3, temperature=0.05, clip_threshold=0.3)
    trainer = LocalSGD(edit(outer_lr=0.7, outer_momentum=0.9, penalty=penalty), _mesh(), 2, loss_fn=_segmented_loss,
                       optimizer=optax.sgd(0.2), fragments=2, donate=False)
    state = trainer.init(_scanned_params())
    assert [trainer.kind_at(k) for k in range(4)] == ["local", "sync_forward@1", "sync_forward@0", "sync_forward@1"]
    state, _ = trainer.step(state, _scanned_batch(0))
    for k, unsynced in ((1, (True, 0, 1)), (2, (False, 1, 2))):
        theta = _f64(state.outer_params)
        want, *_ = np_edit_sync(theta, _f64(state.params), penalty, 0.7, 0.9)
        state, metrics = trainer.step(state, _scanned_batch(k))
        assert "sync" in metrics
        _close(state.outer_params, _keep(theta, want, unsynced), f"θ̄ after the group sync of step {k}")
    # a forward that scans hook_xs["layers"] itself: one line saying what to call
    mine = LocalSGD(edit(), _mesh(), 2, loss_fn=_loss, optimizer=optax.sgd(0.2), fragments=2, donate=False)
    state = mine.init(_scanned_params())
    state, _ = mine.step(state, _scanned_batch(0))
    with pytest.raises(ValueError, match=r"run them with\s+edit_jax.scan_layers"):
        mine.step(state, _scanned_batch(1))
