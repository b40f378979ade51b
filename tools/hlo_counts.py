"""Counts the instructions of an optimized HLO module text: how docs/benchmarks/sparse.md compared the 7B sync
step's GPU program with and without the sparse wire.

    JAX_PLATFORMS=cpu python tools/dump_gpu_program.py configs/edit_7b.py none.txt
    JAX_PLATFORMS=cpu python tools/dump_gpu_program.py configs/edit_7b.py topk2.txt \\
        sync.wire.kind=topk2 sync.wire.error_feedback=true
    python tools/hlo_counts.py none.txt 32          # 32: the layer loop's trip count if XLA left it unknown

Prints one JSON object: every instruction (fused bodies included); the *scheduled* ones, i.e. those
of computations that are not fused bodies or reducers (the entry, loop bodies and conditions, async
wrappers: roughly the kernels and collectives issued), without parameters, tuples, tuple elements,
constants and bitcasts, each also times its computation's run count (``hlo.multiplicities``); the
fusions likewise; sorts (XLA:GPU lowers ``top_k`` to a sort of each row); collectives by opcode
(``-done`` halves not counted).
"""

from __future__ import annotations

import collections
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: the repo root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from edit_jax.analysis.hlo import multiplicities
from edit_jax.analysis.hlo_parse import COLLECTIVES, parse_hlo

TRIVIAL = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}


def fused_computations(mod) -> set[str]:
    """The computations a fusion calls or a reducer applies, and everything they call in turn."""
    fused = {callee for edges in mod.calls.values() for kind, callee, ins in edges
             if (ins.opcode == "fusion" and kind == "calls") or kind == "to_apply"}
    todo = list(fused)
    while todo:
        for _, callee, _ in mod.calls.get(todo.pop(), []):
            if callee not in fused:
                fused.add(callee)
                todo.append(callee)
    return fused


def counts(text: str, default_trip: int | None = None) -> dict:
    mod = parse_hlo(text)
    runs, _ = multiplicities(mod, default_trip)
    fused = fused_computations(mod)
    scheduled = [i for c, instrs in mod.computations.items() if c not in fused for i in instrs]
    runtime = lambda keep: sum(runs.get(i.computation, 0) for i in scheduled if keep(i))
    collectives, collectives_run = collections.Counter(), collections.Counter()
    for i in scheduled:
        base = i.opcode[:-len("-start")] if i.opcode.endswith("-start") else i.opcode
        if base in COLLECTIVES and not i.opcode.endswith("-done"):
            collectives[i.opcode] += 1
            collectives_run[i.opcode] += runs.get(i.computation, 0)
    return {"all_instructions_incl_fused": sum(len(v) for v in mod.computations.values()),
            "scheduled_non_trivial": sum(i.opcode not in TRIVIAL for i in scheduled),
            "scheduled_non_trivial_at_run_time": runtime(lambda i: i.opcode not in TRIVIAL),
            "fusions": sum(i.opcode == "fusion" for i in scheduled),
            "fusions_at_run_time": runtime(lambda i: i.opcode == "fusion"),
            "sorts": sum(i.opcode == "sort" for c, v in mod.computations.items() for i in v),
            "collectives": dict(collectives), "collectives_at_run_time": dict(collectives_run)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or len(argv) > 2:
        print("usage: python tools/hlo_counts.py HLO_TEXT_FILE [LOOP_TRIP_COUNT]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(json.dumps(counts(f.read(), int(argv[1]) if len(argv) > 1 else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
