"""Is a train state safe to keep? Finiteness and checksums, computed on device.

Both run as one jitted reduction over the (sharded) state and bring back a handful of scalars,
never the arrays themselves:

- ``finite_report(state)``: for each part of the state (per-worker params, inner optimizer state,
  outer state, ...) whether every value is finite, per worker where the part has a worker axis.
  A checkpoint is only written when the report says so (see ``nonfinite_parts``).
- ``state_checksums(state)``: one uint32 per array leaf, stored in the checkpoint's metadata and
  compared on restore, so that a checkpoint whose bytes changed on disk (bit rot, a bad copy) is
  refused instead of trained on.

The checksum of a leaf is ``sum_i bits(x_i) * m_i  (mod 2**32)`` with ``m_i`` an odd multiplier
derived from the element's position. An odd multiplier is invertible mod 2**32, so a change of
any single element always changes the sum; positions are mixed in so that swapped elements are
caught too. Integer addition wraps and is associative, so the result does not depend on how the
array is sharded or in which order XLA reduces it: a checkpoint written on one mesh verifies
when read back on another (elastic restarts).
"""

from __future__ import annotations

import io
import json
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from edit_jax.runtime.multihost import host_value, local_value

_GOLDEN = np.uint32(0x9E3779B1)  # Knuth's multiplicative hash constant (odd)


def pack_arrays(arrays, meta: dict) -> bytes:
    """Host arrays (in order) and a JSON ``meta`` as one .npz object: the exchange's posts and
    round states (elastic/rounds.py), and the run dir's ``exchange_state.npz`` (``trained.py``)."""
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
             **{f"a{i:05d}": np.asarray(x) for i, x in enumerate(arrays)})
    return buf.getvalue()


def unpack_arrays(data: bytes, what: str) -> tuple[list[np.ndarray], dict]:
    """``pack_arrays``' arrays and meta back; ValueError naming ``what`` if ``data`` is not one."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = [z[k] for k in sorted(k for k in z.files if k != "meta")]
    except Exception as e:  # a truncated or foreign object: say which
        raise ValueError(f"{what}: not a whole, readable .npz object ({type(e).__name__}: {e})") from e
    return arrays, meta


def leaves_hash(arrays) -> str:
    """A hash of host arrays in order (dtype, shape and bytes): the exchange's round states carry
    it (elastic/rounds.py) and ``trained.py`` checks it when it reads one back."""
    import hashlib

    h = hashlib.sha256()
    for x in arrays:
        x = np.ascontiguousarray(np.asarray(x))
        h.update(str((x.dtype.str, x.shape)).encode())
        h.update(x.tobytes())
    return h.hexdigest()[:24]


def _bits_u32(x: jax.Array) -> jax.Array:
    """The element's bit pattern as uint32 (floats are bitcast, not converted)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if size == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if size == 8:  # only with jax_enable_x64: fold the two halves
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
        return halves[..., 0] ^ (halves[..., 1] * jnp.uint32(0x85EBCA6B))
    raise TypeError(f"cannot checksum dtype {x.dtype}")


def _leaf_checksum(x: jax.Array, salt: int) -> jax.Array:
    bits = _bits_u32(x)
    # Linear position of each element from per-dim iotas (elementwise: keeps the sharding, no reshape).
    pos = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[d]
    mult = (pos * _GOLDEN + jnp.uint32(salt % 2**32)) | jnp.uint32(1)  # odd: invertible mod 2**32
    return jnp.sum(bits * mult, dtype=jnp.uint32)


def _device_memory(sharding: Any) -> Any:
    """``sharding`` in its devices' default memory when it is in host memory (``sync.cpu_offload``),
    else None: the leaf stays where it is."""
    kind = getattr(sharding, "memory_kind", None)
    if kind is None or kind not in ("pinned_host", "unpinned_host"):
        return None
    default = next(iter(sharding.device_set)).default_memory().kind
    return None if kind == default else sharding.with_memory_kind(default)


def _on_device(tree: Any) -> Any:
    """Leaves kept in host memory (``sync.cpu_offload``: θ̄ and the trace) copied to device memory:
    XLA will not mix host- and device-memory operands in one reduction."""
    def one(x):
        sharding = _device_memory(getattr(x, "sharding", None))
        return x if sharding is None else jax.device_put(x, sharding)

    return jax.tree.map(one, tree)


@partial(jax.jit, static_argnums=1)
def _checksums(state: Any, positions: tuple[int, ...]) -> list[jax.Array]:
    """One checksum per leaf; ``positions[i]``: leaf i's index in the whole state (salts the sum)."""
    return [_leaf_checksum(x, i * 0x632BE5AB + 1) for i, x in zip(positions, jax.tree.leaves(state), strict=True)]


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def state_checksums(state: Any) -> dict[str, int]:
    """``{leaf path: uint32 checksum}`` of every array in ``state`` (device or host arrays)."""
    paths = _paths(state)
    values = _checksums(_on_device(state), tuple(range(len(paths))))
    # this process's copy (multi-process too)
    return {p: int(local_value(v)) for p, v in zip(paths, values, strict=True)}


def part_checksums(part: Any, prefix: str, whole: Any) -> dict[str, int]:
    """The checksums ``state_checksums(state)`` gives the leaves of ``part``, the subtree at
    ``prefix`` (a key path, e.g. ``".outer.params"``) of a state shaped like ``whole`` (shapes
    suffice): same paths, same salts. For readers that restore only part of a checkpoint (the
    params, for sample and export) and check it against the checksums saved with the whole state."""
    index = {p: i for i, p in enumerate(_paths(whole))}
    paths = [prefix + p for p in _paths(part)]
    values = _checksums(_on_device(part), tuple(index[p] for p in paths))
    return {p: int(local_value(v)) for p, v in zip(paths, values, strict=True)}


def checksum_mismatches(saved: dict[str, int], now: dict[str, int]) -> list[str]:
    """Leaf paths whose checksum differs (or that are missing on one side)."""
    return sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))


# ----------------------------------------------------------------------------- finiteness


def _all_finite(tree: Any) -> jax.Array:
    oks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(oks)) if oks else jnp.bool_(True)


def _per_worker_finite(tree: Any, n: int) -> jax.Array:
    """[n]: worker i's slice of every leaf with a leading worker axis is finite."""
    oks = [jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(x.dtype, jnp.inexact) and x.ndim >= 1 and x.shape[0] == n]
    return jnp.all(jnp.stack(oks), axis=0) if oks else jnp.ones((n,), bool)


@lru_cache(maxsize=None)
def _finite_fn(n: int):
    def report(state):
        return {"params": _per_worker_finite(state.params, n),
                "opt_state": _per_worker_finite(state.opt_state, n),
                "opt_state (shared)": _all_finite(jax.tree.map(lambda x: x if x.ndim == 0 or x.shape[0] != n else
                                                               jnp.zeros((), x.dtype), state.opt_state)),
                "outer": _all_finite(state.outer) if state.outer is not None else jnp.bool_(True)}

    return jax.jit(report)


def finite_report(state: Any) -> dict[str, np.ndarray]:
    """Whether each part of a ``TrainState`` is finite: ``params`` and ``opt_state`` per worker
    ([N] bools), the inner optimizer's shared scalars and the outer state (θ̄, trace, detectors)
    as one bool each. One jitted reduction; only these few bools leave the device."""
    n = jax.tree.leaves(state.params)[0].shape[0]
    got = _finite_fn(n)(_on_device(state))  # host_value: also when the state spans several processes
    return {k: host_value(got[k]) for k in ("params", "opt_state", "opt_state (shared)", "outer")}


def save_programs(state: Any) -> list[tuple[str, Any, tuple]]:
    """(name, jitted function, abstract arguments) of the programs a save of ``state`` (arrays or
    ``jax.ShapeDtypeStruct`` values of a ``TrainState``) runs: its finiteness report and checksums, for
    compiling ahead (``training/ahead.py``)."""
    def on_device(x):  # where _on_device puts it
        sharding = _device_memory(x.sharding)
        return x if sharding is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    state = jax.tree.map(on_device, state)
    n = jax.tree.leaves(state.params)[0].shape[0]
    positions = tuple(range(len(_paths(state))))
    return [("save report", _finite_fn(n), (state,)), ("save checksums", _checksums, (state, positions))]


def nonfinite_parts(report: dict[str, np.ndarray]) -> list[str]:
    """Human-readable list of what is non-finite in ``report`` (empty: all finite)."""
    out = []
    for name, ok in report.items():
        ok = np.asarray(ok)
        if ok.ndim == 0:
            if not ok:
                out.append(name)
        elif not ok.all():
            bad = [int(i) for i in np.flatnonzero(~ok)]
            out.append(f"{name} of worker{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}")
    return out


__all__ = ["state_checksums", "part_checksums", "checksum_mismatches", "finite_report", "nonfinite_parts",
           "save_programs"]
