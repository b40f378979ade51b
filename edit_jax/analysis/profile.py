"""Where a compiled step spends its time: a ``jax.profiler`` trace summarised per op category.

XLA's runtime records one trace event per executed HLO instruction (on CPU: per thunk, with the
instruction's name in ``args.hlo_op``; on GPU: per kernel, named after the instruction). This
module reads the Perfetto JSON that ``jax.profiler.trace(dir, create_perfetto_trace=True)``
writes, takes each op event's *self* time (its duration minus the op events nested in it on the
same thread: a ``while`` contains its body's ops), and files every instruction under one category
found in the compiled HLO text of the same program:

- ``matmul``: dots and convolutions, and fusions that contain one;
- ``collective``: all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute (on a
  CPU-emulated mesh this includes waiting at the rendezvous for the slowest device);
- ``copy``: pure data movement (copy, transpose, (dynamic-)slice, dynamic-update-slice,
  concatenate, broadcast, pad, ...; a fusion of only those);
- ``sync``: everything else that came from the sync's code (the ops' ``metadata.op_name`` carries
  the ``edit_sync`` name scope, ``SYNC_SCOPE``): the pseudo gradient, norms, penalty, outer step;
- ``elementwise``: every other fusion or op (norms, activations, softmax, AdamW);
- ``control``: ``while``/``conditional``/``call`` self time (loop bookkeeping).

No jax import at module level: the benchmark driver summarises traces written by worker processes.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import defaultdict

from edit_jax.localsgd.sync import SYNC_SCOPE
from edit_jax.analysis.hlo_parse import COLLECTIVES, HloModule, parse_hlo

CATEGORIES = ("matmul", "collective", "copy", "sync", "elementwise", "control", "other")

_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_COPY_OPS = {"copy", "copy-start", "copy-done", "transpose", "slice", "dynamic-slice", "dynamic-update-slice",
             "concatenate", "broadcast", "pad", "reshape", "bitcast", "bitcast-convert", "reverse", "gather",
             "scatter", "tuple", "get-tuple-element", "parameter", "constant", "iota"}
_CONTROL_OPS = {"while", "conditional", "call", "async-start", "async-done", "async-update"}
_COLLECTIVE_OPS = {op + sfx for op in COLLECTIVES for sfx in ("", "-start", "-done")}


def op_categories(hlo_text: str) -> dict[str, str]:
    """Instruction name -> category, for every instruction of a compiled HLO module's text."""
    return _categories(parse_hlo(hlo_text))


def _categories(mod: HloModule) -> dict[str, str]:
    fused_ops: dict[str, set[str]] = {name: {i.opcode for i in instrs} for name, instrs in mod.computations.items()}
    callees: dict[int, list[str]] = defaultdict(list)  # id(instruction) -> the computations it calls
    for edges in mod.calls.values():
        for _, callee, ins in edges:
            callees[id(ins)].append(callee)

    def contents(instr) -> set[str]:  # opcodes inside a fusion (recursively through nested fusions)
        seen, todo, ops = set(), list(callees[id(instr)]), set()
        while todo:
            comp = todo.pop()
            if comp in seen:
                continue
            seen.add(comp)
            ops |= fused_ops.get(comp, set())
            todo += [c for _, c, _ in mod.calls.get(comp, [])]
        return ops

    out = {}
    for instrs in mod.computations.values():
        for ins in instrs:
            op = ins.opcode
            inner = contents(ins) if op in ("fusion", "custom-call") else {op}
            if op in _COLLECTIVE_OPS:
                cat = "collective"
            elif op in _CONTROL_OPS:
                cat = "control"
            elif inner & {"dot", "convolution"}:
                cat = "matmul"
            elif inner and inner <= _COPY_OPS:
                cat = "copy"
            elif SYNC_SCOPE in ins.attrs:
                cat = "sync"
            else:
                cat = "elementwise"
            out[ins.name] = cat
    return out


def find_trace(log_dir: str) -> str:
    """The newest Perfetto trace under a ``jax.profiler.trace`` log directory."""
    pattern = os.path.join(log_dir, "**", "perfetto_trace.json.gz")
    paths = sorted(glob.glob(pattern, recursive=True), key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir!r}: was jax.profiler.trace given "
                                "create_perfetto_trace=True?")
    return paths[-1]


def op_self_times(trace_path: str) -> list[tuple[str, str, float]]:
    """(device, op name, self time in µs) of every op event in the trace (one per execution)."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "hlo_op" in e.get("args", {}):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))  # a parent before the children it contains
        open_: list[dict] = []  # the chain of events containing the current one

        def close(ev):
            out.append((ev["device"], ev["name"], ev["dur"] - ev["children"]))

        for e in evs:
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            while open_ and open_[-1]["end"] <= start:
                close(open_.pop())
            if open_:
                open_[-1]["children"] += dur
            device = str(e["args"].get("device_ordinal", e.get("pid")))
            open_.append({"end": start + dur, "dur": dur, "children": 0.0, "name": e["args"]["hlo_op"],
                          "device": device})
        while open_:
            close(open_.pop())
    return out


def op_sources(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the jax op path it came from (``metadata={op_name=...}``), where printed."""
    return _sources(parse_hlo(hlo_text))


def _sources(mod: HloModule) -> dict[str, str]:
    out = {}
    for instrs in mod.computations.values():
        for ins in instrs:
            m = _OP_NAME_RE.search(ins.attrs)
            if m:
                out[ins.name] = m.group(1)
    return out


def summarize(trace_path: str, hlo_text: str, steps: int, top_n: int = 15) -> dict:
    """Per-step time by category, averaged over the devices that appear in the trace.

    Returns ``{"per_device_step_ms": {category: ms}, "total_ms", "share": {category: fraction},
    "top_ops": [(name, category, ms per device-step, jax op path), ...] (compute ops only),
    "devices", "unmatched_ops"}``. Ops missing from ``hlo_text`` (another program traced alongside)
    count as ``other``."""
    mod = parse_hlo(hlo_text)
    cats = _categories(mod)
    times = op_self_times(trace_path)
    devices = sorted({d for d, _, _ in times})
    scale = 1e-3 / (max(1, len(devices)) * max(1, steps))  # µs summed over devices and steps -> ms per device-step
    per_cat: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    unmatched = set()
    for _, name, t in times:
        cat = cats.get(name)
        if cat is None:
            unmatched.add(name)
            cat = "other"
        per_cat[cat] += t * scale
        per_op[name] += t * scale
    total = sum(per_cat.values())
    # The costliest work (collectives left out: on an emulated mesh their time is mostly waiting).
    work = {n: t for n, t in per_op.items() if cats.get(n) not in ("collective", "control")}
    top = sorted(work.items(), key=lambda kv: -kv[1])[:top_n]
    sources = _sources(mod)
    return {"per_device_step_ms": {c: per_cat.get(c, 0.0) for c in CATEGORIES}, "total_ms": total,
            "share": {c: (per_cat.get(c, 0.0) / total if total else 0.0) for c in CATEGORIES},
            "top_ops": [(n, cats.get(n, "other"), t, sources.get(n, "")) for n, t in top], "devices": len(devices),
            "unmatched_ops": sorted(unmatched)[:20]}


__all__ = ["CATEGORIES", "SYNC_SCOPE", "find_trace", "op_categories", "op_self_times", "op_sources", "summarize"]
