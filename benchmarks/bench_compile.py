"""What compiling a run's programs ahead costs at start-up (issue 60, item 1).

    python benchmarks/bench_compile.py [--config configs/demo.py] [--reps 2] [--json OUT] [--smoke]

The programs a run compiles before its first step (``training/ahead.run_programs``: each step kind,
the outer state's first setting, the evaluations, the checkpoint's report and checksums), compiled
two ways, each in a fresh process with no compilation cache (so nothing is loaded): one after the
other (each program's own compile time, and their sum), and side by side as the loop does
(``ahead.compile_ahead``: one thread per core). The table gives the side-by-side wall against the
longest single program and against the sum; the two ways alternate ``--reps`` times (ABAB), and the
machine's core count and how many cores each way kept busy are in the JSON. The issue's target is
a wall of at most 1.2x the longest program; on few cores the side-by-side compiles share them
(XLA's compile of one program is mostly one thread), so the wall there sits between the longest
and the sum.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

SMOKE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_dim=128",
         "data.seq_len=32", "batch_size=8", "mesh.replica=2", "mesh.shard=2"]


def _child(args) -> dict:
    """In this (fresh) process: the run's programs compiled one way; their seconds."""
    common.ensure_cpu_devices(64)
    from edit_jax.runtime.mesh import make_mesh
    from edit_jax.localsgd.methods import plan_for
    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.training.ahead import compile_ahead, run_programs
    from edit_jax.training.evaluate import Evaluator
    from edit_jax.validate import load_config

    cfg = load_config(args.config, [*args.set, "train.compile_cache=off"])
    plan = plan_for(cfg)
    n = cfg.mesh.replica * cfg.mesh.shard
    programs = StepPrograms(plan, make_mesh(plan.cfg.mesh, common.pick_devices(n)[:n]))
    rows = (plan.cfg.batch_size, plan.cfg.data.seq_len + 1)
    jobs = run_programs(programs, Evaluator(programs), programs.abstract_state(), rows, saves=True)
    cpu0 = _cpu_s()
    if args.child == "one_by_one":
        seconds = {}
        t0 = time.perf_counter()
        for name, job in jobs.items():
            t = time.perf_counter()
            job()
            seconds[name] = time.perf_counter() - t
        wall = time.perf_counter() - t0
    else:
        ahead = compile_ahead(jobs)
        seconds, wall = ahead.seconds, ahead.wall_s
    return {"seconds": seconds, "wall_s": wall, "cpu_s": _cpu_s() - cpu0}


def _cpu_s() -> float:
    """This process's CPU seconds (all its threads: XLA's compile may use several)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run(args, how: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", how, "--config", args.config,
           *[f"--set={s}" for s in args.set]]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, env=common.child_env(), timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"bench_compile: the {how} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo.py")
    p.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    p.add_argument("--reps", type=int, default=2, help="alternations of the two ways (ABAB)")
    p.add_argument("--child", choices=("one_by_one", "side_by_side"), help=argparse.SUPPRESS)
    common.add_common(p, "bench_compile")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    if args.smoke:
        args.config, args.set, args.reps = "configs/tiny.py", [*SMOKE, *args.set], 1
    runs = {"one_by_one": [], "side_by_side": []}
    for _ in range(args.reps):
        for how in runs:
            runs[how].append(_run(args, how))
    longest = min(max(r["seconds"].values()) for r in runs["one_by_one"])  # each rep's slowest program, best rep
    total = min(r["wall_s"] for r in runs["one_by_one"])
    wall = min(r["wall_s"] for r in runs["side_by_side"])
    programs = sorted(runs["one_by_one"][0]["seconds"])
    rows = [[name, *[f"{r['seconds'][name]:.2f}" for r in runs["one_by_one"]]] for name in programs]
    common.print_table(f"compile alone (s), {args.config}", ["program", *[f"rep {i + 1}" for i in range(args.reps)]],
                       rows)
    cpu = {how: min(r["cpu_s"] / r["wall_s"] for r in rs) for how, rs in runs.items()}  # cores busy on average
    common.print_table("start-up compile", ["one by one (sum)", "longest alone", "side by side (wall)",
                                            "wall / longest", "wall / sum", "cores", "busy: one by one",
                                            "busy: side by side"],
                       [[f"{total:.1f}", f"{longest:.1f}", f"{wall:.1f}", f"{wall / longest:.2f}",
                         f"{wall / total:.2f}", os.cpu_count(), f"{cpu['one_by_one']:.2f}",
                         f"{cpu['side_by_side']:.2f}"]],
                       note="busy: the process's CPU seconds per wall second (XLA's own compile threads included)")
    result = {"env": common.env_info(), "args": vars(args), "runs": runs, "sum_s": total, "longest_s": longest,
              "side_by_side_s": wall, "wall_over_longest": wall / longest, "wall_over_sum": wall / total,
              "cores": os.cpu_count(), "cores_busy": cpu}
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
