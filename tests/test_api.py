"""The public API around a user's own model, optimizer and loop (``edit_jax.localsgd.api``).

- ``examples/own_model.py`` (a plain-Flax GPT written the usual way, made layer-wise by
  ``LayerStack``; its own AdamW and loop) trains with DiLoCo and with EDiT's layer-wise sync, loss
  falling.
- One sync against NumPy, written from EDIT.md (Algorithm 2), not from ``outer.py``: DiLoCo (the
  plain mean of the pseudo gradients, Nesterov SGD) over three syncs of an arbitrary pytree; EDiT
  layer-wise with its penalty (softmax(−g/T) weights of the per-unit norms, per-unit clip, the
  detector fed), and the inner update of that step taken at θ̄ and applied to θ̄.
- Post Local SGD's θ̄ is the mean of the workers, for any pytree (tuples, bfloat16 leaves).
- Nothing crosses ``replica`` in a local step; the sync's all-reduce does (HLO).
- Bad arguments fail with a ValueError that names them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edit_jax
from edit_jax.localsgd.api import LocalSGD, Penalty, diloco, edit, identity_hook, post_local_sgd
from edit_jax.localsgd.layer_scan import scan_layers
from edit_jax.localsgd.outer import sgd_trace
from edit_jax.analysis import hlo
from tests.helpers import load_example
from tests.stages import one_stage

N, S = 4, 2


def _mesh():
    return jax.make_mesh((N, S), ("replica", "shard"), devices=jax.devices()[: N * S])


def _f64(tree):
    return jax.tree.map(lambda x: np.array(x, np.float64), tree)


def _close(got, want, what, rtol=2e-5, atol=2e-6):
    """Each leaf of ``got`` against ``want``'s in the same place (one structure, asserted first;
    zipped, so NNX states, whose paths end in ``.value``, compare as dicts do)."""
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


# ============================================================================= the example


@pytest.mark.parametrize("rule", ["diloco", "edit", "co2", "edit+topk2"])
def test_example_trains_with_each_rule(rule):
    name, _, wire = rule.partition("+")
    # One stage each (the conformance test runs every rule's sync under both Pythons): DiLoCo and CO2
    # under the default Python, EDiT and EDiT + topk2 under 3.12.
    pair = {"diloco": "edit", "co2": "edit+topk2"}
    stage = "default" if rule in pair else "3.12"
    other = pair.get(rule) or next(k for k, v in pair.items() if v == rule)
    one_stage(stage, f"the example with {rule}", 18, other=f"the example with {other}")
    example = load_example("own_model")
    out = example.main(["--rule", name, "--tiny", "--steps", "24" if wire else "12"]
                       + (["--wire", wire] if wire else []))
    losses = out["losses"]
    assert len(losses) == (24 if wire else 12) and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert out["val_loss"] < math.log(256) - 0.5, out["val_loss"]
    state = out["state"]  # after the example's last sync every worker is at θ̄
    for w, o in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.outer_params), strict=True):
        np.testing.assert_allclose(np.asarray(w), np.broadcast_to(np.asarray(o), w.shape), rtol=1e-6)
    if rule == "diloco":  # that last sync by NumPy: Δ = mean_i(θ̄ − θ_i), m' = μ m + Δ, θ̄' = θ̄ − lr (Δ + μ m')
        before, lr, mu = out["before_sync"], example.OUTER["outer_lr"], example.OUTER["outer_momentum"]
        trace = optax.tree_utils.tree_get(before.outer_opt_state, "trace")
        for theta, workers, m, got in zip(jax.tree.leaves(before.outer_params), jax.tree.leaves(before.params),
                                          jax.tree.leaves(trace), jax.tree.leaves(state.outer_params), strict=True):
            theta, m = np.asarray(theta, np.float64), np.asarray(m, np.float64)
            delta = (theta[None] - np.asarray(workers, np.float64)).mean(axis=0)
            m_new = mu * m + delta
            np.testing.assert_allclose(np.asarray(got), theta - lr * (delta + mu * m_new), rtol=1e-5, atol=1e-6)


# ============================================================================= DiLoCo, any pytree


def _linear_params():
    rng = np.random.default_rng(0)
    return {"dense": {"w": rng.normal(size=(3, 2)).astype(np.float32)},
            "bias": [np.zeros(2, np.float32), np.float32(0.5)]}


def _linear_loss(p, batch):
    pred = batch["x"] @ p["dense"]["w"] + p["bias"][0] + p["bias"][1]
    return jnp.mean((pred - batch["y"]) ** 2)


def _linear_step(tx):
    def step(p, s, batch):
        loss, g = jax.value_and_grad(_linear_loss)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, {"loss": loss}
    return step


def _linear_batch(k: int, rows: int = 4):
    """[N, rows, ...]: worker i's targets come from its own linear map (the workers drift apart)."""
    rng = np.random.default_rng(100 + k)
    x = rng.normal(size=(N, rows, 3)).astype(np.float32)
    w = np.stack([np.full((3, 2), 0.3 * (i + 1), np.float32) for i in range(N)])
    return {"x": x, "y": np.einsum("nbi,nio->nbo", x, w)}


def test_diloco_syncs_match_numpy_for_any_pytree():
    tx, rule, tau = optax.sgd(0.1), diloco(outer_lr=0.7, outer_momentum=0.9), 2
    trainer = LocalSGD(rule, _mesh(), tau, inner_step=_linear_step(tx), donate=False)
    no_sync = LocalSGD(rule, _mesh(), 10**6, inner_step=_linear_step(tx), donate=False)  # the workers' own steps
    params = _linear_params()
    state = trainer.init(params, tx.init(params))
    theta, trace = _f64(params), jax.tree.map(lambda x: np.zeros(np.shape(x)), params)
    for k in range(3 * tau):
        batch = _linear_batch(k)
        if trainer.kind_at(k) == "local_then_sync":  # (k + 1) % tau == 0
            workers = _f64(no_sync.step(state, batch)[0].params)
            avg = jax.tree.map(lambda t, w: np.mean(t[None] - w, axis=0), theta, workers)  # mean of θ̄ − θ_i
            trace = jax.tree.map(lambda b, d: 0.9 * b + d, trace, avg)  # Nesterov: b <- μb + Δ
            theta = jax.tree.map(lambda t, d, b: t - 0.7 * (d + 0.9 * b), theta, avg, trace)  # θ̄ -= η(Δ + μb)
        state, metrics = trainer.step(state, batch)
        assert ("sync" in metrics) == (trainer.kind_at(k) != "local"), k
        if "sync" in metrics:
            _close(state.outer_params, theta, f"θ̄ after step {k}")
            _close(sgd_trace(state.outer_opt_state), trace, f"outer momentum after step {k}")
            _close(state.params, jax.tree.map(lambda t: np.broadcast_to(t, (N,) + t.shape), theta),
                   f"workers after step {k}")
            np.testing.assert_allclose(np.asarray(metrics["sync"]["weight"]), np.full(N, 1 / N), rtol=1e-6)
    assert int(state.step) == 3 * tau
    # Nothing crosses `replica` in a local step; the sync's all-reduce carries every parameter.
    batch = _linear_batch(0)
    local = trainer.lower("local", state, batch).compile().as_text()
    assert not hlo.replica_crossing(local, (N, S))
    synced = hlo.replica_crossing(trainer.lower("sync", state).compile().as_text(), (N, S))
    assert max(hlo.operand_elements(r) for r in synced) >= sum(np.size(x) for x in jax.tree.leaves(params))


def test_a_sync_that_would_make_theta_non_finite_is_refused_and_said():
    """DiLoCo keeps a NaN worker in the mean: that sync would make θ̄ NaN. It is refused: θ̄ and the
    outer state stay as they were, every worker restarts from that θ̄ (the NaN worker's optimizer
    state zeroed), ``sync_refused`` says so, and the next call warns in one line naming the sync
    and the worker. The run then goes on finite, and a sync that keeps θ̄ finite says nothing."""
    import warnings

    tx = optax.sgd(0.1)
    trainer = LocalSGD(diloco(), _mesh(), 2, inner_step=_linear_step(tx), donate=False)
    params = _linear_params()
    state = trainer.init(params, tx.init(params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a finite run: no warning at any call
        for k in range(4):
            state, metrics = trainer.step(state, _linear_batch(k))
            assert "sync" not in metrics or not bool(metrics["sync"]["sync_refused"])
        trainer.sync(state)
    before = _f64((state.outer_params, sgd_trace(state.outer_opt_state)))
    poisoned = _linear_batch(4)
    poisoned["x"][2] = np.nan  # worker 2's step goes NaN; the sync after step 5 would take it into θ̄
    state, _ = trainer.step(state, poisoned)
    state, metrics = trainer.step(state, _linear_batch(5))
    assert np.asarray(metrics["sync"]["inner_reset"]).tolist() == [False, False, True, False]
    assert bool(metrics["sync"]["sync_refused"])
    _close((state.outer_params, sgd_trace(state.outer_opt_state)), before, "θ̄ and momentum kept", rtol=0, atol=0)
    _close(state.params, jax.tree.map(lambda t: np.broadcast_to(t, (N,) + t.shape), before[0]), "workers at θ̄",
           rtol=0, atol=0)
    with pytest.warns(RuntimeWarning, match=r"sync of step 5 was refused: .*non-finite \(worker\(s\) \[2\].*'diloco'"):
        state, _ = trainer.step(state, _linear_batch(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # finite from there on: nothing more is said
        for k in range(7, 10):
            state, metrics = trainer.step(state, _linear_batch(k))
        _, metrics = trainer.sync(state)
    assert not bool(metrics["sync_refused"])
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves((state.params, state.opt_state)))


def test_a_seed_gives_each_worker_and_step_its_own_key_and_user_metrics_come_back():
    """With ``seed``, ``loss_fn`` / ``inner_step`` get a key as their last argument, different per
    worker and per step, the same for the same seed; ``loss_fn``'s third value (a dict) comes back
    per worker in ``metrics["inner"]`` (``averaged``: their means), sync steps included."""
    tx = optax.sgd(0.01)

    def loss_fn(p, batch, hook, hook_xs, key):
        loss, ys = _scanned_loss(p, batch, hook, hook_xs)
        return loss, ys, {"draw": jax.random.uniform(key), "half_loss": loss / 2}

    def draws(seed, steps=3):
        trainer = LocalSGD(edit(), _mesh(), 2, loss_fn=loss_fn, optimizer=tx, seed=seed, donate=False)
        state, out = trainer.init(_scanned_params()), []
        for k in range(steps):
            state, metrics = trainer.step(state, _scanned_batch(k))
            inner = metrics["inner"]
            np.testing.assert_allclose(np.asarray(inner["half_loss"]), np.asarray(inner["loss"]) / 2, rtol=1e-6)
            np.testing.assert_allclose(trainer.averaged(metrics)["draw"], np.mean(np.asarray(inner["draw"])), rtol=1e-6)
            assert ("sync" in metrics) == (k == 2)
            out.append(np.asarray(inner["draw"]))
        return np.stack(out)  # [steps, N]

    a = draws(0)
    assert len(np.unique(a)) == a.size  # every worker and step its own key
    np.testing.assert_array_equal(a, draws(0))
    assert not np.array_equal(a, draws(jax.random.key(1)))
    step = _linear_step(tx)
    trainer = LocalSGD(diloco(), _mesh(), 2, inner_step=lambda p, s, b, key: step(p, s, b)[:2] + (
        {"draw": jax.random.uniform(key)},), seed=3, donate=False)
    params = _linear_params()
    state, metrics = trainer.step(trainer.init(params, tx.init(params)), _linear_batch(0))
    assert len(np.unique(np.asarray(metrics["inner"]["draw"]))) == N
    with pytest.raises(ValueError, match="seed: expected an int or a JAX random key"):
        LocalSGD(diloco(), _mesh(), 2, inner_step=step, seed="zero")
    bad = LocalSGD(edit(), _mesh(), 2, loss_fn=lambda p, b, h, x: (0.0, None, None, None), optimizer=tx)
    with pytest.raises(ValueError, match=r"loss_fn: must return \(loss, ys\) or \(loss, ys, metrics\).*tuple of 4"):
        bad.step(bad.init(_scanned_params()), _scanned_batch(0))


def test_post_local_sgd_is_the_mean_of_any_pytree():
    params = {"a": (np.ones((2, 3), np.float32), {"b": np.arange(4, dtype=np.float32)}),
              "c": jnp.full((5,), 0.25, jnp.bfloat16)}

    def step(p, s, batch):  # every leaf moves by the worker's own amount
        return jax.tree.map(lambda x: x + (batch.mean() * x.size).astype(x.dtype), p), s, {"shift": batch.mean()}

    trainer = LocalSGD(post_local_sgd(), _mesh(), 1000, inner_step=step, donate=False)
    state = trainer.init(params, ())
    for k in range(3):
        state, _ = trainer.step(state, np.arange(N * 4 * S, dtype=np.float32).reshape(N, 4 * S) * (k + 1))
    workers = _f64(state.params)
    state, figures = trainer.sync(state)
    _close(state.outer_params, jax.tree.map(lambda w: w.mean(0), workers), "θ̄", rtol=1e-2)
    assert jax.tree.map(lambda x: x.dtype, state.params) == jax.tree.map(lambda x: jnp.asarray(x).dtype, params)
    assert figures["inner_reset"].shape == (N,) and not np.any(figures["inner_reset"])


@pytest.mark.parametrize("rule", ["co2", "diloco+int8"])
def test_co2_and_a_lossy_wire_take_any_pytree(rule):
    """The registry's rules on any pytree (tuples, a bfloat16 leaf): CO2's pseudo gradients in flight
    and the wire's residuals live in ``state.extra`` laid out as the user's tree (one unit)."""
    params = {"a": (np.ones((2, 3), np.float32), {"b": np.arange(4, dtype=np.float32)}),
              "c": jnp.full((5,), 0.25, jnp.bfloat16)}

    def step(p, s, batch):  # every leaf moves by the worker's own amount
        return jax.tree.map(lambda x: x + (batch.mean() * 0.01).astype(x.dtype), p), s, {}

    one_stage("default" if rule == "co2" else "3.12", f"{rule} on any pytree", 7,
              other="the other rule on any pytree")
    made = edit_jax.co2() if rule == "co2" else edit_jax.compressed(diloco(), "int8")
    trainer = LocalSGD(made, _mesh(), 2, inner_step=step, donate=False)
    state = trainer.init(params, ())
    key = "pending" if rule == "co2" else "residual"
    assert jax.tree.structure(state.extra[key]["root"]) == jax.tree.structure(params)
    for k in range(4):
        state, metrics = trainer.step(state, np.arange(N * 4 * S, dtype=np.float32).reshape(N, 4 * S) * (k + 1))
    kept = state.extra[key]["root"]
    assert max(float(np.abs(np.asarray(x, np.float32)).max()) for x in jax.tree.leaves(kept)) > 0  # in flight / lost
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(state.outer_params))
    assert jax.tree.map(lambda x: x.dtype, state.params) == jax.tree.map(lambda x: jnp.asarray(x).dtype, params)
    assert not bool(metrics["sync"]["sync_refused"]) and metrics["sync"]["pseudo_grad_norm"].shape == (N,)


@pytest.mark.parametrize("rule", ["diloco", "edit"])
def test_a_synchronous_warmup_averages_gradients_then_hands_theta_to_local_sgd(rule):
    """W steps of the workers' mean gradient (identical workers whatever their batches, each step
    the optimizer on the mean of the per-worker gradients, by hand), then θ̄ = those params and the
    rule's schedule from W."""
    one_stage("default" if rule == "diloco" else "3.12", f"the warmup with {rule}", 15,
              other=f"the warmup with {'edit' if rule == 'diloco' else 'diloco'}")
    tx, w, tau = optax.sgd(0.1), 3, 2
    made = diloco() if rule == "diloco" else edit()
    loss = (lambda p, b, hook, xs: (_linear_loss(p, b), None)) if rule == "diloco" else _scanned_loss
    params = _linear_params() if rule == "diloco" else _scanned_params()
    trainer = LocalSGD(made, _mesh(), tau, loss_fn=loss, optimizer=tx, warmup_steps=w, donate=False)
    kinds = [trainer.kind_at(k) for k in range(w + 2 * tau + 1)]
    sync = "local_then_sync" if rule == "diloco" else "sync_forward"
    assert kinds[:w] == ["hsdp"] * w and kinds[w + (1 if rule == "diloco" else 2)] == sync, kinds
    state = trainer.init(params)
    batch = _linear_batch if rule == "diloco" else (lambda k: {"x": _linear_batch(k)["x"],
                                                                "y": _linear_batch(k)["y"][..., :1]})
    for k in range(w):
        before = jax.tree.map(lambda x: np.asarray(x[0], np.float64), state.params)
        b = batch(k)
        grads = [jax.grad(lambda p: loss(p, jax.tree.map(lambda x: x[i], b),  # noqa: B023 - called at once
                                         identity_hook, None)[0])(
            jax.tree.map(lambda x: x[0], state.params)) for i in range(N)]
        mean = jax.tree.map(lambda *g: np.mean([np.asarray(x, np.float64) for x in g], axis=0), *grads)
        state, _ = trainer.step(state, b)
        _close(jax.tree.map(lambda x: x[0], state.params), jax.tree.map(lambda p, g: p - 0.1 * g, before, mean),
               f"warmup step {k}", rtol=1e-5, atol=1e-6)
        for i in range(1, N):  # every worker the same params
            for x in jax.tree.leaves(state.params):
                np.testing.assert_array_equal(np.asarray(x[i]), np.asarray(x[0]))
    at_w = jax.tree.map(lambda x: np.asarray(x[0], np.float32), state.params)
    state, metrics = trainer.step(state, batch(w))  # the first local step: θ̄ set from the warmup
    _close(state.outer_params, at_w, "θ̄ at W", rtol=0, atol=0)
    assert "sync" not in metrics
    for k in range(w + 1, w + 2 * tau + 1):
        state, metrics = trainer.step(state, batch(k))
        assert ("sync" in metrics) == (kinds[k] == sync), k


# ============================================================================= EDiT, layer-wise


def _scanned_params(layers: int = 2, d: int = 3, h: int = 8):
    rng = np.random.default_rng(1)
    f = lambda *shape: (0.4 * rng.normal(size=shape)).astype(np.float32)
    return {"root": {"w_in": f(d, h), "w_out": f(h, 1)}, "layers": {"w": f(layers, h, h), "b": f(layers, h)}}


def _scanned_loss(p, batch, hook=identity_hook, hook_xs=None, *, segmented=False):
    """A ScannedModel: the root, then each layer in a scan, through the hook (``segmented``: the
    scan by ``edit_jax.scan_layers``, which runs a staggered group's segments)."""
    xs = hook_xs if hook_xs is not None else {"root": None, "layers": None}
    root, root_ys = hook(p["root"], xs["root"], "root")
    h = jnp.tanh(batch["x"] @ root["w_in"])

    def layer(h, unit):
        params, unit_xs = unit
        params, ys = hook(params, unit_xs, "layer")
        return h + jnp.tanh(h @ params["w"] + params["b"]), ys

    if segmented:  # a staggered group's sync: the layers in segments (test_api_fragments)
        h, layer_ys = scan_layers(layer, h, p["layers"], xs["layers"])
    else:
        h, layer_ys = jax.lax.scan(layer, h, (p["layers"], xs["layers"]))
    return jnp.mean((h @ root["w_out"] - batch["y"]) ** 2), {"root": root_ys, "layers": layer_ys}


def _scanned_batch(k: int, rows: int = 4):
    rng = np.random.default_rng(200 + k)
    x = rng.normal(size=(N, rows, 3)).astype(np.float32)
    scale = np.arange(1, N + 1, dtype=np.float32).reshape(N, 1, 1) ** 2  # worker i drifts (i + 1)^2 as far
    return {"x": x, "y": scale * np.sin(x.sum(-1, keepdims=True))}


def _units(tree):
    """Every unit's leaves: the root's, then layer l's."""
    layers = jax.tree.leaves(tree["layers"])
    return [jax.tree.leaves(tree["root"])] + [[x[j] for x in layers] for j in range(layers[0].shape[0])]


def np_edit_sync(theta, workers, p: Penalty, lr: float, mu: float):
    """Algorithm 2 on each unit (EDIT.md), the first sync (trace 0, detectors fresh: none flagged):
    Δ_i = θ̄ − θ_i, g_i = ‖Δ_i‖, w = softmax(−g/T), Δ = Σ w_i Δ_i, clip to φ, Nesterov. Returns the
    new θ̄ and trace (trees like ``theta``), and per unit g [U, N], w [U, N], clip factor [U]."""
    new_theta, new_trace = _f64(theta), jax.tree.map(lambda x: np.zeros(np.shape(x)), _f64(theta))
    g_all, w_all, clips = [], [], []
    for u, (t_u, b_u, th_u) in enumerate(zip(_units(new_theta), _units(new_trace), _units(theta), strict=True)):
        deltas = [[np.float64(t) - np.float64(x) for t, x in zip(th_u, w_u, strict=True)]
                  for w_u in (_units(jax.tree.map(lambda x: x[i], workers))[u]  # noqa: B023 - called at once
                              for i in range(N))]
        g = np.array([math.sqrt(sum(float(np.sum(d * d)) for d in ds)) for ds in deltas])
        e = np.exp(-(g - g.min()) / p.temperature)
        w = e / e.sum()
        avg = [sum(w[i] * deltas[i][j] for i in range(N)) for j in range(len(t_u))]
        c = min(1.0, p.clip_threshold / (math.sqrt(sum(float(np.sum(a * a)) for a in avg)) + 1e-6))
        for j, a in enumerate(avg):
            b_u[j][...] = c * a  # b = μ·0 + Δ
            t_u[j][...] = t_u[j] - lr * (c * a + mu * b_u[j])
        g_all.append(g), w_all.append(w), clips.append(c)
    return new_theta, new_trace, np.array(g_all), np.array(w_all), np.array(clips)


def test_edit_layerwise_sync_matches_numpy_and_steps_from_theta_bar():
    penalty = Penalty(warmup=3, temperature=0.05, clip_threshold=0.3)
    lr_in, wd = 0.2, 0.1
    tx = optax.chain(optax.add_decayed_weights(wd), optax.sgd(lr_in))  # an update that reads the params
    trainer = LocalSGD(edit(outer_lr=0.7, outer_momentum=0.9, penalty=penalty), _mesh(), 2, loss_fn=_scanned_loss,
                       optimizer=tx, donate=False)
    state = trainer.init(_scanned_params())
    assert state.detector.mean.shape == (N, 3)  # [N, U]: the root and 2 layers
    for k in range(2):
        state, metrics = trainer.step(state, _scanned_batch(k))
        assert "sync" not in metrics
    assert trainer.kind_at(2) == "sync_forward"
    theta, workers = _f64(state.outer_params), _f64(state.params)
    want_theta, want_trace, g, w, clip = np_edit_sync(theta, workers, penalty, 0.7, 0.9)
    assert np.max(np.abs(w - 1 / N)) > 0.05 and np.min(clip) < 0.99, (w, clip)  # the penalty is exercised

    batch = _scanned_batch(2)
    state, metrics = trainer.step(state, batch)
    figures = metrics["sync"]
    _close(state.outer_params, want_theta, "θ̄")
    _close({u: sgd_trace(state.outer_opt_state[u]) for u in ("root", "layers")}, want_trace, "outer momentum")
    np.testing.assert_allclose(np.asarray(figures["unit_pseudo_grad_norm"]), g, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(figures["weight"]), w.mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(figures["clip_factor"]), clip.min(), rtol=1e-5)
    # The detectors were fed each worker's norm of each unit (μ = α g after the first sync).
    np.testing.assert_allclose(np.asarray(state.detector.mean), penalty.alpha * g.T, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(state.detector.count), np.ones((N, 3)))
    # The step's gradient was taken at θ̄ and its update applied to θ̄ (weight decay included).
    theta_bar = jax.tree.map(lambda x: x.astype(np.float32), want_theta)
    for i in range(N):
        mine = jax.tree.map(lambda x: x[i], batch)  # noqa: B023 - called at once
        loss, grads = jax.value_and_grad(lambda p: _scanned_loss(p, mine)[0])(theta_bar)  # noqa: B023 - called at once
        want = jax.tree.map(lambda t, gr: t - lr_in * (gr + wd * t), theta_bar, grads)
        _close(jax.tree.map(lambda x: x[i], state.params), want,  # noqa: B023 - called at once
               f"worker {i} after the sync step", rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(metrics["inner"]["loss"][i]), float(loss), rtol=1e-5)

    # Worker 0 goes NaN: the next sync flags it in every unit (weight 0), θ̄ stays finite, and it
    # restarts from θ̄ (its detectors are not fed the outlier).
    poisoned = _scanned_batch(3)
    poisoned["x"][0] = np.nan
    state, _ = trainer.step(state, poisoned)
    assert not np.all(np.isfinite(np.asarray(state.params["root"]["w_in"][0])))
    state, metrics = trainer.step(state, _scanned_batch(4))
    figures = metrics["sync"]
    assert np.asarray(figures["flagged"]).tolist() == [3, 0, 0, 0] and float(figures["weight"][0]) == 0.0
    assert np.asarray(figures["inner_reset"]).tolist() == [True, False, False, False]
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves((state.params, state.outer_params)))
    np.testing.assert_array_equal(np.asarray(state.detector.count), [[1] * 3] + [[2] * 3] * (N - 1))


# ============================================================================= bad arguments


def test_bad_arguments_are_named():
    mesh, step = _mesh(), _linear_step(optax.sgd(0.1))
    with pytest.raises(ValueError, match="mesh: expected .* 'replica' axis"):
        LocalSGD(diloco(), jax.make_mesh((8,), ("data",), devices=jax.devices()[:8]), 4, inner_step=step)
    for tau in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="tau: expected an integer >= 1"):
            LocalSGD(diloco(), mesh, tau, inner_step=step)
    with pytest.raises(ValueError, match="inner_step: rule 'edit' syncs inside the forward"):
        LocalSGD(edit(), mesh, 4, inner_step=step)
    with pytest.raises(ValueError, match="give either inner_step, or loss_fn and optimizer"):
        LocalSGD(diloco(), mesh, 4, loss_fn=_scanned_loss)
    with pytest.raises(ValueError, match="penalty.warmup"):
        edit(penalty=Penalty(warmup=1))
    layerwise = LocalSGD(edit(), mesh, 1, loss_fn=_scanned_loss, optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"params: rule 'edit' syncs layer by layer .*got \['dense'\]"):
        layerwise.init({"dense": np.ones((3, 3), np.float32)})
    uneven = _scanned_params()
    uneven["layers"]["b"] = uneven["layers"]["b"][:1]
    with pytest.raises(ValueError, match="params: every leaf of params\\['layers'\\] .* leading sizes \\[1, 2\\]"):
        layerwise.init(uneven)

    trainer = LocalSGD(diloco(), mesh, 4, inner_step=step)
    params = _linear_params()
    state = trainer.init(params, optax.sgd(0.1).init(params))
    with pytest.raises(ValueError, match=r"batch: \['x'\] must be stacked per worker, \[N=4, \.\.\.\]"):
        trainer.step(state, {"x": np.zeros((3, 4, 3), np.float32), "y": np.zeros((4, 4, 2), np.float32)})
    with pytest.raises(ValueError, match="batch: .*per-worker batch dim \\(3\\) must be divisible by .* shard size 2"):
        trainer.step(state, {"x": np.zeros((4, 3, 3), np.float32), "y": np.zeros((4, 3, 2), np.float32)})
    with pytest.raises(ValueError, match="batch: a global batch's leading dim must be a multiple of the 4 workers"):
        trainer.per_worker(np.zeros((6, 2)))
    assert trainer.per_worker(np.arange(8).reshape(8, 1))[:, :, 0].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    batch = {"x": np.ones((4, 4, 3), np.float32), "y": np.ones((4, 4, 2), np.float32)}
    new, _ = trainer.step(state, batch)
    with pytest.raises(ValueError, match="state: its buffers were consumed .* pass the state that call returned"):
        trainer.step(state, batch)  # the consumed one again (it crashed Python: exit 139)
    trainer.step(new, batch)
    # A user's inner_step returning the wrong things: named while tracing, not a bare unpacking error
    # or JAX's pjit out_shardings message (issue 58).
    wrong = {"two values": (lambda p, o, b: (p, o), r"must return \(params, opt_state, metrics\), got a tuple of 2"),
             "an extra key": (lambda p, o, b: ({**p, "extra": p["bias"][1]}, o, {}),
                              r"the params it returns must have the structure .* extra \[\"\['extra'\]\"\]"),
             "opt_state changed": (lambda p, o, b: (p, (), {}), r"the opt_state it returns must have the structure")}
    for _what, (fn, message) in wrong.items():
        bad = LocalSGD(diloco(), mesh, 4, inner_step=fn)
        with pytest.raises(ValueError, match="inner_step: " + message):
            bad.step(bad.init(params, optax.sgd(0.1).init(params)), batch)
    listed = _scanned_params()
    listed["layers"] = [jax.tree.map(lambda x, i=i: x[i], listed["layers"]) for i in range(2)]
    with pytest.raises(ValueError, match=r"params\['layers'\] is a list of 2 per-layer trees \(of one structure\); "
                                         r".*jax.tree.map\(lambda \*x: jnp.stack\(x\), \*layers\)"):
        layerwise.init(listed)


def test_a_forward_that_skips_the_hook_is_named():
    def no_hook(p, batch, hook, hook_xs):  # ignores the hook: the sync could not reach the forward
        return _scanned_loss(p, batch)[0], None

    trainer = LocalSGD(edit(), _mesh(), 1, loss_fn=no_hook, optimizer=optax.sgd(0.1))
    state, _ = trainer.step(trainer.init(_scanned_params()), _scanned_batch(0))
    with pytest.raises(ValueError, match="loss_fn: on a sync step the forward must pass every unit through hook"):
        trainer.step(state, _scanned_batch(1))


def test_the_public_names_resolve_lazily():
    assert edit_jax.LocalSGD is LocalSGD and edit_jax.diloco is diloco and edit_jax.Penalty is Penalty
    assert edit_jax.post_local_sgd().outer.lr == 1.0 and not edit_jax.diloco().penalty.clip
    assert edit_jax.edit().layerwise and edit_jax.edit().penalty == Penalty()


def test_our_family_meets_the_written_contract():
    """``family.ModelFamily`` is the contract the harness reaches a model through: our Llama module
    meets it, a module without a forward does not (``model_family`` then names what is missing)."""
    import types

    from edit_jax.models import family, llama

    assert isinstance(llama, family.ModelFamily)
    partial = types.ModuleType("half_a_family")
    partial.init_params, partial.token_loss_sum, partial.flops_per_token = llama.init_params, llama.token_loss_sum, len
    assert not isinstance(partial, family.ModelFamily)
    assert set(family.CONTRACT) <= {n for n in dir(family.ModelFamily) if not n.startswith("_")}
