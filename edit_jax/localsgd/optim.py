"""Inner optimizer: clip by the replica's global gradient norm -> AdamW, warmup + cosine decay.

The chain runs under ``shard_map`` on FSDP blocks, so the global norm is a ``psum`` over
``shard`` of the blocks' squared norms: the norm of this replica's whole gradient (replicas may
hold different gradients between syncs; a norm over all of them would couple them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from edit_jax.config import OptimConfig
from edit_jax.localsgd.sharding import shard_sq_norm


def _lr_shape(cfg: OptimConfig, total_steps: int) -> tuple[int, int]:
    """(warmup steps, decay end): the schedule's two breakpoints."""
    decay = cfg.decay_steps or total_steps
    warmup = min(cfg.warmup_steps, max(decay - 1, 0))
    return warmup, max(decay, warmup + 1)


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup, decay = _lr_shape(cfg, total_steps)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, decay, end_value=cfg.lr * cfg.min_lr_ratio)


def host_lr(cfg: OptimConfig, total_steps: int, count: int) -> float:
    """``lr_schedule(cfg, total_steps)(count)`` in Python floats: for records, with no JAX op (each
    would dispatch, and compile at its first use, inside the loop). Linear warmup from 0 to
    ``lr`` over the warmup steps, then a cosine from ``lr`` to ``lr * min_lr_ratio`` until the decay
    end, constant after (optax's ``warmup_cosine_decay_schedule``; float64 here, float32 there)."""
    warmup, decay = _lr_shape(cfg, total_steps)
    if count < warmup:
        return cfg.lr * max(count, 0) / warmup
    t = min(count - warmup, decay - warmup) / (decay - warmup)
    alpha = cfg.min_lr_ratio if cfg.lr else 0.0
    return cfg.lr * ((1.0 - alpha) * 0.5 * (1.0 + math.cos(math.pi * t)) + alpha)


def clip_by_sharded_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm for FSDP blocks: the norm is taken over the whole replica."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        norm = jnp.sqrt(shard_sq_norm(updates))
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(init, update)


def decay_mask(params):
    """Weight decay on matrices only: not on norm scales (which are [L, d] once stacked)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in ("scale",) for k in path), params)


def inner_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = [clip_by_sharded_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


def with_step_counts(opt_state, step: int):
    """``opt_state`` with every optax step count (a leaf named ``count``) set to ``step``: the
    learning-rate schedule's position. Each count gets a buffer of its own (a host array, put on the
    devices by the caller: no JAX op, so nothing compiles inside the loop)."""
    def count(path, x):
        named_count = getattr(path[-1], "name", None) == "count" if path else False
        return np.full(np.shape(x), step, x.dtype) if named_count else x  # (host: the callers device_put it)
    return jax.tree_util.tree_map_with_path(count, opt_state)

