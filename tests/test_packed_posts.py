"""Packed posts: the exchange's post is the sparse wire's packed form (``elastic/packed.py``,
issues 38 and 39).

- a round from topk2 posts equals the in-program compressed sync (``sync_unit`` with
  ``ReplicaPsum`` and ``compress=topk2`` under ``shard_map`` over ``replica``) on the same Δs and
  residuals: θ̄, the outer state, the detectors bit for bit, each worker's new residual too (a
  flagged worker's: zero);
- the poster's rows and residual against the NumPy codec of tests/test_sparse_wire.py;
- the post's bytes on disk against the bits-per-parameter figure; a reader of another wire or an
  unknown format fails naming both; the config rules.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from edit_jax.elastic import packed as PK
from edit_jax.elastic import rounds as R
from edit_jax.elastic.outer_round import OuterRound
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.quantize import flatten_unit
from edit_jax.localsgd.layerwise import LayerwiseSync
from edit_jax.localsgd.methods import OuterSpec, Penalty, Plan
from edit_jax.localsgd.outer import Detector, make_outer_optimizer, sync_unit
from edit_jax.localsgd.reduction import ReplicaPsum
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.localsgd.timed import Timed

A_EDIT_RULE = Timed(LayerwiseSync())  # A-EDiT's rule, as plan_for builds it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIRE = "topk2;chunk=16;k=4"  # small chunks: the tiny tensors below are sparsified for real
CODEC = Codec.from_name(WIRE, error_feedback=True)


def _theta(rng, layers=2):
    return {"root": {"embed": rng.normal(size=(6, 5)).astype(np.float32)},
            "layers": {"w": rng.normal(size=(layers, 4, 5)).astype(np.float32),
                       "b": rng.normal(size=(layers, 3)).astype(np.float32)}}


def _unit(tree, u):
    return tree["root"] if u == 0 else jax.tree.map(lambda x: x[u - 1], tree["layers"])


def _flat_residual(res_tree, layerwise=True, chunk=16):
    """A residual tree (θ̄'s layout) in encode_post's layout: per unit flat, padded to whole chunks."""
    root = np.asarray(flatten_unit(res_tree["root"], chunk)[0])
    layers = np.stack([np.asarray(flatten_unit(_unit(res_tree, u), chunk)[0])
                       for u in range(1, 1 + res_tree["layers"]["w"].shape[0])])
    return [root, layers]


@functools.cache
def _encoder(wire):
    return jax.jit(lambda d, e: PK.encode_post(d, e, Codec.from_name(wire), True))


def _encode(delta, residual, wire=WIRE):
    cpu = jax.devices("cpu")[0]
    out = _encoder(wire)(jax.device_put(delta, cpu), jax.device_put(residual, cpu))
    return jax.tree.map(np.asarray, jax.device_get(out))


PLAN = Plan("a_edit", A_EDIT_RULE, True, Penalty(warmup=2, step_weight_ratio=0.5, clip_threshold=0.3),
            OuterSpec("nesterov", 0.8, 0.85, True))


@functools.cache
def _round():  # one OuterRound: its programs compile once per participant count for every test
    return OuterRound(PLAN, CODEC)


def _setup(n, rng):
    plan, rnd = PLAN, _round()
    start = rnd.initial(_theta(rng), slots=n, n_units=3, window=2)
    start.outer_opt = jax.tree.map(lambda x: (0.01 * rng.normal(size=x.shape)).astype(np.float32), start.outer_opt)
    start.detectors = Detector(np.full((n, 3), 0.25, np.float32), np.full((n, 3), 0.01, np.float32),
                               np.full((n, 3), 5, np.int32), rng.normal(size=(n, 3, 2)).astype(np.float32))
    # worker 1's pseudo gradient is 4x the others': the anomaly (its residual must come back zero)
    deltas = [jax.tree.map(lambda x, w=w: (0.05 * (1 + 3 * (w == 1)) * rng.normal(size=x.shape)).astype(np.float32),
                           start.theta) for w in range(n)]
    # Δ = θ̄ − θ_i as a poster forms it from its params (what sync_unit forms from θ_i = θ̄ − Δ)
    deltas = [jax.tree.map(lambda t, d: t - (t - d), start.theta, d) for d in deltas]
    res = [jax.tree.map(lambda x: (0.01 * rng.normal(size=x.shape)).astype(np.float32), start.theta) for _ in range(n)]
    return plan, rnd, start, deltas, res


def test_packed_round_equals_the_in_program_compressed_sync():
    n, rng = 3, np.random.default_rng(0)
    plan, rnd, start, deltas, res = _setup(n, rng)
    posts, pending = [], []
    for w in range(n):
        rows, norms, new_e = _encode(deltas[w], _flat_residual(res[w]))
        post = R.Post(w, 1, rows, 5 + 3 * w, 10 * w, 1.0, "", wire=WIRE, norms=norms)
        posts.append(R.Post.decode(post.encode(), "post", WIRE))  # through the bytes on the exchange
        pending.append(new_e)
    got, figures = rnd.apply(start, posts)
    assert figures["unit_flagged"] == [[False, True, False]] * 3  # [U, N]

    mesh = Mesh(np.array(jax.devices()[:n]), (REPLICA,))
    steps = np.array([p.steps_since for p in posts], np.float32)
    shares = np.asarray(steps / steps.sum())
    opt = make_outer_optimizer(plan.outer)

    def body(local, det, e, theta_u, opt_u):  # one worker of the in-program compressed sync, one unit
        one = lambda t: jax.tree.map(lambda x: x[0], t)
        r = sync_unit(one(local), theta_u, opt_u, one(det), plan.penalty, opt, shares=shares, codec=CODEC,
                      residual=one(e), reduction=ReplicaPsum(axis=REPLICA, norm_axes=()))
        return r.outer_params, r.opt_state, jax.tree.map(lambda x: x[None], r.detector), \
            jax.tree.map(lambda x: x[None], r.residual)
    meet = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(REPLICA),) * 3 + (P(), P()),
                                 out_specs=(P(), P(), P(REPLICA), P(REPLICA)), check_vma=False))
    for u in range(3):  # the root, layer 0, layer 1 (one compile for both layers)
        theta_u, opt_u = _unit(start.theta, u), _unit(start.outer_opt, u)
        local = jax.tree.map(lambda o, *d: np.stack([o - x for x in d]), theta_u,
                             *(_unit(d, u) for d in deltas))
        e = jax.tree.map(lambda *x: np.stack(x), *(_unit(r, u) for r in res))
        det = jax.tree.map(lambda x: x[:, u], start.detectors)  # noqa: B023 - called at once
        theta_ref, opt_ref, det_ref, res_ref = meet(local, det, e, theta_u, opt_u)
        jax.tree.map(np.testing.assert_array_equal, _unit(got.theta, u), theta_ref)
        jax.tree.map(np.testing.assert_array_equal, _unit(got.outer_opt, u), opt_ref)
        jax.tree.map(np.testing.assert_array_equal,
                     jax.tree.map(lambda x: x[:, u], got.detectors), det_ref)  # noqa: B023 - called at once
        for w in range(n):  # the poster's residual, settled by the round's flags, is the in-program one
            mine = PK.settle_residual(pending[w], np.array(figures["unit_flagged"])[:, w], True)
            ref = np.asarray(flatten_unit(jax.tree.map(lambda x: x[w], res_ref), 16)[0])  # noqa: B023 - called at once
            np.testing.assert_array_equal(mine[0] if u == 0 else mine[1][u - 1], ref)
            assert (np.all(ref == 0)) == (w == 1)
    assert figures["flagged"] == [0, 3, 0] and figures["weight"][1] == 0 and figures["outer_update_norm"] > 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_inf_post_is_flagged_and_sends_nothing(bad):
    """A post whose Δ holds NaN / inf in one unit (its rows decode to NaN) is flagged there on its
    true norm: that unit's θ̄ is the round's of the other posts alone, bit for bit, every value is
    finite, and the poster's settled residual of that unit is zero (its other units' kept)."""
    n, rng = 3, np.random.default_rng(7)
    plan, rnd, start, deltas, res = _setup(n, rng)
    deltas[2]["layers"]["w"][1, 0, 0] = bad  # worker 2, unit 2 (layer 1) only
    posts, pending = [], []
    for w in range(n):
        rows, norms, new_e = _encode(deltas[w], _flat_residual(res[w]))
        posts.append(R.Post(w, 1, rows, 5, 5, 1.0, "", wire=WIRE, norms=norms))
        pending.append(new_e)
    assert not np.isfinite(posts[2].norms[2])
    got, figures = rnd.apply(start, posts)
    alone, _ = rnd.apply(start, posts[:2])
    assert figures["unit_flagged"][2] == [False, True, True]  # worker 1 (4x) and worker 2's bad layer
    layer1 = lambda t: jax.tree.map(lambda x: x[1], t["layers"])  # (the unit worker 2 broke)
    jax.tree.map(np.testing.assert_array_equal, layer1(got.theta), layer1(alone.theta))
    jax.tree.map(np.testing.assert_array_equal, layer1(got.outer_opt), layer1(alone.outer_opt))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(got.theta))
    settled = PK.settle_residual(pending[2], np.array(figures["unit_flagged"])[:, 2], True)
    assert np.all(settled[1][1] == 0) and np.array_equal(settled[1][0], pending[2][1][0])
    assert not np.all(np.isfinite(pending[2][1][1]))  # what it would have kept without the flag


def test_poster_rows_and_residual_match_numpy():
    """encode_post against the NumPy codec: the rows are np_encode(Δ + e), the residual is
    Δ + e − np_decode(rows), exactly; the norms are Δ's alone (the residual not in them)."""
    from test_sparse_wire import np_encode, np_roundtrip

    rng = np.random.default_rng(3)
    theta = _theta(rng, layers=3)
    delta = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), theta)
    res = jax.tree.map(lambda x: (0.3 * rng.normal(size=x.shape)).astype(np.float32), theta)
    e = _flat_residual(res)
    rows, norms, new_e = _encode(delta, e)
    for u in range(4):
        flat = np.concatenate([np.ravel(v) for v in jax.tree.leaves(_unit(delta, u))])  # tree order
        flat = np.pad(flat, (0, -len(flat) % 16))
        x = (flat + (e[0] if u == 0 else e[1][u - 1])).reshape(-1, 16)
        want = np_encode(x, 2, 4)
        np.testing.assert_array_equal(rows[0] if u == 0 else rows[1][u - 1], want)
        np.testing.assert_array_equal(new_e[0] if u == 0 else new_e[1][u - 1], (x - np_roundtrip(x, WIRE)).reshape(-1))
        g = np.sqrt(sum(np.sum(np.square(v.astype(np.float64))) for v in jax.tree.leaves(_unit(delta, u))))
        np.testing.assert_allclose(norms[u], g, rtol=1e-6)


@pytest.mark.parametrize("wire", ["topk2", "topk4"])
def test_post_bytes_match_the_bits_per_parameter(wire):
    """The packed rows are the sparse wire's payload: bits_per_param of the units' sizes, exactly;
    the .npz framing and the norms add a fixed few hundred bytes."""
    rng = np.random.default_rng(4)
    theta = {"root": {"embed": np.zeros((300, 64), np.float32)}, "layers": {"w": np.zeros((2, 64, 256), np.float32)}}
    delta = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), theta)
    codec = Codec.from_name(wire)
    rows, norms, _ = _encode(delta, PK.zero_residual(theta, True, codec), wire)
    sizes = [300 * 64, 64 * 256, 64 * 256]
    want_bits = codec.bits_per_param(sizes) * sum(sizes)
    assert 8 * sum(r.nbytes for r in rows) == round(want_bits) == 8 * PK.post_bytes(theta, True, codec)
    data = R.Post(0, 1, rows, 1, 1, 0.0, "", wire=wire, norms=norms).encode()
    f32 = R.Post(0, 1, jax.tree.leaves(delta), 1, 1, 0.0, "").encode()
    assert 0 < len(data) - want_bits / 8 < 1500 and 4 * sum(sizes) < len(f32) < 4 * sum(sizes) + 1500


def test_a_mismatched_reader_fails_naming_both():
    rng = np.random.default_rng(5)
    theta = _theta(rng)
    rows, norms, _ = _encode(theta, PK.zero_residual(theta, True, CODEC))
    data = R.Post(2, 1, rows, 1, 1, 0.0, "", wire=WIRE, norms=norms).encode()
    assert R.Post.decode(data, "p", "topk2;chunk=16;k=4;decay=0.9").worker == 2  # the decay is the poster's
    with pytest.raises(ValueError, match=r"p: the post carries 'topk2;chunk=16;k=4' .* reads 'none'"):
        R.Post.decode(data, "p", "none")
    with pytest.raises(ValueError, match=r"reads 'topk4;chunk=16;k=4'"):
        R.Post.decode(data, "p", "topk4;chunk=16;k=4")
    f32 = R.Post(2, 1, jax.tree.leaves(theta), 1, 1, 0.0, "").encode()
    with pytest.raises(ValueError, match=r"carries 'none' pseudo gradients, this worker reads 'topk2"):
        R.Post.decode(f32, "p", WIRE)
    leaves, meta = R.unpack(data, "p")
    with pytest.raises(ValueError, match="post format 3 is unknown to this reader"):
        R.Post.decode(R.pack(leaves, {**meta, "format": 3}), "p", WIRE)
    wrong = R.Post(2, 1, [rows[0][:-1], rows[1]], 1, 1, 0.0, "", wire=WIRE, norms=norms)
    start = OuterRound(Plan("a_edit", A_EDIT_RULE, True, Penalty.off(), OuterSpec("nesterov", 1.0, 0.0, False)),
                       CODEC).initial(theta, slots=1, n_units=3, window=2)
    with pytest.raises(ValueError, match="worker 2's packed post has rows"):
        OuterRound(Plan("a_edit", A_EDIT_RULE, True, Penalty.off(), OuterSpec("nesterov", 1.0, 0.0, False)),
                   CODEC).apply(start, [wrong])


def _config(*extra):
    from edit_jax.validate import load_config

    return load_config(os.path.join(ROOT, "configs", "tiny.py"), [
        "sync.method=a_edit", "sync.exchange.url=/tmp/unused-exchange", "sync.warmup_steps=0", "mesh.replica=2",
        "mesh.shard=1", "mesh.processes=2", *extra])


def test_config_exchange_with_sparse_posts():
    from edit_jax.validate import ConfigError

    for kind in ("topk2", "topk4"):
        assert _config(f"sync.wire.kind={kind}", "sync.wire.error_feedback=true").sync.wire.kind == kind
    with pytest.raises(ConfigError, match=r"sync\.wire\.error_feedback"):
        _config("sync.wire.kind=topk2")
    for kind in ("int8", "bf16"):
        with pytest.raises(ConfigError, match=r"sync\.wire\.kind.*int8 / bf16 posts are not built"):
            _config(f"sync.wire.kind={kind}", "sync.wire.error_feedback=true")
