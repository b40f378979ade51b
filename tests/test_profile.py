"""edit_jax.analysis.profile: op categories from HLO text, self times from a Perfetto trace (hand-worked
examples), and a real trace of compiled steps summarised without unknown ops."""

import gzip
import json

import numpy as np
import pytest

from edit_jax.localsgd.programs import StepPrograms
from edit_jax.analysis.profile import CATEGORIES, SYNC_SCOPE, find_trace, op_categories, op_self_times, summarize
from tests.helpers import mesh_for, random_batch, tiny_config

HLO = f"""HloModule jit_step, entry_computation_layout={{()->f32[4]}}

%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {{
  %p0 = f32[4,4]{{1,0}} parameter(0)
  %p1 = f32[4,4]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[4,4]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%fused_move (p0: f32[4,4]) -> f32[4,4] {{
  %p0 = f32[4,4]{{1,0}} parameter(0)
  %t = f32[4,4]{{0,1}} transpose(%p0), dimensions={{1,0}}
  ROOT %c = f32[4,4]{{1,0}} copy(%t)
}}

%fused_add (p0: f32[4,4]) -> f32[4,4] {{
  %p0 = f32[4,4]{{1,0}} parameter(0)
  ROOT %a = f32[4,4]{{1,0}} add(%p0, %p0)
}}

%body (p: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {{
  %p = (s32[], f32[4,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,4]{{1,0}} get-tuple-element(%p), index=1
  %mm = f32[4,4]{{1,0}} fusion(%x, %x), kind=kOutput, calls=%fused_dot
  ROOT %out = (s32[], f32[4,4]{{1,0}}) tuple(%i, %mm)
}}

%cond (p: (s32[], f32[4,4])) -> pred[] {{
  %p = (s32[], f32[4,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {{
  %a = f32[4,4]{{1,0}} parameter(0)
  %ag = f32[4,4]{{1,0}} all-gather(%a), replica_groups={{{{0,1}}}}, dimensions={{0}}
  %mv = f32[4,4]{{1,0}} fusion(%ag), kind=kLoop, calls=%fused_move
  %sy = f32[4,4]{{1,0}} fusion(%mv), kind=kLoop, calls=%fused_add, metadata={{op_name="jit(step)/{SYNC_SCOPE}/sub"}}
  %el = f32[4,4]{{1,0}} fusion(%sy), kind=kLoop, calls=%fused_add, metadata={{op_name="jit(step)/mul"}}
  %z = s32[] constant(0)
  %init = (s32[], f32[4,4]{{1,0}}) tuple(%z, %el)
  %w = (s32[], f32[4,4]{{1,0}}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4,4]{{1,0}} get-tuple-element(%w), index=1
}}
"""


def test_op_categories_hand_written_module():
    cats = op_categories(HLO)
    assert cats["mm"] == "matmul"  # a fusion holding a dot
    assert cats["ag"] == "collective"
    assert cats["mv"] == "copy"  # transpose + copy only
    assert cats["sy"] == "sync"  # elementwise under the sync's name scope
    assert cats["el"] == "elementwise"
    assert cats["w"] == "control"


def _trace(tmp_path, events):
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def _op(name, ts, dur, tid=1, device=0):
    return {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"hlo_op": name, "device_ordinal": str(device)}}


def test_self_times_subtract_nested_ops(tmp_path):
    # Thread 1 (device 0): a while [0, 100) holding mm [10, 30) and mm [40, 50); then el [100, 105).
    # Thread 2 (device 1): ag [0, 7). Events without hlo_op (runtime bookkeeping) are ignored.
    events = [_op("w", 0, 100), _op("mm", 10, 20), _op("mm", 40, 10), _op("el", 100, 5),
              _op("ag", 0, 7, tid=2, device=1),
              {"ph": "X", "name": "ThunkExecutor::Execute", "pid": 1, "tid": 1, "ts": 0, "dur": 200, "args": {}}]
    path = _trace(tmp_path, events)
    assert find_trace(str(tmp_path)) == path
    got = sorted(op_self_times(path))
    assert got == sorted([("0", "w", 70.0), ("0", "mm", 20.0), ("0", "mm", 10.0), ("0", "el", 5.0), ("1", "ag", 7.0)])
    s = summarize(path, HLO, steps=1)
    # µs summed over 2 devices and 1 step -> ms per device-step: (30 / 2) µs = 0.015 ms of matmul.
    assert s["devices"] == 2
    got = [s["per_device_step_ms"][c] for c in ("matmul", "control", "elementwise", "collective")]
    np.testing.assert_allclose(got, [0.015, 0.035, 0.0025, 0.0035])
    np.testing.assert_allclose(s["total_ms"], 0.056)
    assert [t[0] for t in s["top_ops"]] == ["mm", "el"]  # collectives and control left out


def test_find_trace_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace"):
        find_trace(str(tmp_path))


def test_real_trace_of_local_and_sync_steps(tmp_path):
    """Every op the runtime records is found in the compiled HLO; the sync's ops appear only in
    the sync step; matmuls and collectives are there in both."""
    import jax

    cfg = tiny_config(2, 2, method="edit")
    m = StepPrograms.for_config(cfg, mesh_for(cfg))
    state, batch = m.init_state(0), m.put_batch(random_batch(cfg))
    out = {}
    for kind in ("local", "sync_forward"):
        fn = m.step_fn(kind)
        state, _ = fn(state, batch)
        jax.block_until_ready(state)
        d = str(tmp_path / kind)
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(2):
                state, _ = fn(state, batch)
                jax.block_until_ready(state)
        out[kind] = summarize(find_trace(d), m.lowered(kind, state, batch).compile().as_text(), steps=2)
    for kind, s in out.items():
        assert s["unmatched_ops"] == [], kind
        assert s["devices"] == 4, kind
        assert s["per_device_step_ms"]["matmul"] > 0 and s["per_device_step_ms"]["collective"] > 0, kind
        assert set(s["per_device_step_ms"]) == set(CATEGORIES)
    assert out["local"]["per_device_step_ms"]["sync"] == 0.0
    assert out["sync_forward"]["per_device_step_ms"]["sync"] > 0.0
