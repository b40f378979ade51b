"""Compressed exchange of pseudo gradients across ``replica`` (``sync.wire.kind``).

What crosses the slow links at a sync is each worker's pseudo gradient Δ_i of one unit (its FSDP
block on each device). With ``compress="bf16"`` or ``"int8"`` it crosses in that dtype; everything
before the exchange (Δ_i, its norm, the detector, the weights) and after it (the weighted sum, the
clip, the outer step) stays float32. The weighting is applied by the receivers after the exchange
(every device knows every worker's weight), so the sum Σ_i w_i·deq(q_i) is accumulated in float32.

Layout: a unit's leaves are flattened into one float32 vector per device (so small leaves such as
norm scales need no padding of their own), padded with zeros to a multiple of N x BLOCK and cut
into blocks of ``BLOCK`` = 256 elements.

- ``int8``: symmetric per-block quantization, scale = max|x| / 127 (float32, one per block),
  q = round(x / scale) in [-127, 127]; a zero block has scale 0 and q = 0. Bytes per element:
  1 + 4/256 = 1.016.
- ``bf16``: a cast (round to nearest even); 2 bytes per element. The bf16 bits cross as uint16
  (a bitcast): XLA:CPU otherwise widens bf16 collectives to float32 in the compiled program, so the
  wire would carry 4 bytes per element; integer collectives are moved as they are.

Which collective pattern (bytes per device per element of the block, b = bytes per element on the
wire; an all-reduce of float32, today's exchange, moves 2(N-1)/N x 4):

- all-gather of every worker's compressed vector, then each device dequantizes and sums the N
  vectors in float32: (N-1) x b, one quantization;
- all-to-all of N chunks (device r gets chunk r of every worker), dequantize and sum chunk r in
  float32, requantize the sum and all-gather it: 2(N-1)/N x b, two quantizations.

The all-gather moves no more bytes for N <= 2 (equal at N = 2, with one quantization fewer), the
all-to-all fewer for N >= 3; ``exchange_pattern(n)`` picks accordingly. int8 at N = 2 moves
1.016 / 4 = 0.254 x the bytes of the float32 all-reduce, bf16 0.5 x.

Error feedback (``sync.wire.error_feedback``): each worker adds its residual e_i (what its last
quantization dropped) before quantizing, x_i = Δ_i + e_i, and keeps e_i <- x_i - deq(q(x_i)).
Over syncs the worker's transmitted values then sum to Σ Δ_i − e_i (final): nothing is lost for
good. The residual covers the per-worker quantization; the requantization of the reduced chunk in
the all-to-all pattern (N >= 3) is shared by all workers and carries no residual. With
``sync.wire.decay`` = β < 1 the residual enters as β·e_i. The exchange takes the wire as one value,
``codec.Codec`` (the kind, its options, β), which also encodes and decodes a block (with the kernels
below).

``topk2`` / ``topk4``: sparse, 2- or 4-bit, packed into uint8 and all-gathered (``sparse.py``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from edit_jax.localsgd.sharding import REPLICA, gather_workers
from edit_jax.localsgd.sparse import sparse_exchange, sparse_send

BLOCK = 256  # elements per int8 scale
INT8_MAX = 127.0
WIRE_DTYPE = {"bf16": "u16", "int8": "s8", "topk2": "u8", "topk4": "u8"}  # HLO element type of the payload on the wire


def exchange_pattern(n: int) -> str:
    """``"all_gather"`` for N <= 2 (fewest bytes, one quantization), else ``"all_to_all"``."""
    return "all_gather" if n <= 2 else "all_to_all"


def ring_bits_per_param(codec, sizes: list[int], n: int) -> float:
    """Bits one device sends across ``replica`` at a full sync per parameter it holds, as the config
    implies it (ring counts, as ``tools/hlo.py`` counts the program's) for ``codec`` (a ``codec.Codec``):
    ``sizes`` are the flattened vectors per unit on one device (their padding included). The plan
    checks its HLO figure on it."""
    if n <= 1:
        return 0.0
    if codec.kind == "none":  # the float32 all-reduce
        return 2.0 * (n - 1) / n * 32.0
    if codec.is_sparse:  # the all-gather of packed chunks
        return (n - 1) * codec.bits_per_param(sizes)
    padded = sum(-(-m // (n * BLOCK)) * n * BLOCK for m in sizes)
    b = codec.bits_per_param() * padded / sum(sizes)
    return (n - 1) * b if exchange_pattern(n) == "all_gather" else 2.0 * (n - 1) / n * b


# ----------------------------------------------------------------------------- encode / decode


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., BLOCK] float32 -> (q int8 [..., BLOCK], scale float32 [...]): symmetric per block."""
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = amax / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.where(scale[..., None] > 0, jnp.round(x / safe[..., None]), 0.0)
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def dequantize_int8(q: jax.Array, scale: jax.Array) -> jax.Array:
    return q.astype(jnp.float32) * scale[..., None]


def encode(x: jax.Array, compress: str) -> tuple:
    """Blocks [..., BLOCK] float32 -> the wire payload (a tuple of arrays)."""
    if compress == "int8":
        return quantize_int8(x)
    if compress == "bf16":  # the bits as uint16 (see the module doc)
        return (jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16),)
    raise ValueError(f"unknown compression {compress!r}")


def decode(payload: tuple, compress: str) -> jax.Array:
    if compress == "int8":
        return dequantize_int8(*payload)
    return jax.lax.bitcast_convert_type(payload[0], jnp.bfloat16).astype(jnp.float32)


# ----------------------------------------------------------------------------- flattening


def flatten_unit(tree: Any, multiple: int) -> tuple[jax.Array, Any]:
    """All leaves of a unit (this device's blocks) as one float32 vector, zero-padded to a multiple
    of ``multiple``; and the function mapping such a vector back to the tree."""
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [math.prod(x.shape) for x in leaves]
    flat = jnp.concatenate([x.astype(jnp.float32).reshape(-1) for x in leaves])
    total = sum(sizes)
    padded = -(-total // multiple) * multiple
    flat = jnp.pad(flat, (0, padded - total))

    def unflatten(vec):
        out, at = [], 0
        for x, size in zip(leaves, sizes, strict=True):
            out.append(vec[at:at + size].reshape(x.shape))
            at += size
        return jax.tree.unflatten(treedef, out)

    return flat, unflatten


# ----------------------------------------------------------------------------- the exchange


def compressed_weighted_sum(delta: Any, w_all: jax.Array, codec, residual: Any = None,
                            pattern: str | None = None) -> tuple[Any, Any]:
    """Σ_i w_all[i]·Δ_i over ``replica`` (under ``shard_map``), Δ_i crossing in ``codec`` (a lossy
    ``codec.Codec``).

    ``delta`` is this worker's (flagged-zeroed) pseudo gradient of one unit, this device's blocks;
    ``w_all`` [N] every worker's weight. With ``residual`` (same tree as ``delta``: this worker's
    error-feedback state) the residual is added before quantization and the new residual is
    returned (else None). The sum is identical on every replica (typed invariant over ``replica``).
    """
    if codec.is_sparse:  # sparse.py: all-gather of packed uint8, decoded and summed locally
        chunk = codec.chunk
        flat, unflatten = flatten_unit(delta, chunk)
        total, new_e = sparse_exchange(flat, None if residual is None else flatten_unit(residual, chunk)[0],
                                       w_all, codec)
        return unflatten(total), (None if new_e is None else unflatten(new_e))
    decay = codec.decay
    n = jax.lax.axis_size(REPLICA)
    pattern = pattern or exchange_pattern(n)
    flat, unflatten = flatten_unit(delta, n * BLOCK)
    x = flat if residual is None else flat + decay * flatten_unit(residual, n * BLOCK)[0]
    blocks = x.reshape(-1, BLOCK)
    payload = codec.encode(blocks)
    new_residual = None
    if residual is not None:
        new_residual = unflatten((blocks - codec.decode(payload)).reshape(-1))
    bcast = lambda v, y: v.reshape((n,) + (1,) * (y.ndim - 1))
    if pattern == "all_gather":
        got = codec.decode(tuple(gather_workers(p) for p in payload))  # [N, nb, B]
        total = jnp.sum(bcast(w_all, got) * got, axis=0)
    elif pattern == "all_to_all":
        nb = blocks.shape[0]
        chunks = tuple(p.reshape((n, nb // n) + p.shape[1:]) for p in payload)
        mine = codec.decode(tuple(jax.lax.all_to_all(c, REPLICA, 0, 0) for c in chunks))  # [N, nb/N, B]
        part = jnp.sum(bcast(w_all, mine) * mine, axis=0)  # chunk r of the sum, float32
        total = codec.decode(tuple(gather_workers(p, axis=0, tiled=True)
                                   for p in codec.encode(part)))
    else:
        raise ValueError(f"unknown exchange pattern {pattern!r}")
    return unflatten(total.reshape(-1)), new_residual


def stacked_compressed_sum(delta: Any, w_all: jax.Array, codec, residual: Any = None) -> tuple[Any, Any]:
    """``compressed_weighted_sum`` with every worker's values stacked on a leading axis [N] in one
    program (``reduction.Stacked``): each worker's Δ_i (+ e_i) is quantized as it would be sent,
    and the receivers' float32 sum Σ_i w_i·deq(q_i) is the all-gather pattern's (one
    quantization). Returns (the sum, the stacked new residuals or None)."""
    n = w_all.shape[0]
    multiple = codec.chunk if codec.is_sparse else n * BLOCK

    def send(d, e):  # one worker: its vector as it crosses the wire, decoded, and its new residual
        flat, unflatten = flatten_unit(d, multiple)
        ef = None if e is None else flatten_unit(e, multiple)[0]
        if codec.is_sparse:
            got, new_e = sparse_send(flat, ef, codec)
            return got, (None if e is None else unflatten(new_e))
        x = flat if e is None else flat + codec.decay * ef
        blocks = x.reshape(-1, BLOCK)
        got = codec.decode(codec.encode(blocks))
        return got.reshape(-1), (None if e is None else unflatten((blocks - got).reshape(-1)))

    got, new_residual = jax.vmap(send)(delta, residual)  # [N, padded]
    total = jnp.sum(w_all.reshape((n, 1)) * got, axis=0)
    _, unflatten = flatten_unit(jax.tree.map(lambda x: x[0], delta), multiple)
    return unflatten(total.reshape(-1)), new_residual


__all__ = ["BLOCK", "stacked_compressed_sum", "exchange_pattern", "ring_bits_per_param", "quantize_int8",
           "dequantize_int8", "encode", "decode", "flatten_unit", "compressed_weighted_sum"]
