"""Model shapes, causal masking, rotary and GQA, against hand-written NumPy where it matters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.models import llama as M


@pytest.fixture(scope="module")
def tiny():
    cfg = M.preset("tiny")
    return cfg, M.init_params(cfg, jax.random.key(0))


def test_param_shapes_stacked(tiny):
    cfg, params = tiny
    L, d, f, hd = cfg.n_layers, cfg.d_model, cfg.ffn_dim, cfg.head_dim
    layers = params["layers"]
    assert layers["attn"]["wq"].shape == (L, d, cfg.n_heads * hd)
    assert layers["attn"]["wk"].shape == (L, d, cfg.n_kv_heads * hd)  # grouped-query: fewer K/V heads
    assert layers["mlp"]["w_gate"].shape == (L, d, f)
    assert layers["attn_norm"]["scale"].shape == (L, d)
    assert params["root"]["embed"].shape == (cfg.vocab_size, d)
    assert params["root"]["lm_head"].shape == (d, cfg.vocab_size)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tied = M.init_params(M.preset("tiny", tie_embeddings=True), jax.random.key(0))
    assert "lm_head" not in tied["root"]


def test_logits_shape_and_causality(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    logits, _ = M.forward(cfg, params, tokens)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    # Changing token t must not change logits at positions < t, and must change position t.
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    logits2, _ = M.forward(cfg, params, changed)
    np.testing.assert_array_equal(np.asarray(logits[:, :10]), np.asarray(logits2[:, :10]))
    assert not np.allclose(np.asarray(logits[:, 10:]), np.asarray(logits2[:, 10:]))


def test_rotary_matches_numpy():
    x = np.random.default_rng(0).normal(size=(1, 5, 2, 8)).astype(np.float32)
    theta = 10000.0
    out = np.asarray(M.rotary(jnp.asarray(x), theta))
    half = 4
    freqs = 1.0 / theta ** (np.arange(half) / half)
    ref = np.empty_like(x)
    for t in range(5):
        a = t * freqs
        x1, x2 = x[0, t, :, :half], x[0, t, :, half:]
        ref[0, t, :, :half] = x1 * np.cos(a) - x2 * np.sin(a)
        ref[0, t, :, half:] = x2 * np.cos(a) + x1 * np.sin(a)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    # Rotation preserves norms, and relative position is what matters in q.k.
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_attention_matches_numpy_gqa():
    cfg = M.preset("tiny")  # 4 query heads, 2 K/V heads
    params = M.init_params(cfg, jax.random.key(2))
    attn = jax.tree.map(lambda x: x[0], params["layers"])["attn"]
    x = np.random.default_rng(1).normal(size=(1, 6, cfg.d_model)).astype(np.float32)
    out = np.asarray(M.Attention(cfg).apply({"params": attn}, jnp.asarray(x)))
    hd, H, KV = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q = np.asarray(M.rotary(jnp.asarray((x @ np.asarray(attn["wq"])).reshape(1, 6, H, hd)), cfg.rope_theta))
    k = np.asarray(M.rotary(jnp.asarray((x @ np.asarray(attn["wk"])).reshape(1, 6, KV, hd)), cfg.rope_theta))
    v = (x @ np.asarray(attn["wv"])).reshape(1, 6, KV, hd)
    ys = []
    for h in range(H):
        g = h // (H // KV)  # query head h reads K/V head h // group
        s = q[0, :, h] @ k[0, :, g].T / np.sqrt(hd)
        s = np.where(np.tril(np.ones((6, 6), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ys.append(p @ v[0, :, g])
    ref = np.concatenate(ys, axis=-1) @ np.asarray(attn["wo"])
    np.testing.assert_allclose(out[0], ref, rtol=2e-4, atol=2e-5)


def test_loss_is_log_vocab_at_init_scale(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, 256)
    logits, _ = M.forward(cfg, params, tokens[:, :-1])
    mean = float(M.token_loss_sum(logits, tokens[:, 1:])) / (2 * 16)
    assert abs(mean - np.log(cfg.vocab_size)) < 0.1  # small init: near-uniform predictions


def test_bf16_compute_close_to_fp32(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, 256)
    a, _ = M.forward(cfg, params, tokens)
    b, _ = M.forward(M.preset("tiny", compute_dtype="bfloat16"), params, tokens)
    assert b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0.05)


def test_hook_sees_every_unit_in_order(tiny):
    cfg, params = tiny
    seen = []

    def hook(unit, xs, which):
        seen.append(which)
        return unit, xs

    xs = {"root": jnp.float32(7.0), "layers": jnp.arange(cfg.n_layers, dtype=jnp.float32)}
    _, ys = M.forward(cfg, params, jnp.zeros((1, 4), jnp.int32), hook, xs)
    assert seen[0] == "root" and "layer" in seen  # the scan traces the layer hook once
    np.testing.assert_array_equal(np.asarray(ys["layers"]), np.arange(cfg.n_layers))
    assert float(ys["root"]) == 7.0
