"""Sizes XLA cannot address, refused before JAX sees them (``validate``, from ``family.validate``).

XLA computes an array's byte size as an int64: a shape whose bytes pass 2^63 - 1 aborts the whole
process in C++ at compile time ("overflow in static extent product", exit 134; ``plan`` and
``train`` with ``model.d_model=1000000000`` did, ``train`` after making its run dir). Here each of
the llama family's arrays (stacked over its layers, and over ``mesh.replica`` where a method keeps
one copy per worker), its largest activations and the whole state are sized in Python ints
(exact: no overflow) and checked against that limit, so an absurd size is one config error.

JAX runs with x64 off: a count it takes as a Python int becomes an int32 ("An overflow was
encountered while parsing an argument to a jitted computation", a traceback). The llama family's
are the token ids, the layer scan's length (``model.n_layers``) and a worker's tokens per step (the
loss's divisor); ``config.checks`` holds the step counts (``steps``, warmups, ``sync.tau``) to int32.
"""

from __future__ import annotations

import math

from edit_jax.config import Config, require
from edit_jax.config.checks import INT32  # token ids, the layer scan's length, a step's token count

LIMIT = 2 ** 63 - 1  # bytes: XLA's int64 sizes
ITEM = 4  # bytes of the widest element (fp32 params, optimizer state, logits)
STATE_COPIES = 6  # params, gradients, Adam's two moments, the outer params and momentum


def llama_arrays(cfg: Config) -> list[tuple[str, list[tuple[str, int]]]]:
    """Each array with its dims as (config key, size): the parameters (per worker copy) and the
    step's largest activations (global batch)."""
    m, d = cfg.model, cfg.data
    copies, layers = ("mesh.replica", cfg.mesh.replica), ("model.n_layers", m.n_layers)
    dm = ("model.d_model", m.d_model)
    head = m.d_model // max(m.n_heads, 1)
    tokens = [("batch_size", cfg.batch_size), ("data.seq_len", d.seq_len)]
    return [
        ("the embedding", [copies, ("model.vocab_size", m.vocab_size), dm]),
        ("each layer's attention projections", [copies, layers, dm, dm]),
        ("each layer's key / value projections", [copies, layers, dm, ("model.n_kv_heads", m.n_kv_heads * head)]),
        ("each layer's MLP projections", [copies, layers, dm, ("model.ffn_dim", m.ffn_dim)]),
        ("the logits", [*tokens, ("model.vocab_size", m.vocab_size)]),
        ("the MLP activations", [*tokens, ("model.ffn_dim", m.ffn_dim)]),
        ("the attention scores", [*tokens, ("model.n_heads", m.n_heads), ("data.seq_len", d.seq_len)]),
    ]


def llama_param_count(cfg: Config) -> int:
    """The llama family's parameters (one copy), exactly."""
    m = cfg.model
    kv = m.n_kv_heads * (m.d_model // max(m.n_heads, 1))
    layer = 2 * m.d_model * m.d_model + 2 * m.d_model * kv + 3 * m.d_model * m.ffn_dim + 2 * m.d_model
    root = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.d_model
    return root + m.n_layers * layer


def _sized(n: int) -> str:
    return f"{n:.3g}" if n >= 10 ** 6 else str(n)


def validate(cfg: Config) -> None:
    """Every array's bytes, and the whole state's, within XLA's int64 (``LIMIT``); token ids, the
    layer count and a worker's tokens per step within int32 (JAX's integers: x64 is off)."""
    require(cfg.model.vocab_size <= INT32, "model.vocab_size",
            f"token ids are int32 on the device: expected at most 2^31 - 1, got {cfg.model.vocab_size}")
    require(cfg.model.n_layers <= INT32, "model.n_layers",
            f"the layers are a scan whose length is int32 on the device: expected at most 2^31 - 1, "
            f"got {cfg.model.n_layers}")
    rows, seq = cfg.batch_size // cfg.mesh.replica, cfg.data.seq_len
    tokens = rows * seq  # the loss's divisor: a worker's tokens per step (the model runs them as one batch)
    require(tokens <= INT32, "batch_size" if rows >= seq else "data.seq_len",
            f"a worker's step of batch_size / mesh.replica x data.seq_len = {rows} x {seq} = {tokens} tokens: "
            "its token count is int32 on the device (at most 2^31 - 1)")
    for name, dims in llama_arrays(cfg):
        nbytes = math.prod(v for _, v in dims) * ITEM
        key, value = max(dims, key=lambda kv: kv[1])
        require(nbytes <= LIMIT, key, f"{key}={value} is too large: {name} would be "
                f"{' x '.join(f'{v} ({k})' for k, v in dims)} = {_sized(nbytes)} bytes, more than XLA addresses "
                "(2^63 - 1 bytes)")
    params = llama_param_count(cfg)
    total = params * cfg.mesh.replica * ITEM * STATE_COPIES
    key = max(("model.d_model", "model.ffn_dim", "model.vocab_size", "model.n_layers"),
              key=lambda k: getattr(cfg.model, k.split(".")[1]))
    require(total <= LIMIT, key, f"a model of {_sized(params)} parameters: its training state ({_sized(total)} "
            f"bytes over mesh.replica={cfg.mesh.replica} copies) is more than XLA addresses (2^63 - 1 bytes)")


__all__ = ["validate", "llama_arrays", "llama_param_count", "LIMIT"]
