"""Issue 20's memory knobs: the chunked cross-entropy, gradient accumulation, the attention kernel.

- ``chunked_loss_sum`` against a NumPy log-softmax, and its gradients against the plain loss's;
- ``optim.grad_accum=k`` steps against the unsplit batch (k = 1) for the hsdp, local and EDiT
  ``sync_forward`` steps: losses, params, AdamW state and θ̄ to float tolerance;
- ``model.attention``: the kernel each setting picks, and the errors.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.config import ConfigError
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.models import llama as model_lib
from edit_jax.models.llama import AttentionError, attention_impl, chunked_loss_sum, token_loss_sum
from edit_jax.runtime.mesh import make_mesh
from edit_jax.validate import validate
from tests.helpers import tiny_config
from tests.stages import one_stage


def _numpy_loss(x, head, targets):
    logits = x.astype(np.float64) @ head.astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).sum()


@pytest.mark.parametrize("chunk", [0, 3, 4, 5, 10, 64])
def test_chunked_loss_equals_the_plain_one(chunk):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 10, 16)).astype(np.float32)
    head = rng.normal(size=(16, 40)).astype(np.float32) * 0.3
    targets = rng.integers(0, 40, (2, 10)).astype(np.int32)
    got = chunked_loss_sum(jnp.asarray(x), jnp.asarray(head), jnp.asarray(targets), chunk)
    assert float(got) == pytest.approx(_numpy_loss(x, head, targets), rel=1e-5)
    plain = lambda a, b: token_loss_sum(jnp.dot(a, b), targets)
    chunked = lambda a, b: chunked_loss_sum(a, b, targets, chunk)
    for g_plain, g_chunked in zip(jax.grad(plain, (0, 1))(x, head), jax.grad(chunked, (0, 1))(x, head), strict=True):
        np.testing.assert_allclose(g_chunked, g_plain, rtol=1e-5, atol=1e-6)


def test_model_loss_sum_never_holds_the_whole_logits():
    """The tiny model's loss through ``loss_sum`` (chunks of 8 of 32 positions) equals forward +
    token_loss_sum, and its jaxpr has no [batch, seq, vocab] array."""
    one_stage("3.12", "the loss sum's peak", 12, other="test_chunked_loss_inside_the_sharded_step_equals_the_whole_one")
    cfg = tiny_config().model
    chunked_cfg = dataclasses.replace(cfg, loss_chunk=8)
    params = model_lib.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 33)), jnp.int32)
    logits, _ = model_lib.forward(cfg, params, tokens[:, :-1])
    want = float(token_loss_sum(logits, tokens[:, 1:]))
    got, _ = model_lib.loss_sum(chunked_cfg, params, tokens[:, :-1], tokens[:, 1:])
    assert float(got) == pytest.approx(want, rel=1e-6)
    grad_fn = jax.grad(lambda p: model_lib.loss_sum(chunked_cfg, p, tokens[:, :-1], tokens[:, 1:])[0])
    shapes = {tuple(v.aval.shape) for eqn in jax.make_jaxpr(grad_fn)(params).jaxpr.eqns for v in eqn.outvars}
    assert (4, 32, cfg.vocab_size) not in shapes  # chunks of [4, 8, vocab] only (the first outside the scan)


def _machineries(method, k, **kw):
    base = tiny_config(2, 2, method=method, batch_size=16, optim={"eps": 1e-3}, **kw)  # eps: see the next test
    acc = dataclasses.replace(base, optim=dataclasses.replace(base.optim, grad_accum=k))
    validate(acc)
    mesh = make_mesh(base.mesh, jax.devices()[:4])
    return StepPrograms.for_config(base, mesh), StepPrograms.for_config(acc, mesh)


def _close(a, b, what, rtol=2e-5, atol=1e-7):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _batch(cfg, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.model.vocab_size, (cfg.batch_size, cfg.data.seq_len + 1)).astype(np.int32)


@pytest.mark.parametrize("method,kinds,k", [("baseline", ["hsdp"], 4), ("edit", ["local", "sync_forward"], 2)])
def test_accumulated_steps_equal_the_unsplit_batch(method, kinds, k):
    one_stage("default" if method == "edit" else "3.12", f"accumulation with {method}", 25,
              other=f"accumulation with {'baseline' if method == 'edit' else 'edit'}")
    one, acc = _machineries(method, k)
    state = one.init_state(0)
    for i in range(2):  # replicas apart (EDiT: local steps), so that the sync has work to do
        state, _ = one.step_fn(kinds[0])(state, one.put_batch(_batch(one.cfg, i)))
    start = jax.device_get(state)
    for kind in kinds:
        batch = _batch(one.cfg, 10)
        a, ma = jax.device_get(one.step_fn(kind)(jax.device_put(start, one.state_shardings), one.put_batch(batch)))
        b, mb = jax.device_get(acc.step_fn(kind)(jax.device_put(start, acc.state_shardings), acc.put_batch(batch)))
        np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-5)
        np.testing.assert_allclose(mb["grad_norm"], ma["grad_norm"], rtol=1e-4)
        _close(b.params, a.params, f"{kind} params")
        _close(b.opt_state, a.opt_state, f"{kind} AdamW state", atol=1e-9)
        if kind == "sync_forward":
            _close(b.outer.params, a.outer.params, "θ̄")
            assert int(b.outer.syncs) == int(a.outer.syncs) == int(start.outer.syncs) + 1  # one sync, not k
        # the step moved the params: the comparison is not of two unchanged states
        assert np.max(np.abs(a.params["root"]["embed"] - start.params["root"]["embed"])) > 1e-5


def test_grad_accum_must_split_each_devices_rows():
    cfg = tiny_config(2, 2, batch_size=8)  # 2 rows per device
    cfg.optim.grad_accum = 4
    with pytest.raises(ConfigError, match=r"optim.grad_accum.*2 sequences.*4 equal micro-batches"):
        validate(cfg)


def test_attention_kernel_choice_and_errors():
    m = tiny_config().model
    bf16 = dataclasses.replace(m, compute_dtype="bfloat16")
    assert attention_impl(m, "cpu") == "xla" and attention_impl(bf16, "cpu") == "xla"
    assert attention_impl(bf16, "gpu") == "cudnn" and attention_impl(m, "gpu") == "xla"  # fp32: no cuDNN
    assert attention_impl(dataclasses.replace(bf16, attention="xla"), "gpu") == "xla"
    with pytest.raises(AttentionError, match="model.attention=cudnn needs a GPU; this backend is cpu"):
        attention_impl(dataclasses.replace(bf16, attention="cudnn"), "cpu")
    cfg = tiny_config()
    cfg.model.attention = "flash"
    with pytest.raises(ConfigError, match="model.attention"):
        validate(cfg)
    cfg.model.attention = "cudnn"
    with pytest.raises(ConfigError, match="cudnn flash attention needs model.compute_dtype bfloat16"):
        validate(cfg)
    cfg.model.compute_dtype = "bfloat16"
    validate(cfg)
    with pytest.raises(ConfigError, match="needs a GPU"):  # on the CPU: before any work
        StepPrograms.for_config(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))


def test_chunked_loss_inside_the_sharded_step_equals_the_whole_one():
    """The same hsdp step with the loss in chunks of 8 positions (of 32) and at once: inside
    shard_map (where the scan's carry must be per-device) the losses and params agree."""
    one_stage("default", "the chunked loss in the sharded step", 15,
              other="test_model_loss_sum_never_holds_the_whole_logits")
    # AdamW's eps well above the gradients' float noise: with 1e-8 its first step is a sign
    # function, and an element whose gradient is ~0 flips with the summation order.
    whole = tiny_config(2, 2, model={"loss_chunk": 0}, optim={"eps": 1e-3})
    chunked = tiny_config(2, 2, model={"loss_chunk": 8}, optim={"eps": 1e-3})
    mesh = make_mesh(whole.mesh, jax.devices()[:4])
    a_m, b_m = StepPrograms.for_config(whole, mesh), StepPrograms.for_config(chunked, mesh)
    start = jax.device_get(a_m.init_state(0))
    batch = _batch(whole, 3)
    a, ma = jax.device_get(a_m.step_fn("hsdp")(jax.device_put(start, a_m.state_shardings), a_m.put_batch(batch)))
    b, mb = jax.device_get(b_m.step_fn("hsdp")(jax.device_put(start, b_m.state_shardings), b_m.put_batch(batch)))
    np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-6)
    _close(b.params, a.params, "params")
