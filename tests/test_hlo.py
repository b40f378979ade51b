"""The HLO collective parser (edit_jax.analysis.hlo_parse, edit_jax.analysis.hlo) on hand-written HLO in
every form jax 0.10 to 0.12 prints, and on a real compiled program of the installed jax."""

import numpy as np
import pytest

from edit_jax.analysis import hlo, hlo_parse

_TEXT = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x.1 = f32[8]{0} parameter(0)
  %ag = f32[32]{0} all-gather(%x.1), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %ars = (f32[], bf16[16]{0}) all-reduce-start(f32[] %x.2, bf16[16]{0} %y), replica_groups={}, to_apply=%add
  %m12 = s8[64]{0} all-gather(%x.1), channel_id=3, replica_groups=mesh['replica'=2,'shard'=4] {'replica'}, dimensions={0}
  %z = s32[] constant(0)
  %tup = (s32[], f32[8]{0}) tuple(%z, %x.1)
  %w = (s32[], f32[8]{0}) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""  # noqa: E501 - HLO text as XLA prints it: one instruction a line


def test_group_forms():
    assert hlo_parse.iota_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo_parse.iota_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    parse = hlo_parse.parse_replica_groups
    assert parse("replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=a", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse("replica_groups={}, to_apply=a", 8) == [list(range(8))]
    assert parse("to_apply=a", 8) is None
    # jax 0.12: the mesh form, for a (replica=4, shard=2) mesh.
    mesh = "replica_groups=mesh['replica'=4,'shard'=2] "
    assert parse(mesh + "{'shard'}, use_global_device_ids=true", 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parse(mesh + "{'replica'}, use_global_device_ids=true", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert parse(mesh + "{'replica','shard'}, to_apply=a", 8) == [list(range(8))]
    assert parse(mesh + "{'shard','replica'}, to_apply=a", 8) == [[0, 2, 4, 6, 1, 3, 5, 7]]
    assert parse(mesh + "{}, to_apply=a", 8) == [[i] for i in range(8)]
    # A mesh whose devices are not in order names them: positions 0..7 are devices [0, 2, 1, 3, ...].
    odd = "replica_groups=mesh['a'=2,'b'=2,'c'=2,'d'=1], device_ids=([2,2,2]T(0,2,1)) {'c'}, to_apply=a"
    assert parse(odd, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    listed = "replica_groups=mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'b'}, to_apply=a"
    assert parse(listed, 4) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="not in the mesh"):
        parse(mesh + "{'pipeline'}", 8)
    assert hlo_parse.parse_pairs("source_target_pairs={{0,1},{1,0}}") == [[0, 1], [1, 0]]
    assert not hlo.crosses_replica([[0, 1], [2, 3]], 2) and hlo.crosses_replica([[0, 2], [1, 3]], 2)


def test_bytes_and_loops():
    p = hlo.hlo_collectives(_TEXT, (2, 4))
    by = {r["name"]: r for r in p["collectives"]}
    assert by["ar"]["runs_per_step"] == 3 and by["ar"]["crosses_replica"] and by["ar"]["replica_only"]
    assert by["ar"]["ring_bytes"] == 32.0  # 2(2-1)/2 x 32 B
    assert not by["ag"]["crosses_replica"] and by["ag"]["ring_bytes"] == 3 * 32.0
    assert by["ars"]["group_size"] == 8 and by["ars"]["operand_bytes"] == 4 + 32 and by["ars"]["crosses_replica"]
    assert by["m12"]["groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and by["m12"]["replica_only"]
    assert by["m12"]["ring_bytes"] == 1 * 32.0  # all-gather: (n-1) x the f32[8] operand
    tot = hlo.collective_totals(p)
    assert tot["executions"] == 5
    assert tot["ring_bytes"] == 3 * 32.0 + 2 * 7 / 8 * 36 + 32.0
    assert hlo.operand_elements(by["ars"]) == 17


def test_real_program_of_this_jax():
    """Whatever form the installed jax prints, the parser finds the groups of a program whose
    collectives we know: psum over shard, over replica, and over both, on a 4 x 2 mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("replica", "shard"))

    def f(x):
        return jax.lax.psum(x, "shard") + 2 * jax.lax.psum(x, "replica") + 3 * jax.lax.psum(x, ("replica", "shard"))

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("replica", "shard")), out_specs=P(("replica", "shard"))))
    recs = hlo.hlo_collectives(g.lower(jnp.arange(64.0)).compile().as_text(), (4, 2))["collectives"]
    groups = sorted(tuple(map(tuple, r["groups"])) for r in recs)
    assert groups == sorted([((0, 1), (2, 3), (4, 5), (6, 7)), ((0, 2, 4, 6), (1, 3, 5, 7)), (tuple(range(8)),)])
    assert sum(r["crosses_replica"] for r in recs) == 2
