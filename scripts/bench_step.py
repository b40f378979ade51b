#!/usr/bin/env python
"""Throughput of one compiled training step: tokens/s, step time, model FLOPs and MFU.

Times ``Machinery.step_fn(kind)`` (default ``hsdp``: the Baseline step, gradients averaged over
both mesh axes) on one fixed random batch, excluding compilation: the first call (compile + one
step) and ``--warmup`` more steps are not timed; each of the ``--steps`` timed steps is measured
with ``jax.block_until_ready`` on the new state. Reports the median and mean step time, tokens/s
(global batch x seq / step time), model FLOPs per token (``model.flops_per_token``: 6 x matmul
params + attention scores, PaLM appendix B), achieved model FLOP/s and, with ``--peak-tflops``,
MFU = achieved / (peak x devices).

    python scripts/bench_step.py                       # demo model, 2 x 4 CPU-emulated mesh
    python scripts/bench_step.py --model 350m --replica 1 --shard 8 --dtype bfloat16 --peak-tflops 989
    python scripts/bench_step.py --kind sync_forward   # any step kind of step.STEP_KINDS

On CPU the mesh is emulated: XLA_FLAGS=--xla_force_host_platform_device_count=R*S is set before
jax is imported (unless XLA_FLAGS already sets a count), and all emulated devices share the
host's cores, so per-device numbers mean little there.
"""

from __future__ import annotations

import argparse
import os
import time

import _bench_common as common

STEP_KINDS = ("hsdp", "local", "sync_forward", "local_then_sync")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="model preset (edit_jax.model.PRESETS); default demo")
    p.add_argument("--replica", type=int, default=2, help="mesh.replica (N workers); default 2")
    p.add_argument("--shard", type=int, default=4, help="mesh.shard (S FSDP shards per worker); default 4")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences; default 16")
    p.add_argument("--seq", type=int, default=128, help="sequence length; default 128")
    p.add_argument("--steps", type=int, default=20, help="timed steps; default 20")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the compiling first call; default 3")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model.compute_dtype (params stay float32); default float32")
    p.add_argument("--kind", default="hsdp", choices=STEP_KINDS,
                   help="step kind to time; default hsdp (Baseline). sync kinds use method=edit")
    p.add_argument("--method", default=None, choices=("baseline", "post_local_sgd", "diloco", "edit"),
                   help="sync.method of the config (default: baseline for hsdp/local, edit for sync kinds)")
    p.add_argument("--remat", action="store_true", help="model.remat=true (recompute layers in the backward)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of ONE device, to report MFU = achieved / (peak x R x S); on a "
                        "CPU-emulated mesh pass the host's peak divided by R x S")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override (repeatable), e.g. --set model.n_layers=8")
    p.add_argument("--block-every", type=int, default=1, metavar="K",
                   help="block_until_ready after every K-th step and time the group (per-step time = group "
                        "time / K); default 1: every step is timed on its own. K > 1 measures with async "
                        "dispatch. Caution: on an 8-device CPU-emulated mesh with 2 cores, K >= 50 "
                        "deadlocked XLA:CPU (collective rendezvous abort after 40 s); K <= 40 was fine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.path.join(common.DEFAULT_JSON_DIR, "bench_step.json"),
                   help="where to write the JSON result; default runs/bench/bench_step.json")
    return p.parse_args(argv)


def build_config(args):
    from edit_jax.config import Config, DataConfig, MeshConfig, OptimConfig, SyncConfig, apply_overrides, validate
    from edit_jax.model import preset

    method = args.method or ("edit" if args.kind in ("sync_forward", "local_then_sync") else "baseline")
    cfg = Config(model=preset(args.model, compute_dtype=args.dtype, remat=args.remat),
                 mesh=MeshConfig(replica=args.replica, shard=args.shard), data=DataConfig(seq_len=args.seq),
                 optim=OptimConfig(), sync=SyncConfig(method=method),
                 steps=max(1, 1 + args.warmup + args.steps), batch_size=args.batch, seed=args.seed)
    cfg = apply_overrides(cfg, list(args.overrides))
    validate(cfg)
    return cfg


def main(argv=None) -> dict:
    args = parse_args(argv)
    n_dev = args.replica * args.shard
    common.ensure_cpu_devices(n_dev)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from edit_jax import model as model_lib
    from edit_jax.sharding import make_mesh
    from edit_jax.step import Machinery

    cfg = build_config(args)
    if args.kind in ("sync_forward", "local_then_sync") and cfg.sync.method == "baseline":
        raise SystemExit(f"--kind {args.kind} needs an outer state: use --method edit|diloco|post_local_sgd")
    mesh = make_mesh(cfg.mesh, common.pick_devices(n_dev))
    machinery = Machinery(cfg, mesh)
    state = machinery.init_state(cfg.seed)
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, min(cfg.model.vocab_size, 257), (cfg.batch_size, cfg.data.seq_len + 1), dtype=np.int32)
    batch = machinery.put_batch(jnp.asarray(tokens))
    fn = machinery.step_fn(args.kind)
    env = common.env_info()  # before timing: its load average is the one the timings saw

    t0 = time.perf_counter()
    state, metrics = fn(state, batch)
    jax.block_until_ready((state, metrics))
    first = time.perf_counter() - t0
    for _ in range(args.warmup):
        state, metrics = fn(state, batch)
    jax.block_until_ready((state, metrics))
    times = []  # per-step seconds: one entry per step (K = 1) or per group of K steps
    k = max(1, args.block_every)
    done = 0
    while done < args.steps:
        group = min(k, args.steps - done)
        t0 = time.perf_counter()
        for _ in range(group):
            state, metrics = fn(state, batch)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / group)
        done += group
    loss = float(np.mean(jax.device_get(metrics["loss"])))  # per replica ([N]) since b9fb776, or a scalar

    n_params = model_lib.count_params(jax.eval_shape(lambda k: model_lib.init_params(cfg.model, k), jax.random.key(0)))
    tokens_per_step = cfg.batch_size * cfg.data.seq_len
    fpt = model_lib.flops_per_token(cfg.model, cfg.data.seq_len)
    st = common.summary(times)
    res = {
        "benchmark": "bench_step", "env": env, "loadavg_at_end": common.loadavg(),
        "setup": {"model": args.model, "params": n_params, "kind": args.kind, "method": cfg.sync.method,
                  "mesh": [args.replica, args.shard], "devices": n_dev, "batch": cfg.batch_size, "seq": cfg.data.seq_len,
                  "tokens_per_step": tokens_per_step, "compute_dtype": cfg.model.compute_dtype, "remat": cfg.model.remat,
                  "warmup": args.warmup, "steps": args.steps, "block_every": k, "overrides": args.overrides,
                  "batch_source": "one fixed random batch, already on device (no data loading timed)"},
        "first_call_s": first, "step_time": st, "step_times_s": times,
        "tokens_per_s_median": tokens_per_step / st["median_s"], "tokens_per_s_mean": tokens_per_step / st["mean_s"],
        "flops_per_token": fpt, "model_flops_per_step": fpt * tokens_per_step,
        "achieved_flops_per_s_median": fpt * tokens_per_step / st["median_s"],
        "achieved_flops_per_s_mean": fpt * tokens_per_step / st["mean_s"],
        "peak_tflops_per_device": args.peak_tflops, "mfu_median": None, "last_loss": loss,
    }
    if args.peak_tflops:
        res["mfu_median"] = res["achieved_flops_per_s_median"] / (args.peak_tflops * 1e12 * n_dev)
        res["mfu_mean"] = res["achieved_flops_per_s_mean"] / (args.peak_tflops * 1e12 * n_dev)

    rows = [
        ["model / params", f"{args.model} / {n_params:,}"],
        ["step kind (method)", f"{args.kind} ({cfg.sync.method})"],
        ["mesh replica x shard", f"{args.replica} x {args.shard} ({jax.devices()[0].platform})"],
        ["batch x seq = tokens/step", f"{cfg.batch_size} x {cfg.data.seq_len} = {tokens_per_step:,}"],
        ["compute dtype", cfg.model.compute_dtype + (" + remat" if cfg.model.remat else "")],
        ["first call (compile + 1 step)", f"{first:.2f} s"],
        ["timed steps (after warmup)", f"{args.steps} (warmup {args.warmup})"
         + (f", blocking every {k} steps ({len(times)} groups)" if k > 1 else ", each blocked")],
        ["step time median / mean", f"{st['median_s'] * 1e3:.1f} / {st['mean_s'] * 1e3:.1f} ms"],
        ["step time stdev / min / max", f"{st['stdev_s'] * 1e3:.1f} / {st['min_s'] * 1e3:.1f} / {st['max_s'] * 1e3:.1f} ms"],
        ["tokens/s median / mean", f"{res['tokens_per_s_median']:,.0f} / {res['tokens_per_s_mean']:,.0f}"],
        ["model FLOPs/token", f"{fpt:.4e}"],
        ["achieved model FLOP/s (median)", f"{res['achieved_flops_per_s_median']:.4e}"],
    ]
    if args.peak_tflops:
        rows.append(["MFU (median) vs peak x devices", f"{100 * res['mfu_median']:.2f} % of {args.peak_tflops} TFLOP/s x {n_dev}"])
    rows.append(["loss at last step", f"{loss:.4f}"])
    common.print_table("bench_step", ["quantity", "value"], rows)
    common.write_json(args.json, res)
    print(f"\nJSON: {os.path.relpath(args.json, os.getcwd()) if args.json else args.json}")
    return res


if __name__ == "__main__":
    main()
