"""Compressed posts (``sync.exchange.url`` with ``sync.wire.kind = topk2 | topk4``; issues 38 and 39):
the post is the sparse wire's packed form, the same codec as the in-program exchange
(``localsgd/sparse.py``: top-k per chunk, 2/4-bit levels, 12-bit indices, packed uint8).

Where each step of EDiT's compressed sync happens, in the order ``outer.sync_unit`` runs it:

1. **the poster** (``encode_post``, its host CPU), per unit (the root, each layer; or the whole
   model with ``sync.layerwise=false``): Δ = θ̄ − θ_i; the true norm ‖Δ‖ (before the residual is
   added, before compression: what the penalty reads); x = flatten(Δ) + β·e (its own residual,
   padded to whole chunks as ``compress.flatten_unit`` pads); the packed rows encode(x); the new
   residual e' = x − decode(encode(x)), kept locally, pending the round. It posts the packed rows
   and the norms (float32 [U]).
2. **every participant** (``OuterRound``'s CPU program): the rule's own sync over the posts, with
   the ``PackedPosts`` reduction standing in for the exchange: each post decoded as its worker's
   pseudo gradient, the anomaly detectors on the posted norms, the softmax weights mixed with the
   step shares, a flagged worker's decoded rows zeroed (a NaN post decodes to NaN: ``where``, not
   a product), the weighted sum in float32 over the workers in sorted order, the clip on the sum,
   the outer step.
3. **the poster again**, when the round is applied: e <- e' for each unit, or 0 for a unit the
   round flagged (the in-program sync resets a flagged worker's residual before encoding, so it
   sends zeros and keeps zeros: the same result); a post the round did not use (late, or a
   restart's duplicate) sent nothing, so the residual stays what it was before the post.

Bit for bit this equals the in-program ``compressed_weighted_sum`` (all-gather pattern) on the same
Δs, norms and residuals (tests/test_packed_posts.py). A worker that (re)starts or joins begins with
a zero residual, as the in-program ``Compressed.remap_extra`` does on an elastic resume: the
residual is per worker and lives only in its process (recorded: ``"residual": "zeros"``).

The post's meta says ``"format": 2`` and the wire (``codec.Codec.name``); float32 posts have no
``format`` (1). A reader whose config reads another format or layout (``Codec.layout``) fails
naming both. Everything here takes the run's wire as its ``Codec`` (``Codec.from_sync``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from edit_jax.localsgd.codec import NONE, Codec
from edit_jax.localsgd.quantize import flatten_unit
from edit_jax.localsgd.reduction import ReplicaPsum, sq_sum
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.localsgd.sparse import sparse_encode

FLOAT32, PACKED = 1, 2  # post formats: float32 Δ leaves; packed sparse rows + true norms
FORMATS = (FLOAT32, PACKED)


def check_post(meta: dict, wire: Codec | str, what: str) -> int:
    """The post's format, checked against this reader's wire (its codec or wire name): the same
    layout (the decay is the poster's own business); ValueError naming both otherwise."""
    fmt = int(meta.get("format", FLOAT32))
    if fmt not in FORMATS:
        raise ValueError(f"{what}: post format {fmt} is unknown to this reader (reads {list(FORMATS)}): "
                         "a newer edit-jax wrote it")
    theirs = str(meta.get("wire", "none")) if fmt == PACKED else "none"
    mine = wire if isinstance(wire, Codec) else Codec.from_name(wire)
    wire = mine.name
    try:
        same = Codec.from_name(theirs).layout == mine.layout
    except ValueError as e:  # a wire this reader cannot read at all
        raise ValueError(f"{what}: {e}; this worker reads {wire!r}") from None
    if not same:
        raise ValueError(f"{what}: the post carries {theirs!r} pseudo gradients, this worker reads {wire!r} "
                         "(sync.wire.kind, sync.wire.chunk, sync.wire.k): every worker of a run must use the same")
    return fmt


# ----------------------------------------------------------------------------- units


def _units(tree: Any, layerwise: bool) -> tuple[Any, Any]:
    """(the root's unit, the layers' units stacked [L, ...]) or (the whole tree, None)."""
    return (tree["root"], tree["layers"]) if layerwise else (tree, None)


def unit_rows(theta: Any, layerwise: bool, chunk: int) -> tuple[int, int, int]:
    """(chunks of the root or whole model, layers, chunks of one layer); (n, 0, 0) without layers."""
    root, layers = _units(theta, layerwise)
    if layers is None:
        return -(-sum(np.size(x) for x in jax.tree.leaves(root)) // chunk), 0, 0
    n_layers = np.shape(jax.tree.leaves(layers)[0])[0]
    size = lambda t, drop=0: sum(math.prod(np.shape(x)[drop:]) for x in jax.tree.leaves(t))
    return -(-size(root) // chunk), n_layers, -(-size(layers, 1) // chunk)


def zero_residual(theta: Any, layerwise: bool, codec: Codec) -> list[np.ndarray]:
    """A fresh residual: per unit its flat vector padded to whole chunks ([nc·chunk], [L, nc·chunk])."""
    chunk = codec.chunk
    nr, n_layers, nl = unit_rows(theta, layerwise, chunk)
    out = [np.zeros(nr * chunk, np.float32)]
    if layerwise:
        out.append(np.zeros((n_layers, nl * chunk), np.float32))
    return out


# ----------------------------------------------------------------------------- the poster


def _encode_unit(d: Any, e: jax.Array, codec: Codec):
    g = jnp.sqrt(sq_sum(d))  # the true norm: Δ alone, before the residual and the codec
    packed, x = sparse_encode(flatten_unit(d, codec.chunk)[0], e, codec)
    return packed, g, (x - codec.decode(packed)).reshape(-1)


def encode_post(delta: Any, residual: list, codec: Codec, layerwise: bool):
    """(packed rows per unit [root [nc, P], layers [L, nc, P]], true norms [U], new residual per
    unit) of one worker's Δ (θ̄'s tree) and residual (``zero_residual``'s layout). Jit it."""
    root, layers = _units(delta, layerwise)
    p_root, g_root, e_root = _encode_unit(root, residual[0], codec)
    if not layerwise:
        return [p_root], g_root[None], [e_root]
    p_l, g_l, e_l = jax.vmap(lambda d, e: _encode_unit(d, e, codec))(layers, residual[1])
    return [p_root, p_l], jnp.concatenate([g_root[None], g_l]), [e_root, e_l]


def settle_residual(pending: list, flagged_units: np.ndarray | None, layerwise: bool) -> list[np.ndarray]:
    """The residual after the round used the post: ``pending`` (encode_post's), zero for each
    unit the round flagged (``flagged_units`` [U] bool, root first)."""
    if flagged_units is None:
        return [np.asarray(x) for x in pending]
    f = np.asarray(flagged_units, bool)
    out = [np.where(f[0], 0.0, pending[0]).astype(np.float32)]
    if layerwise:
        out.append(np.where(f[1:, None], 0.0, pending[1]).astype(np.float32))
    return out


# ----------------------------------------------------------------------------- the round


@dataclass(frozen=True)
class PackedPosts(ReplicaPsum):
    """The reduction of a round whose workers sent packed posts: every worker's "params" of a unit
    are its post's ``{"rows": [nc, P] uint8, "norm": []}`` (``posted_units``), so its pseudo
    gradient is the decoded rows (x = Δ + β·e as the poster encoded it) and its norm the true ‖Δ‖ it
    posted. The rest is the rule's own sync (``outer.sync_unit``, run by ``stacked.workers_sync``):
    the detectors on the norms, the weights, a flagged post zeroed (its NaNs too), the float32
    weighted sum over the workers in sorted order, the clip, the outer step. The posters encoded,
    so the rule runs without its ``Compressed`` wrapper (``OuterRound``)."""

    axis: str = REPLICA
    norm_axes: Any = ()
    codec: Codec = NONE

    def pseudo_gradient(self, outer_params: Any, post: dict) -> tuple[Any, jax.Array]:
        _, unflatten = flatten_unit(outer_params, self.codec.chunk)
        return unflatten(self.codec.decode(post["rows"]).reshape(-1)), post["norm"]


def posted_units(rows: list, norms: jax.Array, layerwise: bool) -> dict:
    """Packed posts as a rule's units (stacked [N]): ``rows`` per unit (``encode_post``'s, with a
    leading [N]), ``norms`` [N, U] (root first)."""
    root = {"rows": rows[0], "norm": norms[:, 0]}
    if not layerwise:
        return {"root": root, "layers": {}}
    return {"root": root, "layers": {"rows": rows[1], "norm": norms[:, 1:]}}


def post_bytes(theta: Any, layerwise: bool, codec: Codec) -> int:
    """The packed rows' bytes of one post (the norms and the .npz framing not counted)."""
    nr, n_layers, nl = unit_rows(theta, layerwise, codec.chunk)
    return (nr + n_layers * nl) * codec.row_bytes


__all__ = ["FLOAT32", "PACKED", "PackedPosts", "check_post", "encode_post", "post_bytes", "posted_units",
           "settle_residual", "unit_rows", "zero_residual"]
