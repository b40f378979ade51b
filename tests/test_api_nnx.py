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
from edit_jax.localsgd.outer_spec import Penalty
from tests.helpers import load_example
from tests.stages import one_stage
from tests.test_api import N, _close, _f64, _mesh, np_edit_sync


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
    one_stage("default", "DiLoCo on an NNX model", 9,
              other="test_dropout_streams_differ_per_worker_and_step_and_repeat_with_the_seed")
    trainer, state, losses = _train(edit_jax.diloco())
    means = [float(x.mean()) for x in losses]
    assert all(math.isfinite(x) for x in means) and np.mean(means[-3:]) < means[0] * 0.7, means
    model = trainer.to_nnx(state)
    assert isinstance(model, Regressor)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(state.outer_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model.eval()  # dropout off: the module works as any NNX model
    assert np.isfinite(np.asarray(_loss(model, jax.tree.map(lambda x: x[0], _batch(99)))[0]))


def test_dropout_streams_differ_per_worker_and_step_and_repeat_with_the_seed():
    one_stage("3.12", "NNX dropout streams", 8,
              other="test_an_nnx_model_trains_with_diloco_and_comes_back_as_a_module")
    _, _, a = _train(edit_jax.diloco(), steps=2, same_batch=True)
    _, _, b = _train(edit_jax.diloco(), steps=2, same_batch=True)
    assert len({round(float(x), 6) for x in a[0]}) == N  # same rows, another mask per worker
    np.testing.assert_array_equal(np.stack(a), np.stack(b))  # the seed gives the same masks again


def test_what_a_functional_step_cannot_keep_is_refused():
    model = Regressor(nnx.Rngs(0, dropout=1), norm=nnx.BatchNorm(16, rngs=nnx.Rngs(2)))
    with pytest.raises(ValueError, match="BatchStat"):
        LocalSGD.for_nnx(edit_jax.diloco(), _mesh(), 4, model, optax.adam(0.01), _loss)
    with pytest.raises(ValueError, match="blocks: rule 'edit'"):
        LocalSGD.for_nnx(edit_jax.edit(), _mesh(), 4, Regressor(nnx.Rngs(0)), optax.adam(0.01), _loss)
    with pytest.raises(ValueError, match="no attribute 'l3'"):
        LocalSGD.for_nnx(edit_jax.edit(), _mesh(), 4, Regressor(nnx.Rngs(0)), optax.adam(0.01), _loss, blocks="l3")
    with pytest.raises(ValueError, match=r"model.l1: every nnx.Param must be stacked"):
        LocalSGD.for_nnx(edit_jax.edit(), _mesh(), 4, Regressor(nnx.Rngs(0)), optax.adam(0.01), _loss, blocks="l1")
    with pytest.raises(ValueError, match="optimizer"):
        LocalSGD.for_nnx(edit_jax.diloco(), _mesh(), 4, Regressor(nnx.Rngs(0)), "adam", _loss)


# ----------------------------------------------------------------------------- layer-wise rules

V, D, L = 16, 8, 3


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, h):
        return h + self.drop(jnp.tanh(self.lin(h)))


class StackedLM(nnx.Module):
    """Root modules and L blocks built under nnx.vmap (a dropout stream per layer), run with
    edit_jax.scan_blocks: what a layer-wise rule needs of an NNX model."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0, runs: int = 1):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        make = nnx.split_rngs(splits=L)(nnx.vmap(lambda r: Block(r, dropout), in_axes=0, out_axes=0))
        self.blocks = make(rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)
        self.runs = runs

    def __call__(self, tokens):
        h = self.embed(tokens)
        for _ in range(self.runs):
            h = edit_jax.scan_blocks(self.blocks, h)
        return self.head(h)


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _lm_loss(model, batch):
    return _ce(model(batch["x"]), batch["y"])


def _by_hand(params, batch, hook, hook_xs):
    """The same model's forward in plain JAX on the {"root", "layers"} layout, the hook placed by
    hand (root first, each layer inside the scan): the reference for the library's placement."""
    xs = hook_xs if hook_xs is not None else {"root": None, "layers": None}
    root, root_ys = hook(params["root"], xs["root"], "root")

    def layer(h, unit):
        p, x = unit
        p, ys = hook(p, x, "layer")
        return h + jnp.tanh(h @ p["lin"]["kernel"][...] + p["lin"]["bias"][...]), ys

    h, layer_ys = jax.lax.scan(layer, root["embed"]["embedding"][...][batch["x"]], (params["layers"], xs["layers"]))
    logits = h @ root["head"]["kernel"][...] + root["head"]["bias"][...]
    return _ce(logits, batch["y"]), {"root": root_ys, "layers": layer_ys}


def _lm_batch(k):
    rng = np.random.default_rng(k)
    x = rng.integers(0, V, size=(N, 4, 6)).astype(np.int32)
    return {"x": x, "y": (x * 3 + 1) % V}


def _run(trainer, state, steps):
    losses = []
    for k in range(steps):
        state, metrics = trainer.step(state, _lm_batch(k))
        losses.append(np.asarray(metrics["inner"]["loss"]))
    return state, np.stack(losses)


def test_layerwise_edit_on_nnx_equals_the_hook_placed_by_hand():
    """EDiT (layer-wise, tau 3, two syncs in the forward) on an NNX model with stacked blocks equals
    the same rule on the same params through loss_fn with the hook placed by hand: the library
    places it on the root and on every layer. Every unit's θ̄ moved at the syncs."""
    one_stage("default", "EDiT on NNX against the hook by hand", 24,
              other="test_layerwise_nnx_with_dropout_per_layer_and_a_forward_that_scans_twice")
    rule = edit_jax.edit(penalty=Penalty(clip_threshold=0.05))  # a clip that binds: the units' norms matter
    model = StackedLM(nnx.Rngs(0))
    nnx_trainer = LocalSGD.for_nnx(rule, _mesh(), 3, model, optax.adam(0.05), _lm_loss, blocks="blocks")
    state0 = nnx_trainer.init()
    assert set(state0.outer_params) == {"root", "layers"} and sorted(state0.outer_params["root"]) == ["embed", "head"]
    by_hand = LocalSGD(rule, _mesh(), 3, loss_fn=_by_hand, optimizer=optax.adam(0.05))
    a, la = _run(nnx_trainer, state0, 7)
    b, lb = _run(by_hand, by_hand.init(jax.tree.map(np.asarray, nnx_trainer.nnx.params)), 7)
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(a.outer_params), jax.tree.leaves(b.outer_params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
    moved = [not np.allclose(np.asarray(x), np.asarray(y)) for x, y in
             zip(jax.tree.leaves(nnx_trainer.nnx.params), jax.tree.leaves(a.outer_params), strict=True)]
    assert all(moved), moved
    assert la[-1].mean() < la[0].mean()
    back = nnx_trainer.to_nnx(a)  # the module at θ̄, its blocks run by a plain scan
    assert isinstance(back, StackedLM) and np.isfinite(float(_lm_loss(back, jax.tree.map(lambda x: x[0],
                                                                                        _lm_batch(9)))))


def test_layerwise_nnx_with_dropout_per_layer_and_a_forward_that_scans_twice():
    """Dropout streams stacked over the blocks are reseeded per worker and step (a key per layer);
    a forward that runs scan_blocks twice is refused, naming it."""
    one_stage("3.12", "NNX dropout per layer", 10, other="test_layerwise_edit_on_nnx_equals_the_hook_placed_by_hand")
    model = StackedLM(nnx.Rngs(0, dropout=1), dropout=0.3)
    trainer = LocalSGD.for_nnx(edit_jax.edit(), _mesh(), 2, model, optax.adam(0.05), _lm_loss, blocks="blocks",
                               seed=0)
    _, losses = _run(trainer, trainer.init(), 3)
    assert np.all(np.isfinite(losses)) and len({round(float(x), 6) for x in losses[0]}) == N
    twice = LocalSGD.for_nnx(edit_jax.edit(), _mesh(), 2, StackedLM(nnx.Rngs(0), runs=2), optax.adam(0.05),
                             _lm_loss, blocks="blocks")
    with pytest.raises(ValueError, match=r"scan_blocks\(self.blocks, x\) once; it ran it 2 times"):
        twice.step(twice.init(), _lm_batch(0))


# ============================================================================= the NNX example's sync


PENALTY = Penalty(warmup=3, temperature=0.05, clip_threshold=0.5)
RULES = {"diloco": lambda: edit_jax.diloco(0.6, 0.8), "co2": lambda: edit_jax.co2(0.6, 0.8, gap_penalty=2.0),
         "edit": lambda: edit_jax.edit(outer_lr=0.6, outer_momentum=0.8, penalty=PENALTY),
         "edit+topk2": lambda: edit_jax.compressed(edit_jax.edit(outer_lr=0.6, outer_momentum=0.8, penalty=PENALTY),
                                                   "topk2")}


@pytest.mark.parametrize("rule", list(RULES))
def test_the_nnx_example_syncs_as_the_reference(rule):
    """The NNX example's model (``examples/own_nnx_model.py``, tiny) through ``for_nnx``, its workers
    moved off θ̄ by their own amounts (worker i 2^i as far): DiLoCo's and CO2's sync (a round, then
    the flush) give NumPy's θ̄; EDiT's sync inside the forward (``scan_blocks`` placing the hook)
    gives Algorithm 2's (``np_edit_sync``, the conformance tests' reference); EDiT on topk2 with
    error feedback inside the forward gives what the same rule's sync after the step gives on the
    same posts through the plain API (equal to the trainer's: ``test_rule_conformance``)."""
    # each once per CI run: DiLoCo and EDiT + topk2 under the default Python, EDiT and CO2 under 3.12
    stage, pair = {"diloco": ("default", "edit"), "edit+topk2": ("default", "co2"), "edit": ("3.12", "diloco"),
                   "co2": ("3.12", "edit+topk2")}[rule]
    one_stage(stage, f"the NNX example with {rule}", 12, other=f"the same with {pair}")
    ex = load_example("own_nnx_model")
    size = ex.SIZES["tiny"]
    model = ex.ByteLM(size["d_model"], size["n_layers"], size["n_heads"], size["seq_len"], nnx.Rngs(0, dropout=1))
    r = RULES[rule]()
    trainer = LocalSGD.for_nnx(r, _mesh(), 1, model, optax.sgd(0.1), ex.loss_fn, blocks="blocks" if r.layerwise
                               else None, donate=False)
    state = trainer.init()
    rng = np.random.default_rng(0)
    theta = _f64(state.outer_params)
    workers = jax.tree.map(lambda t: np.stack([t - 2.0 ** i * 0.02 * rng.standard_normal(t.shape)
                                               for i in range(N)]).astype(np.float32), theta)
    posts = state._replace(params=workers)
    lr, mu = 0.6, 0.8
    mean_delta = jax.tree.map(lambda t, w: np.mean(t[None] - w, axis=0), theta, workers)
    if rule == "diloco":  # Nesterov from a zero momentum: b = Δ̄, θ̄ -= η(Δ̄ + μb)
        new, _ = trainer.sync(posts)
        _close(new.outer_params, jax.tree.map(lambda t, d: t - lr * (d + mu * d), theta, mean_delta), "DiLoCo θ̄")
    elif rule == "co2":  # a round sends θ̄ − θ_i in flight (θ̄ unmoved: nothing was); the flush lands their mean / Λ
        new, _ = trainer.sync(posts)
        _close(new.outer_params, theta, "CO2 θ̄ after a round with nothing in flight")
        new, _ = trainer.flush(new)
        _close(new.outer_params, jax.tree.map(lambda t, d: t - lr * d / 2.0, theta, mean_delta), "CO2 θ̄ flushed")
    else:  # the sync in step 1's forward (tau 1): θ̄ as Algorithm 2 gives it; the inner update leaves θ̄ be
        batch = ex.batch_at(ex.load_bytes(), (N, size["batch"]), size["seq_len"], 0, 1)
        assert trainer.kind_at(1) == "sync_forward"
        new, metrics = trainer.step(posts._replace(step=np.int32(1)), batch)
        assert "sync" in metrics
        if rule == "edit":
            want, _, _, w, clip = np_edit_sync(theta, workers, PENALTY, lr, mu)
            assert np.ptp(w) > 0.05 and clip.min() < 1.0, (w, clip)  # the penalty is exercised
            _close(new.outer_params, want, "EDiT θ̄, hook placed by scan_blocks")
        else:
            plain = LocalSGD(r, _mesh(), 1, loss_fn=lambda *a: None, optimizer=optax.sgd(0.1), donate=False)
            after, _ = plain.sync(plain.init(state.outer_params)._replace(params=workers))
            _close(new.outer_params, after.outer_params, "EDiT + topk2 θ̄, in the forward vs after the step")
            _close(new.extra, after.extra, "EDiT + topk2 residuals")
