"""All five methods at equal tokens on the embedded corpus, after an outer-optimizer sweep.

    python benchmarks/compare_methods.py                  # about an hour on 2 cores
    python benchmarks/compare_methods.py --report-only    # table and plot from the finished runs

The setup is the demo's (`edit_jax.presets.cpu`: demo model, 2 workers, batch 16 x 128, inner
AdamW lr 3e-3, 20 synchronous warmup steps) on a 2 x 1 mesh (`--shard 1`: FSDP within a worker
is exact, so the shard count changes no number the comparison is about, and 2 emulated devices
step about twice as fast as 8 on 2 cores) with tau = 4 and long enough for Local SGD
to be itself: 1140 steps = 280 syncs (the demo has 28).

1. Sweep (seed 100, a shorter budget: 340 steps = 80 syncs): outer lr x outer momentum over the
   same grid for each method with an outer optimizer (DiLoCo, EDiT: Nesterov; CO2: heavy ball,
   its own update rule). The setting with the lowest final validation loss of the sweep run is
   kept. The Baseline and Post Local SGD have no outer hyper-parameters (Post Local SGD's outer
   step is the plain mean).
2. Final runs: every method at its setting, seeds 0 and 1 (model init and data order). These seeds
   and budget are never used to choose anything.

Writes each run to RUN_ROOT/<name>/ (a finished run is not run again: delete it to redo), the
table to stdout and RUN_ROOT/table.md, everything to RUN_ROOT/results.json, and the plot of the
final runs (seed 0) to docs/compare_methods.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

REPO = common.REPO

METHODS = ("baseline", "post_local_sgd", "diloco", "edit", "co2")
SWEPT = ("diloco", "edit", "co2")


# The paper's claims the table is read for: (the methods each needs, the check on mean val losses).
CHECKS = {"edit <= diloco": (("edit", "diloco"), lambda by: by["edit"] <= by["diloco"]),
          "co2 <= post_local_sgd": (("co2", "post_local_sgd"), lambda by: by["co2"] <= by["post_local_sgd"]),
          "edit within 1% of baseline (or better)": (("edit", "baseline"),
                                                     lambda by: by["edit"] <= 1.01 * by["baseline"])}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1140, help="final runs: inner steps (tokens = steps x 16 x 128)")
    p.add_argument("--sweep-steps", type=int, default=340)
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--sweep-seed", type=int, default=100)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--momenta", type=float, nargs="+", default=[0.5, 0.85])
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--shard", type=int, default=1, help="mesh.shard (mesh.replica stays the preset's 2)")
    p.add_argument("--run-root", default=os.path.join(REPO, "runs", "compare"))
    p.add_argument("--plot", default=os.path.join(REPO, "docs", "compare_methods.png"))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="the methods compared")
    p.add_argument("--report-only", action="store_true", help="no training: report the runs already in RUN_ROOT")
    p.add_argument("--smoke", action="store_true", help="CI: the tiny model (one layer), Baseline and EDiT, 6 steps "
                   "(the sweep too: the same programs, so the final run loads them from the cache), tau 2, no "
                   "synchronous warm-up, one seed, one outer setting: 1 sweep run and 2 final ones; the plot goes "
                   "into RUN_ROOT")
    args = p.parse_args(argv)
    if args.smoke:  # every stage (sweep, pick, final runs, table, JSON, plot) at the smallest size that has them
        args.steps, args.sweep_steps, args.tau, args.seeds, args.lrs, args.momenta = 6, 6, 2, [0], [0.5], [0.5]
        args.methods, args.eval_every, args.plot = (["baseline", "edit"], 4,
                                                    os.path.join(args.run_root, "compare_methods.png"))
    args.methods = [m for m in METHODS if m in args.methods]  # the table's order
    return args


# --smoke: the demo's setup made tiny (its model and 20 synchronous warm-up steps would be minutes;
# with no synchronous warm-up EDiT compiles no HSDP step, the costliest part of a tiny run)
SMOKE_SIZES = {"model": {"n_layers": 1}, "batch_size": 4, "seq_len": 32, "warmup_steps": 2, "sync_warmup_steps": 0}


def config(method: str, steps: int, seed: int, tau: int, eval_every: int, outer: dict | None = None, shard: int = 1,
           smoke: bool = False, cache: str = "auto"):
    from edit_jax.models.llama import preset
    from edit_jax.presets import cpu
    from edit_jax.validate import validate

    cfg = cpu(method, steps=steps)
    if smoke:
        cfg = dataclasses.replace(cfg, model=preset("tiny", **SMOKE_SIZES["model"]),
                                  batch_size=SMOKE_SIZES["batch_size"],
                                  data=dataclasses.replace(cfg.data, seq_len=SMOKE_SIZES["seq_len"]),
                                  optim=dataclasses.replace(cfg.optim, warmup_steps=SMOKE_SIZES["warmup_steps"]),
                                  sync=dataclasses.replace(cfg.sync, warmup_steps=SMOKE_SIZES["sync_warmup_steps"]))
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, shard=shard))
    if outer:  # (the report's names: outer_lr, outer_momentum; the config's section: sync.outer)
        sync = dataclasses.replace(cfg.sync, tau=tau, outer=dataclasses.replace(
            cfg.sync.outer, lr=outer["outer_lr"], momentum=outer["outer_momentum"]))
    else:
        sync = dataclasses.replace(cfg.sync, tau=tau)
    cfg = dataclasses.replace(cfg, sync=sync, seed=seed, data=dataclasses.replace(cfg.data, seed=seed),
                              eval_every=eval_every, checkpoint_every=0, log_every=10,
                              train=dataclasses.replace(cfg.train, compile_cache=cache))
    validate(cfg)
    return cfg


def run(args, name: str, cfg, report_only: bool) -> dict:
    """One training run (skipped when its summary exists); its summary."""
    run_dir = os.path.join(args.run_root, name)
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    if report_only:
        raise SystemExit(f"{name}: no finished run in {run_dir}")
    print(f"compare_methods: {name} ...", file=sys.stderr, flush=True)
    from edit_jax.training.train import DivergedError, train

    t0 = time.perf_counter()
    try:
        devices = common.pick_devices(cfg.mesh.replica * cfg.mesh.shard)  # (a process may have more: the tests')
        res = train(cfg, run_dir, progress=False, verbose=False, devices=devices)
        out = {"val_loss": res.final_val_loss, "val_ppl": res.final_val_ppl, "tokens": res.tokens,
               "seconds": time.perf_counter() - t0, "diverged": False}
    except DivergedError as e:
        out = {"val_loss": float("inf"), "val_ppl": float("inf"), "tokens": 0,
               "seconds": time.perf_counter() - t0, "diverged": True, "error": str(e)}
    out.update(name=name, method=cfg.sync.method, seed=cfg.seed, steps=cfg.steps, tau=cfg.sync.tau,
               outer_lr=cfg.sync.outer.lr, outer_momentum=cfg.sync.outer.momentum, run_dir=run_dir)
    os.makedirs(run_dir, exist_ok=True)
    with open(summary_path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"compare_methods: {name}: val {out['val_loss']:.4f} in {out['seconds']:.0f} s", file=sys.stderr, flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    common.ensure_cpu_devices(2 * args.shard)  # the preset's 2 workers x --shard (before JAX starts)
    os.makedirs(args.run_root, exist_ok=True)
    # One compilation cache for all the runs (a method's runs differ in seed, steps and outer
    # setting, not in their programs), unless $EDIT_JAX_COMPILE_CACHE names one ("auto").
    cache = "auto" if os.environ.get("EDIT_JAX_COMPILE_CACHE") else os.path.join(args.run_root, "compile_cache")
    sweep, best = [], {}
    for method in [m for m in SWEPT if m in args.methods]:
        for lr in args.lrs:
            for mom in args.momenta:
                outer = dict(outer_lr=lr, outer_momentum=mom)
                cfg = config(method, args.sweep_steps, args.sweep_seed, args.tau, args.eval_every, outer, args.shard,
                             args.smoke, cache)
                sweep.append(run(args, f"sweep_{method}_lr{lr}_m{mom}", cfg, args.report_only))
        mine = [r for r in sweep if r["method"] == method]
        pick = min(mine, key=lambda r: r["val_loss"])
        best[method] = dict(outer_lr=pick["outer_lr"], outer_momentum=pick["outer_momentum"])

    final = []
    for method in args.methods:
        for seed in args.seeds:
            cfg = config(method, args.steps, seed, args.tau, args.eval_every, best.get(method), args.shard,
                         args.smoke, cache)
            final.append(run(args, f"{method}_s{seed}", cfg, args.report_only))

    rows = []
    for method in args.methods:
        rs = [r for r in final if r["method"] == method]
        vals = [r["val_loss"] for r in rs]
        rows.append({"method": method, "outer": best.get(method), "val_losses": vals,
                     "val_mean": statistics.fmean(vals), "val_spread": (max(vals) - min(vals)) / 2,
                     "val_ppl_mean": statistics.fmean(r["val_ppl"] for r in rs), "tokens": rs[0]["tokens"],
                     "seconds_mean": statistics.fmean(r["seconds"] for r in rs)})
    by = {r["method"]: r["val_mean"] for r in rows}
    checks = {name: holds(by) for name, (need, holds) in CHECKS.items() if set(need) <= set(by)}  # (those it ran)
    syncs = (args.steps - (SMOKE_SIZES["sync_warmup_steps"] if args.smoke else 20)) // args.tau
    lines = [f"tau={args.tau}, {args.steps} steps ({syncs} syncs), seeds {args.seeds}; "
             f"sweep: {args.sweep_steps} steps, seed {args.sweep_seed}, lr {args.lrs} x momentum {args.momenta}", "",
             "| method | outer lr / momentum (sweep) | final val loss (mean ± half-range) | val ppl | tokens "
             "| wall s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        o = f"{r['outer']['outer_lr']} / {r['outer']['outer_momentum']}" if r["outer"] else "-"
        lines.append(f"| {r['method']} | {o} | {r['val_mean']:.4f} ± {r['val_spread']:.4f} | {r['val_ppl_mean']:.2f} "
                     f"| {r['tokens']:,} | {r['seconds_mean']:.0f} |")
    lines += ["", "sweep (final val loss at the sweep budget):", "", "| method | lr | momentum | val loss |",
              "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['outer_lr']} | {r['outer_momentum']} | {r['val_loss']:.4f} |" for r in sweep]
    lines += [""] + [f"- {k}: {'holds' if v else 'does NOT hold'}" for k, v in checks.items()]
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.run_root, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.run_root, "results.json"), "w") as f:
        json.dump({"env": common.env_info(), "args": vars(args), "sweep": sweep, "best": best, "final": final,
                   "rows": rows, "checks": checks}, f, indent=1)
    try:
        from edit_jax.commands.plot import plot_runs

        seed0 = [r for r in final if r["seed"] == args.seeds[0] and not r["diverged"]]
        plot_runs([r["run_dir"] for r in seed0], args.plot, labels=[r["method"] for r in seed0])
        print(f"plot: {args.plot}")
    except ImportError as e:  # matplotlib missing: the table still stands
        print(f"no plot ({e})", file=sys.stderr)


if __name__ == "__main__":
    main()
