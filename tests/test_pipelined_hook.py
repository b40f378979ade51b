"""The GPU meshes' pipelined layer loop (llama ``_pipelined_layers``: each layer's sync issued one
layer ahead, for XLA:GPU to overlap its all-reduce) computes what the plain loop computes. XLA:CPU
cannot run it with collectives (their rendezvous collide), so the hook here is a pure function of
the unit and its per-layer input: what is checked is the pipelining itself, which layer gets
which synced params and which output, in the forward and in the gradients, with and without remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.models.family import SplitHook
from edit_jax.models.llama import init_params, loss_sum, preset


def _sync(unit, xs, which):
    """Stands in for EDiT's sync: a unit's params moved by its own input, and a per-unit output."""
    if xs is None:
        return unit, None
    moved = jax.tree.map(lambda p: p * (1.0 + xs["scale"]) + 0.01 * xs["scale"], unit)
    return moved, {"norm": sum(jnp.sum(p * p) for p in jax.tree.leaves(moved)), "echo": xs["scale"] * 2.0}


def _gather(unit, which):
    return jax.tree.map(lambda p: p.astype(jnp.float32), unit)


@pytest.mark.parametrize("remat", [False, True])
def test_pipelined_layers_equal_the_plain_loop(remat):
    cfg = preset("tiny", n_layers=3, remat=remat)
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    xs = {"root": {"scale": jnp.float32(0.05)}, "layers": {"scale": jnp.asarray([0.1, -0.2, 0.3], jnp.float32)}}
    split = SplitHook(_sync, _gather)

    def run(hook):
        def f(p):
            return loss_sum(cfg, p, tokens, targets, hook, xs)
        (loss, ys), grads = jax.value_and_grad(f, has_aux=True)(params)
        return loss, ys, grads

    plain = run(split.__call__)  # the plain loop: the hook called whole, inside each iteration
    piped = run(split)  # a SplitHook: the family pipelines the layers that sync
    np.testing.assert_allclose(piped[0], plain[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(piped[1:]), jax.tree.leaves(plain[1:])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert np.asarray(piped[1]["layers"]["echo"]).tolist() == pytest.approx([0.2, -0.4, 0.6])  # layer order kept
