"""``edit-jax plan``: does a config fit its devices? Read from the compiled program, before any run.

    edit-jax plan --config configs/edit_7b.py [overrides] [--json plan.json] [--device-memory 80]

Every step kind the config's method runs is compiled for its mesh on emulated CPU devices
(``mesh.replica x mesh.shard`` of them, set here before JAX starts) with abstract inputs: no
array is allocated, so a 7B preset plans on a laptop. Per device it reports:

- the state by part (params, inner optimizer, outer state, the rest), from the shardings;
- each step's compiled temporaries (``memory_analysis``) and FLOPs (``cost_analysis``);
- bytes per collective and mesh axis per step, from the HLO (``edit_jax/analysis/hlo.py``: ring bytes),
  and for the methods that sync the tau-window mean of the bytes crossing ``replica`` and a full
  sync's bits per parameter (beside the figure the config's ``sync.wire.kind`` implies);
- an analytic estimate of a GPU's peak per step kind (``memory_estimate.gpu_estimate``, the
  formula in its docstring) beside the CPU backend's temporaries (which keep fp32 copies and have
  no fused attention), and the verdict: the state plus the largest step's estimate within
  ``--device-memory`` GB (default 80; with ``--target``, XLA:GPU's own peak decides).

The JSON has a top-level ``"fits"`` (true / false) and every number. Exit 0 when it fits, 1 when it
does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax

from edit_jax.config import ModelConfig
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.quantize import ring_bits_per_param
from edit_jax.localsgd.fragments import unit_param_counts
from edit_jax.localsgd.methods import plan_for, step_kinds
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.sharding import BATCH_SPEC, named
from edit_jax.rundir.runlock import output_path_problem
from edit_jax.runtime.mesh import make_mesh, set_cpu_device_count
from edit_jax.analysis import gpu_plan, hlo
from edit_jax.analysis.gpu_target import GpuTarget, TargetError, cuda_plugin_missing, load_target, target_devices
from edit_jax.analysis.memory_estimate import compute_bytes, gpu_estimate
from edit_jax.validate import ConfigError, load_config
from edit_jax.exit_codes import EXIT_BAD_INPUT

GIB = 1024 ** 3


def state_bytes(abstract_state) -> dict:
    """Bytes per device by part of the state (the largest over devices), device and host memory."""
    def per_device(tree) -> tuple[float, float]:
        dev = host = 0.0
        for x in jax.tree.leaves(tree):
            shard = x.sharding.shard_shape(x.shape)
            nbytes = math.prod(shard) * x.dtype.itemsize
            if "host" in (getattr(x.sharding, "memory_kind", None) or "device"):
                host += nbytes
            else:
                dev += nbytes
        return dev, host

    parts = {"params": abstract_state.params, "inner_optimizer": abstract_state.opt_state,
             "outer": abstract_state.outer, "other": (abstract_state.step, abstract_state.rng)}
    out = {}
    for name, tree in parts.items():
        dev, host = per_device(tree)
        out[name] = {"device_bytes": dev, "host_bytes": host}
    out["total_device_bytes"] = sum(v["device_bytes"] for v in out.values())
    return out


def sync_bits(cfg, rule, sync_bytes: float) -> dict:
    """Bits per parameter at a full sync. ``sync_bits_per_param``: what one device moves across
    ``replica`` (its traffic), from the compiled program's collectives (ring bytes x 8 / the params
    a device holds); ``config_sync_bits_per_param``: the same as the config implies it
    (``compress.ring_bits_per_param``: the wire format with its padding). ``payload_bits_per_param``:
    one worker's encoded pseudo gradient, what a worker's post would hold. A sparse wire is
    all-gathered, so its traffic grows as (N − 1) payloads where the int8 all-to-all's stays under
    2 x 8.1: ``int8_sync_bits_per_param`` is int8's traffic on this mesh and
    ``sparse_crossover_replicas`` the replica count from which the sparse wire moves more."""
    sizes = [u // cfg.mesh.shard for u in unit_param_counts(cfg)]
    codec, n = rule.codec, cfg.mesh.replica
    int8 = Codec("int8")
    out = {"sync_bits_per_param": 8.0 * sync_bytes / sum(sizes), "wire": codec.name,
           "config_sync_bits_per_param": ring_bits_per_param(codec, sizes, n),
           "payload_bits_per_param": codec.bits_per_param(sizes),
           "int8_sync_bits_per_param": ring_bits_per_param(int8, sizes, n)}
    if codec.is_sparse:  # (N − 1)·b against 2(N − 1)/N·b8 (the int8 all-to-all): from N ~ 2·b8/b, ~72 for topk2
        out["sparse_crossover_replicas"] = next(
            (m for m in range(2, 4097) if ring_bits_per_param(codec, sizes, m) > ring_bits_per_param(int8, sizes, m)),
            None)
    return out


def _flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # not every backend / version has it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float(cost.get("flops", float("nan"))) if cost else None


def plan(cfg, device_memory_gb: float = 80.0, target: GpuTarget | None = None, link_gbps: float = 100.0) -> dict:
    """The plan of ``cfg`` (validated). Without ``target``: compiled for ``mesh.replica x
    mesh.shard`` CPU devices (JAX already has them); with one: for that GPU's abstract devices
    (XLA:GPU, the CUDA plugin), each step also with ``gpu_plan.step_report``'s figures (a sync
    step's window judged at ``link_gbps`` Gbit/s per device between workers)."""
    method_plan = plan_for(cfg)
    cfg = method_plan.cfg
    n, s = cfg.mesh.replica, cfg.mesh.shard
    devices = target_devices(target, n * s) if target is not None else jax.devices()[: n * s]
    mesh = make_mesh(cfg.mesh, devices)
    programs = StepPrograms(method_plan, mesh)
    abstract = programs.abstract_state()
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.data.seq_len + 1), jax.numpy.int32,
                                 sharding=named(mesh, BATCH_SPEC))
    state = state_bytes(abstract)
    c = compute_bytes(cfg.model)
    steps, estimates = {}, {}
    for kind in step_kinds(programs.schedule, cfg):
        # a sync step keeps its synced units' shards in the compute dtype for the backward
        synced = gpu_plan.sync_units(programs, kind)[1] * c if kind.startswith("sync_forward") else None
        compiled = programs.lowered(kind, abstract, batch).compile()
        mem = compiled.memory_analysis()
        if isinstance(cfg.model, ModelConfig):
            estimates[kind] = gpu_estimate(cfg, state["params"]["device_bytes"], kind, synced)
        else:  # the analytic estimate is Llama's: another family's is what XLA compiled (CPU or the target)
            temp = float(getattr(mem, "temp_size_in_bytes", 0.0))
            estimates[kind] = {"kind": kind, "parts": {"compiled_temp": temp}, "phases": {"compiled": temp},
                               "peak_phase": "compiled", "total_bytes": temp, "fused_attention": False}
        need = state["total_device_bytes"] + estimates[kind]["total_bytes"]
        parsed = hlo.hlo_collectives(compiled.as_text(), (n, s), default_trip=cfg.model.n_layers)
        cross, within = hlo.collective_totals(parsed, True), hlo.collective_totals(parsed, False)
        steps[kind] = {
            "temp_bytes": float(getattr(mem, "temp_size_in_bytes", float("nan"))),
            "argument_bytes": float(getattr(mem, "argument_size_in_bytes", float("nan"))),
            "flops": _flops(compiled),
            "replica_ring_bytes": cross["ring_bytes"], "shard_ring_bytes": within["ring_bytes"],
            "replica_by_op": cross["by_op"], "shard_by_op": within["by_op"],
            "gpu_estimate_bytes": need,
        }
        if target is not None:
            steps[kind]["xla_gpu"] = gpu_plan.step_report(compiled, kind, programs, need, link_gbps)
    tau = cfg.sync.tau
    window = None
    if programs.rule.keeps_outer:  # a tau window: tau - 1 local steps and the sync step
        local = steps.get("local", {}).get("replica_ring_bytes", 0.0)
        sync_kinds = [k for k in steps if k not in ("hsdp", "local")]
        sync_bytes = sum(steps[k]["replica_ring_bytes"] for k in sync_kinds) / max(len(sync_kinds), 1) \
            * (cfg.sync.fragments if cfg.sync.fragments > 1 else 1)
        window = {"tau": tau, "mean_replica_ring_bytes_per_step": ((tau - 1) * local + sync_bytes) / tau,
                  **sync_bits(cfg, programs.rule, sync_bytes)}
    worst_cpu = max(v["temp_bytes"] for v in steps.values())
    estimate = max(estimates.values(), key=lambda e: e["total_bytes"])  # the step kind that needs most
    need = state["total_device_bytes"] + estimate["total_bytes"]
    out = {
        "fits": bool(need <= device_memory_gb * GIB),
        "estimate_fits": bool(need <= device_memory_gb * GIB),
        "device_memory_gb": device_memory_gb,
        "gpu_estimate_total_gb": need / GIB,
        "config": {"method": cfg.sync.method, "mesh": [n, s], "batch_size": cfg.batch_size,
                   "seq_len": cfg.data.seq_len, "grad_accum": cfg.optim.grad_accum, "family": cfg.model.family,
                   "compute_dtype": cfg.model.compute_dtype, **{k: getattr(cfg.model, k, None)  # (Llama's fields)
                                                                for k in ("remat", "attention", "loss_chunk")}},
        "state_per_device": state,
        "gpu_estimate": estimate,
        "gpu_estimate_by_kind": estimates,
        "cpu_compiled_max_temp_bytes": worst_cpu,
        "steps": steps,
        "tau_window": window,
    }
    # What is planned above is the in-program A-EDiT: say what the exchange's workers differ in.
    if cfg.sync.exchange.url:
        out["exchange"] = {"url": cfg.sync.exchange.url, "devices_per_worker": s, "tau_time": cfg.sync.time.tau,
                           "wire": cfg.sync.wire.kind}
    if target is not None:  # the verdict is XLA:GPU's own peak, not the estimate
        peak = max(v["xla_gpu"]["memory"]["peak_bytes"] for v in steps.values())
        out["target"] = {"name": target.name, "description": target.description, "memory_bytes": target.memory_bytes,
                         "attention": getattr(programs.model_cfg, "attention", None),
                         "compiler_options": {k: str(v) for k, v in programs.compiler_options.items()}}
        out["xla_gpu_max_peak_bytes"] = peak
        out["xla_gpu_fits"] = out["fits"] = bool(peak <= device_memory_gb * GIB)
    return out


def _gb(x: float) -> str:
    return f"{x / GIB:.2f}" if x >= 0.01 * GIB else f"{x / GIB:.1e}"


def report(p: dict) -> str:
    st, est = p["state_per_device"], p["gpu_estimate"]
    lines = [f"edit-jax plan: {p['config']['method']} on mesh {p['config']['mesh'][0]} x {p['config']['mesh'][1]}, "
             f"batch {p['config']['batch_size']} x {p['config']['seq_len']}, grad_accum {p['config']['grad_accum']}, "
             f"{p['config']['compute_dtype']}, remat {p['config']['remat']} (per device)",
             "state GiB: " + ", ".join(f"{k} {_gb(v['device_bytes'])}" + (f" (+{_gb(v['host_bytes'])} host)"
                                                                          if v["host_bytes"] else "")
                                      for k, v in st.items() if isinstance(v, dict)),
             f"{'step':<16}{'CPU temp GiB':>14}{'TFLOP':>10}{'replica B':>16}{'shard B':>16}"]
    for kind, v in p["steps"].items():
        tflop = f"{v['flops'] / 1e12:.3f}" if v["flops"] is not None else "n/a"
        lines.append(f"{kind:<16}{_gb(v['temp_bytes']):>14}{tflop:>10}{v['replica_ring_bytes']:>16,.0f}"
                     f"{v['shard_ring_bytes']:>16,.0f}")
    if p["tau_window"]:
        lines.append(f"tau-window mean across replica: {p['tau_window']['mean_replica_ring_bytes_per_step']:,.0f} B "
                     f"per step (tau = {p['tau_window']['tau']}); a full sync sends "
                     f"{p['tau_window']['sync_bits_per_param']:.3f} bits per parameter "
                     f"(config, {p['tau_window']['wire']}: "
                     f"{p['tau_window']['config_sync_bits_per_param']:.3f})")
        w = p["tau_window"]
        if w.get("sparse_crossover_replicas"):
            lines.append(f"{w['wire']}: a worker's payload is {w['payload_bits_per_param']:.3f} bits per parameter; "
                         f"all-gathered, each device receives {p['config']['mesh'][0] - 1} of them per sync, "
                         f"{w['config_sync_bits_per_param'] / max(w['int8_sync_bits_per_param'], 1e-12):.2f}x int8's "
                         f"{w['int8_sync_bits_per_param']:.2f} bits on this mesh; from "
                         f"{w['sparse_crossover_replicas']} replicas on, int8 moves fewer")
    where = "as compiled: the estimate is Llama's" if est["peak_phase"] == "compiled" else \
        f"peak in the {est['peak_phase']} backward"
    lines.append(f"GPU estimate GiB ({est['kind']}, {where}): "
                 + ", ".join(f"{k} {_gb(v)}" for k, v in est["parts"].items() if v)
                 + f" (fused attention: {est['fused_attention']})")
    lines.append(f"{'fits' if p['estimate_fits'] else 'does NOT fit'}: "
                 f"state {_gb(st['total_device_bytes'])} + estimate "
                 f"{_gb(est['total_bytes'])} = {p['gpu_estimate_total_gb']:.2f} GiB of {p['device_memory_gb']:g} GiB "
                 f"(the {'XLA:GPU' if 'target' in p else 'CPU'} compile's largest temporaries: "
                 f"{_gb(p['cpu_compiled_max_temp_bytes'])} GiB)")
    if "target" in p:
        lines += gpu_plan.report_lines(p)
    if "exchange" in p:
        x = p["exchange"]
        lines.append(f"exchange: these are the in-program figures. With sync.exchange.url the workers are separate "
                     f"programs (mesh.shard={x['devices_per_worker']} devices each) meeting through {x['url']}: a "
                     f"worker runs only the 'local' step, sends nothing across replica (a post of its pseudo gradient, "
                     f"wire {x['wire']}, every {x['tau_time']:g} s) and keeps θ̄ and the outer state in host memory, "
                     "not on its devices")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edit-jax plan", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--config", required=True, help="a config file (.py / .json) or a preset name in configs/")
    parser.add_argument("--json", default=None, help="also write the plan as JSON here")
    parser.add_argument("--device-memory", type=float, default=None,
                        help="GiB of one device (default: the target's memory, else 80)")
    parser.add_argument("--target", default=None, help="compile for this GPU with XLA:GPU (h100, a100, h200; "
                        "needs the cuda extra, not a GPU)")
    parser.add_argument("--target-file", default=None, help="a GPU target description (GpuTargetConfigProto text)")
    parser.add_argument("--link-gbps", type=float, default=100.0, help="with --target: Gbit/s per device between "
                        "workers, for the verdict whether EDiT's sync is hidden under its window (default 100)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_intermixed_args(argv)
    for flag, value in (("--link-gbps", args.link_gbps), ("--device-memory", args.device_memory)):
        if value is not None and not (math.isfinite(value) and value > 0):
            print(f"edit-jax: plan error: {flag} must be a positive number, got {value}", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:  # bad input (config, target) is one line and exit 2, before any compile and from inside it
        cfg = load_config(args.config, args.overrides)
        target = None
        if args.target is not None or args.target_file is not None:
            target = load_target(args.target, args.target_file)
            if target_error := cuda_plugin_missing():
                raise TargetError(f"--target {target.name}: {target_error}")
        if args.json and (problem := output_path_problem(args.json, "--json", directory=False)):
            print(f"edit-jax: plan error: {problem}", file=sys.stderr)  # export --out's check, before any compile
            return EXIT_BAD_INPUT
        memory = args.device_memory or (target.memory_bytes / GIB if target is not None else 80.0)
        # Compiled for emulated CPU devices whatever this machine has (importing jax started no
        # backend yet: the platform and the device count still apply); a GPU target's devices are
        # abstract ones of the CUDA plugin beside them.
        jax.config.update("jax_platforms", "cpu")
        set_cpu_device_count(cfg.mesh.replica * cfg.mesh.shard)
        p = plan(cfg, memory, target, args.link_gbps)
    except TargetError as e:
        print(f"edit-jax: plan error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ConfigError as e:
        print(f"edit-jax: bad config: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(report(p))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(p, f, indent=1)
        except OSError as e:  # checked before compiling; gone since, or a full disk
            print(f"edit-jax: plan error: --json {args.json!r} cannot be written: {e.strerror or e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    return 0 if p["fits"] else 1


__all__ = ["plan", "gpu_estimate", "state_bytes", "step_kinds", "report", "main"]
