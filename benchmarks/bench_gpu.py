#!/usr/bin/env python
"""EDiT on real GPUs: step time and MFU per step kind, the sync step's cost over a local step, and
where the sync's all-reduce sits in a profile; cuDNN vs XLA attention (issue 29, item 6).

    python benchmarks/bench_gpu.py --preset 350m --replica 1 --shard 1 --batch 8          # one GPU
    python benchmarks/bench_gpu.py --preset 1b --replica 2 --shard 4 --batch 64 --json gpu.json   # 8 GPUs
    python benchmarks/bench_gpu.py --preset tiny --platform cpu --batch 16 --replica 2 --shard 2  # smoke test

For each attention kernel of ``--attention`` (default cudnn,xla) the EDiT config of the preset
(bf16, remat, the paper's sync settings) runs its ``local`` and ``sync_forward`` programs on the
mesh of the visible devices: ``--warmup`` untimed calls, then ``--steps`` timed ones each (the
state goes on from step to step; timed with ``jax.block_until_ready``). MFU = model FLOPs per step
(``flops_per_token`` x tokens) / step time / (devices x ``--peak-tflops``, default 989: an H100
SXM's dense bf16). The sync ratio is the median sync step over the median local step: 1.0 is a
fully hidden sync. With ``--profile DIR`` one traced sync step per kernel: each all-reduce across
``replica`` (named from XLA's own program) with its time and how much of it overlapped GEMM /
attention kernels on the same device (``overlap_fraction``).

Measured on one H100 (docs/benchmarks/gpu.md; JSON in docs/gpu/): the peak memory the device
allocator saw beside XLA's own figure per compiled step (``memory_analysis``, what ``edit-jax plan
--target`` reports); ``--no-remat`` keeps every activation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="350m", help="model preset (tiny, 350m, 1b, 3b, 7b)")
    p.add_argument("--replica", type=int, default=1)
    p.add_argument("--shard", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--attention", default="cudnn,xla")
    p.add_argument("--no-remat", action="store_true", help="keep every activation (no rematerialisation)")
    p.add_argument("--remat-saves", default="nothing",
                   help="model.remat_saves: what a rematerialised layer keeps (nothing, dots, dots_attention)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--platform", default="gpu", help="gpu (default), or cpu for a smoke test")
    p.add_argument("--profile", default=None, help="trace one sync step per kernel under this directory")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny preset (one layer) on 2 CPU devices, one timed step (CI)")
    a = p.parse_args(argv)
    if a.smoke:  # the GPU run's path on the CPU: arguments, configs, programs, timing, memory, JSON
        a.preset, a.platform, a.replica, a.shard, a.batch, a.seq_len = "tiny", "cpu", 2, 1, 4, 16
        a.attention, a.steps, a.warmup = "xla", 1, 0
    return a


def _config(a, attention: str):
    from edit_jax.config import DataConfig, MeshConfig
    from edit_jax.models.llama import preset
    from edit_jax.presets import paper
    from edit_jax.validate import validate

    base = paper("350m", "edit")
    dtype = "bfloat16" if a.platform == "gpu" else "float32"
    cfg = base.__class__(**{**base.__dict__,
                            "model": preset(a.preset, compute_dtype=dtype, remat=not a.no_remat, attention=attention,
                                            remat_saves=a.remat_saves,
                                            **({"n_layers": 1} if a.smoke else {})),  # (smoke: compiles in seconds)
                            "mesh": MeshConfig(replica=a.replica, shard=a.shard, fused_gather=a.platform != "gpu"),
                            "data": DataConfig(seq_len=a.seq_len), "batch_size": a.batch,
                            "sync": base.sync.__class__(**{**base.sync.__dict__, "warmup_steps": 0, "tau": 1})})
    validate(cfg)
    return cfg


def _time_kind(programs, state, batch, kind: str, warmup: int, steps: int):
    import jax

    fn = programs.step_fn(kind)
    for _ in range(warmup):
        state, _ = fn(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, _ = fn(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    return state, times


def _sync_in_profile(programs, state, batch, log_dir: str) -> list[dict]:
    """Each replica all-reduce of one traced sync step: its time and the share of it that GEMM /
    attention kernels of the same device overlapped."""
    import gzip

    import jax

    from edit_jax.analysis import hlo_overlap
    from edit_jax.analysis.profile import find_trace

    text = programs.lowered("sync_forward", state, batch).compile().as_text()
    names = {r["name"] for r in
             hlo_overlap.collective_schedule(text, (programs.n, programs.s), programs.cfg.model.n_layers)
             if r["axis"] == "replica" and r["tensor"]}
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        state, _ = programs.step_fn("sync_forward")(state, batch)
        jax.block_until_ready(state)
    with gzip.open(find_trace(log_dir), "rt") as f:
        events = json.load(f)
    events = [e for e in (events["traceEvents"] if isinstance(events, dict) else events) if e.get("ph") == "X"]
    compute = [e for e in events
               if any(k in e.get("name", "") for k in ("gemm", "cublas", "fmha", "cudnn", "sm90", "sm80"))]
    out = []
    for e in events:
        if e.get("args", {}).get("hlo_op", e.get("name")) not in names:  # the op, or on a GPU its NCCL kernel
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        covered = sum(max(0.0, min(end, c["ts"] + c.get("dur", 0.0)) - max(start, c["ts"]))
                      for c in compute if c.get("pid") == e.get("pid"))
        out.append({"name": e["name"], "us": end - start,
                    "overlap_fraction": min(1.0, covered / max(end - start, 1e-9))})
    return out


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2 ** 30:.2f}"


def main(argv=None) -> int:
    a = _args(argv)
    if a.platform == "cpu":
        common.ensure_cpu_devices(a.replica * a.shard)
    import jax
    import numpy as np

    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.models.llama import flops_per_token
    from edit_jax.runtime.mesh import make_mesh

    devices = jax.devices(a.platform)[: a.replica * a.shard]
    results = {}
    for attention in a.attention.split(","):
        cfg = _config(a, attention)
        programs = StepPrograms.for_config(cfg, make_mesh(cfg.mesh, devices))
        state = programs.init_state(0)
        rng = np.random.default_rng(0)
        batch = programs.put_batch(rng.integers(0, cfg.model.vocab_size, (cfg.batch_size, cfg.data.seq_len + 1),
                                                dtype=np.int32))
        model_flops = flops_per_token(cfg.model, cfg.data.seq_len) * cfg.batch_size * cfg.data.seq_len
        row = {}
        for kind in ("local", "sync_forward"):
            state, times = _time_kind(programs, state, batch, kind, a.warmup, a.steps)
            med = statistics.median(times)
            row[kind] = {"median_s": med, "times_s": times,
                         "mfu": model_flops / med / (len(devices) * a.peak_tflops * 1e12)}
        row["sync_over_local"] = row["sync_forward"]["median_s"] / row["local"]["median_s"]
        # Peak memory: what the device allocator saw (None off a GPU) against XLA's own figure for
        # each compiled step (memory_analysis: what ``edit-jax plan --target`` reports per step).
        stats = devices[0].memory_stats() or {}
        row["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        row["bytes_limit"] = stats.get("bytes_limit")
        for kind in ("local", "sync_forward"):
            ma = programs.lowered(kind, state, batch).compile().memory_analysis()
            row[kind]["xla_peak_bytes"] = None if ma is None else int(
                ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
        row["attention_impl"] = programs.model_cfg.attention
        row["remat"], row["remat_saves"] = cfg.model.remat, cfg.model.remat_saves
        row["compiler_options"] = {k: str(v) for k, v in programs.compiler_options.items()}
        if a.profile:
            row["sync_all_reduces"] = _sync_in_profile(programs, state, batch, os.path.join(a.profile, attention))
        results[attention] = row
        print(f"{a.preset} b{a.batch} {attention} ({row['attention_impl']}), remat saves {a.remat_saves} "
              f"on {a.replica} x {a.shard}: local "
              f"{row['local']['median_s'] * 1e3:.1f} ms (MFU {row['local']['mfu']:.3f}), sync_forward "
              f"{row['sync_forward']['median_s'] * 1e3:.1f} ms (MFU {row['sync_forward']['mfu']:.3f}), "
              f"sync / local {row['sync_over_local']:.3f}; peak {_gib(row['peak_bytes_in_use'])} GiB measured, "
              f"XLA {_gib(row['local']['xla_peak_bytes'])} / {_gib(row['sync_forward']['xla_peak_bytes'])} GiB "
              f"(local / sync_forward)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "devices": [str(d) for d in devices], "results": results,
                       "env": common.env_info()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
