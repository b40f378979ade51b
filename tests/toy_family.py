"""A model family written outside the library, for ``test_model_family.py``: what a new family is
(``models/family.py``'s contract and a config class of its own), nothing of the Llama family's. A
residual MLP over each token's embedding mixed with the previous token's (causal): root
``{"embed": [V, d], "head": [d, V]}``, layers ``{"w_in": [L, d, f], "w_out": [L, f, d]}`` stacked,
every unit through the hook, the layers in a scan (segment by segment for the streaming sync).
Registered with one line: ``family.register("toy", "tests.toy_family", ToyConfig)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from edit_jax.config import ConfigError, FamilyConfig


@dataclass
class ToyConfig(FamilyConfig):
    """The toy family's model section: ``model.width`` and ``model.hidden`` beside every family's fields."""

    STRUCTURAL: ClassVar[tuple[str, ...]] = (*FamilyConfig.STRUCTURAL, "width", "hidden")

    width: int = 64  # the residual stream
    hidden: int = 128  # each layer's MLP
    mix: float = 0.5  # how much of the previous token's embedding joins each position's


def validate(cfg) -> None:
    """The family's own fields (``models.family.validate`` calls it before any work)."""
    for key in ("width", "hidden"):
        value = getattr(cfg.model, key)
        if value <= 0 or value % cfg.mesh.shard:
            raise ConfigError(f"config key 'model.{key}': must be a positive multiple of mesh.shard="
                              f"{cfg.mesh.shard} (FSDP shards it), got {value}")


def init_params(cfg: ToyConfig, key: jax.Array) -> dict:
    k = jax.random.split(key, 4)
    d, f, v, n = cfg.width, cfg.hidden, cfg.vocab_size, cfg.n_layers
    return {"root": {"embed": 0.02 * jax.random.normal(k[0], (v, d)), "head": 0.02 * jax.random.normal(k[1], (d, v))},
            "layers": {"w_in": jax.random.normal(k[2], (n, d, f)) / d ** 0.5,
                       "w_out": jnp.zeros((n, f, d), jnp.float32)}}


def forward(cfg: ToyConfig, params: dict, tokens: jax.Array, hook, hook_xs=None, layer_segments=None):
    xs = hook_xs if hook_xs is not None else {"root": None, "layers": None}
    root, root_ys = hook(params["root"], xs["root"], "root")
    x = jnp.take(root["embed"], tokens, axis=0)
    x = x + cfg.mix * jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # the previous token's (causal)

    def layer(x, unit):
        p, unit_xs = unit
        p, ys = hook(p, unit_xs, "layer")
        return x + jnp.tanh(x @ p["w_in"]) @ p["w_out"], ys

    segments = layer_segments if layer_segments is not None else [(cfg.n_layers, xs["layers"])]
    layer_ys, start = [], 0
    for n, seg_xs in segments:
        if n == 0:
            layer_ys.append(None)
            continue
        seg = jax.tree.map(lambda p: p[start:start + n], params["layers"])  # noqa: B023 - called at once
        x, ys = jax.lax.scan(layer, x, (seg, seg_xs))
        layer_ys.append(ys)
        start += n
    return x @ root["head"], {"root": root_ys, "layers": layer_ys[0] if layer_segments is None else layer_ys}


def token_loss_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def flops_per_token(cfg: ToyConfig, seq_len: int) -> float:
    del seq_len
    return 6.0 * (cfg.width * cfg.vocab_size + 2 * cfg.n_layers * cfg.width * cfg.hidden)
