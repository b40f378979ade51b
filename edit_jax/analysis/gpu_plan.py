"""``edit-jax plan --target h100``: the GPU side of a plan, read from XLA:GPU's own compiled program.

Per step kind: XLA:GPU's memory per device (``memory_analysis()``: arguments, temporaries,
output, aliasing; peak = arguments + output - aliased + temporaries) beside ``plan``'s analytic
estimate (state + ``gpu_estimate``); the collectives per mesh axis, async and synchronous; and
for EDiT's sync step whether each unit crosses ``replica`` once (``hlo_overlap.sync_overlap``) and
the sync's window (``gpu_window``: the layer's GEMMs and attention issued while its all-reduce is in
flight) with the verdict at a link rate between workers: hidden, or exposed by X ms per layer.
"""

from __future__ import annotations

import math

import jax

from edit_jax.localsgd.methods import StepKind
from edit_jax.analysis import gpu_window, hlo_overlap

GIB = 1024 ** 3


def sync_units(programs, kind: str) -> tuple[int, int]:
    """(units, param elements of this device's shards of them) a sync of step kind ``kind`` covers:
    the root and every layer, or a fragment group's ('@f')."""
    params = programs.abstract_state().params
    span = programs._span(StepKind.parse(kind))
    root_in, lo, hi = span if span is not None else (True, 0, programs.cfg.model.n_layers)

    def elements(tree, rows=None) -> int:
        total = 0
        for x in jax.tree.leaves(tree):
            shard = x.sharding.shard_shape(x.shape)[1:]  # without the replica dim
            total += math.prod(shard) // (x.shape[1] if rows is not None else 1) * (rows or 1)
        return total

    n = elements(params["root"]) if root_in else 0
    return int(root_in) + hi - lo, n + (elements(params["layers"], hi - lo) if hi > lo else 0)


def step_report(compiled, kind: str, programs, estimate_bytes: float, link_gbps: float = gpu_window.DEFAULT_LINK_GBPS,
                mfu: float = gpu_window.DEFAULT_MFU) -> dict:
    """The XLA:GPU figures of one compiled step (``estimate_bytes``: plan's state + estimate; a
    sync step's window judged at ``link_gbps`` Gbit/s between workers and ``mfu``)."""
    mem = compiled.memory_analysis()
    fields = {k: float(getattr(mem, f"{k}_size_in_bytes", 0.0) or 0.0)
              for k in ("argument", "output", "alias", "temp")}
    peak = fields["argument"] + fields["output"] - fields["alias"] + fields["temp"]
    cfg = programs.cfg
    text = compiled.as_text()
    schedule = hlo_overlap.collective_schedule(text, (programs.n, programs.s), cfg.model.n_layers)
    out = {"memory": {**{f"{k}_bytes": v for k, v in fields.items()}, "peak_bytes": peak,
                      "estimate_bytes": estimate_bytes, "estimate_over_xla": estimate_bytes / peak if peak else None},
           "collectives_by_axis": hlo_overlap.by_axis(schedule)}
    if kind.startswith("sync_forward"):
        out["sync_overlap"] = hlo_overlap.sync_overlap(schedule, *sync_units(programs, kind))
        window = gpu_window.sync_window(text, schedule)
        flops = gpu_window.peak_flops(programs.mesh.devices.flat[0].device_kind)
        out["sync_window"] = window and {**window, **gpu_window.window_verdict(window, link_gbps, flops, mfu)}
    return out


def report_lines(p: dict) -> list[str]:
    """The text report's GPU part."""
    t = p["target"]
    lines = [f"XLA:GPU ({t['description']}, {t['memory_bytes'] / GIB:.1f} GiB; attention {t['attention']}; "
             f"compile options {t['compiler_options'] or 'none'}):",
             f"{'step':<16}{'peak GiB':>10}{'args':>8}{'temp':>8}{'out':>8}{'alias':>8}{'estimate':>10}{'est/xla':>9}"
             "  replica collectives (async/sync)"]
    for kind, v in p["steps"].items():
        g = v["xla_gpu"]
        m = g["memory"]
        rep = ", ".join(f"{op} {d['async']:g}/{d['sync']:g}"
                        for op, d in g["collectives_by_axis"].get("replica", {}).items())
        ratio = f"{m['estimate_over_xla']:.3f}" if m["estimate_over_xla"] else "n/a"
        lines.append(f"{kind:<16}{m['peak_bytes'] / GIB:>10.2f}{m['argument_bytes'] / GIB:>8.2f}"
                     f"{m['temp_bytes'] / GIB:>8.2f}"
                     f"{m['output_bytes'] / GIB:>8.2f}{m['alias_bytes'] / GIB:>8.2f}{m['estimate_bytes'] / GIB:>10.2f}"
                     f"{ratio:>9}  {rep or '-'}")
        if "sync_overlap" in g:
            o = g["sync_overlap"]
            lines.append(f"  EDiT sync: each unit's pseudo gradient crosses replica "
                         f"{'once' if o['once_per_unit'] else 'NOT once'} "
                         f"({o['elements_moved'] / o['unit_elements']:.3f} x its elements, in "
                         f"{o['replica_tensor_collectives_per_step']:g} collectives for {o['units']} units); "
                         f"in the layer loop {o['in_loop_async_with_compute']} of {o['in_loop']} async with compute "
                         f"between start and done")
            lines.append(gpu_window.report_line(g.get("sync_window"), g.get("sync_window")))
    fits = p["xla_gpu_fits"]
    lines.append(f"XLA:GPU: {'fits' if fits else 'does NOT fit'}: largest peak "
                 f"{p['xla_gpu_max_peak_bytes'] / GIB:.2f} GiB of {p['device_memory_gb']:g} GiB")
    return lines


__all__ = ["step_report", "report_lines", "sync_units"]
