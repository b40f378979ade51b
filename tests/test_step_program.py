"""How the step programs are built, where it matters for speed: every step donates the state it
consumes (no second copy of the params and optimizer state per step), a local step hands the
outer state back untouched (no copy), unrolling the layer scan changes no number, and the fused
FSDP gather (one collective per unit) equals the per-leaf gathers."""

import dataclasses

import jax
import numpy as np

from edit_jax.localsgd.methods import plan_for
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.training.evaluate import Evaluator
from tests.helpers import mesh_for, random_batch, tiny_config
from tests.stages import one_stage


def _buffers(tree):
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def test_machinery_takes_the_method_plan():
    """The caller computes the plan once and passes it in: the machinery's (and its layout's) cfg,
    plan and schedule are the plan's, the config as the method table normalised it, not a second
    normalisation of their own; ``for_config`` builds the same; the evaluator asks the machinery
    for the schedule."""
    # diloco fixes both off
    cfg = tiny_config(2, 2, method="diloco", sync={"layerwise": True, "penalty": {"anomaly": True}})
    mp = plan_for(cfg)
    m = StepPrograms(mp, mesh_for(cfg))
    assert m.cfg is mp.cfg and m.plan is mp.plan and m.schedule is mp.schedule
    assert m.layout.cfg is mp.cfg and m.layout.plan is mp.plan
    assert (m.cfg.sync.layerwise, m.cfg.sync.penalty.anomaly, cfg.sync.layerwise) == (False, False, True)
    other = StepPrograms.for_config(cfg, mesh_for(cfg))
    assert (other.cfg, other.plan, other.schedule) == (mp.cfg, mp.plan, mp.schedule)
    assert Evaluator(m).schedule is mp.schedule


def test_every_step_donates_its_state():
    """Every kind comes from ``StepPrograms.step_fn`` (one jit with ``donate_argnums=0``); checked on a
    local step and on the sync step, whose program also consumes and returns the outer state."""
    cfg = tiny_config(2, 2, method="edit")
    m = StepPrograms.for_config(cfg, mesh_for(cfg))
    state, batch = m.init_state(0), m.put_batch(random_batch(cfg))
    for kind in ("local", "sync_forward"):
        fn = m.step_fn(kind)
        state, _ = fn(state, batch)  # compile
        consumed = _buffers((state.step, state.params, state.opt_state, state.rng))
        outer_in = _buffers(state.outer)
        outer_ptrs = [x.addressable_shards[0].data.unsafe_buffer_pointer() for x in outer_in]
        state, _ = fn(state, batch)
        jax.block_until_ready(state)
        assert all(x.is_deleted() for x in consumed), f"{kind}: an input buffer was left alive (not donated)"
        assert all(x.is_deleted() for x in outer_in), f"{kind}: an outer-state buffer was left alive (not donated)"
        if kind == "local":  # the outer state does not enter the computation: the same buffers come back
            assert [x.addressable_shards[0].data.unsafe_buffer_pointer() for x in _buffers(state.outer)] == outer_ptrs


def test_scan_unroll_changes_no_number(kind="sync_forward"):
    """Three steps with the layer stack as a 3-layer loop and fully unrolled: same losses, params
    and outer state up to float32 round-off (XLA fuses the unrolled layers differently; AdamW's
    division by sqrt(v) magnifies a last-bit difference in a near-zero gradient to ~5e-6)."""
    one_stage("3.12", "the unrolled layer loop", 27, other="test_edit_sync's one-replica AdamW")
    results = []
    for unroll in (1, 3):
        cfg = tiny_config(2, 2, method="edit", model={"n_layers": 3, "scan_unroll": unroll})
        m = StepPrograms.for_config(cfg, mesh_for(cfg))
        state, batch = m.init_state(0), m.put_batch(random_batch(cfg))
        losses = []
        for _ in range(3):
            state, met = m.step_fn(kind)(state, batch)
            losses.append(np.asarray(met["loss"]))
        results.append((np.array(losses), jax.device_get(state.params), jax.device_get(state.outer.params)))
    (l1, p1, o1), (l3, p3, o3) = results
    np.testing.assert_allclose(l1, l3, rtol=1e-5)
    for a, b in zip(jax.tree.leaves((p1, o1)), jax.tree.leaves((p3, o3)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def _gather_both_ways(mesh, blocks, dims):
    """gather_unit per leaf and fused, and the gradient of a loss through each, on the mesh."""
    from jax.sharding import PartitionSpec as P

    from edit_jax.localsgd.sharding import SHARD, gather_unit

    specs = jax.tree.map(lambda x, d: P(*[SHARD if i == d else None for i in range(x.ndim)]), blocks, dims)
    weights = jax.tree.map(lambda x: np.random.default_rng(x.size).standard_normal(x.shape).astype(np.float32), blocks)

    def run(fused):
        def body(local):
            full = gather_unit(local, dims, None, fused)
            loss = sum(jax.numpy.sum(f * w)
                       for f, w in zip(jax.tree.leaves(full), jax.tree.leaves(weights), strict=True))
            return full, jax.grad(lambda lo: sum(jax.numpy.sum(f * w) for f, w in zip(
                jax.tree.leaves(gather_unit(lo, dims, None, fused)), jax.tree.leaves(weights),
                strict=True)))(local), loss

        replicated = jax.tree.map(lambda _: P(), specs)
        f = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(replicated, specs, P()), check_vma=False)
        return jax.device_get(jax.jit(f)(blocks))

    return run(False), run(True)


def test_fused_gather_equals_per_leaf_gathers():
    """The fused all-gather rebuilds every leaf exactly as the per-leaf gathers do (FSDP dims 0, 1
    and 2 mixed), and its transpose (one reduce-scatter) gives the same gradient blocks."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("replica", "shard"))
    rng = np.random.default_rng(0)
    blocks = {"a": rng.standard_normal((8, 3)).astype(np.float32), "b": rng.standard_normal((3, 8)).astype(np.float32),
              "c": rng.standard_normal((2, 3, 12)).astype(np.float32),
              "d": rng.standard_normal((4,)).astype(np.float32)}
    dims = {"a": 0, "b": 1, "c": 2, "d": 0}
    (full1, g1, l1), (full2, g2, l2) = _gather_both_ways(mesh, blocks, dims)
    for k in blocks:  # a gather of the whole (already global) array is the array itself
        np.testing.assert_array_equal(full2[k], blocks[k])
        np.testing.assert_array_equal(full1[k], full2[k])
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)


def test_fused_gather_one_collective_per_unit():
    """Compiled local step of a 2-layer model: with mesh.fused_gather one all-gather and one
    reduce-scatter per unit (root + 2 layers) run per step; per leaf, one per parameter."""
    from edit_jax.analysis import hlo

    runs = {}
    for fused in (True, False):
        cfg = tiny_config(2, 2, method="edit")
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, fused_gather=fused))
        m = StepPrograms.for_config(cfg, mesh_for(cfg))
        state, batch = m.abstract_state(), m.put_batch(random_batch(cfg))
        parsed = hlo.hlo_collectives(m.lowered("local", state, batch).compile().as_text(), (2, 2))
        count = {}
        for c in parsed["collectives"]:
            count[c["op"]] = count.get(c["op"], 0) + c["runs_per_step"]
        runs[fused] = count
    n_units, n_leaves = 1 + 2, 3 + 2 * 9  # root: embed, final_norm, lm_head; a layer: 9 params
    assert runs[True]["all-gather"] == n_units and runs[True]["reduce-scatter"] == n_units
    assert runs[False]["all-gather"] == n_leaves and runs[False]["reduce-scatter"] == n_leaves


def test_public_lowering_from_shapes_alone():
    """``lowered(kind)`` with no arrays (the abstract state and batch) lowers the very program a
    real state and batch do (lowering only: nothing compiles here)."""
    cfg = tiny_config(2, 2, method="edit")
    m = StepPrograms.for_config(cfg, mesh_for(cfg))
    state, batch = m.abstract_state(), m.put_batch(random_batch(cfg))
    assert m.abstract_batch().shape == batch.shape and m.abstract_batch().sharding == batch.sharding
    for kind in ("local", "sync_forward"):
        assert m.lowered(kind).as_text() == m.lowered(kind, state, batch).as_text()
