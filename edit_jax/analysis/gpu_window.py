"""How much of a layer's compute runs while EDiT's sync is in flight, and is that enough
(docs/developer/gpu-program.md).

XLA:GPU's optimized program is scheduled: inside the forward layer loop's body, the instructions
issued between a ``replica`` all-reduce's ``-start`` and its ``-done`` run while it is in flight.
``sync_window`` reads that body and measures the **window**: every GEMM and cuDNN attention call
issued while at least one of the layer's tensor-sized all-reduces across ``replica`` is in flight
(all pieces of the per-layer sync together: the union of their start..done spans), in FLOPs per
device, beside the body's total (the layer's forward compute, the FSDP gathers' consumers included).

GEMM FLOPs are 2 x output elements x contracted size, read from the ``dot`` of XLA's GEMM fusion
(or the cuBLAS call's operands and ``dot_dimension_numbers``); cuDNN's fused attention counts
4 x batch x heads x q_len x kv_len x head_dim (QK^T and PV), halved for a causal mask.

``window_verdict`` turns a window into time: the window's compute at the target's peak and at an
assumed MFU against the sync's bytes per device at a link rate between workers; the sync is
*hidden* when the collective takes no longer than the window's compute at that MFU, else *exposed*
by the difference, per layer. A *bare* piece (synchronous, or async with nothing issued between
its own start and done) is counted exposed in full.
"""

from __future__ import annotations

import json
import math
import re

from edit_jax.analysis.hlo_parse import parse_hlo, parse_shapes
from edit_jax.training.throughput import device_peak_tflops

H100_BF16_PEAK_FLOPS = 989e12  # dense bf16 tensor-core peak of an H100 SXM: an unknown GPU's stand-in
DEFAULT_MFU = 0.45
DEFAULT_LINK_GBPS = 100.0
_DIMS_RE = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_JSON_DIMS_RE = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def peak_flops(device_kind: str) -> float:
    """The dense bf16 peak (FLOP/s) of a device kind ("NVIDIA H100 80GB HBM3", ...), from the table
    the records' MFU uses (``throughput.PEAK_BF16_TFLOPS``); an unknown GPU is taken as an H100 (the
    verdict then says so through ``peak_flops`` in the JSON)."""
    tflops = device_peak_tflops(device_kind)
    return tflops * 1e12 if tflops else H100_BF16_PEAK_FLOPS


def _local_types(instrs) -> dict[str, str]:
    return {ins.name: ins.type_str for ins in instrs}


def _operand_shape(operand: str, types: dict[str, str]):
    head = operand.split("%")[0]
    shapes = parse_shapes(head) if "[" in head else []
    if not shapes:
        ref = re.search(r"%?([\w.\-]+)\s*$", operand)
        shapes = parse_shapes(types.get(ref.group(1), "")) if ref else []
    return shapes[0][1] if shapes else None


def _dot_flops(out_type: str, lhs_shape, contracting: list[int]) -> float:
    out = parse_shapes(out_type)
    if not out or lhs_shape is None:
        return 0.0
    return 2.0 * math.prod(out[0][1]) * math.prod(lhs_shape[d] for d in contracting)


def instr_compute(ins, mod, types: dict[str, str]) -> tuple[str, float] | None:
    """("gemm" | "attention", FLOPs) of a scheduled instruction, None when it is neither."""
    if ins.opcode == "custom-call" and "__cudnn$fmha" in ins.attrs and "Backward" not in ins.attrs:
        q = _operand_shape(ins.operands[0], types)  # [batch, q_len, heads, head_dim]
        k = _operand_shape(ins.operands[1], types)
        if q is None or k is None or len(q) != 4:
            return "attention", 0.0
        flops = 4.0 * q[0] * q[2] * q[1] * k[1] * q[3]
        return "attention", flops / 2 if '"mask_type":"CAUSAL"' in ins.attrs else flops
    if ins.opcode == "custom-call" and "gemm" in ins.attrs[:600] and "__cudnn" not in ins.attrs[:600]:
        m = _JSON_DIMS_RE.search(ins.attrs)
        dims = [int(d.strip('" ')) for d in m.group(1).split(",") if d.strip('" ')] if m else []
        return "gemm", _dot_flops(ins.type_str, _operand_shape(ins.operands[0], types), dims)
    if ins.opcode == "fusion" and "gemm" in ins.name + ins.attrs[:300]:
        callee = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
        body = mod.computations.get(callee.group(1), []) if callee else []
        inner = _local_types(body)
        flops = 0.0
        for d in body:
            if d.opcode == "dot":
                m = _DIMS_RE.search(d.attrs)
                dims = [int(x) for x in m.group(1).split(",") if x] if m else []
                flops += _dot_flops(d.type_str, _operand_shape(d.operands[0], inner), dims)
        return "gemm", flops
    if ins.opcode == "dot":
        m = _DIMS_RE.search(ins.attrs)
        dims = [int(x) for x in m.group(1).split(",") if x] if m else []
        return "gemm", _dot_flops(ins.type_str, _operand_shape(ins.operands[0], types), dims)
    return None


def sync_window(text: str, schedule: list[dict]) -> dict | None:
    """The window of the sync's in-loop all-reduces across ``replica`` (``schedule``:
    ``hlo_overlap.collective_schedule`` of ``text``), None when the layer loop has none."""
    loop = [r for r in schedule if r["axis"] == "replica" and r["tensor"] and r["in_loop"]]
    if not loop:
        return None
    mod = parse_hlo(text)
    body = max({r["computation"] for r in loop}, key=lambda c: sum(r["computation"] == c for r in loop))
    instrs = mod.computations[body]
    types = _local_types(instrs)
    names = {r["name"] for r in loop if r["computation"] == body}
    in_flight, open_ = [], set()
    for ins in instrs:
        if ins.name in names and ins.opcode.endswith("-start"):
            open_.add(ins.name)
        elif ins.opcode.endswith("-done"):
            open_ -= {o.split()[-1].lstrip("%") for o in ins.operands}
        in_flight.append(bool(open_))
    totals = {"gemm": [0.0, 0.0, 0, 0], "attention": [0.0, 0.0, 0, 0]}  # flops in window, all, count in, all
    for ins, inside in zip(instrs, in_flight, strict=True):
        got = instr_compute(ins, mod, types)
        if got is None:
            continue
        t = totals[got[0]]
        t[1] += got[1]
        t[3] += 1
        if inside and not ins.opcode.endswith("-start"):
            t[0] += got[1]
            t[2] += 1
    g, a = totals["gemm"], totals["attention"]
    mine = [r for r in loop if r["computation"] == body]
    # a piece with nothing issued between its start and done (XLA then makes it synchronous) waits
    # on the link with the compute stream idle: its bytes are exposed whatever the window holds
    bare = [r for r in mine if not (r["async"] and r["compute_between"] > 0)]
    return {
        "pieces": len(mine), "all_async": all(r["async"] for r in mine),
        "bare_pieces": len(bare), "bare_ring_bytes_per_layer": sum(r["ring_bytes"] for r in bare),
        "window_gemm_flops": g[0], "layer_gemm_flops": g[1], "window_gemms": g[2], "layer_gemms": g[3],
        "gemm_share": g[0] / g[1] if g[1] else 0.0,
        "window_attention_flops": a[0], "layer_attention_flops": a[1],
        "window_attention_calls": a[2], "layer_attention_calls": a[3],
        "attention_inside": a[3] > 0 and a[2] == a[3],
        "window_flops": g[0] + a[0], "layer_flops": g[1] + a[1],
        "sync_ring_bytes_per_layer": sum(r["ring_bytes"] for r in mine),
    }


def window_verdict(window: dict, link_gbps: float, peak_flops: float, mfu: float = DEFAULT_MFU) -> dict:
    """The window's compute time (at ``peak_flops`` and at ``mfu`` of it) against the sync's ring
    bytes per device at ``link_gbps`` Gbit/s between workers: hidden, or exposed by how much."""
    at_peak = window["window_flops"] / peak_flops
    at_mfu = at_peak / mfu
    rate = link_gbps * 1e9 / 8  # bytes per second
    coll = window["sync_ring_bytes_per_layer"] / rate
    bare = window.get("bare_ring_bytes_per_layer", 0.0) / rate
    exposed = bare + max(0.0, coll - bare - at_mfu)
    return {"link_gbps": link_gbps, "mfu": mfu, "peak_flops": peak_flops,
            "window_ms_at_peak": at_peak * 1e3, "window_ms_at_mfu": at_mfu * 1e3,
            "sync_ms": coll * 1e3, "bare_sync_ms": bare * 1e3,
            "exposed_ms_per_layer": exposed * 1e3, "hidden": exposed == 0.0,
            "verdict": "hidden" if exposed == 0.0 else f"exposed by {exposed * 1e3:.2f} ms per layer"}


def report_line(window: dict | None, verdict: dict | None) -> str:
    """The text report's line of one sync step kind."""
    if window is None:
        return "  sync window: no all-reduce across replica inside the layer loop"
    w, v = window, verdict
    att = f"attention {w['window_attention_calls']}/{w['layer_attention_calls']} inside"
    line = (f"  sync window: {w['window_gemms']}/{w['layer_gemms']} GEMMs, {w['gemm_share']:.0%} of the layer's "
            f"GEMM FLOPs, {att}; {w['window_flops'] / 1e12:.2f} TFLOP per device in {w['pieces']} piece(s)"
            + (f", {w['bare_pieces']} with nothing under them" if w.get("bare_pieces") else ""))
    if v is not None:
        bare = f" ({v['bare_sync_ms']:.2f} ms of it bare)" if v.get("bare_sync_ms") else ""
        line += (f"\n  at {v['link_gbps']:g} Gb/s: sync {v['sync_ms']:.2f} ms per layer{bare} "
                 f"vs window {v['window_ms_at_peak']:.2f} ms at peak / {v['window_ms_at_mfu']:.2f} ms "
                 f"at MFU {v['mfu']:g}: {v['verdict']}")
    return line


if __name__ == "__main__":  # python -m edit_jax.analysis.gpu_window HLO.txt REPLICA SHARD LAYERS
    import sys

    from edit_jax.analysis.hlo_overlap import collective_schedule

    txt = open(sys.argv[1]).read()
    sched = collective_schedule(txt, (int(sys.argv[2]), int(sys.argv[3])), int(sys.argv[4]))
    win = sync_window(txt, sched)
    print(json.dumps(win, indent=1))
    if win:
        for rate in (10, 100, 400):
            print(report_line(win, window_verdict(win, rate, H100_BF16_PEAK_FLOPS)))

__all__ = ["sync_window", "window_verdict", "report_line", "instr_compute", "H100_BF16_PEAK_FLOPS", "peak_flops",
           "DEFAULT_MFU", "DEFAULT_LINK_GBPS"]
