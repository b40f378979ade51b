"""What a scheduled XLA:GPU program does with its collectives: async or not, and what runs meanwhile.

XLA:GPU's optimized HLO is scheduled (``is_scheduled=true``): a computation's instructions are in
the order they are issued. An async collective is a ``*-start`` / ``*-done`` pair; what is issued
between them runs while the collective is in flight. ``collective_schedule`` lists, for every
collective, its mesh axis, whether it is async and the compute issued between its start and done
(GEMMs: cuBLAS calls and XLA's GEMM fusions; cuDNN's attention); ``sync_overlap`` says whether
EDiT's sync crosses ``replica`` once per unit and sync step and how many of its in-loop all-reduces
are async with compute between start and done (how much compute, and whether that hides the sync
at a link rate: ``gpu_window``).
"""

from __future__ import annotations

import re

from edit_jax.analysis import hlo
from edit_jax.analysis.hlo_parse import parse_hlo

_COMPUTE_RE = re.compile(r"gemm|cublas|__cudnn\$fmha|fmha|convolution")
TENSOR_ELEMENTS = 1024  # operands with fewer elements are norms, weights, flags: latency, not bandwidth


def _is_compute(ins) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    if ins.opcode in ("custom-call", "fusion"):
        head = ins.name + " " + ins.attrs[:400]
        return bool(_COMPUTE_RE.search(head))
    return False


def collective_schedule(text: str, mesh_shape: tuple[int, int], default_trip: int | None = None) -> list[dict]:
    """Every collective of a compiled program with: ``axis`` ("replica" when it crosses replicas,
    else "shard"), ``async``, ``compute_between`` (GEMM / attention ops issued between its start
    and done; 0 when synchronous), ``in_loop`` (inside a while body) and ``tensor`` (an operand
    of at least ``TENSOR_ELEMENTS`` elements), beside ``hlo.hlo_collectives``' fields."""
    parsed = hlo.hlo_collectives(text, mesh_shape, default_trip)
    mod = parse_hlo(text)
    bodies = {loop["body"] for loop in parsed["loops"] if "body" in loop}
    out = []
    for rec in parsed["collectives"]:
        instrs = mod.computations[rec["computation"]]
        between = 0
        if rec["async"]:
            idx = next(i for i, ins in enumerate(instrs) if ins.name == rec["name"])
            for ins in instrs[idx + 1:]:
                if ins.opcode.endswith("-done") and any(o.split()[-1].lstrip("%") == rec["name"] for o in ins.operands):
                    break
                between += _is_compute(ins)
        out.append({**rec, "axis": "replica" if rec["crosses_replica"] else "shard", "compute_between": between,
                    "in_loop": rec["computation"] in bodies,
                    "tensor": hlo.operand_elements(rec) >= TENSOR_ELEMENTS})
    return out


def by_axis(schedule: list[dict]) -> dict:
    """Per mesh axis and op: executions per step, async and synchronous, and ring bytes."""
    out: dict = {}
    for r in schedule:
        d = out.setdefault(r["axis"], {}).setdefault(r["op"], {"async": 0.0, "sync": 0.0, "ring_bytes": 0.0})
        d["async" if r["async"] else "sync"] += r["runs_per_step"]
        d["ring_bytes"] += r["runs_per_step"] * r["ring_bytes"]
    return out


def sync_overlap(schedule: list[dict], units: int, unit_elements: int) -> dict:
    """The shape of EDiT's sync in a ``sync_forward`` program of ``units`` units (root + layers of
    the due group) holding ``unit_elements`` param elements on this device: each unit's pseudo
    gradient crosses ``replica`` once (the tensor-sized collectives across it move those elements
    once per step, within 5%: XLA may split a unit's all-reduce in pieces or combine two units'), and
    inside the layer loop every one of them is async with compute between its start and done (the
    root's, before the loop, has no layer to hide behind)."""
    tensors = [r for r in schedule if r["axis"] == "replica" and r["tensor"]]
    loop = [r for r in tensors if r["in_loop"]]
    per_step = sum(r["runs_per_step"] for r in tensors)
    moved = sum(r["runs_per_step"] * hlo.operand_elements(r) for r in tensors)
    once = abs(moved - unit_elements) <= 0.05 * unit_elements
    hidden = [r for r in loop if r["async"] and r["compute_between"] > 0]
    return {
        "replica_tensor_collectives_per_step": per_step, "units": units, "elements_moved": moved,
        "unit_elements": unit_elements, "once_per_unit": bool(once),
        "in_loop": len(loop), "in_loop_async_with_compute": len(hidden),
        "collectives": [{k: r[k] for k in ("name", "op", "async", "compute_between", "runs_per_step", "in_loop",
                                           "operands")} for r in tensors],
    }


__all__ = ["collective_schedule", "by_axis", "sync_overlap", "TENSOR_ELEMENTS"]
