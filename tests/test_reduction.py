"""The reduction is a parameter of the sync (localsgd/reduction.py): the same penalty and outer
step run with the workers' values on their own devices (a psum over `replica`, what training
runs) and with them stacked on a leading axis of one program (a sum over that axis), and give the
same θ̄, outer optimizer state, detectors, residuals and figures (to float32 rounding)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.methods import OuterSpec, Penalty
from edit_jax.localsgd.outer import Detector, make_outer_optimizer, sync_unit
from edit_jax.localsgd.reduction import ReplicaPsum, Stacked
from edit_jax.localsgd.sharding import REPLICA, SHARD

N, S, K = 3, 2, 4


def _inputs(seed: int, n: int):
    """A unit of two leaves (FSDP dim 0, S blocks), every worker's params, θ̄, a warm detector per
    worker, an outer momentum buffer; worker 1's pseudo gradient is 50x the others' (flagged)."""
    rng = np.random.default_rng(seed)
    theta = {"w": rng.normal(size=(8, 5)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    scale = np.ones(n, np.float32)
    scale[1] = 50.0
    local = {k: (v[None] - scale.reshape((n,) + (1,) * v.ndim) * 0.01
                 * rng.normal(size=(n,) + v.shape)).astype(np.float32)
             for k, v in theta.items()}
    window = rng.normal(size=(n, K)).astype(np.float32) * 0.5
    det = Detector(np.full(n, 0.05, np.float32), np.full(n, 1e-4, np.float32), np.full(n, 10, np.int32), window)
    residual = {k: (0.001 * rng.normal(size=v.shape)).astype(np.float32) for k, v in local.items()}
    return local, theta, det, residual


def _both(compress: str, n: int, with_residual: bool, penalty: Penalty):
    local, theta, det, residual = _inputs(0, n)
    opt = make_outer_optimizer(OuterSpec("nesterov", 0.7, 0.9, True))
    opt_state = opt.init(theta)
    res = residual if with_residual else None
    mesh = Mesh(np.array(jax.devices()[: n * S]).reshape(n, S), (REPLICA, SHARD))
    fsdp = {"w": P(SHARD), "b": P(SHARD)}
    per_worker = {"w": P(REPLICA, SHARD), "b": P(REPLICA, SHARD)}
    opt_specs = jax.tree.map(lambda x: P(SHARD) if np.ndim(x) else P(), opt_state)

    # Each worker on its own devices: the harness's psum over `replica`.
    def psum_body(theta_s, opt_s, local, det, res):
        one = jax.tree.map(lambda x: x[0], (local, det, res))
        out = sync_unit(one[0], theta_s, opt_s, one[1], penalty, opt, codec=Codec(compress), residual=one[2],
                        reduction=ReplicaPsum())
        return out.outer_params, out.opt_state, jax.tree.map(lambda x: x[None], out.detector), out.metrics, \
            (None if out.residual is None else jax.tree.map(lambda x: x[None], out.residual))

    # Every worker stacked in one program (still FSDP blocks over `shard`).
    def stacked_body(theta_s, opt_s, local, det, res):
        out = sync_unit(local, theta_s, opt_s, det, penalty, opt, codec=Codec(compress), residual=res,
                        reduction=Stacked(norm_axes=SHARD))
        return out.outer_params, out.opt_state, out.detector, out.metrics, out.residual, out.params

    det_spec = Detector(P(REPLICA), P(REPLICA), P(REPLICA), P(REPLICA))
    metric_specs = {k: P() for k in ("pseudo_grad_norm", "weight", "flagged", "avg_norm", "clip_factor", "update_norm")}
    out_psum = jax.jit(jax.shard_map(
        psum_body, mesh=mesh,
        in_specs=(fsdp, opt_specs, per_worker, det_spec, per_worker if res is not None else None),
        out_specs=(fsdp, opt_specs, det_spec, metric_specs,
                   per_worker if (res is not None and compress != "none") else None),
        check_vma=False))(theta, opt_state, local, det, res)
    stacked_in = {"w": P(None, SHARD), "b": P(None, SHARD)}
    out_stacked = jax.jit(jax.shard_map(
        stacked_body, mesh=mesh,
        in_specs=(fsdp, opt_specs, stacked_in, P(), stacked_in if res is not None else None),
        out_specs=(fsdp, opt_specs, P(), metric_specs,
                   stacked_in if (res is not None and compress != "none") else None, stacked_in),
        check_vma=False))(theta, opt_state, local, det, res)
    return out_psum, out_stacked


def _close(a, b, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=2e-6, atol=1e-7,
                                   err_msg=what)


@pytest.mark.parametrize("compress,n,with_residual", [("none", N, False), ("int8", 2, True)])
def test_psum_and_stacked_reductions_agree(compress, n, with_residual):
    penalty = Penalty(warmup=K, threshold=3.0)
    (p_outer, p_opt, p_det, p_met, p_res), (s_outer, s_opt, s_det, s_met, s_res, s_params) = \
        _both(compress, n, with_residual, penalty)
    # The penalty did something: worker 1 flagged, a weight of 0, the others sharing 1.
    flags = np.asarray(s_met["flagged"])
    assert flags.tolist() == [i == 1 for i in range(n)], flags
    assert np.asarray(s_met["weight"])[1] == 0.0 and np.isclose(np.asarray(s_met["weight"]).sum(), 1.0)
    _close(p_outer, s_outer, "theta bar")
    _close(p_opt, s_opt, "outer optimizer state")
    _close(p_det, s_det, "detectors")
    _close(p_met, s_met, "figures")
    if with_residual:
        _close(p_res, s_res, "error-feedback residuals")
    # Every worker restarts from θ̄: the stacked params are N copies of it.
    for leaf, outer in zip(jax.tree.leaves(s_params), jax.tree.leaves(s_outer), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.broadcast_to(np.asarray(outer), np.shape(leaf)))


def test_stacked_reduction_matches_a_numpy_sync():
    """The stacked form against an independent NumPy sync (plain mean, no penalty, Nesterov)."""
    local, theta, det, _ = _inputs(1, N)
    opt = make_outer_optimizer(OuterSpec("nesterov", 0.7, 0.9, True))
    out = jax.jit(lambda lo, d: sync_unit(lo, theta, opt.init(theta), d, Penalty.off(), opt,
                                          reduction=Stacked()))(local, det)
    for k in theta:
        delta = (theta[k][None] - local[k]).astype(np.float64).mean(axis=0)
        m = delta  # first step: the momentum buffer is the update
        expected = theta[k] - 0.7 * (delta + 0.9 * m)
        np.testing.assert_allclose(np.asarray(out.outer_params[k]), expected, rtol=1e-5, atol=1e-6)
