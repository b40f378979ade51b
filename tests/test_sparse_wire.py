"""Sparse 2/4-bit pseudo gradients on the wire (issue 39, ``localsgd/sparse.py``), against an
independent NumPy re-implementation and the compiled HLO.

- The encoder: chunking with padding, top-k (ties: lower index), the level bins, the byte layout
  (a LSB-first bit stream here, written bit by bit) and the decode.
- The exchange (``compressed_weighted_sum`` / ``stacked_compressed_sum``) with error feedback and
  decay: the sum and the residual x − decode(encode(x)) exactly.
- The whole sync on the tiny config against NumPy Algorithm 2 with the same compression; the HLO's
  replica collectives: u8 all-gathers of exactly the packed bytes; the plan's bits per parameter.
- Resume with the residual; a NaN / inf worker is flagged, its residual reset, θ̄ finite.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_edit_sync import (
    BASE4,
    _assert_det_close,
    _assert_tree_close,
    _cfg,
    _crafted_state,
    _det_tuple,
    _host,
    _put,
    _ref_of,
    _unit,
    np_sync,
)
from test_streaming_sync import EDIT4, _cross_replica, _mesh, np_sync_compressed

from edit_jax.config import ConfigError, MeshConfig
from edit_jax.localsgd import sparse
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.quantize import compressed_weighted_sum, ring_bits_per_param, stacked_compressed_sum
from edit_jax.localsgd.fragments import unit_param_counts
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.runtime.mesh import make_mesh
from edit_jax.analysis import hlo
from edit_jax.commands.plan import sync_bits
from tests.stages import one_stage

# ============================================================================= NumPy reference


def _bits_write(nbytes: int, values, width: int) -> np.ndarray:
    """An LSB-first bit stream: value t occupies bits [t·width, (t+1)·width)."""
    out = np.zeros(nbytes, np.uint8)
    for t, v in enumerate(values):
        for b in range(width):
            if (int(v) >> b) & 1:
                pos = t * width + b
                out[pos // 8] |= np.uint8(1 << (pos % 8))
    return out


def _bits_read(buf: np.ndarray, count: int, width: int) -> list[int]:
    return [sum(((int(buf[(t * width + b) // 8]) >> ((t * width + b) % 8)) & 1) << b for b in range(width))
            for t in range(count)]


def np_encode(x: np.ndarray, bits: int, k: int) -> np.ndarray:
    """Chunks [nc, C] float32 -> [nc, k·bits/8 + 3k/2 + 4] uint8 (the layout of sparse.py's doc)."""
    levels = 2 ** (bits - 1)
    rows = []
    for row in np.asarray(x, np.float32):
        order = np.argsort(-np.abs(row), kind="stable")[:k]  # descending |x|, ties: lower index
        vals = row[order]
        s = np.float32(np.max(np.abs(row)))
        j = np.clip(np.round(np.abs(vals) / (s if s > 0 else np.float32(1)) * np.float32(levels)) - 1, 0, levels - 1)
        codes = [(int(v < 0) << (bits - 1)) | int(q) for v, q in zip(vals, j, strict=True)]
        rows.append(np.concatenate([_bits_write(k * bits // 8, codes, bits), _bits_write(k * 12 // 8, order, 12),
                                    np.frombuffer(np.array(s, "<f4").tobytes(), np.uint8)]))
    return np.stack(rows)


def np_decode(packed: np.ndarray, bits: int, k: int, chunk: int) -> np.ndarray:
    levels, nv, ni = 2 ** (bits - 1), k * bits // 8, k * 12 // 8
    out = np.zeros((len(packed), chunk), np.float32)
    for r, row in enumerate(packed):
        s = np.frombuffer(row[nv + ni:].tobytes(), "<f4")[0]
        for c, i in zip(_bits_read(row[:nv], k, bits), _bits_read(row[nv:], k, 12), strict=True):
            mag = np.float32((c & (levels - 1)) + 1) / np.float32(levels) * s
            out[r, i] = -mag if c >> (bits - 1) else mag
    return out


def np_roundtrip(x, wire):
    c = Codec.from_name(wire)
    return np_decode(np_encode(x, c.bits, c.k), c.bits, c.k, c.chunk)


def roundtrip(x, wire):
    c = Codec.from_name(wire)
    return np.asarray(c.decode(c.encode(jnp.asarray(x))))


def _ties(rng, chunk):
    """Chunks whose top-k boundary falls inside runs of equal magnitudes (and a zero chunk)."""
    x = (rng.standard_normal((4, chunk)) * 0.01).astype(np.float32)
    x[0, rng.choice(chunk, 100, replace=False)] = rng.choice([-1.0, 1.0], 100)  # 100 ties at |x| = 1
    x[1, :] = 0.5  # every value equal: the first k indices
    x[1, 3] = -0.5
    x[2] = rng.standard_normal(chunk) * np.geomspace(1e-3, 10, chunk)
    x[3] = 0.0
    return x


# ============================================================================= the encoder


@pytest.mark.parametrize("bits,k,chunk", [(2, 64, 4096), (4, 64, 4096), (2, 8, 256)])
def test_encoder_matches_numpy(bits, k, chunk):
    x = _ties(np.random.default_rng(bits + chunk), chunk)
    got = np.asarray(sparse.encode(jnp.asarray(x), bits, k))
    want = np_encode(x, bits, k)
    assert got.dtype == np.uint8 and got.shape == (4, sparse.payload_bytes(bits, k))
    np.testing.assert_array_equal(got, want)
    dec = np.asarray(sparse.decode(jnp.asarray(want), bits, k, chunk))
    np.testing.assert_array_equal(dec, np_decode(want, bits, k, chunk))
    assert np.all((dec != 0).sum(1)[:3] == k) and np.all(dec[3] == 0)
    np.testing.assert_array_equal(np.flatnonzero(dec[1]), np.arange(k))  # ties: the lower indices


def test_level_bins_by_hand():
    x = np.zeros((1, 8), np.float32)
    x[0, :5] = [1.0, -0.76, 0.74, -0.3, 0.2]
    two = roundtrip(x, "topk2;chunk=8;k=4")[0]
    np.testing.assert_array_equal(two, [1.0, -1.0, 0.5, -0.5, 0, 0, 0, 0])  # ±{s/2, s}, 0.2 not among top 4
    four = roundtrip(x, "topk4;chunk=8;k=4")[0]
    np.testing.assert_array_equal(four, [1.0, -0.75, 0.75, -0.25, 0, 0, 0, 0])  # ±(j+1)/8·s, round(2.4)=2 -> 2/8
    assert Codec("topk2").bits_per_param() == (64 * 14 + 32) / 4096 < 0.23
    assert Codec("topk4").bits_per_param() == (64 * 16 + 32) / 4096 < 0.26
    assert Codec("topk2").bits_per_param([1000]) == 928 / 1000  # one padded chunk


# ============================================================================= the exchange


def _exchange(n, deltas, w, wire, residual):
    mesh = make_mesh(MeshConfig(replica=n, shard=1), jax.devices()[:n])

    def body(d, w, e):
        avg, res = compressed_weighted_sum({"a": d[0]}, w, Codec.from_name(wire), {"a": e[0]})
        return avg["a"], res["a"][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(REPLICA), P(), P(REPLICA)), out_specs=(P(), P(REPLICA))))
    avg, res = f(jnp.asarray(deltas), jnp.asarray(w), jnp.asarray(residual))
    return np.asarray(avg), np.asarray(res)


@pytest.mark.parametrize("n,wire", [(2, "topk2"), (4, "topk4;chunk=256;k=8;decay=0.5")])
def test_exchange_and_residual_match_numpy(n, wire):
    """Σ_i w_i·decode(encode(x_i)) with x_i = Δ_i + β·e_i padded to whole chunks (a 1000-value leaf);
    the new residual x_i − decode(encode(x_i)) exactly; the stacked variant the same."""
    rng = np.random.default_rng(n)
    deltas = (rng.standard_normal((n, 10, 100)) * np.geomspace(1e-3, 10, 10)[None, :, None]).astype(np.float32)
    resid = (rng.standard_normal((n, 10, 100)) * 0.1).astype(np.float32)
    w = rng.dirichlet(np.ones(n)).astype(np.float32)
    codec = Codec.from_name(wire)
    chunk, decay = codec.chunk, np.float32(codec.decay)
    padded = -(-1000 // chunk) * chunk
    x = np.zeros((n, padded), np.float32)
    x[:, :1000] = deltas.reshape(n, -1) + decay * resid.reshape(n, -1)
    dec = np.stack([np_roundtrip(x[i].reshape(-1, chunk), wire).reshape(-1) for i in range(n)])
    want = np.sum(w[:, None] * dec, axis=0, dtype=np.float32)[:1000].reshape(10, 100)
    want_res = (x - dec)[:, :1000].reshape(n, 10, 100)
    avg, res = _exchange(n, deltas, w, wire, resid)
    np.testing.assert_allclose(avg, want, rtol=1e-6, atol=1e-7 * np.abs(want).max())
    np.testing.assert_array_equal(res, want_res)
    s_avg, s_res = stacked_compressed_sum({"a": jnp.asarray(deltas)}, jnp.asarray(w), codec, {"a": jnp.asarray(resid)})
    np.testing.assert_allclose(np.asarray(s_avg["a"]), want, rtol=1e-6, atol=1e-7 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(s_res["a"]), want_res)
    assert np.count_nonzero(dec[0]) == codec.k * (padded // chunk)


# ============================================================================= the sync on the tiny config


TOPK2 = [*EDIT4, "sync.wire.kind=topk2", "sync.wire.error_feedback=true"]


@pytest.fixture(scope="module")
def topk2():
    """The tiny EDiT config (N = 4, S = 2) with topk2 + error feedback, its programs and crafted state."""
    cfg = _cfg(*TOPK2)
    m = StepPrograms.for_config(cfg, _mesh(cfg))
    return cfg, m, _crafted_state(m, _host(m.init_state(0)))


def _np_sparse_avg(deltas, ok, w, dims, s, wire):
    """The device exchange in NumPy: per shard index, each worker's FSDP blocks flattened, padded to
    whole chunks, round-tripped, summed with the weights; back into full leaves."""
    chunk = Codec.from_name(wire).chunk
    out = [np.zeros(x.shape, np.float32) for x in deltas[0]]
    for sh in range(s):
        vecs = [np.concatenate([np.split(np.asarray(x, np.float32), s, axis=d)[sh].reshape(-1)
                                for x, d in zip(deltas[i], dims, strict=True)]) * (1.0 if ok[i] else 0.0)
                for i in range(len(deltas))]
        m = vecs[0].size
        padded = np.zeros((len(vecs), -(-m // chunk) * chunk), np.float32)
        padded[:, :m] = np.stack(vecs)
        total = np.sum(w[:, None].astype(np.float32) * np.stack([np_roundtrip(v.reshape(-1, chunk), wire).reshape(-1)
                                                                 for v in padded]), axis=0, dtype=np.float32)
        at = 0
        for j, (x, d) in enumerate(zip(deltas[0], dims, strict=True)):
            shape = list(x.shape)
            shape[d] //= s
            idx = [slice(None)] * x.ndim
            idx[d] = slice(sh * shape[d], (sh + 1) * shape[d])
            out[j][tuple(idx)] = total[at:at + math.prod(shape)].reshape(shape)
            at += math.prod(shape)
    return out


def test_sync_matches_numpy_and_residual_is_what_was_not_sent(topk2):
    """The whole sync with topk2 + error feedback on the crafted state (N = 4, S = 2): norms, flags,
    weights from the uncompressed Δ (the penalty before compression); θ̄ and trace equal NumPy
    Algorithm 2 whose average goes through the NumPy round trip; each worker's new residual is
    Δ_i − (what it sent), 0 for a flagged worker."""
    cfg, m, start = topk2
    assert m.rule.codec == Codec("topk2", error_feedback=True) and m.rule.codec.name == "topk2"
    dims = [jax.tree.leaves(m.layout.unit_dims["root"]), jax.tree.leaves(m.layout.unit_dims["layer"])]
    theta, trace, det, _, _ = np_sync_compressed(
        start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector), _ref_of(cfg),
        lambda u, deltas, ok, w: _np_sparse_avg(deltas, ok, w, dims[min(u, 1)], m.s, "topk2"))
    plain = np_sync(start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector),
                    _ref_of(cfg))[-1]
    synced, metrics = _host(m.sync_fn()(_put(m, start)))
    np.testing.assert_array_equal(np.asarray(metrics["unit_flagged"]), plain["flagged"])
    np.testing.assert_allclose(np.asarray(metrics["unit_pseudo_grad_norm"]), plain["g"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(metrics["unit_weight"]), plain["w"], atol=1e-5)
    _assert_tree_close(synced.outer.params, theta, "θ̄", rtol=1e-5, atol=2e-6)
    _assert_tree_close(synced.outer.trace, trace, "trace", rtol=1e-5, atol=2e-6)
    _assert_det_close(synced.outer.detector, det, "detector")
    flags = np.asarray(metrics["unit_flagged"])
    for u in range(1 + cfg.model.n_layers):
        for i in range(m.n):
            res = _unit(jax.tree.map(lambda x, i=i: x[i], synced.outer.extra["residual"]), u)
            theta_i = _unit(jax.tree.map(lambda x, i=i: x[i], start.params), u)
            delta = [t - x for t, x in zip(_unit(start.outer.params, u), theta_i, strict=True)]
            if flags[u, i]:
                assert all(np.all(x == 0) for x in res), (u, i)
                continue
            sent = _np_sparse_avg([delta], [True], np.ones(1, np.float32), dims[min(u, 1)], m.s, "topk2")
            for r, d, snt in zip(res, delta, sent, strict=True):
                np.testing.assert_allclose(r, d - snt, rtol=0, atol=1e-7)


def test_hlo_replica_collectives_are_the_packed_bytes(topk2):
    """The sync step's replica collectives: u8 all-gathers carrying exactly Σ_units ⌈block / 4096⌉ x 116
    bytes per device (block = the unit's params / S), plus scalars (norms, flags); no float tensor."""
    cfg, m, _ = topk2
    parsed = _cross_replica(m, "sync_forward")
    cross = [r for r in parsed["collectives"] if r["crosses_replica"]]
    tensors = [r for r in cross if r["operand_bytes"] > r["small_operand_bytes"]]
    assert {r["op"] for r in tensors} == {"all-gather"}, tensors
    assert {o.split("[")[0] for r in tensors for o in r["operands"]} == {"u8"}, tensors
    packed = sum(-(-u // m.s // 4096) * sparse.payload_bytes(2, 64) for u in unit_param_counts(cfg))
    assert sum(r["runs_per_step"] * r["operand_bytes"] for r in tensors) == packed
    # The plan's bits per parameter (``edit-jax plan``'s tau_window) from these ring bytes: within 10%
    # of the config's figure, which is the packed format with its padding, x (N − 1) all-gather peers.
    w = sync_bits(cfg, m.rule, hlo.collective_totals(parsed, True)["ring_bytes"])
    sizes = [u // m.s for u in unit_param_counts(cfg)]
    assert w["wire"] == "topk2"
    assert w["config_sync_bits_per_param"] == pytest.approx((m.n - 1) * Codec("topk2").bits_per_param(sizes))
    assert abs(w["sync_bits_per_param"] / w["config_sync_bits_per_param"] - 1) < 0.10, w
    # Payload and traffic apart: one worker's payload, (N − 1) of them per device, int8's traffic on
    # this mesh, and the replica count from which the all-gathered sparse wire moves more than int8.
    assert w["payload_bits_per_param"] == pytest.approx(Codec("topk2").bits_per_param(sizes))
    assert w["config_sync_bits_per_param"] == pytest.approx((m.n - 1) * w["payload_bits_per_param"])
    assert w["int8_sync_bits_per_param"] == pytest.approx(ring_bits_per_param(Codec("int8"), sizes, m.n))
    cross = w["sparse_crossover_replicas"]
    topk2, int8 = (lambda n, c=c: ring_bits_per_param(Codec(c), sizes, n) for c in ("topk2", "int8"))
    assert topk2(cross - 1) <= int8(cross - 1) and topk2(cross) > int8(cross), cross
    assert 40 < cross < 100, cross  # 2 x 8.1 / ~0.23 bits, shifted by the padding of the tiny units


@pytest.mark.parametrize("overrides,key", [
    (["sync.wire.kind=topk2"], "sync.wire.error_feedback"),  # top-k without a residual
    (["sync.wire.kind=topk2", "sync.wire.error_feedback=true", "sync.wire.k=30"], "sync.wire.k"),
    (["sync.wire.kind=topk4", "sync.wire.error_feedback=true", "sync.wire.chunk=8192"], "sync.wire.chunk"),
    (["sync.wire.kind=int8", "sync.wire.error_feedback=true", "sync.wire.decay=0"], "sync.wire.decay"),
    (["sync.wire.kind=topk2", "sync.wire.error_feedback=true", "sync.wire.residual_dtype=float16"],
     "sync.wire.residual_dtype"),
    (["sync.wire.kind=int8", "sync.wire.residual_dtype=bfloat16"], "sync.wire.residual_dtype"),  # no residual to store
])
def test_config_errors_name_the_field(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        _cfg(*BASE4, "sync.method=edit", *overrides)


def test_bfloat16_residual_is_the_float32_one_rounded_once(tmp_path, topk2):
    """sync.wire.residual_dtype=bfloat16: the state holds the residual in bfloat16 and the sync computes in
    float32. From the same state (a residual exactly representable in bfloat16), θ̄, trace, params
    and detectors equal the float32 residual's sync bit for bit, and the new residual is the
    float32 sync's rounded to bfloat16 once. A float32 run's checkpoint resumes into bfloat16 (cast)."""
    one_stage("default", "the bfloat16 residual", 12)
    from edit_jax.rundir.checkpoint import Checkpointer
    from edit_jax.training.resume import restore

    cfg, m, start = topk2
    half = StepPrograms.for_config(_cfg(*TOPK2, "sync.wire.residual_dtype=bfloat16"), _mesh(cfg))
    stored = {x.dtype for x in jax.tree.leaves(half.abstract_state().outer.extra["residual"])}
    assert stored == {jnp.dtype(jnp.bfloat16)}
    rng = np.random.default_rng(5)
    res16 = jax.tree.map(lambda x: jnp.asarray(1e-3 * rng.standard_normal(x.shape), jnp.bfloat16),
                         start.outer.extra["residual"])
    full, _ = _host(m.sync_fn()(_put(m, start.replace(outer=start.outer.replace(
        extra={"residual": jax.tree.map(lambda x: np.asarray(x, np.float32), res16)})))))
    got, _ = _host(half.sync_fn()(_put(half, start.replace(outer=start.outer.replace(extra={"residual": res16})))))
    for a, b in zip(jax.tree.leaves((full.params, full.outer.params, full.outer.trace, full.outer.detector)),
                    jax.tree.leaves((got.params, got.outer.params, got.outer.trace, got.outer.detector)), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(full.outer.extra["residual"]), jax.tree.leaves(got.outer.extra["residual"]),
                    strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).astype(jnp.bfloat16), b)
    residuals = jax.tree.leaves(got.outer.extra["residual"])
    assert max(float(np.max(np.abs(np.asarray(x, np.float32)))) for x in residuals) > 0
    ck = Checkpointer(str(tmp_path), 2)
    try:
        ck.save(1, _put(m, full), {"position": 0}, cfg)
        # verified as written, then cast
        restored, _ = restore(ck, 1, _cfg(*TOPK2, "sync.wire.residual_dtype=bfloat16"), half)
    finally:
        ck.close()
    for a, b in zip(jax.tree.leaves(full.outer.extra["residual"]),
                    jax.tree.leaves(_host(restored).outer.extra["residual"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a).astype(jnp.bfloat16), b)


def test_a_compression_change_on_resume_is_said_or_refused(tmp_path, topk2):
    """A topk2 checkpoint resumed as topk4 with another chunk (issue 56 item 2): one line names both
    wires and the residual carries over as saved (it is the part of Δ not sent yet, laid out like the
    params whatever the wire). Error feedback turned off: refused, naming the field and both values."""
    from edit_jax.rundir.checkpoint import CheckpointError, Checkpointer
    from edit_jax.training.resume import restore_verified

    cfg, m, start = topk2
    rng = np.random.default_rng(7)
    saved = start.replace(outer=start.outer.replace(extra={"residual": jax.tree.map(
        lambda x: rng.standard_normal(x.shape).astype(np.float32), start.outer.extra["residual"])}))
    topk4 = _cfg(*EDIT4, "sync.wire.kind=topk4", "sync.wire.error_feedback=true", "sync.wire.chunk=1024")
    said = []
    ck = Checkpointer(str(tmp_path), 2)
    try:
        ck.save(1, _put(m, saved), {"position": 0}, cfg)
        restored, _, step = restore_verified(ck, topk4, StepPrograms.for_config(topk4, _mesh(topk4)), said.append, None)
        with pytest.raises(CheckpointError, match=r"\(sync\.wire\.error_feedback: checkpoint True, config False\)"):
            ck.check_compatible(ck.read_meta(1), _cfg(*EDIT4, "sync.wire.kind=int8"), 1)
    finally:
        ck.close()
    assert step == 1 and said == [
        "edit-jax: checkpoint 1: the wire changed (sync.wire.kind with its options: checkpoint 'topk2', config "
        "'topk4;chunk=1024'): the saved error-feedback residual carries over (stored as float32)"]
    _assert_tree_close(_host(restored.outer.extra["residual"]), saved.outer.extra["residual"], "residual",
                       rtol=0, atol=0)


# ============================================================================= resume and the guards


def test_resume_with_the_residual_is_exact(tmp_path, topk2):
    """Sync, checkpoint, restore, sync again == two syncs without the checkpoint (bit for bit)."""
    from edit_jax.rundir.checkpoint import Checkpointer

    cfg, m, start = topk2
    one, _ = m.sync_fn()(_put(m, start))
    host = _host(one)
    rng = np.random.default_rng(3)  # move the workers again so that the second sync has a Δ
    host = host.replace(params=jax.tree.map(lambda x: x + 1e-3 * rng.standard_normal(x.shape).astype(np.float32),
                                            host.params))
    assert max(float(np.max(np.abs(x))) for x in jax.tree.leaves(host.outer.extra["residual"])) > 0
    ck = Checkpointer(str(tmp_path), 2)
    try:
        ck.save(1, _put(m, host), {"position": 0}, cfg)
        restored, _ = ck.restore(1, m.abstract_state())
    finally:
        ck.close()
    a, _ = _host(m.sync_fn()(_put(m, host)))
    b, _ = _host(m.sync_fn()(restored))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_bad_worker_is_flagged_and_its_residual_reset(bad, topk2):
    """As test_edit_sync's NaN-replica tests: the worker is flagged in every unit, weighted 0, θ̄
    stays finite; its residual is reset to 0 (the others' stay finite)."""
    _, m, start = topk2
    start = start.replace(params=jax.tree.map(lambda x: np.concatenate([x[:1], np.full_like(x[1:2], bad), x[2:]]),
                                              start.params))
    start = start.replace(outer=start.outer.replace(extra={"residual": jax.tree.map(
        lambda x: np.full_like(x, 1e-3), start.outer.extra["residual"])}))
    synced, metrics = _host(m.sync_fn()(_put(m, start)))
    assert np.asarray(metrics["unit_flagged"])[:, 1].all()
    assert np.all(np.asarray(metrics["unit_weight"])[:, 1] == 0)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves((synced.outer.params, synced.outer.trace, synced.params)))
    assert all(np.all(x[1] == 0) for x in jax.tree.leaves(synced.outer.extra["residual"]))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(synced.outer.extra["residual"]))
