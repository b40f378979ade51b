"""`edit-jax plan` over the paper presets: does each fit an 80 GB GPU, and how close is the
analytic GPU estimate to a compiled figure?

    python benchmarks/plan_presets.py [--sizes 350m 1b 3b 7b] [--methods baseline diloco edit]
                                      [--json plan_presets.json]

Table 1: per preset (8 x 8 mesh, batch 1024 x 4096, bf16, remat, the preset's grad_accum): state
per device, the CPU compile's largest temporaries, the analytic GPU estimate, FLOPs of the local
(or hsdp) step, bytes per step crossing `replica` (hsdp step; tau-window mean for the Local-SGD
methods) and within a replica (`shard`), and the verdict.

Table 2: the estimate against the compiled temporaries where the two count the same thing: the
small presets in float32 with XLA attention (what the CPU backend runs) and the chunked loss.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="*", default=["350m", "1b", "3b", "7b"])
    p.add_argument("--methods", nargs="+", default=["baseline", "diloco", "edit"])
    p.add_argument("--check-sizes", nargs="*", default=["350m", "1b"])
    p.add_argument("--json", default=os.path.join(common.DEFAULT_JSON_DIR, "plan_presets.json"))
    p.add_argument("--smoke", action="store_true", help="the argument and report path only: no preset planned (CI)")
    args = p.parse_args(argv)
    if args.smoke:  # a preset needs 64 devices and minutes of compiling
        args.sizes, args.check_sizes = [], []
    common.ensure_cpu_devices(64)
    from edit_jax.config import apply_overrides
    from edit_jax.presets import paper
    from edit_jax.commands.plan import GIB, plan
    from edit_jax.validate import validate

    rows, out = [], {"env": common.env_info(), "presets": {}, "checks": {}}
    for size in args.sizes:
        for method in args.methods:
            cfg = paper(size, method)
            validate(cfg)
            r = plan(cfg)
            out["presets"][f"{method}_{size}"] = r
            main_kind = "hsdp" if "local" not in r["steps"] else "local"
            cross = (r["tau_window"]["mean_replica_ring_bytes_per_step"] if r["tau_window"]
                     else r["steps"]["hsdp"]["replica_ring_bytes"])
            flops = r["steps"][main_kind]["flops"]
            rows.append([f"{method}_{size}", r["config"]["grad_accum"],
                         f"{r['state_per_device']['total_device_bytes'] / GIB:.2f}",
                         f"{r['cpu_compiled_max_temp_bytes'] / GIB:.1f}",
                         f"{r['gpu_estimate']['total_bytes'] / GIB:.1f}",
                         f"{r['gpu_estimate_total_gb']:.1f}", f"{flops / 1e12:.1f}" if flops else "n/a",
                         f"{cross / 1e9:.3f}", f"{r['steps'][main_kind]['shard_ring_bytes'] / 1e9:.1f}",
                         "fits" if r["fits"] else "NO"])
            print(f"planned {method}_{size}", flush=True)
    common.print_table("Paper presets on 80 GB (per device; B = bytes per step)",
                       ["preset", "grad_accum", "state GiB", "CPU temp GiB", "GPU est. GiB", "state + est. GiB",
                        "TFLOP/step", "replica GB", "shard GB", "verdict"], rows,
                       "replica GB: hsdp step for the baseline, tau-window mean for Local SGD; shard GB: the "
                       "local (or hsdp) step's FSDP gathers and reduce-scatters. CPU temp: the CPU backend's "
                       "compiled temporaries (fp32 copies, no fused attention).")
    check_rows = []
    for size in args.check_sizes:
        cfg = apply_overrides(paper(size, "edit"), ["model.compute_dtype=float32", "model.attention=xla"])
        validate(cfg)
        r = plan(cfg)
        cpu = r["steps"]["local"]["temp_bytes"]
        est = r["gpu_estimate"]["total_bytes"]
        out["checks"][size] = {"cpu_local_temp_bytes": cpu, "estimate_bytes": est, "ratio": est / cpu}
        check_rows.append([f"edit_{size} fp32 xla", f"{cpu / GIB:.1f}", f"{est / GIB:.1f}", f"{est / cpu:.2f}"])
    if check_rows:
        common.print_table("The analytic estimate against the compiled temporaries (same dtype and attention)",
                           ["config", "CPU local step temp GiB", "estimate GiB", "estimate / compiled"], check_rows)
    common.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
