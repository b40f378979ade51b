"""``LayerStack``: a linen model written the usual way (root modules, one block module, a plain
forward) as the layout of a layer-wise sync, checked against the same modules composed by hand,
and trained with EDiT through ``LocalSGD`` (the hook placed by the helper: every unit synced)."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from edit_jax import LayerStack, LocalSGD, edit
from tests.stages import one_stage

N, S, L, D, V, T = 4, 2, 3, 16, 32, 8


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))


def _model():
    return LayerStack(root={"embed": nn.Embed(V, D), "norm": nn.LayerNorm(), "head": nn.Dense(V)},
                      block=Block(), n_layers=L, forward=lambda m, tokens: m.head(m.norm(m.blocks(m.embed(tokens)))))


def _tokens(seed, shape=(2, T + 1)):
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


def test_the_layout_and_the_forward_equal_the_modules_composed_by_hand():
    model, tokens = _model(), _tokens(0)[:, :-1]
    params = model.init(jax.random.key(0), tokens)
    assert sorted(params) == ["layers", "root"] and sorted(params["root"]) == ["embed", "head", "norm"]
    assert {np.shape(x)[0] for x in jax.tree.leaves(params["layers"])} == {L}
    layer = [jax.tree.map(lambda x: x[i], params["layers"]) for i in range(L)]  # noqa: B023 - called at once
    # own keys
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(layer[0]), jax.tree.leaves(layer[1]), strict=True))
    x = nn.Embed(V, D).apply({"params": params["root"]["embed"]}, tokens)
    for p in layer:
        x = Block().apply({"params": p}, x)
    x = nn.LayerNorm().apply({"params": params["root"]["norm"]}, x)
    want = nn.Dense(V).apply({"params": params["root"]["head"]}, x)
    got, ys = model.apply(params, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert ys == {"root": None, "layers": None}

    def scaled(unit, xs, which):  # the hook's params are what computes: a scaled root moves the output
        return (jax.tree.map(lambda p: p * 2.0, unit) if which == "root" else unit), which == "root"
    moved, ys = model.apply(params, tokens, hook=scaled)
    assert not np.allclose(np.asarray(moved), np.asarray(got)) and bool(ys["root"])
    assert np.asarray(ys["layers"]).tolist() == [False] * L  # called inside the scan, once per layer


def test_edit_trains_a_layer_stack_in_a_few_lines():
    one_stage("3.12", "EDiT on a LayerStack", 12, other="test_examples' linen example")
    model, tx = _model(), optax.adamw(1e-2)

    def loss_fn(params, batch, hook, hook_xs):
        logits, ys = model.apply(params, batch[:, :-1], hook=hook, hook_xs=hook_xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), ys

    mesh = jax.make_mesh((N, S), ("replica", "shard"), devices=jax.devices()[: N * S])
    trainer = LocalSGD(edit(), mesh, 3, loss_fn=loss_fn, optimizer=tx)
    state = trainer.init(model.init(jax.random.key(0), _tokens(0)[:, :-1]))
    data = np.tile(np.arange(T + 1, dtype=np.int32) % V, (N, 4, 1))  # one sequence to learn
    losses = []
    for k in range(9):
        state, metrics = trainer.step(state, data)
        losses.append(float(np.mean(np.asarray(metrics["inner"]["loss"]))))
        if k in (3, 6):  # the sync ran inside the forward, every unit (root + L layers) with a norm
            assert np.asarray(metrics["sync"]["unit_pseudo_grad_norm"]).shape == (1 + L, N)
            assert np.all(np.asarray(metrics["sync"]["unit_pseudo_grad_norm"]) > 0)
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_forward_that_misses_a_module_is_named():
    tokens = _tokens(0)[:, :-1]
    skips = LayerStack(root={"embed": nn.Embed(V, D), "head": nn.Dense(V)}, block=Block(), n_layers=2,
                       forward=lambda m, t: m.head(m.embed(t)))
    with pytest.raises(ValueError, match=r"not called: \['blocks'\]"):
        skips.init(jax.random.key(0), tokens)
    unknown = LayerStack(root={"embed": nn.Embed(V, D)}, block=Block(), n_layers=2,
                         forward=lambda m, t: m.head(m.blocks(m.embed(t))))
    with pytest.raises(ValueError, match="called m.head, which is not a root module"):
        unknown.init(jax.random.key(0), tokens)
    with pytest.raises(ValueError, match="n_layers: expected an integer >= 1"):
        LayerStack(root={"embed": nn.Embed(V, D)}, block=Block(), n_layers=0, forward=lambda m, t: t)
