#!/usr/bin/env python
"""Step time side by side: every step kind of a method on the R x S mesh, the same model and
global batch on one device (mesh 1 x 1: the limit), and optionally another checkout's code, all
timed interleaved in one run; plus where the time goes (a jax.profiler trace per kind, summarised
per op category) and the compile time of each kind's first call.

    python benchmarks/bench_step.py                          # demo model, 2 x 4 CPU mesh, EDiT kinds + 1 x 1
    python benchmarks/bench_step.py --vs-src ../before       # the same kinds from another checkout, interleaved
    python benchmarks/bench_step.py --model tiny --replica 8 --shard 8 --reps 2   # compile times on 8 x 8
    python benchmarks/bench_step.py --model 1b --replica 1 --shard 1 --dtype bfloat16 --peak-tflops 989 --no-limit

How: this checkout's R x S configuration ('mesh') and the comparison ('vs': another checkout,
imported in this process under another package name, and/or other config overrides) run in this
process on the same devices; the 1 x 1 limit runs in a worker process of its own (this script with
``--worker``), with one device, so XLA gives that device the host's cores (one device of an
8-device CPU process measured slower). Each configuration compiles its kinds first (the first call
of each is timed: compile + one step). Then, for each of ``--reps`` repetitions, every
(configuration, kind) in a rotated order runs ``--resume-steps`` untimed steps and ``--steps-per-rep``
timed ones, each timed with ``jax.block_until_ready`` on the new state; one runs at a time.
Ratios are of the medians over all timed steps.

Profile: with ``--profile-steps K`` (default 3) each configuration of this checkout traces K steps of
every kind (``jax.profiler.trace(dir, create_perfetto_trace=True)``, under ``<json dir>/traces``)
and the driver files every op's self time under a category (``edit_jax.analysis.profile``). To look at a
trace: open ``perfetto_trace.json.gz`` in https://ui.perfetto.dev, or the directory in
TensorBoard's profile plugin / ``xprof`` (the ``.xplane.pb``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

SCRIPT = os.path.abspath(__file__)
SYNC_KINDS = ("sync_forward", "local_then_sync")
ONE_PROGRAM = "one:"  # kinds "one:local" / "one:sync_forward": Steps.one_program's branches


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="model preset (edit_jax.models.llama.PRESETS); default demo")
    p.add_argument("--replica", type=int, default=2, help="mesh.replica (N workers); default 2")
    p.add_argument("--shard", type=int, default=4, help="mesh.shard (S FSDP shards per worker); default 4")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences; default 16")
    p.add_argument("--seq", type=int, default=128, help="sequence length; default 128")
    p.add_argument("--method", default="edit", choices=("baseline", "post_local_sgd", "diloco", "edit", "co2"),
                   help="sync.method of the R x S configuration; default edit")
    p.add_argument("--kinds", default=None,
                   help="comma-separated step kinds to time; default: hsdp,local and the method's sync kind. "
                        "'one:local' and 'one:sync_forward' (method edit) time the branches of one compiled "
                        "program holding both (lax.cond on a runtime flag; its first call compiles both)")
    p.add_argument("--tau", type=int, default=10,
                   help="sync.tau for the window mean ((tau-1) local + sync) / tau; default 10")
    p.add_argument("--reps", type=int, default=6, help="interleaved repetitions; default 6")
    p.add_argument("--steps-per-rep", type=int, default=3, help="timed steps per kind per repetition; default 3")
    p.add_argument("--resume-steps", type=int, default=1,
                   help="untimed steps each time a (configuration, kind) takes its turn, so caches and thread pools "
                        "warmed by the previous one do not bias the first timed step; default 1")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model.compute_dtype (params stay float32); default float32")
    p.add_argument("--remat", action="store_true", help="model.remat=true (recompute layers in the backward)")
    p.add_argument("--no-limit", dest="limit", action="store_false",
                   help="skip the 1 x 1 worker (on a GPU host with one device a second process would compete "
                        "for its memory)")
    p.add_argument("--vs-src", default=None, metavar="DIR",
                   help="another checkout (a directory holding edit_jax/) whose R x S steps are timed in the same "
                        "interleaved run, e.g. a `git worktree` of the commit before a change")
    p.add_argument("--vs-set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of the 'vs' configuration only (repeatable): an A/B of one setting in "
                        "one run, e.g. --vs-set model.scan_unroll=4 (with or without --vs-src)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps traced per kind (0: no profile); default 3")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of ONE device, to report MFU = achieved / (peak x devices)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every configuration (repeatable), e.g. --set model.scan_unroll=2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 x 2 mesh, one repetition (CI)")
    p.add_argument("--json", default=os.path.join(common.DEFAULT_JSON_DIR, "bench_step.json"),
                   help="where to write the JSON result; default runs/bench/bench_step.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: a worker's spec (JSON)
    args = p.parse_args(argv)
    if args.smoke:  # every path once (the one-program experiment included), seconds not minutes
        args.model, args.replica, args.shard, args.batch, args.seq = "tiny", 2, 1, 4, 16
        args.overrides = args.overrides + ["model.n_layers=1"]
        args.reps, args.steps_per_rep, args.resume_steps, args.profile_steps, args.limit = 1, 1, 0, 0, False
        args.kinds = args.kinds or "local,one:local"  # one:local: the public StepPrograms.local_step
    return args


def default_kinds(method: str) -> list[str]:
    if method == "baseline":
        return ["hsdp"]
    return ["hsdp", "local", "sync_forward" if method == "edit" else "local_then_sync"]


# ----------------------------------------------------------------------------- one configuration's steps


def load_checkout(src: str, alias: str) -> str:
    """Imports another checkout's ``edit_jax`` under the package name ``alias`` (a renamed copy in a
    temporary directory), so its steps run in this process next to this checkout's: two processes
    on this machine differ by several percent for the same program (measured: A/A pairs of
    processes 0.92-1.08, A/A in one process 0.99-1.03), which would swamp the change measured."""
    import importlib
    import re
    import shutil
    import tempfile

    pkg = os.path.join(os.path.abspath(src), "edit_jax")
    if not os.path.isdir(pkg):
        raise SystemExit(f"--vs-src {src!r}: no edit_jax/ package there")
    root = tempfile.mkdtemp(prefix="bench_step_vs_")
    shutil.copytree(pkg, os.path.join(root, alias), ignore=shutil.ignore_patterns("__pycache__"))
    for dirpath, _, files in os.walk(os.path.join(root, alias)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    text = re.sub(r"\bedit_jax\b", alias, f.read())
                with open(path, "w") as f:
                    f.write(text)
    sys.path.insert(0, root)
    importlib.import_module(alias)
    return alias


def _module(pkg: str, *names: str):
    """The first of ``pkg.name`` for ``names`` that imports (module paths moved between checkouts)."""
    import importlib

    for name in names[:-1]:
        try:
            return importlib.import_module(f"{pkg}.{name}")
        except ModuleNotFoundError:
            continue
    return importlib.import_module(f"{pkg}.{names[-1]}")


class Steps:
    """One configuration on its devices: machinery, state, a fixed batch, and a timed step."""

    def __init__(self, spec: dict, devices, pkg: str = "edit_jax"):
        import importlib

        import jax
        import numpy as np

        # this checkout's layout; a --vs-src checkout from before the package split has the old names
        config = importlib.import_module(f"{pkg}.config")
        model_lib = _module(pkg, "models.llama", "model")
        mesh_mod = _module(pkg, "runtime.mesh", "sharding")
        step_mod = _module(pkg, "localsgd.programs", "step")
        try:  # every check: edit_jax.validate, or config.validate in a tree from before it (--vs-src)
            validate = importlib.import_module(f"{pkg}.validate").validate
        except ModuleNotFoundError:
            validate = config.validate
        cfg = config.Config(
            model=model_lib.preset(spec["model"], compute_dtype=spec["dtype"], remat=spec["remat"]),
            mesh=config.MeshConfig(replica=spec["replica"], shard=spec["shard"]),
            data=config.DataConfig(seq_len=spec["seq"]), optim=config.OptimConfig(),
            sync=config.SyncConfig(method=spec["method"], tau=spec["tau"], warmup_steps=0),
            steps=1000, batch_size=spec["batch"], seed=spec["seed"])
        cfg = config.apply_overrides(cfg, list(spec["overrides"]))
        validate(cfg)
        self.spec, self.cfg, self.jax = spec, cfg, jax
        # A checkout from before StepPrograms.for_config took the config itself.
        make = getattr(step_mod.StepPrograms, "for_config", step_mod.StepPrograms)
        self.machinery = make(cfg, mesh_mod.make_mesh(cfg.mesh, devices))
        self.state = self.machinery.init_state(cfg.seed)
        tokens = np.random.default_rng(spec["seed"]).integers(0, min(cfg.model.vocab_size, 257),
                                                              (cfg.batch_size, cfg.data.seq_len + 1), dtype=np.int32)
        self.batch = self.machinery.put_batch(tokens)
        self.params = model_lib.count_params(jax.eval_shape(lambda k: model_lib.init_params(cfg.model, k),
                                                            jax.random.key(0)))
        self.flops_per_token = model_lib.flops_per_token(cfg.model, cfg.data.seq_len)
        self._one = None  # the one-program experiment, compiled on first use
        self.first_call_s = {}
        for kind in spec["kinds"]:  # the first call of each kind: compile + one step; then one warm step
            self.first_call_s[kind] = self.step(kind)
            self.step(kind)

    def step(self, kind: str) -> float:
        t0 = time.perf_counter()
        if kind.startswith(ONE_PROGRAM):  # "one:<kind>": that branch of the one-program experiment
            self.state, _ = self.one_program()(self.state, self.batch, kind == ONE_PROGRAM + "sync_forward")
        else:
            self.state, _ = self.machinery.step_fn(kind)(self.state, self.batch)
        self.jax.block_until_ready(self.state)
        return time.perf_counter() - t0

    def one_program(self):
        """The experiment of one compiled program for EDiT's local and sync steps, picked by a
        runtime flag (``lax.cond``), against one program per kind (what the library does). Built
        from the machinery's step body; the local branch passes the outer state through and
        returns zeros for the sync figures, so both branches have one output type."""
        if self._one is None:
            import jax
            import jax.numpy as jnp
            from jax.sharding import PartitionSpec as P

            m = self.machinery  # its public per-device step body (StepPrograms.local_step), this checkout's
            step_mod = sys.modules[type(m).__module__]
            sharding = sys.modules[step_mod.__name__.rsplit(".", 1)[0] + ".sharding"]
            metric_specs = {"loss": P(sharding.REPLICA), "grad_norm": P(sharding.REPLICA),
                            **{k: P() for k in step_mod.SYNC_METRICS}}

            def body(state, batch, is_sync):
                def sync(st):
                    return m.local_step(st, batch, kind="sync_forward")

                def local(st):
                    new, met = m.local_step(st.replace(outer=None), batch, kind="local")
                    shapes = jax.eval_shape(sync, st)[1]
                    zeros = {k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items()}
                    return new.replace(outer=st.outer), {**zeros, **met}
                return jax.lax.cond(is_sync, sync, local, state)

            mapped = jax.shard_map(body, mesh=m.mesh, in_specs=(m.state_specs, sharding.BATCH_SPEC, P()),
                                   out_specs=(m.state_specs, metric_specs))
            self._one = jax.jit(mapped, donate_argnums=0, out_shardings=(m.state_shardings, None))
        return self._one

    def run(self, kind: str, steps: int, untimed: int = 0) -> list[float]:
        for _ in range(untimed):
            self.step(kind)
        return [self.step(kind) for _ in range(steps)]

    def profile(self, kind: str, steps: int, log_dir: str) -> dict:
        """Traces ``steps`` steps; writes the trace and the compiled HLO under ``log_dir``."""
        os.makedirs(log_dir, exist_ok=True)
        with self.jax.profiler.trace(log_dir, create_perfetto_trace=True):
            times = [self.step(kind) for _ in range(steps)]
        if kind.startswith(ONE_PROGRAM):  # both branches live in the one program
            lowered = self.one_program().lower(self.state, self.batch, kind == ONE_PROGRAM + "sync_forward")
        else:
            lowered = self.machinery.lowered(kind, self.state, self.batch)
        hlo_path = os.path.join(log_dir, "step.hlo.txt")
        with open(hlo_path, "w") as f:
            f.write(lowered.compile().as_text())
        return {"times": times, "hlo": hlo_path}

    def info(self) -> dict:
        return {"first_call_s": self.first_call_s, "params": self.params, "flops_per_token": self.flops_per_token,
                "platform": self.jax.devices()[0].platform}


def worker(spec: dict) -> None:
    """The 1 x 1 limit in a process of its own: builds its Steps, then serves orders (one JSON line
    each on stdin, one JSON line back on the real stdout; jax's prints go to stderr)."""
    reply_to = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    common.ensure_cpu_devices(spec["replica"] * spec["shard"])
    steps = Steps(spec, common.pick_devices(spec["replica"] * spec["shard"]))
    reply_to.write(json.dumps(steps.info()) + "\n")
    for line in sys.stdin:
        order = json.loads(line)
        if order["op"] == "run":
            reply = {"times": steps.run(order["kind"], order["steps"], order.get("untimed", 0))}
        elif order["op"] == "profile":
            reply = steps.profile(order["kind"], order["steps"], order["dir"])
        else:
            break
        reply_to.write(json.dumps(reply) + "\n")


class Worker:
    """The driver's handle on a worker process; same ``run``/``profile`` as ``Steps``."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self._info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the 1 x 1 worker exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def _ask(self, **order) -> dict:
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def info(self) -> dict:
        return self._info

    def run(self, kind, steps, untimed=0):
        return self._ask(op="run", kind=kind, steps=steps, untimed=untimed)["times"]

    def profile(self, kind, steps, log_dir):
        return self._ask(op="profile", kind=kind, steps=steps, dir=log_dir)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


# ----------------------------------------------------------------------------- the driver


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return {}
    n_dev = args.replica * args.shard
    common.ensure_cpu_devices(n_dev)
    from edit_jax.analysis.profile import find_trace, summarize

    kinds = args.kinds.split(",") if args.kinds else default_kinds(args.method)
    base = {"model": args.model, "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "remat": args.remat,
            "tau": args.tau, "overrides": args.overrides, "seed": args.seed}
    mesh_spec = {**base, "replica": args.replica, "shard": args.shard, "method": args.method, "kinds": kinds}
    specs = {"mesh": {**mesh_spec, "src": common.REPO}}
    if args.vs_src or args.vs_set:
        specs["vs"] = {**mesh_spec, "src": os.path.abspath(args.vs_src) if args.vs_src else common.REPO,
                       "overrides": args.overrides + args.vs_set}
    if args.limit and n_dev > 1:  # (on a 1 x 1 mesh the limit is the mesh itself)
        specs["1x1"] = {**base, "replica": 1, "shard": 1, "method": "baseline", "kinds": ["hsdp"], "src": common.REPO}
    env = common.env_info()
    devices = common.pick_devices(n_dev)
    runners = {}
    try:
        for label, spec in specs.items():  # one at a time: compiling in parallel would skew the compile times
            if label == "1x1":
                runners[label] = Worker(spec)
            else:
                pkg = load_checkout(spec["src"], "edit_jax_vs") if label == "vs" and args.vs_src else "edit_jax"
                runners[label] = Steps(spec, devices, pkg)
            first = {k: round(v, 2) for k, v in runners[label].info()["first_call_s"].items()}
            print(f"{label}: ready, first calls {json.dumps(first)}", flush=True)
        runs = [(label, kind) for label, spec in specs.items() for kind in spec["kinds"]]
        samples = {r: [] for r in runs}
        load0 = common.loadavg()
        for rep in range(args.reps):
            for label, kind in runs[rep % len(runs):] + runs[:rep % len(runs)]:  # rotated: drifts spread over kinds
                samples[(label, kind)] += runners[label].run(kind, args.steps_per_rep, args.resume_steps)
        load1 = common.loadavg()
        profiles = {}
        if args.profile_steps > 0:
            trace_root = os.path.join(os.path.dirname(os.path.abspath(args.json)), "traces")
            for label, kind in runs:
                if label == "vs" and args.vs_src:
                    continue  # another checkout: timed, not profiled (its HLO may predate the profile's categories)
                d = os.path.join(trace_root, f"{label}_{kind}")
                rep = runners[label].profile(kind, args.profile_steps, d)
                trace = find_trace(d)
                with open(rep["hlo"]) as f:
                    profiles[f"{label}/{kind}"] = {"trace": trace, "step_times_s": rep["times"],
                                                   **summarize(trace, f.read(), args.profile_steps)}
        infos = {label: r.info() for label, r in runners.items()}
    finally:
        for r in runners.values():
            if isinstance(r, Worker):
                r.close()
    return report(args, specs, infos, runs, samples, profiles, env, (load0, load1))


def report(args, specs, infos, runs, samples, profiles, env, loads) -> dict:
    med = {r: statistics.median(t) for r, t in samples.items()}
    info = infos["mesh"]
    tokens = args.batch * args.seq
    ref = med.get(("mesh", "hsdp"))
    loc = med.get(("mesh", "local"))
    sync_kind = next((k for _, k in runs if k in SYNC_KINDS), None)
    rows, res_kinds = [], {}
    for label, kind in runs:
        st = common.summary(samples[(label, kind)])
        r = {**st, "first_call_s": infos[label]["first_call_s"][kind], "tokens_per_s": tokens / st["median_s"],
             "ratio_to_mesh_hsdp": st["median_s"] / ref if ref else None,
             "ratio_to_mesh_local": st["median_s"] / loc if loc else None,
             "ratio_to_same_kind_here": st["median_s"] / med[("mesh", kind)] if ("mesh", kind) in med else None,
             "samples_s": samples[(label, kind)]}
        if args.peak_tflops:
            n_dev = specs[label]["replica"] * specs[label]["shard"]
            r["mfu"] = info["flops_per_token"] * tokens / st["median_s"] / (args.peak_tflops * 1e12 * n_dev)
        res_kinds[f"{label}/{kind}"] = r
        rows.append([f"{label} {kind}", f"{st['median_s'] * 1e3:.1f}", f"{st['stdev_s'] * 1e3:.1f}",
                     f"{tokens / st['median_s']:,.0f}", _ratio(r["ratio_to_mesh_hsdp"]),
                     _ratio(r["ratio_to_mesh_local"]),
                     _ratio(r["ratio_to_same_kind_here"]) if label != "mesh" else "-",
                     f"{r['first_call_s']:.2f}"] + ([f"{100 * r['mfu']:.1f}%"] if args.peak_tflops else []))
    derived = {}
    if loc and sync_kind and ("mesh", sync_kind) in med:
        derived["sync_over_local"] = med[("mesh", sync_kind)] / loc
        window = ((args.tau - 1) * loc + med[("mesh", sync_kind)]) / args.tau
        derived["window_mean_s"] = window
        if ref:
            derived["window_over_hsdp"] = window / ref
    if ref and ("1x1", "hsdp") in med:
        derived["mesh_overhead_hsdp_over_1x1"] = ref / med[("1x1", "hsdp")]
    if "vs" in specs:
        for kind in specs["vs"]["kinds"]:
            derived[f"{kind}_here_over_vs"] = med[("mesh", kind)] / med[("vs", kind)]
    mesh_txt = f"{args.replica} x {args.shard}"
    common.print_table(
        f"bench_step: {args.model} ({info['params']:,} params), {args.method}, mesh {mesh_txt} ({info['platform']}), "
        f"{args.batch} x {args.seq} tokens/step, {args.dtype}",
        ["config / kind", "median ms", "stdev ms", "tokens/s", "/ mesh hsdp", "/ mesh local", "/ vs same kind",
         "first call s"] + (["MFU"] if args.peak_tflops else []), rows,
        f"{args.reps} interleaved repetitions x {args.steps_per_rep} steps per (config, kind); load average "
        f"before/after {loads[0]} / {loads[1]} on {os.cpu_count()} CPUs. 'mesh' = this checkout on {mesh_txt}; "
        f"'1x1' = one device in its own process"
        + (f"; 'vs' = {args.vs_src or 'this checkout'} {' '.join(args.vs_set)}" if "vs" in specs else "")
        + ". First call = compile + one step.")
    if derived:
        common.print_table("derived ratios (medians)", ["quantity", "value"],
                           [[k, f"{v * 1e3:.1f} ms" if k.endswith("_s") else f"{v:.3f}"] for k, v in derived.items()])
    if profiles:
        from edit_jax.analysis.profile import CATEGORIES

        prow = [[k] + [f"{p['per_device_step_ms'][c]:.2f}" for c in CATEGORIES] + [f"{p['total_ms']:.1f}"]
                for k, p in profiles.items()]
        common.print_table(f"profile: self time per device per step (ms), {args.profile_steps} traced steps per kind",
                           ["config/kind"] + list(CATEGORIES) + ["total"], prow,
                           "Each op's time is its thread's wall time: on a CPU-emulated mesh 'collective' includes "
                           "waiting at the rendezvous while other devices compute, and with more device threads than "
                           "cores every column includes descheduled time. Compare kinds within one run.")
    res = {"benchmark": "bench_step", "env": env, "loadavg": list(loads),
           "args": {k: v for k, v in vars(args).items() if k != "worker"},
           "configs": {label: {"spec": specs[label], **infos[label]} for label in specs},
           "kinds": res_kinds, "derived": derived, "profiles": profiles}
    common.write_json(args.json, res)
    print(f"\nJSON: {os.path.relpath(args.json, os.getcwd())}")
    return res


def _ratio(x):
    return "-" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
