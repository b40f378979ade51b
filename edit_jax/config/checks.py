"""What the config's fields say on their own (``check_fields``): finiteness, ranges, divisibility.
``edit_jax.validate`` runs it first, then each part's own rules (those that ask a part of the
package: this package imports none)."""

from __future__ import annotations

import dataclasses
import math
import os

from edit_jax.config.parse import require
from edit_jax.config.sections import COMPRESS, Config, ModelConfig

INT32 = 2 ** 31 - 1  # the largest count a step's program holds (int32: JAX runs with x64 off)


def _require_finite(obj, prefix: str = "") -> None:
    """Every float field is a finite number (inf / nan pass most range checks, e.g. lr > 0)."""
    for f in dataclasses.fields(obj):
        val, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(val):
            _require_finite(val, key + ".")
        elif f.metadata.get("registered"):  # sync.rule_sections: each a registered rule's section, sync.NAME
            for name, section in val.items():
                _require_finite(section, f"{prefix}{name}.")
        elif isinstance(val, float):
            require(math.isfinite(val), key, f"must be a finite number, got {val}")


def check_fields(cfg: Config) -> None:
    """Checks what the fields say on their own: finiteness, ranges, and divisibility (heads, batch,
    FSDP shards). The rules that ask a part of the package are that part's ``validate``
    (``edit_jax.validate`` runs this first, then them)."""
    m, mesh, d, o, s, sp = cfg.model, cfg.mesh, cfg.data, cfg.optim, cfg.sync, cfg.train.spike
    _require_finite(cfg)
    for key, val in [("steps", cfg.steps), ("batch_size", cfg.batch_size),
                     ("model.n_layers", m.n_layers), ("model.vocab_size", m.vocab_size), ("mesh.replica", mesh.replica),
                     ("mesh.shard", mesh.shard), ("data.seq_len", d.seq_len), ("log_every", cfg.log_every),
                     ("eval_batches", cfg.eval_batches), ("sync.tau", s.tau),
                     ("keep_checkpoints", cfg.keep_checkpoints), ("data.unit_bytes", d.unit_bytes),
                     ("train.spike.window", sp.window), ("train.spike.mads", sp.mads),
                     ("train.spike.margin", sp.margin)]:
        require(val > 0, key, f"must be positive, got {val}")
    for key, val in [("eval_every", cfg.eval_every), ("checkpoint_every", cfg.checkpoint_every),
                     ("optim.warmup_steps", o.warmup_steps), ("optim.decay_steps", o.decay_steps),
                     ("optim.weight_decay", o.weight_decay), ("optim.grad_clip", o.grad_clip),
                     ("sync.warmup_steps", s.warmup_steps), ("log.peak_tflops", cfg.log.peak_tflops),
                     ("train.spike.patience", sp.patience), ("train.spike.max_rollbacks", sp.max_rollbacks)]:
        require(val >= 0, key, f"must be >= 0, got {val}")
    for key, val in [("steps", cfg.steps), ("optim.warmup_steps", o.warmup_steps), ("optim.decay_steps", o.decay_steps),
                     ("sync.warmup_steps", s.warmup_steps), ("sync.tau", s.tau)]:  # (JAX's integers: x64 is off)
        require(val <= INT32, key, f"steps are counted in int32 on the device: expected at most 2^31 - 1, got {val}")
    for key, val, allowed in [("model.compute_dtype", m.compute_dtype, ("float32", "bfloat16", "float16")),
                              ("sync.wire.kind", s.wire.kind, COMPRESS),
                              ("sync.outer_sharding", s.outer_sharding, ("shard", "replica_shard"))]:
        require(val in allowed, key, f"expected one of {', '.join(allowed)}, got {val!r}")
    if isinstance(m, ModelConfig):  # (another family checks its own fields: its module's validate)
        _check_llama(m, mesh.shard)
    require(o.grad_accum > 0, "optim.grad_accum", f"must be positive, got {o.grad_accum}")
    require(o.grad_accum == 1 or cfg.batch_size % (mesh.replica * mesh.shard * o.grad_accum) == 0, "optim.grad_accum",
            f"each device's {cfg.batch_size // max(mesh.replica * mesh.shard, 1)} sequences (batch_size "
            f"{cfg.batch_size} / mesh.replica x mesh.shard = {mesh.replica * mesh.shard}) must split into "
            f"{o.grad_accum} equal micro-batches")
    workers = mesh.replica * mesh.shard
    require(cfg.batch_size % workers == 0, "batch_size",
            f"global batch {cfg.batch_size} must be divisible by mesh.replica x mesh.shard = "
            f"{mesh.replica} x {mesh.shard} = {workers}")
    require(0.0 < d.val_fraction < 1.0, "data.val_fraction", f"must be in (0, 1), got {d.val_fraction}")
    require(o.lr > 0, "optim.lr", f"must be positive, got {o.lr}")
    require(cfg.max_seconds >= 0, "max_seconds", f"must be >= 0 (0: no time limit), got {cfg.max_seconds}")
    require(0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    require(0.0 <= o.b1 < 1.0, "optim.b1", f"must be in [0, 1), got {o.b1}")
    require(0.0 <= o.b2 < 1.0, "optim.b2", f"must be in [0, 1), got {o.b2}")
    o = s.outer
    require(0.0 <= o.b2 < 1.0, "sync.outer.b2", f"must be in [0, 1), got {o.b2}")
    require(o.lr > 0, "sync.outer.lr", f"must be positive, got {o.lr}")
    require(0.0 <= o.momentum < 1.0, "sync.outer.momentum", f"must be in [0, 1), got {o.momentum}")
    p = s.penalty
    require(0.0 < p.anomaly_alpha <= 1.0, "sync.penalty.anomaly_alpha", f"must be in (0, 1], got {p.anomaly_alpha}")
    require(p.anomaly_warmup >= 2, "sync.penalty.anomaly_warmup",
            f"must be >= 2 (the z-score window needs an unbiased std), got {p.anomaly_warmup}")
    require(p.anomaly_threshold > 0, "sync.penalty.anomaly_threshold", f"must be positive, got {p.anomaly_threshold}")
    require(p.temperature > 0, "sync.penalty.temperature", f"must be positive, got {p.temperature}")
    require(p.clip_threshold > 0, "sync.penalty.clip_threshold", f"must be positive, got {p.clip_threshold}")
    x = s.exchange
    require(x.patience >= 0, "sync.exchange.patience", f"must be >= 0 seconds (0: no retry), got {x.patience}")
    require(x.grace > 0, "sync.exchange.grace", f"must be positive (seconds a round waits for posts), got {x.grace}")
    require(x.late_posts in ("carry", "drop"), "sync.exchange.late_posts",
            f"expected carry or drop, got {x.late_posts!r}")
    require(x.progress_every >= 0, "sync.exchange.progress_every",
            f"must be >= 0 seconds (0: off), got {x.progress_every}")
    require(0.0 <= x.carried_weight <= 1.0, "sync.exchange.carried_weight",
            f"must be in [0, 1] (1: carried steps count as fresh ones), got {x.carried_weight}")
    require(not x.progress_every or x.url, "sync.exchange.progress_every",
            "saves an exchange worker's unposted steps: set sync.exchange.url too, or 0")
    require(s.fragments >= 1, "sync.fragments", f"must be >= 1, got {s.fragments}")
    require(s.tau % s.fragments == 0, "sync.fragments", f"must divide sync.tau={s.tau}, got {s.fragments}")
    require(s.fragments <= 1 + m.n_layers, "sync.fragments",
            f"must be <= the number of units (1 + model.n_layers = {1 + m.n_layers}), got {s.fragments}")
    _check_compile_cache(cfg.train.compile_cache)
    require(s.wire.kind == "none" or s.outer_sharding == "shard", "sync.wire.kind",
            f"{s.wire.kind!r} needs sync.outer_sharding='shard' (with 'replica_shard' the exchange moves θ_i, not "
            "the pseudo gradient)")


def _check_llama(m: ModelConfig, shard: int) -> None:
    """The "llama" family's own fields: sizes, heads, kernels."""
    for key, val in [("model.d_model", m.d_model), ("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                     ("model.ffn_dim", m.ffn_dim), ("model.scan_unroll", m.scan_unroll)]:
        require(val > 0, key, f"must be positive, got {val}")
    require(m.d_model % m.n_heads == 0, "model.n_heads", f"must divide model.d_model={m.d_model}, got {m.n_heads}")
    require(m.head_dim % 2 == 0, "model.n_heads",
            f"head dim d_model/n_heads={m.head_dim} must be even for rotary embeddings")
    require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
            f"must divide model.n_heads={m.n_heads}, got {m.n_kv_heads}")
    for key, val, allowed in [("model.remat_saves", m.remat_saves, ("nothing", "dots", "dots_attention")),
                              ("model.attention", m.attention, ("auto", "xla", "cudnn"))]:
        require(val in allowed, key, f"expected one of {', '.join(allowed)}, got {val!r}")
    require(m.attention != "cudnn" or m.compute_dtype in ("bfloat16", "float16"), "model.attention",
            f"cudnn flash attention needs model.compute_dtype bfloat16 or float16, got {m.compute_dtype!r} "
            "(use attention=auto or xla)")
    require(m.loss_chunk >= 0, "model.loss_chunk", f"must be >= 0 (0: the whole sequence), got {m.loss_chunk}")
    # Every parameter is FSDP-sharded over `shard` along one of its dims (see sharding.py).
    for key, dim in [("model.d_model", m.d_model), ("model.ffn_dim", m.ffn_dim), ("model.vocab_size", m.vocab_size)]:
        require(dim % shard == 0, key, f"must be divisible by mesh.shard={shard} (FSDP shards it), got {dim}")


def _check_compile_cache(value: str) -> None:
    key = "train.compile_cache"
    require("\x00" not in value and "\n" not in value and value == value.strip(), key,
            f"expected auto, off or a directory path, got {value!r}")
    if value not in ("", "auto", "off") and os.path.exists(value):
        require(os.path.isdir(value), key,
                f"{value!r} exists and is not a directory (expected auto, off or a directory)")


__all__ = ["check_fields", "INT32"]
