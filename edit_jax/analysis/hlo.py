"""HLO collectives: which devices talk in a compiled program, and how many bytes each one moves.

* ``multiplicities``: how many times each computation runs per step (while trip counts, branches).
* ``hlo_collectives``: every collective with its groups, whether it crosses ``replica``, its bytes.
* ``collective_totals``: per-step per-device totals over those that cross ``replica`` (or not).
* ``crosses_replica`` / ``replica_crossing`` / ``operand_elements``: the tests' view of the records.

The one collective accounting for the tests, the benchmark scripts and ``plan``. It reads the
text of a compiled SPMD program (``jax.stages.Compiled.as_text()``, parsed by ``hlo_parse``), finds
every collective (also inside while bodies, counted per trip, and conditional branches, counted as
taken), resolves its device groups and operand shapes, and totals per-device bytes for those that
cross ``replica`` and those that stay inside one. Device ids are positions in ``mesh.devices.flat``
(``hlo_parse``), so position p is on replica p // S.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

from edit_jax.analysis.hlo_parse import (
    COLLECTIVES,
    HloModule,
    parse_hlo,
    parse_pairs,
    parse_replica_groups,
    parse_shapes,
    shape_bytes,
)

_TRIP_RE = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')


def multiplicities(mod: HloModule, default_trip: int | None = None) -> tuple[dict[str, float], list[dict]]:
    """How many times each computation runs per execution of the entry. A while body runs its
    trip count times per execution of its caller: ``known_trip_count`` from the while's backend
    config, else ``default_trip`` (flagged). Conditional branches count as always taken (an upper
    bound, flagged)."""
    callers: dict[str, list[tuple[str, float]]] = {}
    loops = []
    for caller, edges in mod.calls.items():
        for kind, callee, ins in edges:
            factor = 1.0
            if ins.opcode == "while" and kind in ("body", "condition"):
                m = _TRIP_RE.search(ins.attrs)
                trip, source = (int(m.group(1)), "known_trip_count") if m else (default_trip, "assumed (n_layers)")
                if trip is None:
                    raise ValueError(f"while loop {ins.name} has no known_trip_count; pass default_trip")
                factor = trip if kind == "body" else trip + 1
                if kind == "body":
                    loops.append({"while": ins.name, "in": caller, "body": callee, "trip_count": trip,
                                  "trip_count_source": source})
            elif kind == "branch" or kind in ("true_computation", "false_computation"):
                loops.append({"conditional": ins.name, "branch": callee, "note": "counted as always taken"})
            callers.setdefault(callee, []).append((caller, factor))

    @lru_cache(maxsize=None)
    def count(c: str) -> float:
        if c == mod.entry:
            return 1.0
        return sum(count(p) * f for p, f in callers.get(c, []))

    return {c: count(c) for c in mod.computations}, loops


def _ring_bytes(op: str, operand_bytes: float, n: int) -> float:
    """Bytes one device sends in a ring implementation (``operand_bytes``: this device's input)."""
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2.0 * (n - 1) / n * operand_bytes
    if op == "all-gather":  # full result = n x operand; each device sends (n-1)/n of it
        return (n - 1) * operand_bytes
    if op in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):  # operand is the full buffer
        return (n - 1) / n * operand_bytes
    if op in ("collective-permute", "collective-broadcast"):
        return operand_bytes
    raise ValueError(op)


RING_FORMULAS = {
    "all-reduce": "2(n-1)/n x B (B = per-device buffer = operand bytes)",
    "all-gather": "(n-1)/n x n x B = (n-1) x B (B = per-device operand; n x B = the gathered result)",
    "reduce-scatter": "(n-1)/n x B (B = the full per-device operand before scattering)",
    "all-to-all": "(n-1)/n x B",
    "collective-permute": "B (each device sends its whole operand once)",
}


def hlo_collectives(text: str, mesh_shape: tuple[int, int], default_trip: int | None = None,
                    small_elems: int | None = None) -> dict:
    """Every collective of a compiled SPMD program (mesh (replica, shard) = ``mesh_shape``).

    Device ids in replica_groups are taken as positions in ``mesh.devices.flat`` (row-major over
    (replica, shard)), so position p is on replica p // S. A collective crosses ``replica`` when a
    group (or a source/target pair) holds positions of two replicas. Bytes are per device and per
    step: ring bytes (formulas in RING_FORMULAS) and plain operand bytes, times the number of times
    the instruction runs per step (product of enclosing while trip counts). Operands with at most
    ``small_elems`` elements (rank-0 included) are also totalled apart as "small" (norms, weights,
    flags, metrics): they cost latency, not bandwidth.
    """
    n_rep, n_shard = mesh_shape
    num_devices = n_rep * n_shard
    small_elems = n_rep if small_elems is None else small_elems
    mod = parse_hlo(text)
    mult, loops = multiplicities(mod, default_trip)
    records = []
    for cname, instrs in mod.computations.items():
        for ins in instrs:
            op = ins.opcode
            if op.endswith("-done") or op.endswith("-update"):
                continue
            base = op[:-len("-start")] if op.endswith("-start") else op
            if base not in COLLECTIVES:
                continue
            shapes = []
            for operand in ins.operands:
                inline = parse_shapes(operand.split("%")[0]) if "[" in operand.split("%")[0] else []
                if inline:
                    shapes.extend(inline)
                    continue
                ref = re.search(r"%?([\w.\-]+)\s*$", operand)
                t = mod.types.get(ref.group(1)) if ref else None
                if t is None:
                    raise ValueError(f"{ins.name}: cannot resolve operand {operand!r}")
                shapes.extend(parse_shapes(t))
            if base == "collective-permute":
                pairs = parse_pairs(ins.attrs) or []
                groups = pairs
                n = 2
                crosses = any(len({p // n_shard for p in pr}) > 1 for pr in pairs)
            else:
                groups = parse_replica_groups(ins.attrs, num_devices)
                if groups is None:
                    groups = [list(range(num_devices))]
                n = max(len(g) for g in groups)
                crosses = any(len({p // n_shard for p in g}) > 1 for g in groups)
            within = all(len({p % n_shard for p in g}) == 1 for g in groups) if base != "collective-permute" else None
            times = mult.get(cname, 0.0)
            op_bytes = sum(shape_bytes(s) for s in shapes)
            small = sum(shape_bytes(s) for s in shapes if math.prod(s[1]) <= small_elems)
            records.append({
                "name": ins.name, "op": base, "async": op.endswith("-start"), "computation": cname,
                "runs_per_step": times, "group_size": n, "num_groups": len(groups),
                "groups": groups if len(groups) <= 16 else groups[:16] + [["..."]],
                "crosses_replica": crosses, "replica_only": bool(crosses and within),
                "operands": [f"{dt}[{','.join(map(str, d))}]" for dt, d in shapes],
                "operand_bytes": op_bytes, "small_operand_bytes": small,
                "ring_bytes": _ring_bytes(base, op_bytes, n),
                "small_ring_bytes": _ring_bytes(base, small, n),
            })
    return {"collectives": records, "loops": loops, "entry": mod.entry}


def collective_totals(parsed: dict, crossing: bool = True) -> dict:
    """Per-step per-device totals over the collectives that do (or do not) cross ``replica``."""
    recs = [r for r in parsed["collectives"] if r["crosses_replica"] == crossing]
    tot = {"ring_bytes": 0.0, "operand_bytes": 0.0, "small_ring_bytes": 0.0, "small_operand_bytes": 0.0,
           "executions": 0.0, "ops_in_hlo": len(recs), "by_op": {}}
    for r in recs:
        k = r["runs_per_step"]
        tot["ring_bytes"] += k * r["ring_bytes"]
        tot["operand_bytes"] += k * r["operand_bytes"]
        tot["small_ring_bytes"] += k * r["small_ring_bytes"]
        tot["small_operand_bytes"] += k * r["small_operand_bytes"]
        tot["executions"] += k
        b = tot["by_op"].setdefault(r["op"], {"executions": 0.0, "ring_bytes": 0.0, "operand_bytes": 0.0})
        b["executions"] += k
        b["ring_bytes"] += k * r["ring_bytes"]
        b["operand_bytes"] += k * r["operand_bytes"]
    tot["tensor_ring_bytes"] = tot["ring_bytes"] - tot["small_ring_bytes"]
    tot["tensor_operand_bytes"] = tot["operand_bytes"] - tot["small_operand_bytes"]
    return tot


# ----------------------------------------------------------------------------- the tests' view


def crosses_replica(groups: list[list[int]] | None, shard: int) -> bool:
    """Whether any group holds positions of two replicas (position p is on replica p // S)."""
    return groups is not None and any(len({p // shard for p in g}) > 1 for g in groups)


def replica_crossing(text: str, mesh_shape: tuple[int, int], default_trip: int | None = None) -> list[dict]:
    """The records of ``hlo_collectives`` that cross ``replica``."""
    return [r for r in hlo_collectives(text, mesh_shape, default_trip)["collectives"] if r["crosses_replica"]]


def operand_elements(record: dict) -> int:
    """Elements in a collective record's operands (summed over a tuple)."""
    total = 0
    for operand in record["operands"]:
        dims = operand[operand.index("[") + 1:-1]
        total += math.prod(int(d) for d in dims.split(",") if d)
    return total


__all__ = ["RING_FORMULAS", "multiplicities", "hlo_collectives", "collective_totals", "crosses_replica",
           "replica_crossing", "operand_elements"]
