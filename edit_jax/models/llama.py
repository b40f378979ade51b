"""Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, causal (grouped-query) attention.

Flax modules define the math of one decoder layer and of the "root" pieces (embedding, final norm,
LM head). The stack of layers is a plain ``jax.lax.scan`` over parameters stacked along a leading
layer axis, and every unit's params pass through one ``hook`` on their way into compute:

    root params  -> hook -> embed ... final norm, LM head
    layer l      -> hook -> decoder layer l

In synchronous HSDP the hook all-gathers the unit's FSDP shards; in EDiT it first syncs the unit
with the other replicas (pseudo gradient, penalty, outer step) and then gathers. The hook may also
take a per-unit input (``hook_xs``, scanned with the layers) and return a per-unit output, which
is how the layer-wise sync threads its outer state through the forward pass.

Params tree: {"root": {"embed", "final_norm", ["lm_head"]}, "layers": {...stacked, leading L...}}.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from edit_jax.config import ConfigError, ModelConfig
from edit_jax.models.family import HOOK_SAVED, SplitHook, identity_hook

Params = Any
# hook(unit_params, unit_xs, which) -> (params ready for compute, unit_ys); which: "root" | "layer"
Hook = Callable[[Params, Any, str], tuple[Params, Any]]

PRESETS: dict[str, dict] = {
    # tiny: tests and the 8 x 8 CPU mesh; every dim divisible by 8 so any shard count <= 8 works.
    # The small stacks are unrolled (scan_unroll = n_layers): 10-19% off a demo step on CPU, no
    # per-layer slicing and stacking copies (docs/benchmarks/step-time.md); compiles stay short.
    "tiny": dict(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, scan_unroll=2),
    # demo: the README's main job on 8 CPU devices, a few minutes on 2 cores.
    "demo": dict(vocab_size=320, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, scan_unroll=4),
    # The paper's sizes (Llama shapes; vocab of the Llama tokenizer).
    "350m": dict(vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=16, ffn_dim=2816),
    "1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632),
    "3b": dict(vocab_size=32000, d_model=3200, n_layers=26, n_heads=32, n_kv_heads=32, ffn_dim=8640),
    "7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def _dense_init(std: float):
    return nn.initializers.normal(stddev=std)


class RMSNorm(nn.Module):
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array, theta: float, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half convention).
    ``positions`` ([seq]; default 0..seq-1) are the tokens' absolute positions (KV-cache decode)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    positions = jnp.arange(seq) if positions is None else positions
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [seq, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class AttentionError(ConfigError):
    """``model.attention`` asks for a kernel this backend does not have (a config error)."""


def attention_impl(cfg: ModelConfig, backend: str | None = None) -> str:
    """The kernel of ``model.attention`` on ``backend`` (default: JAX's): "auto" is cuDNN's flash
    attention on GPU in bf16 / fp16 with head dims it takes (<= 128, multiple of 8), else XLA's."""
    backend = backend or jax.default_backend()
    if cfg.attention == "cudnn":
        if backend != "gpu":
            raise AttentionError(f"model.attention=cudnn needs a GPU; this backend is {backend} (use auto or xla)")
        return "cudnn"
    if cfg.attention == "auto" and backend == "gpu" and cfg.compute_dtype in ("bfloat16", "float16") \
            and cfg.head_dim <= 128 and cfg.head_dim % 8 == 0:
        return "cudnn"
    return "xla"


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        hd, init = c.head_dim, _dense_init(c.init_std)
        # Output projection scaled down with depth (GPT-2 style) to keep the residual stream stable.
        out_init = _dense_init(c.init_std / (2 * c.n_layers) ** 0.5)
        wq = self.param("wq", init, (c.d_model, c.n_heads * hd))
        wk = self.param("wk", init, (c.d_model, c.n_kv_heads * hd))
        wv = self.param("wv", init, (c.d_model, c.n_kv_heads * hd))
        wo = self.param("wo", out_init, (c.n_heads * hd, c.d_model))
        b, t, _ = x.shape
        q = (x @ wq.astype(x.dtype)).reshape(b, t, c.n_heads, hd)
        k = (x @ wk.astype(x.dtype)).reshape(b, t, c.n_kv_heads, hd)
        v = (x @ wv.astype(x.dtype)).reshape(b, t, c.n_kv_heads, hd)
        q, k = rotary(q, c.rope_theta), rotary(k, c.rope_theta)
        # Grouped-query attention: dot_product_attention repeats K/V heads over query groups.
        # "auto" is resolved here for JAX's default backend; the step programs resolve it for their
        # mesh's devices first (a GPU target compiled from a CPU process), passing "cudnn" or "xla".
        impl = c.attention if c.attention == "cudnn" else attention_impl(c)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return y.reshape(b, t, c.n_heads * hd) @ wo.astype(x.dtype)


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        init, out_init = _dense_init(c.init_std), _dense_init(c.init_std / (2 * c.n_layers) ** 0.5)
        w_gate = self.param("w_gate", init, (c.d_model, c.ffn_dim))
        w_up = self.param("w_up", init, (c.d_model, c.ffn_dim))
        w_down = self.param("w_down", out_init, (c.ffn_dim, c.d_model))
        h = jax.nn.silu(x @ w_gate.astype(x.dtype)) * (x @ w_up.astype(x.dtype))
        return h @ w_down.astype(x.dtype)


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.cfg, name="attn")(RMSNorm(self.cfg.norm_eps, name="attn_norm")(x))
        return x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg.norm_eps, name="mlp_norm")(x))


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Full (unsharded) fp32 params with the decoder layers stacked along a leading axis."""
    k_embed, k_head, k_layers = jax.random.split(key, 3)
    dummy = jnp.zeros((1, 1, cfg.d_model), jnp.float32)
    layer_keys = jax.random.split(k_layers, cfg.n_layers)
    plain = dataclasses.replace(cfg, attention="xla")  # the params do not depend on the kernel
    layers = jax.vmap(lambda k: DecoderLayer(plain).init(k, dummy)["params"])(layer_keys)
    root = {
        "embed": cfg.init_std * jax.random.normal(k_embed, (cfg.vocab_size, cfg.d_model), jnp.float32),
        "final_norm": {"scale": jnp.ones((cfg.d_model,), jnp.float32)},
    }
    if not cfg.tie_embeddings:
        root["lm_head"] = cfg.init_std * jax.random.normal(k_head, (cfg.d_model, cfg.vocab_size), jnp.float32)
    return {"root": root, "layers": layers}


def _saves_attention(prim, *_, **__) -> bool:
    # cuDNN's fused attention: its forward primitive returns the output and the softmax statistics,
    # the residuals its backward kernel needs (saving the output alone would still rerun the kernel).
    # XLA's attention is plain dots and a softmax: not saved here (its [seq, seq] scores are huge).
    return prim.name.startswith("dot_product_attention_fwd")


def remat_policy(cfg: ModelConfig, base: Callable) -> Callable:
    """The checkpoint policy of a rematerialised layer: ``base`` (what the caller must keep, e.g.
    the sync's outputs) and what ``model.remat_saves`` adds. "dots" keeps every matmul with no batch
    dimension (the q / k / v / o and MLP projections: the attention's own dots have batch dims), so
    the backward reruns only the attention and the elementwise ops; "dots_attention" keeps cuDNN's
    attention too."""
    policies = jax.checkpoint_policies
    if cfg.remat_saves == "nothing":
        return base
    extra = policies.dots_with_no_batch_dims_saveable
    if cfg.remat_saves == "dots_attention":
        extra = policies.save_from_both_policies(extra, _saves_attention)
    return policies.save_from_both_policies(base, extra)


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array, hook: Hook = identity_hook,
            hook_xs: Any = None, layer_segments: Any = None) -> tuple[jax.Array, Any]:
    """Logits [batch, seq, vocab] (fp32) for int tokens [batch, seq], and the hook's outputs
    (``forward_hidden``, then the LM head)."""
    x, head, ys = forward_hidden(cfg, params, tokens, hook, hook_xs, layer_segments)
    return jnp.dot(x, head, preferred_element_type=jnp.float32), ys


def loss_sum(cfg: ModelConfig, params: Params, tokens: jax.Array, targets: jax.Array, hook: Hook = identity_hook,
             hook_xs: Any = None, layer_segments: Any = None) -> tuple[jax.Array, Any]:
    """Sum of next-token cross-entropy of ``targets`` after ``tokens`` (fp32), and the hook's
    outputs: ``forward`` then ``token_loss_sum``, with the logits made ``model.loss_chunk``
    positions at a time (``chunked_loss_sum``)."""
    x, head, ys = forward_hidden(cfg, params, tokens, hook, hook_xs, layer_segments)
    return chunked_loss_sum(x, head, targets, cfg.loss_chunk), ys


def chunked_loss_sum(x: jax.Array, head: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """``token_loss_sum(x @ head, targets)`` for final hidden states x [batch, seq, d], with the
    fp32 logits of ``chunk`` positions alive at a time: a scan over the sequence's chunks whose
    body is rematerialised, so the backward pass recomputes each chunk's logits instead of
    keeping them all (the same sum, up to float addition order). ``chunk`` 0 or >= seq: at once."""
    t = x.shape[1]
    if not chunk or chunk >= t:
        return token_loss_sum(jnp.dot(x, head, preferred_element_type=jnp.float32), targets)

    @jax.checkpoint
    def piece(x_c, t_c):
        return token_loss_sum(jnp.dot(x_c, head, preferred_element_type=jnp.float32), t_c)

    n = t // chunk
    b, d = x.shape[0], x.shape[2]
    x_chunks = x[:, :n * chunk].reshape(b, n, chunk, d).swapaxes(0, 1)
    t_chunks = targets[:, :n * chunk].reshape(b, n, chunk).swapaxes(0, 1)
    # The carry starts from the first chunk's sum (not a zero): inside shard_map it then has the
    # per-device ("varying") type of every later sum.
    total, _ = jax.lax.scan(lambda acc, ct: (acc + piece(*ct), None), piece(x_chunks[0], t_chunks[0]),
                            (x_chunks[1:], t_chunks[1:]))
    if n * chunk < t:  # the last, shorter chunk
        total = total + piece(x[:, n * chunk:], targets[:, n * chunk:])
    return total


def forward_hidden(cfg: ModelConfig, params: Params, tokens: jax.Array, hook: Hook = identity_hook,
                   hook_xs: Any = None, layer_segments: Any = None) -> tuple[jax.Array, jax.Array, Any]:
    """(final hidden states [batch, seq, d] after the final norm, the LM head [d, vocab], both in
    the compute dtype, the hook's outputs) for int tokens [batch, seq].

    ``hook_xs`` is ``{"root": ..., "layers": ...}`` (the layers' entry scanned with the layers)
    or None; the returned ys have the same layout.

    ``layer_segments`` (streaming sync): a list of ``(n, xs)`` covering the layers in order; the
    stack is then scanned segment by segment, the layers of a segment with its own ``xs`` (None
    for a segment that only gathers), and ``ys["layers"]`` is the list of the segments' ys (None for an empty one).
    """
    dtype = jnp.dtype(cfg.compute_dtype)
    xs = hook_xs if hook_xs is not None else {"root": None, "layers": None}
    # The root unit passes the hook first (EDiT syncs it before any layer).
    root, root_ys = hook(params["root"], xs["root"], "root")
    x = jnp.take(root["embed"], tokens, axis=0).astype(dtype)

    def layer_step(x, layer):
        layer_params, layer_xs = layer
        full, ys = hook(layer_params, layer_xs, "layer")
        return DecoderLayer(cfg).apply({"params": full}, x), ys

    if cfg.remat:  # recompute the layer in the backward, but not what the hook named HOOK_SAVED (the sync)
        layer_step = jax.checkpoint(layer_step, prevent_cse=False, policy=remat_policy(
            cfg, jax.checkpoint_policies.save_only_these_names(HOOK_SAVED)))
    pipelined = isinstance(hook, SplitHook)  # the layers that sync: each sync one layer ahead
    segments = layer_segments if layer_segments is not None else [(cfg.n_layers, xs["layers"])]
    layer_ys, start = [], 0
    for n, seg_xs in segments:
        if n == 0:  # an empty segment: no loop at all in the program
            layer_ys.append(None)
            continue
        seg = params["layers"] if layer_segments is None else \
            jax.tree.map(lambda p: p[start:start + n], params["layers"])  # noqa: B023 - called at once
        if pipelined and seg_xs is not None:
            x, ys = _pipelined_layers(cfg, hook, x, seg, seg_xs)
        else:
            x, ys = jax.lax.scan(layer_step, x, (seg, seg_xs), unroll=min(cfg.scan_unroll, n))
        layer_ys.append(ys)
        start += n
    if layer_segments is None:
        layer_ys = layer_ys[0]
    x = RMSNorm(cfg.norm_eps).apply({"params": root["final_norm"]}, x)
    head = root["embed"].T if cfg.tie_embeddings else root["lm_head"]
    return x, head.astype(dtype), {"root": root_ys, "layers": layer_ys}


def _pipelined_layers(cfg: ModelConfig, hook: SplitHook, x: jax.Array, layers: Params, layer_xs: Any):
    """``(x, ys)`` after the layers ``layers`` [n, ...] that all sync (``layer_xs`` their hook
    inputs), each layer's sync issued one layer ahead (software pipelining): layer 0's before the
    loop, then iteration l computes layer l from the synced shard carried in and syncs layer l+1.
    That sync depends on nothing layer l computes, so XLA:GPU's scheduler can run its all-reduce
    across ``replica`` under layer l's GEMMs and attention (one sync of a unit inside its own
    iteration cannot: the layer's compute needs its result). The same values as ``hook`` per layer."""
    n = jax.tree.leaves(layers)[0].shape[0]

    def at(i):  # layer i's params and hook inputs, read in place (a slice [1:] would copy them)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), (layers, layer_xs))

    def compute(synced, x):
        return DecoderLayer(cfg).apply({"params": hook.gather(synced, "layer")}, x)

    in_loop = last = compute
    if cfg.remat:  # the synced shard is an argument: remat keeps it and recomputes the gather and layer
        policy = remat_policy(cfg, jax.checkpoint_policies.nothing_saveable)
        in_loop = jax.checkpoint(compute, prevent_cse=False, policy=policy)
        last = jax.checkpoint(compute, policy=policy)  # outside a loop CSE
        # would merge the recomputation with the forward and keep the layer's activations

    synced, ys0 = hook.sync(*at(0), "layer")
    # The sync outputs go into [n, ...] buffers carried through the loop and updated in place:
    # stacked by the scan after layer 0's, they would be copied to join them.
    ys = jax.tree.map(lambda a: jnp.zeros((n,) + a.shape, a.dtype).at[0].set(a), ys0)

    def step(carry, i):
        x, synced, ys = carry
        x = in_loop(synced, x)
        synced_next, y = hook.sync(*at(i), "layer")
        ys = jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, i, 0), ys, y)
        return (x, synced_next, ys), None

    (x, synced, ys), _ = jax.lax.scan(step, (x, synced, ys), jnp.arange(1, n, dtype=jnp.int32),
                                      unroll=max(1, min(cfg.scan_unroll, n - 1)))
    return last(synced, x), ys


def token_loss_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Sum of next-token cross-entropy over all positions (fp32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def count_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x params in matmuls + attention scores (PaLM appendix B)."""
    hd = cfg.head_dim
    per_layer = cfg.d_model * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.d_model * cfg.ffn_dim
    matmul_params = cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def causal_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """``flops_per_token`` with the attention scores counted for the causal half only (the work a
    causal kernel does; MaxText's count): the PaLM count overstates it by ~14% at 1B, seq 4096."""
    return flops_per_token(cfg, seq_len) - 6.0 * cfg.n_layers * cfg.d_model * seq_len
