#!/usr/bin/env python
"""EDiT vs DiLoCo vs Baseline: traffic across `replica`, outer-state memory, step times, loss.

Four sections (``--only a,b,c,d``; all by default), each a table and a key of the JSON:

a. Bytes crossing ``replica`` per device, read from the COMPILED programs' collectives
   (``StepPrograms.lowered(kind, ...).compile().as_text()``): every all-reduce / all-gather /
   reduce-scatter / collective-permute / all-to-all (async ``-start`` forms too), its operand
   shapes and dtypes and its replica_groups (explicit or iota). Group ids are positions in
   ``mesh.devices.flat`` (checked by compiling on a permuted device order), so position p lives
   on replica p // S; a collective crosses ``replica`` when one of its groups holds two replicas.
   Collectives inside a while loop (the layer scan) run trip-count times per step (the while's
   ``known_trip_count``, else n_layers). Bytes per device: ring formulas (all-reduce
   2(n-1)/n x B, all-gather (n-1) x B for a per-device operand B, reduce-scatter (n-1)/n x B for
   a full operand B) and plain operand bytes. Per inner step of a Local-SGD method:
   local-step bytes + (sync-step bytes - local-step bytes) / tau.
b. Extra device memory of the outer state (θ̄ + Nesterov trace) per device: DiLoCo-style full
   copies (2 x |θ| x 4 B, computed) vs the actual arrays of EDiT with sync.outer_sharding=shard,
   =replica_shard and sync.cpu_offload=true (memory kind pinned_host), plus the compiled steps'
   memory_analysis().
c. Inner-step (local) and sync-step (sync_forward, local_then_sync) time relative to the Baseline
   hsdp step on the same mesh, interleaved repetitions, medians.
d. Validation loss after the same number of steps (= tokens) for Baseline, Post Local SGD, DiLoCo
   and EDiT: ``train()`` on the config (default configs/demo.py) with method=..., same W and tau.
e. Streaming and compressed sync (EDiT): for sync.fragments F in {1, 2, 4} and sync.wire.kind in
   {none, bf16, int8} (plus int8 with error feedback at F = 1), the bytes crossing ``replica`` of
   every sync program (one per fragment group) read from the compiled HLO as in a, the peak (the
   largest single sync step), bytes per token over a tau window, and the validation loss after
   the same tokens (``train()``, tau = --stream-tau, which F must divide).

    python benchmarks/bench_edit.py                 # everything, demo model on a 2 x 4 CPU mesh
    python benchmarks/bench_edit.py --only a,b      # compile-only sections (about a minute)
    python benchmarks/bench_edit.py --only d --steps 600
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common
from edit_jax.analysis import hlo  # no jax import: safe before the device count is set

SECTIONS = ("a", "b", "c", "d", "e")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="a,b,c,d,e", help="comma-separated sections to run (a,b,c,d,e); default all")
    p.add_argument("--config", default=os.path.join(common.REPO, "configs", "demo.py"),
                   help="base config file (default configs/demo.py); the flags below override it")
    p.add_argument("--model", default=None, help="model preset replacing the config's model")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"), help="model.compute_dtype")
    p.add_argument("--replica", type=int, default=None, help="mesh.replica (config: 2)")
    p.add_argument("--shard", type=int, default=None, help="mesh.shard (config: 4)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (config: 16)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (config: 128)")
    p.add_argument("--tau", type=int, default=None, help="sync.tau for all Local-SGD methods (config: 10)")
    p.add_argument("--warmup-steps", type=int, default=None, help="sync.warmup_steps W, all methods (config: 20)")
    p.add_argument("--steps", type=int, default=300, help="section d: training steps per method; default 300")
    p.add_argument("--methods", default="baseline,post_local_sgd,diloco,edit", help="section d: methods to train")
    p.add_argument("--diloco-outer-lr", type=float, default=0.8, help="DiLoCo outer lr (paper: 0.8)")
    p.add_argument("--diloco-outer-momentum", type=float, default=0.85, help="DiLoCo outer momentum (paper: 0.85)")
    p.add_argument("--reps", type=int, default=7, help="section c: interleaved repetitions; default 7")
    p.add_argument("--steps-per-rep", type=int, default=3, help="section c: timed steps per kind per repetition")
    p.add_argument("--stream-tau", type=int, default=8, help="section e: sync.tau (divisible by 4); default 8")
    p.add_argument("--stream-rows", default="1:none,1:bf16,1:int8,1:int8+ef,2:none,2:bf16,2:int8,4:none,4:bf16,4:int8",
                   help="section e: F:compress[+ef] rows")
    p.add_argument("--stream-train", default="all", help="section e: rows to train for the val loss ('all', 'none' "
                                                         "or a comma list like 1:none,1:int8)")
    p.add_argument("--stream-seeds", default="0",
                   help="section e: comma-separated seeds; each trained row runs once per seed and reports the "
                        "mean val loss (and each seed's, paired with F=1 none of the same seed); default 0")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every section (repeatable)")
    p.add_argument("--json", default=None,
                   help="where to write the JSON result; default runs/bench/bench_edit.json (all sections) or "
                        "runs/bench/bench_edit_<sections>.json with --only (e.g. bench_edit_ab.json)")
    p.add_argument("--smoke", action="store_true",
                   help="section c on the tiny model (one layer), 2 x 1 mesh, one repetition (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.only, args.model, args.replica, args.shard, args.batch, args.seq = "c", "tiny", 2, 1, 4, 16
        args.tau, args.warmup_steps, args.reps, args.steps_per_rep = 2, 0, 1, 1
        args.overrides = args.overrides + ["model.n_layers=1"]  # five programs to compile: one layer each
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"--only: unknown section(s) {bad}; expected some of {','.join(SECTIONS)}")
    if args.json is None:
        tag = "" if sorted(set(args.sections)) == list(SECTIONS) else "_" + "".join(sorted(set(args.sections)))
        args.json = os.path.join(common.DEFAULT_JSON_DIR, f"bench_edit{tag}.json")
    return args


# ----------------------------------------------------------------------------- config plumbing


def base_config(args):
    from edit_jax.config import apply_overrides
    from edit_jax.models.llama import preset
    from edit_jax.validate import load_config, validate

    ov = []
    for flag, key in [("replica", "mesh.replica"), ("shard", "mesh.shard"), ("batch", "batch_size"),
                      ("seq", "data.seq_len"), ("tau", "sync.tau"), ("warmup_steps", "sync.warmup_steps")]:
        if getattr(args, flag) is not None:
            ov.append(f"{key}={getattr(args, flag)}")
    cfg = load_config(args.config, ov)
    if args.model:
        cfg = dataclasses.replace(cfg, model=preset(args.model))
    if args.dtype:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype=args.dtype))
    cfg = apply_overrides(cfg, list(args.overrides))
    validate(cfg)
    return cfg


def variant(cfg, *overrides):
    from edit_jax.config import apply_overrides
    from edit_jax.validate import validate

    out = apply_overrides(cfg, list(overrides))
    validate(out)
    return out


# Section a/b/c variants: name -> (overrides, step kinds)
def variants(args):
    dil = [f"sync.outer.lr={args.diloco_outer_lr}", f"sync.outer.momentum={args.diloco_outer_momentum}"]
    return {
        "Baseline": (["sync.method=baseline"], ["hsdp"]),
        "DiLoCo": (["sync.method=diloco", *dil], ["local", "local_then_sync"]),
        "EDiT": (["sync.method=edit"], ["local", "sync_forward"]),
        "EDiT replica_shard": (["sync.method=edit", "sync.outer_sharding=replica_shard"], ["local", "sync_forward"]),
        "EDiT cpu_offload": (["sync.method=edit", "sync.cpu_offload=true"], ["local", "sync_forward"]),
    }


class Ctx:
    """Machineries and compiled programs shared by sections a and b (compiled once)."""

    def __init__(self, args, cfg, devices):
        self.args, self.cfg, self.devices = args, cfg, devices
        self._mach, self._compiled = {}, {}
        self.compile_s = {}

    def machinery(self, name):
        from edit_jax.runtime.mesh import make_mesh
        from edit_jax.localsgd.programs import StepPrograms

        if name not in self._mach:
            cfg = variant(self.cfg, *variants(self.args)[name][0])
            self._mach[name] = StepPrograms.for_config(cfg, make_mesh(cfg.mesh, self.devices))
        return self._mach[name]

    def compiled(self, name, kind):
        import jax
        import jax.numpy as jnp

        from edit_jax.localsgd.sharding import BATCH_SPEC, named

        key = (name, kind)
        if key not in self._compiled:
            m = self.machinery(name)
            batch = jax.ShapeDtypeStruct((m.cfg.batch_size, m.cfg.data.seq_len + 1), jnp.int32,
                                         sharding=named(m.mesh, BATCH_SPEC))
            t0 = time.perf_counter()
            self._compiled[key] = m.lowered(kind, m.abstract_state(), batch).compile()
            self.compile_s[f"{name}/{kind}"] = time.perf_counter() - t0
        return self._compiled[key]


def param_counts(cfg):
    import jax

    from edit_jax.models import llama as model_lib

    abstract = jax.eval_shape(lambda k: model_lib.init_params(cfg.model, k), jax.random.key(0))
    n = model_lib.count_params(abstract)
    per_dev = sum(x.size // cfg.mesh.shard for x in jax.tree.leaves(abstract))  # every leaf is FSDP-sharded
    return n, per_dev


# ----------------------------------------------------------------------------- section a


def verify_group_ids(n_rep, n_shard, devices) -> dict:
    """Compiles the tiny model's hsdp step on the identity and on an interleaved device order and
    checks that replica_groups name positions in mesh.devices.flat, not device ids."""
    import jax
    import jax.numpy as jnp

    from edit_jax.config import Config, DataConfig, MeshConfig, SyncConfig
    from edit_jax.models.llama import preset
    from edit_jax.localsgd.sharding import BATCH_SPEC, named
    from edit_jax.runtime.mesh import make_mesh
    from edit_jax.localsgd.programs import StepPrograms

    cfg = Config(model=preset("tiny"), mesh=MeshConfig(n_rep, n_shard), data=DataConfig(seq_len=16),
                 sync=SyncConfig(method="baseline"), batch_size=n_rep * n_shard, steps=2)
    order = [(i % n_rep) * n_shard + i // n_rep for i in range(n_rep * n_shard)]
    pos_shard = sorted(tuple(range(r * n_shard, (r + 1) * n_shard)) for r in range(n_rep))
    pos_rep = sorted(tuple(r * n_shard + s for r in range(n_rep)) for s in range(n_shard))
    out = {"device_order": order}
    for label, dev_order in [("identity", None), ("interleaved", order)]:
        mesh = make_mesh(cfg.mesh, devices, dev_order)
        m = StepPrograms.for_config(cfg, mesh)
        batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.data.seq_len + 1), jnp.int32,
                                     sharding=named(mesh, BATCH_SPEC))
        parsed = hlo.hlo_collectives(m.lowered("hsdp", m.abstract_state(), batch).compile().as_text(),
                                        (n_rep, n_shard), cfg.model.n_layers)
        seen = {tuple(sorted(tuple(sorted(g)) for g in r["groups"])) for r in parsed["collectives"]}
        out[label] = {"mesh_device_ids": [d.id for d in mesh.devices.flat], "group_sets": sorted(seen)}
    ok = all(set(out[lbl]["group_sets"]) <= {tuple(pos_shard), tuple(pos_rep)} for lbl in ("identity", "interleaved"))
    ok = ok and out["identity"]["group_sets"] == out["interleaved"]["group_sets"]
    ids = [d.id for d in make_mesh(cfg.mesh, devices, order).devices.flat]
    as_ids = sorted(tuple(sorted(ids[r * n_shard:(r + 1) * n_shard])) for r in range(n_rep))
    out["positions_verified"] = bool(ok and (as_ids != pos_shard or n_rep == 1))
    out["explanation"] = ("with the interleaved order the replica-0 devices have ids "
                          f"{as_ids[0] if as_ids else ()}, yet the compiled shard groups are still "
                          f"{pos_shard[0] if pos_shard else ()}...: ids are positions in mesh.devices.flat")
    return out


def section_a(ctx: Ctx) -> dict:
    cfg, args = ctx.cfg, ctx.args
    n_rep, n_shard, tau = cfg.mesh.replica, cfg.mesh.shard, cfg.sync.tau
    ver = verify_group_ids(n_rep, n_shard, ctx.devices)
    n_params, per_dev = param_counts(cfg)
    tokens = cfg.batch_size * cfg.data.seq_len
    ar = 2 * (n_rep - 1) / n_rep
    expected_sync = ar * 4 * per_dev
    programs, detail_rows = {}, []
    for name in ("Baseline", "DiLoCo", "EDiT", "EDiT replica_shard"):
        for kind in variants(args)[name][1]:
            text = ctx.compiled(name, kind).as_text()
            parsed = hlo.hlo_collectives(text, (n_rep, n_shard), default_trip=cfg.model.n_layers)
            cross, within = hlo.collective_totals(parsed, True), hlo.collective_totals(parsed, False)
            programs[f"{name}/{kind}"] = {"cross_replica": cross, "within_replica": within, "loops": parsed["loops"],
                                          "collectives": parsed["collectives"]}
            groups = {}  # collectives crossing replica, grouped by (op, runs/step, group size, payload kind)
            for r in parsed["collectives"]:
                if r["crosses_replica"]:
                    small_only = r["small_operand_bytes"] == r["operand_bytes"]
                    key = (r["op"], r["runs_per_step"], r["group_size"], "small only" if small_only else "tensors")
                    g = groups.setdefault(key, {"ops": 0, "operands": [], "operand": 0.0, "ring": 0.0})
                    g["ops"] += 1
                    g["operands"] += r["operands"]
                    g["operand"] += r["operand_bytes"] * r["runs_per_step"]
                    g["ring"] += r["ring_bytes"] * r["runs_per_step"]
            for (op, runs, n, payload), g in groups.items():
                ops = g["operands"]
                desc = ", ".join(ops[:3]) + (f", ... ({len(ops)} operands)" if len(ops) > 3 else "")
                detail_rows.append([f"{name}/{kind}", op, payload, g["ops"], f"{runs:g}", n, desc,
                                    f"{g['operand']:,.0f}", f"{g['ring']:,.0f}"])
    rows, methods = [], {}
    base = programs["Baseline/hsdp"]["cross_replica"]
    for name, (_, kinds) in list(variants(args).items())[:4]:
        if name == "Baseline":
            local = sync = programs["Baseline/hsdp"]["cross_replica"]
            per_step = {k: local[k] for k in ("ring_bytes", "operand_bytes", "tensor_ring_bytes", "small_ring_bytes")}
            extra = None
        else:
            local, sync = (programs[f"{name}/{k}"]["cross_replica"] for k in kinds)
            extra = {k: sync[k] - local[k] for k in ("ring_bytes", "operand_bytes", "tensor_ring_bytes",
                                                      "small_ring_bytes", "executions")}
            per_step = {k: local[k] + extra[k] / tau for k in ("ring_bytes", "operand_bytes", "tensor_ring_bytes",
                                                               "small_ring_bytes")}
        ratio = per_step["ring_bytes"] / base["ring_bytes"] if base["ring_bytes"] else float("nan")
        methods[name] = {"kinds": kinds, "local_step": local if extra is not None else None, "sync_extra": extra,
                         "per_inner_step": per_step, "per_token_ring_bytes": per_step["ring_bytes"] / tokens,
                         "ratio_to_baseline_per_token": ratio}
        rows.append([name, "+".join(kinds),
                     f"{local['ring_bytes']:,.0f}" if extra is not None else "-",
                     f"{local['tensor_ring_bytes']:,.0f} / {local['small_ring_bytes']:,.0f}"
                     if extra is not None else "-",
                     f"{extra['ring_bytes']:,.0f}" if extra else f"{base['ring_bytes']:,.0f} (every step)",
                     f"{extra['executions']:g}" if extra else f"{base['executions']:g}",
                     f"{per_step['ring_bytes']:,.1f}", f"{per_step['operand_bytes']:,.1f}",
                     f"{per_step['ring_bytes'] / tokens:.2f}", f"{ratio:.4f}"])
    note = (f"|θ| = {n_params:,} params; |θ|/S = {per_dev:,} fp32 per device = {4 * per_dev:,} B; one all-reduce of it "
            f"moves 2(N-1)/N x {4 * per_dev:,} = {expected_sync:,.0f} B per device (N={n_rep}). tau = {tau}; "
            f"{tokens:,} tokens/step. 'local step' = bytes crossing replica in one local step (tensor / small "
            f"operands: small = rank-0 or <= N elements: metrics, norms, weights). 'sync' = sync-step program minus "
            f"local-step program. Per inner step = local + sync/tau. Ring formulas: "
            + "; ".join(f"{k}: {v}" for k, v in hlo.RING_FORMULAS.items() if k != "all-to-all")
            + f". replica_groups ids = positions in mesh.devices.flat: "
            f"{'verified' if ver['positions_verified'] else 'NOT verified'} (interleaved device order).")
    common.print_table("a. Bytes crossing `replica` per device (from compiled HLO)",
                       ["method", "step kinds", "local step B", "tensor / small B", "sync B (extra)",
                        "sync collectives run", "per inner step B (ring)", "per inner step B (operand)", "B/token",
                        "ratio to Baseline"], rows, note)
    common.print_table("a'. Every collective that crosses `replica` (per step = per run x runs/step)",
                       ["program", "op", "payload", "HLO ops", "runs/step each", "n", "operands (per device)",
                        "operand B/step", "ring B/step"], detail_rows,
                       "HLO ops: instructions in the program (grouped by op, runs/step, group size n, payload); "
                       "runs/step each: executions per step of each (trip count of the enclosing layer loop, or 1). "
                       "Every instruction is listed in the JSON (a.programs.*.collectives).")
    loops = {k: [(lp.get("trip_count"), lp.get("trip_count_source")) for lp in v["loops"] if "while" in lp]
             for k, v in programs.items()}
    shard_rows = [[k, f"{v['within_replica']['executions']:g}", f"{v['within_replica']['ring_bytes']:,.0f}",
                   ", ".join(f"{t}x ({s})" for t, s in loops[k])] for k, v in programs.items()]
    common.print_table("a''. Context: traffic within a replica (over `shard`) and while loops per program",
                       ["program", "collectives run/step", "ring B/step", "while trip counts"], shard_rows,
                       "Collectives inside a while body count trip-count times; n_layers = "
                       f"{cfg.model.n_layers}.")
    return {"params": n_params, "params_per_device": per_dev, "tau": tau, "tokens_per_step": tokens,
            "expected_sync_ring_bytes": expected_sync, "ring_formulas": hlo.RING_FORMULAS,
            "group_id_check": ver, "methods": methods,
            "programs": {k: {kk: vv for kk, vv in v.items()} for k, v in programs.items()}}


# ----------------------------------------------------------------------------- section b


def _per_device_bytes(tree):
    import jax

    dev, host, kinds = {}, {}, set()
    for x in jax.tree.leaves(tree):
        kind = getattr(x.sharding, "memory_kind", None) or "device"
        kinds.add(kind)
        target = host if "host" in kind else dev
        for s in x.addressable_shards:
            target[s.device.id] = target.get(s.device.id, 0) + s.data.nbytes
    return dev, host, sorted(kinds)


def section_b(ctx: Ctx) -> dict:
    import jax

    cfg, args = ctx.cfg, ctx.args
    n_rep, n_shard = cfg.mesh.replica, cfg.mesh.shard
    n_params, per_dev = param_counts(cfg)
    theta_b = 4 * n_params
    rows = [["DiLoCo reference (full θ̄ + trace)", "computed", "device", 2 * theta_b, 0, "2 x |θ| x 4 B", "-", "-", "-"]]
    out = {"theta_bytes_fp32": theta_b, "variants": {}}
    expect = {"DiLoCo": ("2 |θ|/S x 4 B", 2 * theta_b / n_shard), "EDiT": ("2 |θ|/S x 4 B", 2 * theta_b / n_shard),
              "EDiT replica_shard": ("2 |θ|/(N S) x 4 B", 2 * theta_b / (n_rep * n_shard)),
              "EDiT cpu_offload": ("0 on device (2 |θ|/S x 4 B on host)", 0.0)}
    for name in ("DiLoCo", "EDiT", "EDiT replica_shard", "EDiT cpu_offload"):
        m = ctx.machinery(name)
        state = m.init_state(0)
        dev, host, kinds = _per_device_bytes((state.outer.params, state.outer.opt_state))
        first = state.outer.params["root"]["embed"]
        shard0 = sum(s.addressable_shards[0].data.nbytes
                     for s in jax.tree.leaves((state.outer.params, state.outer.opt_state)))
        mems = {}
        for kind in variants(args)[name][1]:
            ma = ctx.compiled(name, kind).memory_analysis()
            mems[kind] = {f: getattr(ma, f) for f in dir(ma) if f.endswith("_in_bytes")} if ma is not None else None
        sync_kind = variants(args)[name][1][-1]
        ms = mems.get(sync_kind) or {}
        dmax, hmax = max(dev.values(), default=0), max(host.values(), default=0)
        out["variants"][name] = {"overrides": variants(args)[name][0], "device_bytes_per_device": dev,
                                 "host_bytes_per_device": host, "memory_kinds": kinds,
                                 "addressable_shards0_sum_bytes": shard0,
                                 "embed_sharding": str(first.sharding), "expected": expect[name][0],
                                 "expected_device_bytes": expect[name][1], "memory_analysis": mems}
        rows.append([f"{name} (actual)" if name != "DiLoCo" else "DiLoCo as implemented here (actual)",
                     ", ".join(variants(args)[name][0][1:]) or "default", "/".join(kinds), dmax, hmax,
                     expect[name][0], ms.get("argument_size_in_bytes", "-"), ms.get("temp_size_in_bytes", "-"),
                     ms.get("host_argument_size_in_bytes", "-")])
        del state
    note = (f"|θ| = {n_params:,} params = {theta_b:,} B fp32; mesh {n_rep} x {n_shard}. Device/host bytes = max over "
            "devices of the sum of this device's shards of state.outer.params + state.outer.trace (all devices equal "
            "here), split by the arrays' memory_kind. The last three columns are memory_analysis() of the compiled "
            "sync step (per device program): argument bytes (the WHOLE state incl. params, AdamW moments and outer "
            "state), temp bytes, host argument bytes. On the CPU backend memory_analysis() does not separate "
            "pinned_host from device memory (host_* stay 0; offloaded outer state is still counted in arguments).")
    common.print_table("b. Extra memory of the outer state per device",
                       ["variant", "overrides", "memory kind", "device B/device", "host B/device", "expected",
                        "sync step args B", "sync step temp B", "sync step host args B"], rows, note)
    return out


# ----------------------------------------------------------------------------- section c


def section_c(ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    args, cfg = ctx.args, ctx.cfg
    tau = cfg.sync.tau
    edit, dil = ctx.machinery("EDiT"), ctx.machinery("DiLoCo")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, min(cfg.model.vocab_size, 257), (cfg.batch_size, cfg.data.seq_len + 1), dtype=np.int32)
    states = {"EDiT": edit.init_state(0), "DiLoCo": dil.init_state(0)}
    batches = {"EDiT": edit.put_batch(jnp.asarray(tokens)), "DiLoCo": dil.put_batch(jnp.asarray(tokens))}
    runs = [("hsdp", "EDiT", "hsdp"), ("local", "EDiT", "local"), ("sync_forward (EDiT)", "EDiT", "sync_forward"),
            ("local_then_sync (EDiT plan, layerwise=false)", "EDiT", "local_then_sync"),
            ("local_then_sync (DiLoCo)", "DiLoCo", "local_then_sync")]
    mach = {"EDiT": edit, "DiLoCo": dil}
    first = {}
    for label, owner, kind in runs:  # compile + one warm step each (untimed)
        fn = mach[owner].step_fn(kind)
        t0 = time.perf_counter()
        for _ in range(2):
            states[owner], met = fn(states[owner], batches[owner])
        jax.block_until_ready(states[owner])
        first[label] = time.perf_counter() - t0
    samples = {label: [] for label, _, _ in runs}
    rep_medians = {label: [] for label, _, _ in runs}
    load0 = common.loadavg()
    for rep in range(args.reps):
        order = runs[rep % len(runs):] + runs[:rep % len(runs)]  # rotate to spread drifts over kinds
        for label, owner, kind in order:
            fn = mach[owner].step_fn(kind)
            ts = []
            for _ in range(args.steps_per_rep):
                t0 = time.perf_counter()
                states[owner], met = fn(states[owner], batches[owner])
                jax.block_until_ready(states[owner])
                ts.append(time.perf_counter() - t0)
            samples[label] += ts
            rep_medians[label].append(statistics.median(ts))
    load1 = common.loadavg()
    base = statistics.median(samples["hsdp"])
    res, rows = {}, []
    for label, owner, kind in runs:
        st = common.summary(samples[label])
        res[label] = {"kind": kind, "machinery": owner, **st,
                      "median_of_rep_medians_s": statistics.median(rep_medians[label]),
                      "ratio_to_hsdp_median": st["median_s"] / base, "samples_s": samples[label],
                      "first_two_calls_s": first[label]}
        rows.append([label, f"{st['median_s'] * 1e3:.1f}", f"{st['mean_s'] * 1e3:.1f}", f"{st['stdev_s'] * 1e3:.1f}",
                     f"{statistics.median(rep_medians[label]) * 1e3:.1f}", f"{st['median_s'] / base:.3f}"])
    loc = res["local"]["median_s"]
    avg_edit = ((tau - 1) * loc + res["sync_forward (EDiT)"]["median_s"]) / tau
    avg_dil = ((tau - 1) * loc + res["local_then_sync (DiLoCo)"]["median_s"]) / tau
    rows.append([f"EDiT mean over a tau={tau} window", f"{avg_edit * 1e3:.1f}", "-", "-", "-",
                 f"{avg_edit / base:.3f}"])
    rows.append([f"DiLoCo mean over a tau={tau} window", f"{avg_dil * 1e3:.1f}", "-", "-", "-",
                 f"{avg_dil / base:.3f}"])
    common.print_table("c. Step time relative to the Baseline hsdp step (same mesh, interleaved)",
                       ["step", "median ms", "mean ms", "stdev ms", "median of rep medians ms", "ratio to hsdp"], rows,
                       f"{args.reps} interleaved repetitions x {args.steps_per_rep} timed steps per kind "
                       f"(block_until_ready each; compile and one warm step excluded), one fixed batch. "
                       f"Host load average before/after: {load0} / {load1} on {os.cpu_count()} CPUs. "
                       "On a CPU-emulated mesh collectives are memory copies: the ratios measure compute overhead "
                       "(sync arithmetic, extra HLO), not network time.")
    return {"steps": res, "tau": tau, "edit_window_mean_s": avg_edit, "diloco_window_mean_s": avg_dil,
            "edit_window_ratio": avg_edit / base, "diloco_window_ratio": avg_dil / base,
            "reps": args.reps, "steps_per_rep": args.steps_per_rep, "loadavg_before": load0, "loadavg_after": load1}


# ----------------------------------------------------------------------------- section d


def section_d(ctx: Ctx) -> dict:
    from edit_jax.training.train import train

    args, cfg = ctx.args, ctx.cfg
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    # log_every stays the config's (10): train() then fetches metrics every 10 steps, which bounds how
    # many steps are dispatched ahead. Without such a sync (e.g. log_every >= 100) XLA:CPU with 8
    # emulated devices on 2 cores aborted here ("Termination timeout for all gather RendezvousKey").
    common_ov = [f"steps={args.steps}", "eval_every=0", "checkpoint_every=0"]
    extra = {"baseline": [], "post_local_sgd": [], "edit": [],
             "diloco": [f"sync.outer.lr={args.diloco_outer_lr}", f"sync.outer.momentum={args.diloco_outer_momentum}"]}
    out, rows = {}, []
    tokens = args.steps * cfg.batch_size * cfg.data.seq_len
    for method in methods:
        ov = [f"sync.method={method}", *common_ov, *extra.get(method, [])]
        run_cfg = variant(cfg, *ov)
        t0 = time.perf_counter()
        r = train(run_cfg, run_dir=None, progress=False, devices=ctx.devices)
        wall = time.perf_counter() - t0
        out[method] = {"overrides": ov, "final_val_loss": r.final_val_loss, "final_val_ppl": r.final_val_ppl,
                       "final_train_loss": r.final_loss, "steps": r.steps, "tokens": r.tokens,
                       "train_seconds": r.seconds, "wall_seconds": wall, "interrupted": r.interrupted,
                       "outer_lr": run_cfg.sync.outer.lr, "outer_momentum": run_cfg.sync.outer.momentum}
        print(f"  [d] {method}: val_loss {r.final_val_loss:.4f} after {r.steps} steps in {wall:.0f} s", flush=True)
    base = out.get("baseline", {}).get("final_val_loss")
    names = {"baseline": "Baseline", "post_local_sgd": "Post Local SGD", "diloco": "DiLoCo", "edit": "EDiT"}
    for method, o in out.items():
        d = (o["final_val_loss"] - base) if base is not None and o["final_val_loss"] is not None else None
        outer = {"baseline": "-", "post_local_sgd": "mean (lr 1, mom 0)",
                 "diloco": f"Nesterov lr {o['outer_lr']} mom {o['outer_momentum']}",
                 "edit": f"Nesterov lr {o['outer_lr']} mom {o['outer_momentum']} + penalty"}[method]
        rows.append([names.get(method, method), outer, o["steps"], f"{o['tokens']:,}", f"{o['final_train_loss']:.4f}",
                     f"{o['final_val_loss']:.4f}", f"{d:+.4f}" if d is not None else "-", f"{o['final_val_ppl']:.3f}",
                     f"{o['wall_seconds']:.0f}"])
    s = cfg.sync
    common.print_table("d. Validation loss after the same tokens (embedded stdlib corpus)",
                       ["method", "outer step", "steps", "tokens", "train loss (last)", "val loss", "Δ vs Baseline",
                        "val ppl", "wall s"], rows,
                       f"Config {os.path.relpath(args.config, common.REPO)} with steps={args.steps}, "
                       f"W={s.warmup_steps}, tau={s.tau}, inner lr {cfg.optim.lr}, "
                       f"batch {cfg.batch_size} x seq {cfg.data.seq_len}, "
                       f"mesh {cfg.mesh.replica} x {cfg.mesh.shard}, eval on {cfg.eval_batches} val batches at the end "
                       "(Local-SGD methods: on θ̄ after a fresh sync). Wall s includes compilation and data loading.")
    return {"methods": out, "tokens": tokens, "warmup_steps": s.warmup_steps, "tau": s.tau}


# ----------------------------------------------------------------------------- section e


def _stream_overrides(row: str, tau: int) -> list[str]:
    f, comp = row.split(":")
    comp, ef = (comp[:-3], True) if comp.endswith("+ef") else (comp, False)
    return ["sync.method=edit", f"sync.tau={tau}", f"sync.fragments={f}", f"sync.wire.kind={comp}",
            f"sync.wire.error_feedback={str(ef).lower()}"]


def section_e(ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp

    from edit_jax.localsgd.sharding import BATCH_SPEC, named

    from edit_jax.runtime.mesh import make_mesh
    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.training.train import train

    args, cfg = ctx.args, ctx.cfg
    tau, n_rep, n_shard = args.stream_tau, cfg.mesh.replica, cfg.mesh.shard
    rows_spec = [r.strip() for r in args.stream_rows.split(",") if r.strip()]
    to_train = rows_spec if args.stream_train == "all" else \
        [] if args.stream_train == "none" else [r.strip() for r in args.stream_train.split(",")]
    tokens_step = cfg.batch_size * cfg.data.seq_len
    out, table = {}, []
    for row in rows_spec:
        run_cfg = variant(cfg, *_stream_overrides(row, tau))
        m = StepPrograms.for_config(run_cfg, make_mesh(run_cfg.mesh, ctx.devices))
        batch = jax.ShapeDtypeStruct((run_cfg.batch_size, run_cfg.data.seq_len + 1), jnp.int32,
                                     sharding=named(m.mesh, BATCH_SPEC))
        state = m.abstract_state()
        per_kind, wire = {}, {}
        f_count = run_cfg.sync.fragments
        for kind in ["local"] + ["sync_forward" if f_count == 1 else f"sync_forward@{g}" for g in range(f_count)]:
            text = m.lowered(kind, state, batch).compile().as_text()
            parsed = hlo.hlo_collectives(text, (n_rep, n_shard), default_trip=run_cfg.model.n_layers)
            tot = hlo.collective_totals(parsed, True)
            per_kind[kind] = {"ring_bytes": tot["ring_bytes"], "tensor_ring_bytes": tot["tensor_ring_bytes"],
                              "small_ring_bytes": tot["small_ring_bytes"], "by_op": tot["by_op"]}
            wire[kind] = sorted({o.split("[")[0] for r in parsed["collectives"] if r["crosses_replica"]
                                 for o in r["operands"] if r["operand_bytes"] > 1024})
        local = per_kind["local"]["ring_bytes"]
        sync_bytes = [per_kind[k]["ring_bytes"] - local for k in per_kind if k != "local"]
        window = local * tau + sum(sync_bytes)  # tau steps: every group syncs once
        out[row] = {"overrides": _stream_overrides(row, tau), "groups": list(m.groups) if m.groups else None,
                    "programs": per_kind, "wire_dtypes": wire, "sync_step_bytes": sync_bytes, "peak": max(sync_bytes),
                    "per_step_bytes": window / tau, "per_token_bytes": window / tau / tokens_step}
        print(f"  [e] {row}: sync steps {[f'{b:,.0f}' for b in sync_bytes]} wire {wire}", flush=True)
    today = out.get("1:none")
    for row in rows_spec:
        o = out[row]
        if row in to_train:
            seeds = [int(x) for x in args.stream_seeds.split(",") if x.strip()]
            per_seed, t0 = {}, time.perf_counter()
            for seed in seeds:
                ov = _stream_overrides(row, tau) + [f"steps={args.steps}", "eval_every=0", "checkpoint_every=0",
                                                    f"seed={seed}"]
                r = train(variant(cfg, *ov), run_dir=None, progress=False, devices=ctx.devices)
                per_seed[seed] = {"val_loss": r.final_val_loss, "train_loss": r.final_loss}
                print(f"  [e] {row} seed {seed}: val_loss {r.final_val_loss:.4f} after {r.steps} steps", flush=True)
            vals = [v["val_loss"] for v in per_seed.values()]
            o.update(final_val_loss=statistics.fmean(vals),
                     val_loss_stdev=statistics.stdev(vals) if len(vals) > 1 else 0.0, per_seed=per_seed,
                     steps=r.steps, tokens=r.tokens, wall_seconds=time.perf_counter() - t0)
    for row in rows_spec:
        o = out[row]
        ratio = lambda k: o[k] / today[k] if today else float("nan")  # noqa: B023 - called at once
        val, base_val = o.get("final_val_loss"), (today or {}).get("final_val_loss")
        o["peak_ratio"], o["per_token_ratio"] = ratio("peak"), ratio("per_token_bytes")
        o["val_loss_rel"] = (val - base_val) / base_val if val is not None and base_val else None
        if val is not None and base_val and len(o["per_seed"]) > 1:  # the same seed with and without the change
            o["val_loss_rel_per_seed"] = {sd: (v["val_loss"] - today["per_seed"][sd]["val_loss"])
                                          / today["per_seed"][sd]["val_loss"]
                                          for sd, v in o["per_seed"].items() if sd in today["per_seed"]}
        table.append([row.split(":")[0], row.split(":")[1], " / ".join(f"{b:,.0f}" for b in o["sync_step_bytes"]),
                      f"{o['peak']:,.0f}", f"{o['peak_ratio']:.3f}", f"{o['per_token_bytes']:.2f}",
                      f"{o['per_token_ratio']:.3f}", ",".join(sorted({d for k, v in o["wire_dtypes"].items()
                                                                      if k != "local" for d in v})),
                      (f"{val:.4f}" + (f" ± {o['val_loss_stdev']:.4f}" if o.get("val_loss_stdev") else ""))
                      if val is not None else "-",
                      f"{100 * o['val_loss_rel']:+.2f}%" if o["val_loss_rel"] is not None else "-"])
    common.print_table("e. Streaming (fragments) and compressed sync: bytes crossing `replica` and val loss",
                       ["F", "compress", "B per sync step (each group)", "peak B", "peak / today",
                        "B per token", "per token / today", "wire dtypes (>1 KiB)", "val loss", "vs F=1 none"],
                       table,
                       f"EDiT, config {os.path.relpath(args.config, common.REPO)}, tau={tau}, "
                       f"W={cfg.sync.warmup_steps}, mesh {n_rep} x {n_shard}, {tokens_step} tokens per step. "
                       "Bytes per device, ring formulas of "
                       "section a, read from the compiled sync_forward[@f] programs minus the local step's (0 here); "
                       "scalars (norms, weights, flags) included. Per token: a tau window (every group once) / "
                       f"(tau x tokens per step). Val loss after {args.steps} steps, eval on θ̄ after a fresh "
                       f"sync, mean over seeds {args.stream_seeds}.")
    return {"tau": tau, "rows": out, "tokens_per_step": tokens_step}


# ----------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    args = parse_args(argv)
    # Loading the config imports jax (configs import edit_jax.models.llama) but creates no backend; XLA_FLAGS is
    # read when the first backend is created, so setting the device count after this still works.
    from edit_jax.validate import load_config

    pre = load_config(args.config, [])
    n_dev = (args.replica or pre.mesh.replica) * (args.shard or pre.mesh.shard)
    common.ensure_cpu_devices(n_dev)
    devices = common.pick_devices(n_dev)
    cfg = base_config(args)
    ctx = Ctx(args, cfg, devices)
    result = {"benchmark": "bench_edit", "env": common.env_info(), "sections_run": args.sections,
              "config": {"file": os.path.relpath(args.config, common.REPO), "mesh": [cfg.mesh.replica, cfg.mesh.shard],
                         "model": dataclasses.asdict(cfg.model), "batch": cfg.batch_size, "seq": cfg.data.seq_len,
                         "tau": cfg.sync.tau, "warmup_steps": cfg.sync.warmup_steps, "overrides": args.overrides}}
    timings = {}
    for sec, fn in (("a", section_a), ("b", section_b), ("c", section_c), ("d", section_d), ("e", section_e)):
        if sec in args.sections:
            t0 = time.perf_counter()
            result[sec] = fn(ctx)
            timings[sec] = time.perf_counter() - t0
            print(f"(section {sec}: {timings[sec]:.0f} s)", flush=True)
            common.write_json(args.json, {**result, "section_seconds": timings, "compile_seconds": ctx.compile_s})
    result["section_seconds"] = timings
    result["compile_seconds"] = ctx.compile_s
    common.write_json(args.json, result)
    print(f"\nJSON: {os.path.relpath(args.json, os.getcwd())}")
    return result


if __name__ == "__main__":
    main()
