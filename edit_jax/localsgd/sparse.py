"""Sparse low-bit pseudo gradients on the wire (``sync.wire.kind = "topk2" | "topk4"``; docs/developer/wire.md).

Each worker's pseudo gradient of one unit plus its error-feedback residual, x_i = Δ_i + β·e_i
(this device's FSDP blocks, flattened as in ``compress.flatten_unit``), is zero-padded to a
multiple of ``chunk`` (``sync.wire.chunk``, default 4096) and cut into chunks. Per chunk:

- **top-k** (``sync.wire.k``, default 64) by magnitude |x|. Ties: the lower index wins (the rule
  of ``jax.lax.top_k``); the kept entries are listed in descending |x|, ties by ascending index.
- **scale** s = max |x| over the chunk (float32, = the largest kept magnitude); a zero chunk has s = 0.
- **levels**, sign + magnitude, L = 2**(bits-1) magnitudes {1/L, 2/L, ..., 1}·s:
  j = clip(round(|x| / s · L) − 1, 0, L − 1) (round half to even), decoded ±(j + 1)/L · s.
  2 bits: ±{s/2, s}; 4 bits: ±{s/8, ..., s}. No level is zero: every kept entry is among the
  chunk's largest, so the smallest magnitude level costs nothing.
- **code** c = sign << (bits−1) | j, sign = 1 for x < 0.

Packing, per chunk, one uint8 row of ``payload_bytes`` = k·bits/8 + 3k/2 + 4:
``[codes, 8/bits per byte, the first in the low bits][indices, 12 bits, two per 3 bytes:
b0 = a & 255, b1 = a >> 8 | (b & 15) << 4, b2 = b >> 4][s as 4 little-endian bytes]``.
Wire bits per parameter (no padding): (k·(bits + 12) + 32) / chunk: 0.227 for topk2, 0.258 for
topk4 at the defaults (fp32: 32, int8: 8.1).

The exchange: an all-gather of the packed rows over ``replica`` (the only payload crossing it),
then every device decodes the N workers' rows (scatter into zero chunks) and sums them with the
weights in float32. Error feedback keeps e_i <- x_i − decode(encode(x_i)) (β, ``sync.wire.decay``,
scales it at its next use). The options (chunk, k, β) travel in one value, ``codec.Codec``, whose
``name`` is the wire name (``"topk2"`` at the defaults, else ``"topk2;chunk=1024;k=32;decay=0.9"``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from edit_jax.localsgd.sharding import REPLICA, gather_workers

CHUNK, TOPK, INDEX_BITS = 4096, 64, 12
BITS = {"topk2": 2, "topk4": 4}


# ----------------------------------------------------------------------------- encode / decode


def payload_bytes(bits: int, k: int) -> int:
    """Bytes of one packed chunk: codes, indices, scale."""
    return k * bits // 8 + k * INDEX_BITS // 8 + 4


def _pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    per = 8 // bits
    c = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // per, per)).astype(jnp.uint8)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.sum(jnp.left_shift(c, shifts), axis=-1, dtype=jnp.uint8)  # disjoint bits: sum == or


def _unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    c = jnp.right_shift(packed[..., None], shifts) & jnp.uint8(2 ** bits - 1)
    return c.reshape(packed.shape[:-1] + (packed.shape[-1] * per,))


def _pack_indices(idx: jax.Array) -> jax.Array:
    pairs = idx.astype(jnp.uint32).reshape(idx.shape[:-1] + (idx.shape[-1] // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([a & 255, (a >> 8) | ((b & 15) << 4), b >> 4], axis=-1).astype(jnp.uint8)
    return out.reshape(idx.shape[:-1] + (idx.shape[-1] * 3 // 2,))


def _unpack_indices(packed: jax.Array) -> jax.Array:
    t = packed.astype(jnp.int32).reshape(packed.shape[:-1] + (packed.shape[-1] // 3, 3))
    a = t[..., 0] | ((t[..., 1] & 15) << 8)
    b = (t[..., 1] >> 4) | (t[..., 2] << 4)
    return jnp.stack([a, b], axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] // 3 * 2,))


def encode(x: jax.Array, bits: int, k: int) -> jax.Array:
    """Chunks x [..., chunk] float32 -> packed uint8 [..., payload_bytes(bits, k)]."""
    _, idx = jax.lax.top_k(jnp.abs(x), k)  # descending |x|, ties: lower index first
    vals = jnp.take_along_axis(x, idx, axis=-1)
    scale = jnp.max(jnp.abs(x), axis=-1)
    levels = 2 ** (bits - 1)
    safe = jnp.where(scale > 0, scale, 1.0)
    j = jnp.clip(jnp.round(jnp.abs(vals) / safe[..., None] * levels) - 1, 0, levels - 1).astype(jnp.uint8)
    codes = ((vals < 0).astype(jnp.uint8) << (bits - 1)) | j
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8)  # [..., 4]
    return jnp.concatenate([_pack_codes(codes, bits), _pack_indices(idx), scale_bytes], axis=-1)


def decode(packed: jax.Array, bits: int, k: int, chunk: int) -> jax.Array:
    """Packed uint8 [..., payload_bytes] -> dense chunks [..., chunk] float32 (zeros but the k sent)."""
    nv, ni = k * bits // 8, k * INDEX_BITS // 8
    codes = _unpack_codes(packed[..., :nv], bits)
    idx = _unpack_indices(packed[..., nv:nv + ni])
    scale = jax.lax.bitcast_convert_type(packed[..., nv + ni:nv + ni + 4], jnp.float32)  # [...]
    levels = 2 ** (bits - 1)
    mag = ((codes & (levels - 1)).astype(jnp.float32) + 1.0) / levels * scale[..., None]
    vals = jnp.where(codes >> (bits - 1) == 1, -mag, mag)
    lead = packed.shape[:-1]
    rows = math.prod(lead)
    dense = jnp.zeros((rows, chunk), jnp.float32)
    dense = dense.at[jnp.arange(rows)[:, None], idx.reshape(rows, k)].set(vals.reshape(rows, k),
                                                                         unique_indices=True)
    return dense.reshape(lead + (chunk,))


# ----------------------------------------------------------------------------- the exchange


def sparse_exchange(flat: jax.Array, e: jax.Array | None, w_all: jax.Array,
                    codec) -> tuple[jax.Array, jax.Array | None]:
    """Under ``shard_map``: this worker's flat vector (padded to whole chunks) and residual (same
    layout or None) -> (Σ_i w_i·decode(payload_i) [same length], the new residual or None). Only the
    packed uint8 rows cross ``replica`` (one all-gather). ``codec``: a sparse ``codec.Codec``."""
    n = jax.lax.axis_size(REPLICA)
    packed, x = sparse_encode(flat, e, codec)
    got = decode(gather_workers(packed), codec.bits, codec.k, codec.chunk)  # [N, nc, chunk]
    # The residual from this worker's own row of what every device decoded: no second decode.
    new_e = None if e is None else (x - got[jax.lax.axis_index(REPLICA)]).reshape(-1)
    total = jnp.sum(w_all.reshape((n, 1, 1)) * got, axis=0)
    return total.reshape(-1), new_e


def sparse_encode(flat: jax.Array, e: jax.Array | None, codec) -> tuple[jax.Array, jax.Array]:
    """What one worker sends: (its packed rows [nc, P], x [nc, chunk]) for its flat vector (padded to
    whole chunks) plus β·residual (``e``, same layout, or None); its new residual is x − decode(rows).
    The in-program exchange, ``reduction.Stacked`` and the exchange's posts (``elastic/packed.py``)."""
    x = (flat if e is None else flat + codec.decay * e).reshape(-1, codec.chunk)
    return encode(x, codec.bits, codec.k), x


def sparse_send(flat: jax.Array, e: jax.Array | None, codec) -> tuple[jax.Array, jax.Array | None]:
    """One worker's vector as the receivers decode it, and its new residual (``reduction.Stacked``)."""
    packed, x = sparse_encode(flat, e, codec)
    got = decode(packed, codec.bits, codec.k, codec.chunk)
    return got.reshape(-1), (None if e is None else (x - got).reshape(-1))


__all__ = [
    "BITS",
    "CHUNK",
    "INDEX_BITS",
    "TOPK",
    "decode",
    "encode",
    "payload_bytes",
    "sparse_encode",
    "sparse_exchange",
    "sparse_send",
]
