"""Streaming (staggered) sync and quantized pseudo gradients (issue 8), against independent NumPy
re-computations and the compiled HLO.

- The fragment partition against a brute force over every contiguous split; the schedule against
  the formula of the issue ((k − W) mod τ == f·τ/F).
- A few steps of a staggered EDiT / DiLoCo run against the same steps with the due group's sync done
  in NumPy (Algorithm 2 from test_edit_sync.np_sync, on that group's units only) and the rest by the
  machinery's plain local step.
- The HLO of a staggered sync step: only the due group's bytes cross ``replica``.
- int8 / bf16: quantization and the exchange (both collective patterns) against NumPy; the full
  sync with compress=int8 against a NumPy Algorithm 2 whose average goes through the same
  quantization (per device, per FSDP block); the wire dtype in the compiled HLO; error feedback
  exact over two syncs on a constructed example.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from edit_jax.config import ConfigError, MeshConfig
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.quantize import BLOCK, compressed_weighted_sum, dequantize_int8, exchange_pattern, quantize_int8
from edit_jax.localsgd.fragments import balanced_groups, fragment_of_unit, unit_param_counts
from edit_jax.localsgd.methods import StepKind, plan_for
from edit_jax.localsgd.outer import Penalty
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.sharding import REPLICA, SHARD
from edit_jax.localsgd.state import state_shapes
from edit_jax.runtime.mesh import make_mesh
from edit_jax.analysis import hlo
from tests.stages import one_stage
from test_edit_sync import (BASE, BASE4, PERM, Ref, _assert_det_close, _assert_tree_close, _batch, _cfg,
                            _crafted_state, _det_tuple, _host, _put, _ref_of, _unit, np_detector_feed,
                            np_detector_flags, np_sync)



def step_kind(cfg, k):
    return str(plan_for(cfg).schedule.kind(k))  # the kind's record name, e.g. "sync_forward@1"

N4, S2 = 4, 2
EDIT4 = [*BASE4, "sync.method=edit", "sync.penalty.anomaly_alpha=0.3", "sync.penalty.temperature=0.5",
         "sync.penalty.clip_threshold=0.2", "sync.outer.lr=0.7", "sync.outer.momentum=0.8"]


def _mesh(cfg):
    return make_mesh(cfg.mesh, jax.devices()[8:16], device_order=PERM)


# ============================================================================= partition and schedule


def test_balanced_groups_against_brute_force():
    """The contiguous split with the smallest largest group, checked against every split."""
    rng = np.random.default_rng(0)
    for _trial in range(30):
        n = int(rng.integers(2, 8))
        sizes = [int(x) for x in rng.integers(1, 100, n)]
        for groups in range(1, n + 1):
            got = balanced_groups(sizes, groups)
            assert got[0] == 0 and list(got) == sorted(got) and set(got) == set(range(groups))
            best = min(max(sum(sizes[a:b]) for a, b in zip((0,) + cuts, cuts + (n,), strict=True))
                       for cuts in itertools.combinations(range(1, n), groups - 1))
            assert max(sum(s for s, g in zip(sizes, got, strict=True) if g == f) for f in range(groups)) == best


def test_fragment_of_unit_demo_and_tiny():
    demo = _cfg("model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
                "model.ffn_dim=384")
    sizes = unit_param_counts(demo)
    assert sizes == [2 * 320 * 128 + 128] + [4 * 128 * 128 + 3 * 128 * 384 + 2 * 128] * 4
    assert sum(sizes) == 935_040  # the demo model (docs/benchmarks/demo.md)
    # Root (82,048) + 4 layers (213,248 each): F = 2 -> {root, L0, L1} {L2, L3}; F = 4 -> {root, L0} {L1} {L2} {L3}.
    assert fragment_of_unit(_cfg("model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
                                 "model.ffn_dim=384", "sync.tau=4", "sync.fragments=2")) == (0, 0, 0, 1, 1)
    assert fragment_of_unit(_cfg("model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
                                 "model.ffn_dim=384", "sync.tau=4", "sync.fragments=4")) == (0, 0, 1, 2, 3)
    # tiny, 3 layers: root 41,024 > layer 36,992: {root, L0} {L1, L2}.
    assert fragment_of_unit(_cfg(*BASE, "sync.tau=4", "sync.fragments=2")) == (0, 0, 1, 1)


@pytest.mark.parametrize("method", ["edit", "diloco"])
def test_staggered_schedule(method):
    """Group f syncs at (k − W) mod τ == f·τ/F (EDiT, in step k's forward; DiLoCo after step k − 1,
    i.e. (k + 1 − W) mod τ == f·τ/F); every unit syncs exactly once per τ steps; F = 1 is today's."""
    w, tau, steps = 3, 8, 40
    for frags in (1, 2, 4, 8):
        cfg = _cfg(*BASE, "model.n_layers=7", f"sync.method={method}", f"sync.warmup_steps={w}", f"sync.tau={tau}",
                   f"sync.fragments={frags}")
        kinds = [step_kind(cfg, k) for k in range(steps)]
        assert kinds[:w] == ["hsdp"] * w
        shift = 0 if method == "edit" else 1
        base_kind = "sync_forward" if method == "edit" else "local_then_sync"
        for k in range(w, steps):
            j = k + shift - w
            due = [f for f in range(frags) if j > 0 and j % tau == f * tau // frags]
            want = "local" if not due else (base_kind if frags == 1 else f"{base_kind}@{due[0]}")
            assert kinds[k] == want, (frags, k)
        groups = [StepKind.parse(x).group for x in kinds if x.startswith(base_kind)]
        # Round robin over the groups: each group once per τ window.
        assert groups[:2 * frags] == ([None] * 2 if frags == 1
                                      else list(range(1, frags)) + [0] + list(range(1, frags)) + [0])
    # F = 1 is exactly the schedule of before (test_edit_sync.test_step_kind_schedule's numbers).
    one = _cfg(*BASE, f"sync.method={method}", "sync.warmup_steps=4", "sync.tau=4")
    syncs = [k for k in range(20) if step_kind(one, k) != "local" and step_kind(one, k) != "hsdp"]
    assert syncs == ([8, 12, 16] if method == "edit" else [7, 11, 15, 19])


@pytest.mark.parametrize("overrides,key", [
    (["sync.tau=6", "sync.fragments=4"], "sync.fragments"),
    (["sync.tau=8", "sync.fragments=8"], "sync.fragments"),  # 3 layers: 4 units < 8
    (["sync.fragments=0"], "sync.fragments"),
    (["sync.wire.kind=fp8"], "sync.wire.kind"),
    (["sync.wire.error_feedback=true"], "sync.wire.error_feedback"),
    (["sync.wire.kind=int8", "sync.outer_sharding=replica_shard"], "sync.wire.kind"),
])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        _cfg(*BASE, "sync.method=edit", *overrides)


def test_defaults_keep_the_state_structure():
    """fragments=1, compress=none: no residual in the state (checkpoints keep their structure)."""
    cfg = _cfg(*BASE4, "sync.method=edit")
    assert state_shapes(cfg).outer.extra is None
    ef = state_shapes(_cfg(*BASE4, "sync.method=edit", "sync.wire.kind=int8", "sync.wire.error_feedback=true"))
    assert jax.tree.structure(ef.outer.extra["residual"]) == jax.tree.structure(ef.params)
    assert ([x.shape for x in jax.tree.leaves(ef.outer.extra["residual"])]
            == [x.shape for x in jax.tree.leaves(ef.params)])


# ============================================================================= staggered sync vs NumPy


def _group_units(m: StepPrograms, f: int) -> list[int]:
    return [u for u, g in enumerate(m.groups) if g == f]


def _np_group_sync(host, m: StepPrograms, f: int, r: Ref, avg_fn=None):
    """``host`` with fragment f's units synced by the NumPy Algorithm 2 (the other units as they were)."""
    n_units = 1 + m.cfg.model.n_layers
    run = np_sync if avg_fn is None else (lambda *a: np_sync_compressed(*a, avg_fn=avg_fn))
    theta, trace, det, params, info = run(host.outer.params, host.outer.trace, host.params,
                                          _det_tuple(host.outer.detector), r)
    out = jax.tree.map(lambda x: np.array(x), host)
    units = _group_units(m, f)
    for u in units:
        for dst, src in ((out.outer.params, theta), (out.outer.trace, trace)):
            for a, b in zip(_unit(dst, u), _unit(src, u), strict=True):
                a[...] = b
        for i in range(m.n):
            for a, b in zip(_unit(jax.tree.map(lambda x: x[i], out.params), u),  # noqa: B023 - called at once
                            _unit(jax.tree.map(lambda x: x[i], params), u), strict=True):  # noqa: B023 - called at once
                a[...] = b
    for dst, src in zip((out.outer.detector.mean, out.outer.detector.m2, out.outer.detector.count,
                         out.outer.detector.window), det, strict=True):
        dst[:, units] = src[:, units]
    assert sorted(set(range(n_units)) - set(units)) == [u for u in range(n_units) if m.groups[u] != f]
    return out, {k: v[units] for k, v in info.items()}


@pytest.mark.parametrize("method", ["edit", "diloco"])
def test_staggered_steps_match_numpy_reference(method):
    """Five steps (τ = 4, F = 2, groups {root, L0} {L1, L2}) from the crafted state of
    test_edit_sync: [local, local, sync@1, local, sync@0] for EDiT (sync in the step's forward) and
    [local, sync@1, local, sync@0, local] for DiLoCo (sync after the step). The reference runs the
    machinery's plain local step and the due group's sync in NumPy; params, AdamW state, θ̄, trace,
    detectors and the sync metrics must agree, and the units outside the group stay untouched."""
    one_stage("3.12" if method == "edit" else "default", f"the staggered {method} steps", 30,
              other="the other method's")
    extra = [] if method == "edit" else ["sync.layerwise=false", "sync.penalty.anomaly=false",
                                         "sync.penalty.weighting=false", "sync.penalty.clip=false"]
    cfg = _cfg(*EDIT4, f"sync.method={method}", *extra, "sync.tau=4", "sync.fragments=2")
    m = StepPrograms.for_config(cfg, _mesh(cfg))
    assert m.groups == (0, 0, 1, 1)
    r = _ref_of(cfg)
    if method == "diloco":  # DiLoCo's plan is Penalty.off(): its detector (unused) runs with the defaults
        off = Penalty.off()
        r = dataclasses.replace(r, alpha=off.alpha, k=off.warmup)
    start = _crafted_state(m, _host(m.init_state(0)))
    kinds = [step_kind(cfg, k) for k in range(5)]
    assert kinds == (["local", "local", "sync_forward@1", "local", "sync_forward@0"] if method == "edit" else
                     ["local", "local_then_sync@1", "local", "local_then_sync@0", "local"])
    got, ref = _put(m, start), start
    for k, kind in enumerate(kinds):
        batch = m.put_batch(_batch(k, cfg))
        before = _host(got)
        got, metrics = m.step_fn(kind)(got, batch)
        base, group = StepKind.parse(kind).name, StepKind.parse(kind).group
        if base == "sync_forward":
            ref, info = _np_group_sync(ref, m, group, r)
        ref = _host(m.step_fn("local")(_put(m, ref), batch)[0])
        if base == "local_then_sync":
            ref, info = _np_group_sync(ref, m, group, r)
        if group is not None:
            metrics = _host(metrics)
            np.testing.assert_array_equal(np.asarray(metrics["unit_flagged"]), info["flagged"], err_msg=kind)
            np.testing.assert_allclose(np.asarray(metrics["unit_weight"]), info["w"], atol=1e-5, err_msg=kind)
            np.testing.assert_allclose(np.asarray(metrics["unit_pseudo_grad_norm"]), info["g"], rtol=1e-4, err_msg=kind)
            host = _host(got)
            for u in range(1 + cfg.model.n_layers):  # units outside the group: outer state untouched
                if m.groups[u] != group:
                    for a, b in zip(_unit(host.outer.params, u) + _unit(host.outer.trace, u),
                                    _unit(before.outer.params, u) + _unit(before.outer.trace, u), strict=True):
                        np.testing.assert_array_equal(a, b)
                    np.testing.assert_array_equal(host.outer.detector.count[:, u], before.outer.detector.count[:, u])
        host = _host(got)
        what = f"{method} step {k} ({kind})"
        # AdamW divides by sqrt(v): float32 noise of the two paths' gradients (~1e-7) can move a lone
        # element with a tiny v after a step: by ~1e-6 under XLA:CPU's default -O2, by 1.6e-5 (1 of
        # 81,920; 1.9e-5 under jax 0.12) under the suite's -O0 (conftest.py); a wrong sync moves θ by ~1e-2.
        _assert_tree_close(host.params, ref.params, f"{what}: θ_i", rtol=1e-4, atol=1e-4)
        _assert_tree_close(host.opt_state, ref.opt_state, f"{what}: AdamW", rtol=1e-3, atol=1e-7)
        _assert_tree_close(host.outer.params, ref.outer.params, f"{what}: θ̄", rtol=1e-5, atol=1e-5)
        _assert_tree_close(host.outer.trace, ref.outer.trace, f"{what}: trace", rtol=1e-5, atol=1e-5)
        _assert_det_close(host.outer.detector, _det_tuple(ref.outer.detector), f"{what}: detector")


# ============================================================================= HLO of a staggered sync


def _cross_replica(m: StepPrograms, kind: str) -> dict:
    state = m.abstract_state()
    batch = jax.ShapeDtypeStruct((m.cfg.batch_size, m.cfg.data.seq_len + 1), jnp.int32,
                                 sharding=jax.sharding.NamedSharding(m.mesh, P((REPLICA, SHARD))))
    text = m.lowered(kind, state, batch).compile().as_text()
    return hlo.hlo_collectives(text, (m.n, m.s), default_trip=m.cfg.model.n_layers)


def test_hlo_staggered_sync_step_carries_only_its_group():
    """EDiT, N = 4, S = 2, 3 layers, F = 2 (groups {root, L0} {L1, L2}): the tensor bytes crossing
    `replica` in sync_forward@f are one float32 all-reduce of exactly group f's parameters per
    device, 2(N−1)/N x 4 B x |group f|/S; the two groups add up to the F = 1 sync step."""
    one_stage("default", "the staggered sync step's HLO", 35)
    cfg1 = _cfg(*EDIT4, "sync.tau=4")
    cfg2 = _cfg(*EDIT4, "sync.tau=4", "sync.fragments=2")
    m1, m2 = StepPrograms.for_config(cfg1, _mesh(cfg1)), StepPrograms.for_config(cfg2, _mesh(cfg2))
    sizes = unit_param_counts(cfg2)
    ring = 2 * (N4 - 1) / N4 * 4 / S2
    total = 0.0
    for f in range(2):
        parsed = _cross_replica(m2, f"sync_forward@{f}")
        tot = hlo.collective_totals(parsed, True)
        want = ring * sum(s for s, g in zip(sizes, m2.groups, strict=True) if g == f)
        assert tot["tensor_ring_bytes"] == pytest.approx(want, rel=1e-9), (f, tot["tensor_ring_bytes"], want)
        big = [r for r in parsed["collectives"] if r["crosses_replica"] and r["operand_bytes"] > 4 * N4]
        assert {r["op"] for r in big} == {"all-reduce"}
        total += tot["tensor_ring_bytes"]
    one = hlo.collective_totals(_cross_replica(m1, "sync_forward"), True)
    assert one["tensor_ring_bytes"] == pytest.approx(total, rel=1e-9)
    assert hlo.collective_totals(_cross_replica(m2, "local"), True)["ring_bytes"] == 0


# ============================================================================= quantization and the exchange


def np_quantize(x):
    """x [..., BLOCK] -> q, scale: scale = max|x|/127, q = round-half-even(x/scale), 0 for a zero block."""
    x = np.asarray(x, np.float32)
    scale = (np.max(np.abs(x), axis=-1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.where(scale[..., None] > 0, np.round(x / safe[..., None]), 0.0)
    return np.clip(q, -127, 127).astype(np.int8), scale


def np_roundtrip(x, compress):
    if compress == "int8":
        q, s = np_quantize(x)
        return q.astype(np.float32) * s[..., None]
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def test_quantize_int8_matches_numpy():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, BLOCK)) * np.array([1e-3, 1, 50, 0, 1e-8, 3])[:, None]).astype(np.float32)
    q, s = jax.jit(quantize_int8)(x)
    qn, sn = np_quantize(x)
    np.testing.assert_array_equal(np.asarray(q), qn)
    np.testing.assert_array_equal(np.asarray(s), sn)
    assert np.asarray(q).dtype == np.int8 and np.abs(np.asarray(q)).max() == 127
    err = np.abs(np.asarray(dequantize_int8(q, s)) - x)
    assert np.all(err <= sn[:, None] / 2 * (1 + 1e-6))  # half a quantum at most
    assert np.all(np.asarray(q)[3] == 0) and float(np.asarray(s)[3]) == 0.0  # a zero block


def _exchange(mesh, n, deltas, w, compress, pattern, residual=None):
    """compressed_weighted_sum on a (n, 1) mesh: deltas [n, ...] (worker i's row)."""
    def body(d, w, e):
        avg, res = compressed_weighted_sum({"a": d[0]}, w, Codec(compress), None if e is None else {"a": e[0]}, pattern)
        return avg["a"], (res["a"][None] if res is not None else d)

    rep = P(REPLICA)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rep, P(), rep if residual is not None else P()),
                              out_specs=(P(), rep)))
    avg, res = f(jnp.asarray(deltas), jnp.asarray(w), None if residual is None else jnp.asarray(residual))
    return np.asarray(avg), (np.asarray(res) if residual is not None else None)


@pytest.mark.parametrize("compress", ["int8", "bf16"])
@pytest.mark.parametrize("n,pattern", [(2, "all_gather"), (4, "all_gather"), (4, "all_to_all")])
def test_compressed_exchange_matches_numpy(compress, n, pattern):
    """Σ_i w_i·Δ_i with Δ_i crossing in ``compress``: all-gather: Σ_i w_i·deq(q(Δ_i)) in float32;
    all-to-all: the same sum per chunk, requantized (chunks are whole blocks). Padding: a 1000-element
    leaf becomes ceil(1000 / (N·256))·N·256 elements."""
    assert exchange_pattern(2) == "all_gather" and exchange_pattern(4) == "all_to_all"
    mesh = make_mesh(MeshConfig(replica=n, shard=1), jax.devices()[:n])
    rng = np.random.default_rng(n)
    deltas = (rng.standard_normal((n, 10, 100)) * np.geomspace(1e-3, 10, 10)[None, :, None]).astype(np.float32)
    w = rng.dirichlet(np.ones(n)).astype(np.float32)
    got, _ = _exchange(mesh, n, deltas, w, compress, pattern)
    m = deltas[0].size
    padded = -(-m // (n * BLOCK)) * n * BLOCK
    blocks = np.zeros((n, padded), np.float32)
    blocks[:, :m] = deltas.reshape(n, -1)
    deq = np_roundtrip(blocks.reshape(n, -1, BLOCK), compress)
    want = np.sum(w[:, None, None] * deq, axis=0, dtype=np.float32)
    tol = np.full(want.shape, 1e-6 * np.abs(want).max())
    if pattern == "all_to_all":
        exact = want
        want = np_roundtrip(want, compress)
        # One quantum of the second rounding at most (float32 sum order may tip a .5 the other way).
        tol = np.broadcast_to((np.abs(exact).max(-1) / 127.0)[:, None] if compress == "int8"
                              else np.abs(exact) * 2.0 ** -7, want.shape) * 1.0001
    diff = np.abs(got.reshape(-1) - want.reshape(-1)[:m])
    assert np.all(diff <= tol.reshape(-1)[:m] + 1e-30), np.max(diff / (tol.reshape(-1)[:m] + 1e-30))
    assert np.mean(diff <= 1e-6 * np.abs(want).max()) > 0.999
    exact_sum = np.einsum("i,i...->...", w.astype(np.float64), deltas.astype(np.float64))
    rel = np.linalg.norm(got - exact_sum) / np.linalg.norm(exact_sum)
    assert rel < (0.02 if compress == "int8" else 0.01), rel


def test_error_feedback_exact_over_two_syncs():
    """Constructed example, N = 2, weights (0.5, 0.5), one block with max |x| = 127 (scale 1), the
    same Δ at both syncs: worker 0 (127, 0.5, 2.5, 0, ...), worker 1 (127, 0.5, −1.5, 0, ...).
    int8 rounds half to even: 0.5 -> 0, 2.5 -> 2, −1.5 -> −2, residuals 0.5 everywhere they are not
    0. With error feedback the second sync sends 1.0, 3.0 and −1.0, all exact: the two syncs' sums
    add up to the exact 2·Σ_i w_i·Δ_i, bit for bit, and the residuals return to 0. Without it the
    elements 1 and 2 are lost both times (sum 0 instead of 1)."""
    mesh = make_mesh(MeshConfig(replica=2, shard=1), jax.devices()[:2])
    d = np.zeros((2, BLOCK), np.float32)
    d[:, 0] = 127.0
    d[:, 1] = 0.5
    d[0, 2], d[1, 2] = 2.5, -1.5
    w = np.array([0.5, 0.5], np.float32)
    s1, res1 = _exchange(mesh, 2, d, w, "int8", "all_gather", np.zeros_like(d))
    want_res = np.zeros_like(d)
    want_res[:, 1:3] = 0.5
    np.testing.assert_array_equal(res1, want_res)
    s2, res2 = _exchange(mesh, 2, d, w, "int8", "all_gather", res1)
    np.testing.assert_array_equal(res2, np.zeros_like(d))
    exact = 2 * (w @ d)
    np.testing.assert_array_equal(exact[:3], [254.0, 1.0, 1.0])
    np.testing.assert_array_equal(s1 + s2, exact)  # exact, not approximately
    n1, _ = _exchange(mesh, 2, d, w, "int8", "all_gather")  # without error feedback
    np.testing.assert_array_equal(2 * n1[:3], [254.0, 0.0, 0.0])


# ============================================================================= the compressed sync vs NumPy


def np_compressed_avg(deltas, ok, w, dims, s, n, compress, pattern):
    """The weighted average of the workers' unit deltas (lists of full leaves per worker) as the
    device exchange computes it: per shard index, each worker's FSDP blocks of the unit's leaves
    flattened in order, zero-padded to N·BLOCK, quantized per block, summed in float32 with the
    weights, requantized per block for the all-to-all pattern, and put back into full leaves."""
    out = [np.zeros(x.shape, np.float32) for x in deltas[0]]
    for sh in range(s):
        vecs = []
        for i in range(n):
            parts = [np.split(np.asarray(x, np.float32), s, axis=d)[sh] for x, d in zip(deltas[i], dims, strict=True)]
            vecs.append(np.concatenate([p.reshape(-1) for p in parts]) if ok[i] else
                        np.zeros(sum(p.size for p in parts), np.float32))
        m = vecs[0].size
        padded = -(-m // (n * BLOCK)) * n * BLOCK
        blocks = np.zeros((n, padded), np.float32)
        blocks[:, :m] = np.stack(vecs)
        total = np.sum(w[:, None, None].astype(np.float32) * np_roundtrip(blocks.reshape(n, -1, BLOCK), compress),
                       axis=0, dtype=np.float32)
        if pattern == "all_to_all":
            total = np_roundtrip(total, compress)
        flat, at = total.reshape(-1), 0
        for j, (x, d) in enumerate(zip(deltas[0], dims, strict=True)):
            shape = list(x.shape)
            shape[d] //= s
            piece = flat[at:at + math.prod(shape)].reshape(shape)
            at += piece.size
            idx = [slice(None)] * x.ndim
            idx[d] = slice(sh * shape[d], (sh + 1) * shape[d])
            out[j][tuple(idx)] = piece
    return out


def np_sync_compressed(theta, trace, params, det, r: Ref, avg_fn):
    """test_edit_sync.np_sync with the weighted average replaced by ``avg_fn(u, deltas, ok, w)``."""
    theta = jax.tree.map(lambda x: np.array(x, np.float64), theta)
    trace = jax.tree.map(lambda x: np.array(x, np.float64), trace)
    params = jax.tree.map(lambda x: np.array(x, np.float64), params)
    mean, m2 = np.array(det[0], np.float64), np.array(det[1], np.float64)
    count, window = np.array(det[2], np.int64), np.array(det[3], np.float64)
    n, n_units = mean.shape
    info = {"g": np.zeros((n_units, n)), "w": np.zeros((n_units, n)), "flagged": np.zeros((n_units, n), bool),
            "clip": np.ones(n_units), "skipped": np.zeros(n_units, bool)}
    for u in range(n_units):
        tb, tr = _unit(theta, u), _unit(trace, u)
        deltas = [[t - x for t, x in zip(
                       tb, _unit(jax.tree.map(lambda a: a[i], params), u), strict=True)]  # noqa: B023 - called at once
                  for i in range(n)]
        g = np.array([math.sqrt(sum(float(np.sum(d * d)) for d in deltas[i])) for i in range(n)])
        flagged = np.zeros(n, bool)
        for i in range(n):
            flagged[i] = r.anomaly and np_detector_flags(mean[i, u], m2[i, u], count[i, u], window[i, u], g[i], r)
            if not flagged[i]:
                mean[i, u], m2[i, u], count[i, u], window[i, u] = np_detector_feed(
                    mean[i, u], m2[i, u], count[i, u], window[i, u], g[i], r)
        ok = ~flagged
        w = np.zeros(n)
        if ok.any():
            if r.weighting:
                e = np.exp(-g[ok] / r.temperature - (-g[ok] / r.temperature).max())
                w[ok] = e / e.sum()
            else:
                w[ok] = 1.0 / ok.sum()
            avg = [np.asarray(a, np.float64) for a in avg_fn(u, deltas, ok, w)]
            norm = math.sqrt(sum(float(np.sum(a * a)) for a in avg))
            c = min(1.0, r.phi / (norm + 1e-6)) if r.clip else 1.0
            avg = [a * c for a in avg]
            for j in range(len(tb)):
                tr[j][...] = r.mu * tr[j] + avg[j]
                tb[j][...] = tb[j] - r.lr * (avg[j] + r.mu * tr[j])
            info["clip"][u] = c
        else:
            info["skipped"][u] = True
        info["g"][u], info["w"][u], info["flagged"][u] = g, w, flagged
    new_params = jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), theta)
    return theta, trace, (mean, m2, count, window), new_params, info


@pytest.mark.parametrize("compress", ["int8", "bf16"])
def test_compressed_sync_matches_numpy_reference(compress):
    """The whole sync (sync_fn) and the layer-wise sync (sync_forward@f) with compress on the crafted
    state: norms, flags and weights equal the uncompressed NumPy Algorithm 2 (computed before
    quantization); θ̄, trace and θ_i equal the NumPy Algorithm 2 whose average goes through the
    same per-device block quantization (all-to-all pattern at N = 4). The HLO carries the payload
    in s8 (int8) or u16 (bf16 bits) across `replica` and no float32 tensor."""
    one_stage("default" if compress == "int8" else "3.12", f"the {compress} sync against NumPy", 27,
              other="the other codec's")
    cfg = _cfg(*EDIT4, f"sync.wire.kind={compress}", "sync.tau=4", "sync.fragments=2")
    m = StepPrograms.for_config(cfg, _mesh(cfg))
    start = _crafted_state(m, _host(m.init_state(0)))
    r = _ref_of(cfg)
    dims = [jax.tree.leaves(m.layout.unit_dims["root"]), jax.tree.leaves(m.layout.unit_dims["layer"])]

    def avg_fn(u, deltas, ok, w):
        return np_compressed_avg(deltas, ok, w, dims[0 if u == 0 else 1], m.s, m.n, compress, "all_to_all")

    theta, trace, det, params, info = np_sync_compressed(start.outer.params, start.outer.trace, start.params,
                                                         _det_tuple(start.outer.detector), r, avg_fn)
    plain = np_sync(start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector), r)[-1]
    synced, metrics = _host(m.sync_fn()(_put(m, start)))
    np.testing.assert_array_equal(np.asarray(metrics["unit_flagged"]), plain["flagged"])
    np.testing.assert_allclose(np.asarray(metrics["unit_pseudo_grad_norm"]), plain["g"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(metrics["unit_weight"]), plain["w"], atol=1e-5)
    atol = 1e-6 if compress == "bf16" else 2e-6
    _assert_tree_close(synced.outer.params, theta, "θ̄", rtol=1e-5, atol=atol)
    _assert_tree_close(synced.outer.trace, trace, "trace", rtol=1e-5, atol=atol)
    _assert_det_close(synced.outer.detector, det, "detector")
    # The compressed result is not the uncompressed one (the quantization is really there).
    theta_plain = np_sync(start.outer.params, start.outer.trace, start.params, _det_tuple(start.outer.detector), r)[0]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(synced.outer.params),
                                                             jax.tree.leaves(theta_plain), strict=True))
    assert diff > 1e-6
    # Layer-wise, group 1 (layers 1, 2) at step 0 (inner lr 0): its units as the reference, θ_i = θ̄.
    stepped, _ = _host(m.step_fn("sync_forward@1")(_put(m, start), m.put_batch(_batch(0, cfg))))
    for u in (2, 3):
        for a, b in zip(_unit(stepped.outer.params, u), _unit(theta, u), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol)
        for i in range(m.n):
            for a, b in zip(_unit(jax.tree.map(lambda x: x[i], stepped.params), u),  # noqa: B023 - called at once
                            _unit(theta, u), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol)
    # Wire dtype in the compiled sync programs.
    wire = "s8" if compress == "int8" else "u16"
    for kind in ("sync_forward@0", "sync_forward@1"):
        cross = [r_ for r_ in _cross_replica(m, kind)["collectives"] if r_["crosses_replica"]]
        big = {o.split("[")[0] for r_ in cross for o in r_["operands"] if r_["operand_bytes"] > 1024}
        assert big == {wire}, (kind, big)
        assert {r_["op"] for r_ in cross if r_["operand_bytes"] > 1024} == {"all-to-all", "all-gather"}


def test_error_feedback_state_through_the_machinery():
    """With sync.wire.error_feedback the state holds each worker's residual (sharded like the params);
    after a sync it is the part of Δ_i the int8 exchange dropped: Δ_i − deq(q(Δ_i)) on each device
    block, non-zero, smaller than half a quantum; a flagged worker's residual is 0."""
    cfg = _cfg(*EDIT4, "sync.wire.kind=int8", "sync.wire.error_feedback=true")
    m = StepPrograms.for_config(cfg, _mesh(cfg))
    start = _crafted_state(m, _host(m.init_state(0)))
    assert start.outer.extra["residual"] is not None
    assert m.state_specs.outer.extra["residual"] == m.state_specs.params  # [N, ...], sharded like the params
    synced, metrics = _host(m.sync_fn()(_put(m, start)))
    flags = np.asarray(metrics["unit_flagged"])  # [U, N]
    for u in range(1 + cfg.model.n_layers):
        for i in range(m.n):
            res = _unit(jax.tree.map(lambda x: x[i], synced.outer.extra["residual"]), u)  # noqa: B023 - called at once
            if flags[u, i]:
                assert all(np.all(x == 0) for x in res), (u, i)
                continue
            delta = [t - x for t, x in zip(
                _unit(start.outer.params, u),
                _unit(jax.tree.map(lambda x: x[i], start.params), u), strict=True)]  # noqa: B023 - called at once
            amax = max(float(np.max(np.abs(d))) for d in delta)
            assert max(float(np.max(np.abs(x))) for x in res) <= amax / 127 / 2 * 1.001
            assert max(float(np.max(np.abs(x))) for x in res) > 0
            # Δ_i − residual is on the int8 grid of its block: re-quantizing it changes nothing.
            dims = jax.tree.leaves(m.layout.unit_dims["root" if u == 0 else "layer"])
            sent = [d - x for d, x in zip(delta, res, strict=True)]
            back = np_compressed_avg([sent], [True], np.ones(1), dims, m.s, 1, "int8", "all_gather")
            for a, b in zip(back, sent, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def test_error_feedback_residual_is_checkpointed(tmp_path):
    """The residual is saved and restored with the state; a resume that turns error feedback on or
    off is refused naming the key (the state's structure differs)."""
    from edit_jax.rundir.checkpoint import Checkpointer, CheckpointError

    cfg = _cfg(*BASE4, "sync.method=edit", "sync.wire.kind=int8", "sync.wire.error_feedback=true")
    m = StepPrograms.for_config(cfg, _mesh(cfg))
    host = _host(m.init_state(0))
    rng = np.random.default_rng(5)
    host = host.replace(outer=host.outer.replace(extra={"residual": jax.tree.map(
        lambda x: rng.standard_normal(x.shape).astype(np.float32), host.outer.extra["residual"])}))
    ck = Checkpointer(str(tmp_path), 2)
    try:
        ck.save(3, _put(m, host), {"position": 0}, cfg)
        ck.check_compatible(ck.read_meta(3), cfg, 3)
        with pytest.raises(CheckpointError, match="sync.wire.error_feedback"):
            ck.check_compatible(ck.read_meta(3), _cfg(*BASE4, "sync.method=edit", "sync.wire.kind=int8"), 3)
        restored, _ = ck.restore(3, m.abstract_state())
        _assert_tree_close(_host(restored.outer.extra["residual"]), host.outer.extra["residual"], "residual",
                           rtol=0, atol=0)
    finally:
        ck.close()
