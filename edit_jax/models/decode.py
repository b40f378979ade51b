"""The decoder's forward with a key/value cache, for sampling one token at a time.

``forward_cached(cfg, params, tokens, cache, pos)`` runs tokens [batch, t] that sit at absolute
positions ``pos .. pos + t - 1``: it writes their keys and values into the cache at those
positions and attends over every cached position up to each token's own (causal). Prefill is a
call with the prompt at ``pos = 0``; a decode step is a call with one token at ``pos = n``.

The layers are the training model's (``model.RMSNorm``, ``model.MLP``, ``model.rotary``) under the
same parameter names, so the params tree of ``model.init_params`` / a checkpoint applies as it is;
only attention differs (it reads keys and values from the cache). ``model.forward`` is unchanged.
The test in tests/test_sample.py checks that cached and uncached logits agree.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from edit_jax.config import ModelConfig
from edit_jax.models.llama import MLP, Params, RMSNorm, rotary


class KVCache(NamedTuple):
    k: jax.Array  # [layers, batch, length, kv_heads, head_dim]
    v: jax.Array


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.compute_dtype)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class CachedAttention(nn.Module):
    """``model.Attention``'s math (same params: wq, wk, wv, wo) with keys/values from a cache."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cache_k, cache_v, pos):
        c = self.cfg
        hd, zeros = c.head_dim, nn.initializers.zeros  # params always come from a trained tree
        wq = self.param("wq", zeros, (c.d_model, c.n_heads * hd))
        wk = self.param("wk", zeros, (c.d_model, c.n_kv_heads * hd))
        wv = self.param("wv", zeros, (c.d_model, c.n_kv_heads * hd))
        wo = self.param("wo", zeros, (c.n_heads * hd, c.d_model))
        b, t, _ = x.shape
        positions = pos + jnp.arange(t)
        q = (x @ wq.astype(x.dtype)).reshape(b, t, c.n_heads, hd)
        k = (x @ wk.astype(x.dtype)).reshape(b, t, c.n_kv_heads, hd)
        v = (x @ wv.astype(x.dtype)).reshape(b, t, c.n_kv_heads, hd)
        q, k = rotary(q, c.rope_theta, positions), rotary(k, c.rope_theta, positions)
        # The caller keeps pos + t <= cache length (dynamic_update_slice would clamp the start).
        cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, pos, 0, 0))
        cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, pos, 0, 0))
        # Causal over absolute positions; slots past the newest token hold stale or zero entries.
        mask = jnp.arange(cache_k.shape[1])[None, :] <= positions[:, None]  # [t, length]
        y = jax.nn.dot_product_attention(q, cache_k.astype(x.dtype), cache_v.astype(x.dtype),
                                         mask=mask[None, None])
        return y.reshape(b, t, c.n_heads * hd) @ wo.astype(x.dtype), cache_k, cache_v


class CachedDecoderLayer(nn.Module):
    """``model.DecoderLayer`` with a cached attention (same submodule names)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cache_k, cache_v, pos):
        h, cache_k, cache_v = CachedAttention(self.cfg, name="attn")(
            RMSNorm(self.cfg.norm_eps, name="attn_norm")(x), cache_k, cache_v, pos)
        x = x + h
        return x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg.norm_eps, name="mlp_norm")(x)), cache_k, cache_v


def forward_cached(cfg: ModelConfig, params: Params, tokens: jax.Array, cache: KVCache,
                   pos: jax.Array | int) -> tuple[jax.Array, KVCache]:
    """Logits [batch, t, vocab] (fp32) of tokens [batch, t] at positions pos.., and the updated cache."""
    dtype = jnp.dtype(cfg.compute_dtype)
    root = params["root"]
    x = jnp.take(root["embed"], tokens, axis=0).astype(dtype)
    pos = jnp.asarray(pos, jnp.int32)

    def layer_step(x, xs):
        layer_params, ck, cv = xs
        x, ck, cv = CachedDecoderLayer(cfg).apply({"params": layer_params}, x, ck, cv, pos)
        return x, (ck, cv)

    x, (k, v) = jax.lax.scan(layer_step, x, (params["layers"], cache.k, cache.v))
    x = RMSNorm(cfg.norm_eps).apply({"params": root["final_norm"]}, x)
    head = root["embed"].T if cfg.tie_embeddings else root["lm_head"]
    logits = jnp.dot(x, head.astype(dtype), preferred_element_type=jnp.float32)
    return logits, KVCache(k, v)


__all__ = ["KVCache", "init_cache", "forward_cached"]
