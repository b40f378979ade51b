"""A-EDiT against step-based EDiT with and without a straggler, at the same wall-time budget.

    python benchmarks/bench_straggler.py                       # demo model, 2 workers x 2 devices, 120 s per run
    python benchmarks/bench_straggler.py --seconds 60 --slowdown 3

Four runs of `edit-jax train` with mesh.processes=2 (one process per worker, each pinned to a CPU
core of its own, so a worker's step time is its own speed): EDiT (sync every tau steps) and
A-EDiT (sync every tau_time seconds), each without and with worker 1 slowed down
(`debug.slowdown=1:FACTOR`). Every run stops at `max_seconds` (then evaluates θ̄ and saves).
tau_time is set to tau x the median local step time of the EDiT run without a straggler, so both
methods sync about as often when no worker is slow.

Reported per run: tokens/s of all workers in the steady state (from the end of the first sync, when
every training program is compiled, to the final evaluation, periodic evaluations excluded),
steps per worker, syncs, validation loss on θ̄ at the end, and the ideal throughput: the sum of
the workers' own speeds (tokens per local step / median local step time of each worker, read
from the same run's records). Writes a table, JSON (runs/bench/bench_straggler.json) and a plot of validation loss
against wall time (docs/straggler.png).

``--smoke`` (CI): the tiny config (one layer, no synchronous warm-up) on 2 workers of one device,
12 steps, tau=2, two runs instead of four (EDiT without a straggler, whose step time sets
tau_time, and A-EDiT with one): both summaries (lock-step and per-worker records), the table, the
JSON and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo.py")
    p.add_argument("--seconds", type=float, default=120.0, help="wall-time budget of each run (max_seconds)")
    p.add_argument("--slowdown", type=float, default=2.0, help="worker 1's step-time factor in the straggler runs")
    p.add_argument("--tau", type=int, default=10, help="EDiT's sync interval (steps)")
    p.add_argument("--steps", type=int, default=600, help="`steps` (sets the lr schedule and A-EDiT's token budget)")
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--run-root", default=os.path.join(common.REPO, "runs", "bench_straggler"))
    p.add_argument("--json", default=os.path.join(common.DEFAULT_JSON_DIR, "bench_straggler.json"))
    p.add_argument("--plot", default=None, help="default docs/straggler.png (--smoke: beside --json)")
    p.add_argument("--smoke", action="store_true", help="tiny config, 2 runs of 12 steps (CI)")
    args = p.parse_args(argv)
    args.extra = []
    if args.smoke:
        args.config, args.steps, args.tau, args.eval_every, args.seconds = "configs/tiny.py", 12, 2, 4, 120.0
        args.extra = ["mesh.shard=1", "model.n_layers=1", "batch_size=4", "data.seq_len=32", "eval_batches=1",
                      "sync.warmup_steps=0", "optim.warmup_steps=0"]
    args.plot = args.plot or (os.path.join(os.path.dirname(os.path.abspath(args.json)), "straggler.png") if args.smoke
                              else os.path.join(common.REPO, "docs", "straggler.png"))
    return args


def run(args, name, overrides):
    run_dir = os.path.join(args.run_root, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "edit_jax", "train", "--config", args.config, "--run-dir", run_dir, "--no-progress",
           "mesh.replica=2", "mesh.shard=2", "mesh.processes=2", "debug.pin_cores=true", f"steps={args.steps}",
           f"max_seconds={args.seconds}", f"eval_every={args.eval_every}", "eval_batches=4", "checkpoint_every=0",
           "log_every=1", *args.extra, *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=common.REPO, env=common.child_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return summarise(name, overrides, recs, wall)


def summarise(name, overrides, recs, wall):
    """Throughput in the steady state: from the end of the first sync (every training program
    compiled) to the start of the final evaluation, less the periodic evaluations in between."""
    train = [r for r in recs if "worker" in r and "loss" in r]
    if not train:  # a lock-step run (EDiT): one record per step for all workers, their own speeds inside
        return _summarise_lock_step(name, overrides, recs, wall)
    workers = sorted({r["worker"] for r in train})
    steps = {w: max(r["step"] for r in train if r["worker"] == w) for w in workers}
    local_times = {w: statistics.median([r["step_time"] for r in train if r["worker"] == w and r["kind"] == "local"])
                   for w in workers}
    tokens_per_step = train[-1]["tokens_per_s"] * train[-1]["step_time"]  # tokens of one worker step
    evals = [r for r in recs if "val_loss" in r]
    syncs = [r for r in recs if r.get("sync")]
    t0 = min(r["time"] for r in train if r["kind"] != "local" and r["kind"] != "hsdp")  # first sync done
    t_end = evals[-1]["time"]  # the final evaluation starts when training ends
    eval_s = sum(r["eval_seconds"] for r in evals[:-1] if t0 < r["time"] < t_end)
    steady_steps = sum(1 for r in train if t0 < r["time"] <= t_end)
    steady_s = t_end - t0 - eval_s
    ideal = sum(tokens_per_step / t for t in local_times.values())
    return {"name": name, "overrides": overrides, "steps_per_worker": steps, "syncs": len(syncs),
            "local_step_s": local_times, "tokens_per_worker_step": tokens_per_step, "train_seconds": t_end,
            "steady_seconds": steady_s, "steady_steps": steady_steps,
            "tokens_per_s": steady_steps * tokens_per_step / steady_s, "ideal_tokens_per_s": ideal,
            "final_val_loss": evals[-1]["val_loss"], "val_curve": [(r["time"], r["val_loss"]) for r in evals],
            "wall_seconds": wall}


def _summarise_lock_step(name, overrides, recs, wall):
    """``summarise`` for a lock-step run: every record is a step of all N workers; each record's
    ``worker_step_time`` holds each worker's own local step time (its speed without waiting)."""
    train = [r for r in recs if "loss" in r and not r.get("sync")]
    n = len(train[-1]["replica_loss"])
    local = [r for r in train if r["kind"] == "local"]
    local_times = {w: statistics.median([r["worker_step_time"][w] for r in local]) for w in range(n)}
    tokens_per_step = train[-1]["tokens_per_s"] * train[-1]["step_time"] / n  # tokens of one worker step
    evals = [r for r in recs if "val_loss" in r]
    syncs = [r for r in recs if r.get("sync")]
    t0 = min(r["time"] for r in syncs)  # first sync done
    t_end = evals[-1]["time"]
    eval_s = sum(r["eval_seconds"] for r in evals[:-1] if t0 < r["time"] < t_end)
    steady_steps = n * sum(1 for r in train if t0 < r["time"] <= t_end)
    steady_s = t_end - t0 - eval_s
    return {"name": name, "overrides": overrides, "steps_per_worker": {w: train[-1]["step"] for w in range(n)},
            "syncs": len(syncs), "local_step_s": local_times, "tokens_per_worker_step": tokens_per_step,
            "train_seconds": t_end, "steady_seconds": steady_s, "steady_steps": steady_steps,
            "tokens_per_s": steady_steps * tokens_per_step / steady_s,
            "ideal_tokens_per_s": sum(tokens_per_step / t for t in local_times.values()),
            "final_val_loss": evals[-1]["val_loss"], "val_curve": [(r["time"], r["val_loss"]) for r in evals],
            "wall_seconds": wall}


def main(argv=None):
    args = parse_args(argv)
    results = []
    base = run(args, "edit", ["method=edit", f"sync.tau={args.tau}"])
    results.append(base)
    tau_time = max(0.01, args.tau * statistics.median(base["local_step_s"].values()))  # (printed to 3 decimals)
    slow = f"debug.slowdown=1:{args.slowdown}"
    if not args.smoke:
        results.append(run(args, "edit_straggler", ["method=edit", f"sync.tau={args.tau}", slow]))
        results.append(run(args, "a_edit", ["method=a_edit", f"sync.time.tau={tau_time:.3f}"]))
    results.append(run(args, "a_edit_straggler", ["method=a_edit", f"sync.time.tau={tau_time:.3f}", slow]))
    rows = [[r["name"], f"{r['tokens_per_s']:.0f}", f"{r['ideal_tokens_per_s']:.0f}",
             f"{r['tokens_per_s'] / r['ideal_tokens_per_s']:.2f}",
             " / ".join(str(r["steps_per_worker"][w]) for w in sorted(r["steps_per_worker"])), r["syncs"],
             f"{r['final_val_loss']:.4f}", f"{r['train_seconds']:.0f}"] for r in results]
    shard = 1 if args.smoke else 2
    common.print_table(f"A-EDiT vs EDiT, 2 workers x {shard} devices (one core each), {args.seconds:g} s per run, "
                       f"worker 1 at {args.slowdown}x in the straggler runs, tau={args.tau}, tau_time={tau_time:.2f} s",
                       ["run", "tokens/s", "ideal tokens/s", "ratio", "steps w0 / w1", "syncs", "val loss (θ̄)",
                        "train s"], rows,
                       note="tokens/s: steady state (after the first sync, periodic evaluations excluded); ideal: "
                            "sum of the workers' own speeds (median local step time, same run)")
    common.write_json(args.json, {"benchmark": "bench_straggler", "env": common.env_info(), "args": vars(args),
                                  "tau_time": tau_time, "runs": results})
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return results


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        t, v = zip(*r["val_curve"], strict=True)
        ax.plot(t, v, marker="o", ms=3, label=r["name"].replace("_", " "), ls="--" if "straggler" in r["name"] else "-")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("validation loss on θ̄")
    ax.set_title("EDiT vs A-EDiT, 2 workers; straggler: worker 1 slowed down")
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
