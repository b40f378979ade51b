"""The GPU meshes' pipelined layer loop (llama ``_pipelined_layers``: each layer's sync issued one
layer ahead, for XLA:GPU to overlap its all-reduce) computes what the plain loop computes. XLA:CPU
cannot run it with collectives (their rendezvous collide), so the hook here is a pure function of
the unit and its per-layer input: what is checked is the pipelining itself, which layer gets
which synced params and which output, in the forward and in the gradients, with and without remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.config import OuterConfig
from edit_jax.models.family import SplitHook
from edit_jax.models.llama import init_params, loss_sum, preset
from tests.stages import one_stage


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
    one_stage("3.12" if remat else "default", f"the pipelined layers with remat={remat}", 25,
              other=f"the same with remat={not remat}")
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
    for a, b in zip(jax.tree.leaves(piped[1:]), jax.tree.leaves(plain[1:]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert np.asarray(piped[1]["layers"]["echo"]).tolist() == pytest.approx([0.2, -0.4, 0.6])  # layer order kept


def test_pipelined_layers_with_the_real_sync_equal_the_plain_loop():
    """EDiT's own sync step (the penalty, the outer Nesterov step, the unit outputs assembled into
    the outer state) with the layer loop pipelined as on GPUs equals the plain loop. On one device
    (N = 1, S = 1): no collective, so XLA:CPU can run the pipelined loop; the workers' pseudo
    pseudo gradients are noise added to θ_i."""
    one_stage("default", "the pipelined layers with the real sync", 26)
    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.runtime.mesh import make_mesh
    from tests.helpers import tiny_config

    cfg = tiny_config(1, 1, method="edit", model={"n_layers": 3},
                      sync={"outer": OuterConfig(lr=0.7, momentum=0.8), "penalty": {"clip_threshold": 0.05}})
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    plain, piped = StepPrograms.for_config(cfg, mesh), StepPrograms.for_config(cfg, mesh)
    piped.pipelined_layers = True
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.model.vocab_size, (cfg.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
    start = jax.device_get(plain.init_state(0))
    start = start.replace(params=jax.tree.map(lambda p: p + 0.01 * rng.standard_normal(p.shape).astype(p.dtype),
                                              start.params))
    outs = [m.step_fn("sync_forward")(jax.device_put(start, m.state_shardings), m.put_batch(batch))
            for m in (plain, piped)]
    (a, ma), (b, mb) = jax.device_get(outs)
    moved = np.abs(np.asarray(a.outer.params["layers"]["mlp"]["w_down"]) -
                   np.asarray(start.outer.params["layers"]["mlp"]["w_down"])).max()
    assert moved > 1e-4, "the sync should move θ̄"
    for name, x, y in (("θ_i", a.params, b.params), ("θ̄", a.outer.params, b.outer.params),
                       ("outer state", a.outer.opt_state, b.outer.opt_state), ("metrics", ma, mb)):
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
            np.testing.assert_allclose(np.asarray(v, np.float64), np.asarray(u, np.float64), rtol=2e-5, atol=1e-7,
                                       err_msg=name)



def _dot_counts(jaxpr, acc=None) -> dict:
    """dot_general equations in a jaxpr, sub-jaxprs (scan bodies, checkpoints) included, split into
    those with batch dimensions (attention's) and those without (the projections, the head)."""
    acc = {"batch": 0, "plain": 0} if acc is None else acc
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
            acc["batch" if lhs_batch else "plain"] += 1
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _dot_counts(inner, acc)
    return acc


@pytest.mark.parametrize("pipelined", [False, True])
def test_remat_saves_keeps_the_gradients_and_drops_the_recomputed_matmuls(pipelined):
    """``model.remat_saves="dots"`` gives the gradients of the plain rematerialised layer, and its
    backward recomputes no projection: its gradient program has exactly the projection matmuls of
    no remat at all, where remat that keeps nothing reruns them; attention's own (batched) dots are
    rerun by both."""
    one_stage("default" if pipelined else "3.12", "remat saves", 15, other="the other hook")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 320)
    targets = jnp.roll(tokens, -1, axis=1)
    xs = {"root": {"scale": jnp.float32(0.05)}, "layers": {"scale": jnp.asarray([0.1, -0.2, 0.3], jnp.float32)}}
    hook = SplitHook(_sync, _gather) if pipelined else SplitHook(_sync, _gather).__call__
    out = {}
    for remat, saves in ((False, "nothing"), (True, "nothing"), (True, "dots"), (True, "dots_attention")):
        cfg = preset("tiny", n_layers=3, remat=remat, remat_saves=saves, scan_unroll=1)
        params = init_params(cfg, jax.random.PRNGKey(0))
        grad = jax.grad(lambda p: loss_sum(cfg, p, tokens, targets, hook, xs)[0])  # noqa: B023 - called at once
        out[remat, saves] = (grad(params), _dot_counts(jax.make_jaxpr(grad)(params).jaxpr))
    for key in ((True, "dots"), (True, "dots_attention")):
        for a, b in zip(jax.tree.leaves(out[key][0]), jax.tree.leaves(out[True, "nothing"][0]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)  # float order differs
    plain = {k: v[1]["plain"] for k, v in out.items()}
    assert plain[True, "dots"] == plain[False, "nothing"] < plain[True, "nothing"]
    assert out[True, "dots"][1]["batch"] == out[True, "nothing"][1]["batch"] > out[False, "nothing"][1]["batch"]
    # XLA attention on the CPU is not cuDNN's primitive: dots_attention keeps what dots does here.
    assert out[True, "dots_attention"][1] == out[True, "dots"][1]
