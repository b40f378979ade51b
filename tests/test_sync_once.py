"""EDiT's sync crosses ``replica`` once per sync step, also with ``model.remat`` (issue 29).

``model.remat`` wraps the layer step, the hook with the sync in it, in ``jax.checkpoint``; before
the synced unit was named ``HOOK_SAVED`` (and saved by the remat policy), the backward pass
recomputed the sync, its all-reduce across ``replica`` too: a ``sync_forward`` step sent the
layers' pseudo gradients twice (1.64x HSDP's bytes on the config below, 1.96x on the 7B preset).
The layer stack is a real loop here (``scan_unroll=1``): unrolled, XLA's CSE merged the two.
"""

import jax
import numpy as np

from edit_jax.config import WireConfig
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.sharding import BATCH_SPEC, named
from edit_jax.analysis import hlo
from tests.helpers import mesh_for, random_batch, tiny_config
from tests.stages import one_stage

REMAT_LOOP = {"remat": True, "scan_unroll": 1, "n_layers": 3}


def _abstract(m: StepPrograms):
    cfg = m.cfg
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.data.seq_len + 1), jax.numpy.int32,
                                 sharding=named(m.mesh, BATCH_SPEC))
    return m.abstract_state(), batch


def _replica_traffic(m: StepPrograms, kind: str) -> tuple[float, float]:
    """(ring bytes per device across `replica`, executions of tensor-sized collectives across it)."""
    text = m.lowered(kind, *_abstract(m)).compile().as_text()
    recs = hlo.replica_crossing(text, (m.n, m.s), default_trip=m.cfg.model.n_layers)
    tensors = sum(r["runs_per_step"] for r in recs if hlo.operand_elements(r) > 1000)
    return sum(r["runs_per_step"] * r["ring_bytes"] for r in recs), tensors


def test_sync_step_sends_one_all_reduce_of_the_model_with_remat_and_accumulation():
    cfg = tiny_config(2, 2, method="edit", sync={"warmup_steps": 1, "tau": 4}, model=REMAT_LOOP,
                      optim={"grad_accum": 2})
    m = StepPrograms.for_config(cfg, mesh_for(cfg))
    sync_bytes, sync_tensors = _replica_traffic(m, "sync_forward")
    hsdp_bytes, _ = _replica_traffic(m, "hsdp")
    # one tensor all-reduce per unit (the root and 3 layers), and about HSDP's gradient all-reduce
    assert sync_tensors == cfg.model.n_layers + 1
    assert 0.95 <= sync_bytes / hsdp_bytes <= 1.05, (sync_bytes, hsdp_bytes)


def test_compressed_fragment_crosses_once_per_unit_with_remat():
    cfg = tiny_config(2, 2, method="edit", sync={"warmup_steps": 1, "tau": 4, "fragments": 2,
                                                  "wire": WireConfig(kind="int8")},
                      model=REMAT_LOOP)
    m = StepPrograms.for_config(cfg, mesh_for(cfg))
    root_in, lo, hi = m._span(m.schedule.kind(cfg.sync.warmup_steps + cfg.sync.tau))
    kind = str(m.schedule.kind(cfg.sync.warmup_steps + cfg.sync.tau))
    _, tensors = _replica_traffic(m, kind)
    assert hi > lo and tensors == (hi - lo) + int(root_in), (kind, root_in, lo, hi, tensors)


def test_saving_the_synced_unit_changes_no_result():
    """A sync step with remat gives what it gives without (the sync is the identity in the
    backward, so keeping its result instead of recomputing it changes nothing but float order)."""
    one_stage("3.12", "saving the synced unit changes no result", 41)
    out = []
    for remat in (False, True):
        cfg = tiny_config(2, 2, method="edit", sync={"warmup_steps": 0, "tau": 1}, optim={"grad_accum": 2},
                          model={**REMAT_LOOP, "remat": remat})
        m = StepPrograms.for_config(cfg, mesh_for(cfg))
        state = m.init_state(0)
        for k, kind in enumerate(["local", "sync_forward"]):
            assert str(m.schedule.kind(k)) == kind
            state, metrics = m.step_fn(kind)(state, m.put_batch(random_batch(cfg, seed=k)))
        out.append(jax.device_get((state.params, state.outer.params, metrics["loss"])))
    # Float order differs (the backward reads the saved shard instead of recomputing it), and
    # AdamW's normalisation magnifies that where the second moment is small: jax 0.12 gave one
    # element of 24,576 off by 6.3e-6 after two steps. A wrong gradient or sync is off by the
    # size of an update (~lr = 3e-3 per element), two orders of magnitude more.
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=2e-5)
