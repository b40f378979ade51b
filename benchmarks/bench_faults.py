"""What faults and restarts cost (issue 31), one part at a time.

    python benchmarks/bench_faults.py --part compile        # a restart's compile time, cold vs cached
    python benchmarks/bench_faults.py --part save           # steps during an async save vs normal steps
    python benchmarks/bench_faults.py --part compile,save --json runs/bench/bench_faults.json
    python benchmarks/bench_faults.py --part kill --workers 2 --mtbf 60 --duration 600   # kill loop
    python benchmarks/bench_faults.py --part spike          # an injected loss spike beside the clean run, both modes
    python benchmarks/bench_faults.py --part live --mtbf 30 --duration 600   # A-EDiT workers leave / join live
    python benchmarks/bench_faults.py --part programs       # an exchange worker's restart: CPU per program

Part ``compile``: three runs of ``--config`` (default the demo), each in a fresh process. ``cold``:
a new run dir, empty compilation cache, stopped after ``--steps`` steps (checkpoint). ``restart,
no cache``: a copy of that run dir resumed with ``train.compile_cache=off``. ``restart``: the run
dir itself resumed, reading RUN_DIR/compile_cache. Compile time is what JAX reports in its own
events, summed over every program of the run: tracing, lowering to MLIR and the backend compile
(which, on a cache hit, is the read of the executable from disk). Also the first step's time
from metrics.jsonl (it includes that step's compile). Target: restart / cold <= 0.20.

Part ``save``: the config (with ``--method``, default baseline: one kind of step) trained with a
checkpoint every ``--every`` steps, once with async saves and once with sync saves (one process,
side by side; log_every=1). Per mode: the time the loop is blocked in a save (async: the checksums
and the copy to host; sync: the whole write), and the step times: the interval of the step that
holds a save (step + blocked time), and, for async saves, the steps that overlap the background
write (until orbax, polled after every step, says it is done), with the blocked time taken out.
Normal steps: all others (steps that compiled a program are left out). Target: async step during the
write / normal step <= 1.2.

Part ``live`` (``bench_live.py``): exchange-mode A-EDiT (issue 38) under a kill loop, a SIGSTOP and
a worker joining mid-run, beside the same run without faults: tokens/s, rounds that left a worker
out and why, time to the first round without a lost worker and back, val loss at equal tokens.

Part ``kill`` (``bench_kill.py``): a kill loop. ``--config`` (default tiny) with ``--workers``
processes; a fault-free run, then the same steps under the launcher with SIGKILLs of a random
worker every ``--mtbf`` seconds for ``--duration`` seconds. Goodput, kill-to-next-step, steps lost
per fault, final losses side by side. Targets: goodput >= 0.8, kill-to-next-step <= 15 s.
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
from benchmarks import bench_kill, bench_live, bench_spike
from benchmarks import harness as common

PARTS = ("compile", "save", "kill", "spike", "live", "programs")
# --smoke: the tiny config made smaller still (one layer, 2 x 1 mesh, 4 x 32 tokens): seconds to compile
SMOKE_SIZES = ["model.n_layers=1", "mesh.shard=1", "batch_size=4", "data.seq_len=32", "eval_batches=1"]
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default=None, help=f"comma-separated, of {', '.join(PARTS)}; default compile,save "
                                                 "(--smoke: save)")
    p.add_argument("--config", default=None, help="default configs/demo.py (kill: configs/tiny.py)")
    p.add_argument("--steps", type=int, default=10, help="compile: steps of each run")
    p.add_argument("--save-steps", type=int, default=60, help="save: steps of each run")
    p.add_argument("--every", type=int, default=10, help="save: checkpoint_every")
    p.add_argument("--method", default=None,
                   help="save: sync.method, default baseline (one kind of step, so step times compare like with "
                        "like); kill: default edit (lockstep: its losses must equal the fault-free run's); "
                        "live: default a_edit (a lock-step method through the exchange posts every --tau steps)")
    p.add_argument("--run-root", default=os.path.join(common.REPO, "runs", "bench_faults"))
    bench_kill.add_args(p)
    bench_live.add_args(p)
    p.add_argument("--json", default=os.path.join(common.DEFAULT_JSON_DIR, "bench_faults.json"))
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (CI): save: the tiny config, 6 steps; kill: 2 one-device workers, 6 steps, one "
                        "kill; spike: one process mode, 24 steps; compile: the tiny config, 2 steps; live: 2 workers "
                        "+ a joiner, one kill, a 1.5 s stop")
    p.add_argument("--child", nargs=4, metavar=("CONFIG", "RUN_DIR", "STEPS", "CACHE"), help=argparse.SUPPRESS)
    p.add_argument("--programs-child", nargs=2, metavar=("ROOT", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.part = args.part or "save"
        args.config, args.save_steps, args.every, args.steps = args.config or "configs/tiny.py", 6, 3, 2
    args.part = args.part or "compile,save"
    bad = set(args.part.split(",")) - set(PARTS)
    if bad:
        p.error(f"--part: unknown {', '.join(sorted(bad))} (expected {', '.join(PARTS)})")
    return args


def _load(config: str, overrides: list[str]):
    from edit_jax.config import apply_overrides
    from edit_jax.validate import load_config, validate

    cfg = apply_overrides(load_config(config), overrides)
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- part compile


def child_compile(config: str, run_dir: str, steps: int, cache: str) -> None:
    """One run in this process: train ``steps`` more steps on ``run_dir``; prints JAX's compile
    durations (summed per event) and cache hits as JSON."""
    common.ensure_cpu_devices(8)
    from jax import monitoring

    durations, hits = {e: 0.0 for e in COMPILE_EVENTS}, [0]
    monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: durations.__setitem__(event, durations[event] + secs) if event in durations else None)
    monitoring.register_event_listener(
        lambda event, **kw: hits.__setitem__(0, hits[0] + (event.endswith("/cache_hits"))))
    from edit_jax.training.train import train

    cfg = _load(config, [f"train.compile_cache={cache}", "log_every=1", "eval_every=0", "checkpoint_every=0"])
    t0 = time.perf_counter()
    result = train(cfg, run_dir, progress=False, verbose=False, stop_after=steps)
    wall = time.perf_counter() - t0
    first = result.history[0] if result.history else {}
    print(json.dumps({"compile_s": sum(durations.values()), "by_event": durations, "cache_hits": hits[0],
                      "first_step_s": first.get("step_time"), "wall_s": wall, "resumed_from": result.resumed_from,
                      "steps": result.steps}))


def _child(args, run_dir: str, cache: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", args.config, run_dir, str(args.steps), cache]
    proc = subprocess.run(cmd, cwd=common.REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_faults: the run on {run_dir} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def part_compile(args) -> dict:
    root = os.path.join(args.run_root, "compile")
    shutil.rmtree(root, ignore_errors=True)
    cached, uncached = os.path.join(root, "run"), os.path.join(root, "run_nocache")
    cold = _child(args, cached, "auto")
    shutil.copytree(cached, uncached, ignore=shutil.ignore_patterns("compile_cache"))
    nocache = _child(args, uncached, "off")
    warm = _child(args, cached, "auto")
    runs = {"cold": cold, "restart, no cache": nocache, "restart": warm}
    rows = [[name, r["compile_s"], *(r["by_event"][e] for e in COMPILE_EVENTS), r["cache_hits"], r["first_step_s"],
             r["wall_s"]] for name, r in runs.items()]
    common.print_table("compile: JAX's compile time per run (s)",
                       ["run", "compile", "trace", "lower", "backend/cache read", "cache hits", "first step", "wall"],
                       rows, note=f"restart / cold = {warm['compile_s'] / cold['compile_s']:.3f} (target <= 0.20); "
                                  f"restart / restart without cache = {warm['compile_s'] / nocache['compile_s']:.3f}")
    return {"runs": runs, "ratio_restart_to_cold": warm["compile_s"] / cold["compile_s"],
            "ratio_restart_to_uncached_restart": warm["compile_s"] / nocache["compile_s"], "target": 0.20}


# ----------------------------------------------------------------------------- part save


def _timed_run(cfg, run_dir: str) -> dict:
    """Trains ``cfg`` on a new ``run_dir``; the loop's own timing records (``train(on_timing=)``)
    say when each save blocked, when its background write was found finished, when each step
    ended (times since the run started)."""
    from edit_jax.training.train import train

    got = []
    shutil.rmtree(run_dir, ignore_errors=True)
    devices = common.pick_devices(cfg.mesh.replica * cfg.mesh.shard)
    train(cfg, run_dir, progress=False, verbose=False, devices=devices, on_timing=got.append)
    saves = [(r["step"], r["at"], r["at"] + r["save_s"]) for r in got if r["timing"] == "save"]
    written = [r["at"] for r in got if r["timing"] == "written"]  # a synchronous save's: when it returned
    step_ends, last = [], None
    for r in got:
        if r["timing"] == "advance" and r["step"] != last:  # (an advance that stopped took no step)
            step_ends.append((r["step"], r["at"], r["includes_compile"]))
            last = r["step"]
    return {"saves": saves, "written": written, "step_ends": step_ends}


def _classify(run: dict, asynchronous: bool) -> dict:
    """Step intervals (end of step k-1 to end of step k): normal ones, those that hold a save
    (step + the time blocked in the save), and, for async saves, the step time of those that
    overlap the background write (the time blocked in the save taken out)."""
    ends = {k: t for k, t, _ in run["step_ends"]}
    compiled = {k for k, _, c in run["step_ends"] if c}
    blocks = [(t0, t1) for _, t0, t1 in run["saves"]]
    # (save's start, write found done) per save; finish() runs once per save, in order
    windows = [(t0, done if asynchronous else t1)
               for (_, t0, t1), done in zip(run["saves"], run["written"], strict=False)]
    normal, during, with_save = [], [], []
    for k in sorted(ends):
        if k - 1 not in ends or k in compiled:  # a step that compiled its program is no step time
            continue
        a, b = ends[k - 1], ends[k]
        blocked = sum(max(0.0, min(b, t1) - max(a, t0)) for t0, t1 in blocks)
        if blocked:
            with_save.append(b - a)
        if any(a < w1 and b > w0 for w0, w1 in windows):
            during.append(b - a - blocked)
        else:
            normal.append(b - a)
    mean = lambda xs: statistics.fmean(xs) if xs else None
    return {"normal_median_s": statistics.median(normal), "during_mean_s": mean(during), "steps_during": len(during),
            "step_with_save_mean_s": mean(with_save), "save_blocking_mean_s": mean([t1 - t0 for t0, t1 in blocks]),
            "saves": len(blocks)}


def part_save(args) -> dict:
    common.ensure_cpu_devices(8)
    root = os.path.join(args.run_root, "save")
    out = {}
    for mode in ("async", "sync"):
        cfg = _load(args.config, [f"method={args.method}", f"steps={args.save_steps}",
                                  f"checkpoint_every={args.every}", "log_every=1", "eval_every=0",
                                  f"train.async_checkpoint={mode == 'async'}",
                                  f"keep_checkpoints={args.save_steps}", *(SMOKE_SIZES if args.smoke else [])])
        run = _timed_run(cfg, os.path.join(root, mode))
        out[mode] = _classify(run, mode == "async")
    ckpt_dir = os.path.join(root, "async", "checkpoints", str(args.save_steps))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt_dir) for f in fs)
    rows = [[mode, r["save_blocking_mean_s"], r["normal_median_s"], r["step_with_save_mean_s"],
             r["step_with_save_mean_s"] / r["normal_median_s"], r["during_mean_s"], r["steps_during"],
             r["during_mean_s"] / r["normal_median_s"]] for mode, r in out.items()]
    ratio = rows[0][-1]
    common.print_table(f"save: step time around checkpoints ({common.human_bytes(size)} each)",
                       ["saves", "blocked in save", "normal step", "step + save", "(step + save) / normal",
                        "step during the write", "steps", "during / normal"], rows,
                       note=f"async: a step while the checkpoint is written / a normal step = {ratio:.3f} "
                            "(target <= 1.2); times in s, means over the saves (normal: median)")
    return {**out, "checkpoint_bytes": size, "ratio_async": ratio, "target": 1.2}


# ----------------------------------------------------------------------------- part programs
# (start, executable store on): without the store a restart traces each program and finds it in JAX's cache
PROGRAM_RUNS = (("cold, no store", False), ("restart, compile cache only", False), ("cold, with the store", True),
                ("restart, cache + executable store", True))


def child_programs(root: str, config: str) -> None:
    """An exchange worker's start in this process (slot 0, one device, the live bench's settings
    from ``ROOT/overrides.json``): CPU seconds (``time.process_time``) of its construction, its join
    (the init program), its first local step and its outer round for 4 participants; prints them
    and the store's summary as JSON."""
    common.ensure_cpu_devices(1)
    from edit_jax.elastic.worker import ElasticWorker, Local
    from edit_jax.runtime.compile_cache import compile_cache

    with open(os.path.join(root, "overrides.json")) as f:
        cfg = _load(config, json.load(f))
    cpu = {}
    with compile_cache(os.path.join(root, "compile_cache")):
        t = time.process_time()
        w = ElasticWorker(cfg, 0, os.path.join(root, "run"), say=lambda m: None)
        cpu["construct"], t = time.process_time() - t, time.process_time()
        shared = w.join()
        cpu["join (init program)"], t = time.process_time() - t, time.process_time()
        local = Local(w.initial_state, done=shared.cursors[0])  # as ElasticWorker.run starts
        local.state = w.restart_from(shared, local.state, count=local.done)
        w.train_for(local, 0.0)
        cpu["first local step"], t = time.process_time() - t, time.process_time()
        w.outer.program(shared, 4)
        cpu["outer round, 4 posts"] = time.process_time() - t
    print(json.dumps({"cpu_s": cpu, "programs": w.exe.summary()}))


def part_programs(args) -> dict:
    """Four starts of one exchange worker in fresh processes: cold and again (a restart) with JAX's
    compile cache only (``$EDIT_JAX_EXECUTABLE_STORE=off``, as before the store), then cold and again
    with the store (a new cache: the store's misses compile for real and JAX keeps no entry of them)."""
    from edit_jax.runtime.executables import ENV_OFF

    root = os.path.join(args.run_root, "programs")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    config = args.kill_config  # the live bench's (configs/tiny.py)
    with open(os.path.join(root, "overrides.json"), "w") as f:
        json.dump(bench_live.overrides(args, os.path.join(root, "ex")), f)
    runs = {}
    for name, store in PROGRAM_RUNS:
        if name.startswith("cold"):
            shutil.rmtree(os.path.join(root, "compile_cache"), ignore_errors=True)
        shutil.rmtree(os.path.join(root, "ex"), ignore_errors=True)  # a new exchange each start: round 0
        cmd = [sys.executable, os.path.abspath(__file__), "--programs-child", root, config]
        env = {k: v for k, v in os.environ.items() if k != ENV_OFF} | ({} if store else {ENV_OFF: "off"})
        proc = subprocess.run(cmd, cwd=common.REPO, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"bench_faults: the {name} start failed:\n{proc.stderr[-3000:]}")
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    phases = list(runs[PROGRAM_RUNS[0][0]]["cpu_s"])
    rows = [[name, *(r["cpu_s"][k] for k in phases), sum(r["cpu_s"].values()), len(r["programs"]["loaded"])]
            for name, r in runs.items()]
    total = {name: sum(r["cpu_s"].values()) for name, r in runs.items()}
    ratio = total[PROGRAM_RUNS[3][0]] / total[PROGRAM_RUNS[1][0]]
    common.print_table(f"programs: an exchange worker's start, CPU seconds per phase ({config}, the live bench's "
                       "settings, 1 device)",
                       ["start", *phases, "total", "programs loaded whole"], rows,
                       note=f"with the store / compile cache only = {ratio:.3f}")
    return {"config": config, "runs": runs, "ratio_store_to_cache_only": ratio}


def main(argv=None):
    args = parse_args(argv)
    if args.programs_child:
        child_programs(*args.programs_child)
        return
    if args.child:
        config, run_dir, steps, cache = args.child
        child_compile(config, run_dir, int(steps), cache)
        return
    if args.part not in ("kill", "spike"):
        common.ensure_cpu_devices(8)  # (parts kill and spike run everything in processes of their own; live
        # evaluates its runs' round states here, on any device count)
    # (kill --smoke: baseline, one training program to compile in each of its six worker processes)
    args.kill_config, args.kill_method = args.config or "configs/tiny.py", args.method or (
        "baseline" if args.smoke else "edit")
    args.live_method = args.method or "a_edit"  # live: A-EDiT, or a lock-step method posting every --tau steps
    args.config, args.method = args.config or "configs/demo.py", args.method or "baseline"
    result = {"env": common.env_info(),
              "args": {k: v for k, v in vars(args).items() if k not in ("child", "programs_child")}}
    for part in args.part.split(","):
        result[part] = {"compile": part_compile, "save": part_save, "kill": bench_kill.part_kill,
                        "spike": bench_spike.part_spike, "live": bench_live.part_live,
                        "programs": part_programs}[part](args)
    common.write_json(args.json, result)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
