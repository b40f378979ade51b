"""``edit-jax placement``: place a training job on a heterogeneous network.

Usage::

    edit-jax placement --scenario world [--objective dtfm|edit] [--seed 0] [--evaluations 5000]
                       [--json out.json] [--plot curves.png]
    edit-jax placement --topology net.json --objective edit --replica 8 --shard 8 --tau 128 \\
                       --params 1.3e9 [--async] --json placement.json

Network: ``--scenario`` one of ondemand, spot, multi_dc, regional, world (the DT-FM paper's cases
1-5, 64 GPUs each), or ``--topology FILE``:

* JSON: {"delay_ms": N x N, "bandwidth_gbps": N x N, optional "speed_tflops": [N],
  "memory_gb": [N], "regions": [N names], "name": str}. Delay >= 0 ms, bandwidth > 0 Gbit/s off
  the diagonal (the diagonal is ignored); asymmetric links are averaged.
* CSV: lines ``src,dst,delay_ms,bandwidth_gbps`` (0-based device indices, optional header, every
  pair at least once; both directions are averaged).

Objectives:

* ``dtfm`` (default): DT-FM's model, total = DP + 2 PP for a D_PP x D_DP (pipeline stages x
  data-parallel ways) layout, ``--stages`` D_PP (default 8). The JSON's device_order is the
  (pipeline, stage) grid flattened row-major, ``mesh_shape`` = [D_DP, D_PP]: row i is pipeline i
  (one model copy, like an EDiT replica), column j its j-th stage in pipeline order, so
  device_order[i * D_PP + j] = device of pipeline i at stage j.
* ``edit``: EDiT's (replica, shard) mesh (``--replica N --shard S --tau T --params P``, ``--async``
  for A-EDiT's throughput objective). device_order[r * S + s] = device of replica r, shard s;
  ``mesh_shape`` = [N, S], as the training mesh (rows = replicas) expects.

The search is the hybrid GA (``search.py``); the baselines, run at the same number of objective
evaluations, are the Kernighan-Lin GA, random placement (as the reference scores it) and random
partitions scored by the full model. Errors in inputs print a message naming the field or file and
exit with code 2.

JSON keys: objective, network, seed, evaluations, cost, dp_cost, pp_cost, seconds (wall clock of our
search; cpu_seconds: its CPU time), device_order,
mesh_shape, groups, baselines {name: {cost, seconds}}, kernighan_lin_cost, random_cost,
random_partitions_cost, and objective-specific details (stage_order, hop costs; for edit: step
times, sync seconds, random placement mean). For ``edit``, dp_cost is the cross-replica sync cost
per step (sync / tau) and pp_cost the slowest replica's per-step FSDP communication.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

from edit_jax.placement.cost import DtfmCostModel, GPT3_XL_C_DP_GB, GPT3_XL_C_PP_GB
from edit_jax.placement.edit_cost import EditCostModel
from edit_jax.placement.search import genetic_search, random_placement_search, random_search
from edit_jax.placement.topology import SCENARIOS, PlacementError, Topology, load_topology, scenario

RANDOM_PLACEMENT_SAMPLES = 1000  # for the reported mean step time of a random placement


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the epilog's layout and show every option's default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edit-jax placement", description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Network:"):], formatter_class=_HelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--scenario", help=f"built-in network: {', '.join(SCENARIOS)} (or 1-5)")
    where.add_argument("--topology", metavar="FILE", help="network file, JSON or CSV (formats below)")
    parser.add_argument("--objective", choices=["dtfm", "edit"], default="dtfm",
                        help="DT-FM pipeline x data-parallel layout, or EDiT's (replica, shard) mesh")
    parser.add_argument("--seed", type=int, default=0, help="seeds every search (numpy Generator)")
    parser.add_argument("--evaluations", type=int, default=5000, help="objective evaluations per search")
    parser.add_argument("--population", type=int, default=100, help="GA population size")
    parser.add_argument("--json", metavar="FILE", help="write the placement and its costs here")
    parser.add_argument("--plot", metavar="FILE.png", help="convergence curves of the searches")
    parser.add_argument("--no-baselines", action="store_true", help="skip the baseline searches")
    dtfm = parser.add_argument_group("dtfm objective")
    dtfm.add_argument("--stages", type=int, default=8, help="D_PP pipeline stages (D_DP = devices / D_PP)")
    dtfm.add_argument("--c-dp", type=float, default=GPT3_XL_C_DP_GB, help="gradient GB per stage")
    dtfm.add_argument("--c-pp", type=float, default=GPT3_XL_C_PP_GB, help="activation GB per hop")
    edit = parser.add_argument_group("edit objective")
    edit.add_argument("--replica", type=int, default=8, help="N replicas (mesh rows)")
    edit.add_argument("--shard", type=int, default=None, help="S devices per replica (default devices / N)")
    edit.add_argument("--tau", type=int, default=128, help="inner steps between syncs")
    edit.add_argument("--params", type=float, default=1.3e9, help="model parameters")
    edit.add_argument("--async", dest="asynchronous", action="store_true", help="A-EDiT throughput objective")
    edit.add_argument("--tokens-per-device", type=int, default=4096, help="tokens per device per step")
    edit.add_argument("--overlap", type=float, default=0.0, help="fraction of the sync hidden by overlap")
    edit.add_argument("--compression", type=float, default=1.0, help="pseudo-gradient compression ratio")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return _run(args)
    except PlacementError as exc:
        print(f"edit-jax placement: error: {exc}", file=sys.stderr)
        return 2


def _check_option(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise PlacementError(f"{field}: {message}")


def _run(args) -> int:
    _check_option(args.evaluations >= 2, "--evaluations", f"must be >= 2, got {args.evaluations}")
    _check_option(args.population >= 2, "--population", f"must be >= 2, got {args.population}")
    topology = scenario(args.scenario) if args.scenario else load_topology(args.topology)
    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            _check_option(os.path.isdir(folder), option, f"directory {folder!r} does not exist")
    if args.objective == "dtfm":
        n = topology.num_devices
        _check_option(args.stages >= 1 and n % args.stages == 0, "--stages",
                      f"{args.stages} does not divide the {n} devices of {topology.name}")
        _check_option(args.c_dp > 0 and args.c_pp > 0, "--c-dp/--c-pp", "message sizes must be > 0")
        objective = DtfmCostModel(topology, d_pp=args.stages, c_dp_gb=args.c_dp, c_pp_gb=args.c_pp)
    else:
        shard = args.shard if args.shard is not None else topology.num_devices // max(args.replica, 1)
        objective = EditCostModel(topology, args.replica, shard, tau=args.tau, params=args.params,
                                  asynchronous=args.asynchronous, tokens_per_device=args.tokens_per_device,
                                  overlap=args.overlap, compression=args.compression)
    results = run_searches(objective, args.evaluations, args.seed, args.population, baselines=not args.no_baselines)
    report = build_report(objective, topology, results, args)
    print_report(report, objective, topology)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
        print(f"placement written to {args.json}")
    if args.plot:
        plot_convergence({r.method: r.curve for r in results.values()}, args.plot,
                         f"{topology.name}, {args.objective} objective, seed {args.seed}")
        print(f"convergence plot written to {args.plot}")
    return 0


def run_searches(objective, evaluations: int, seed: int, population: int = 100, baselines: bool = True) -> dict:
    """Ours plus, optionally, the three baselines; each gets its own seeded stream."""
    streams = np.random.SeedSequence(seed).spawn(4)
    rng = [np.random.default_rng(s) for s in streams]
    results = {"ours": genetic_search(objective, evaluations, rng[0], population=population)}
    if baselines:
        results["kernighan-lin"] = genetic_search(objective, evaluations, rng[1], gain="kl", structured=False,
                                                  swaps=False, population=population)
        results["random"] = random_placement_search(objective, evaluations, rng[2])
        results["random-partitions"] = random_search(objective, evaluations, rng[3])
    return results


def _region_summary(topology: Topology, devices) -> str:
    if not topology.regions:
        return ""
    counts = Counter(topology.regions[d] for d in devices)
    return ", ".join(f"{name} x{c}" if c > 1 else name for name, c in counts.items())


def build_report(objective, topology: Topology, results: dict, args) -> dict:
    ours = results["ours"]
    report: dict = {"objective": args.objective, "network": topology.name, "num_devices": topology.num_devices,
                    "seed": args.seed, "evaluations": args.evaluations}
    if isinstance(objective, DtfmCostModel):
        layout = objective.layout(ours.labels)
        report.update(cost=layout.cost, dp_cost=layout.dp_cost, pp_cost=layout.pp_cost,
                      seconds=ours.seconds, device_order=layout.grid.ravel().tolist(),
                      mesh_shape=[objective.d_dp, objective.d_pp],
                      mesh_axes=["pipeline (data-parallel way)", "stage (pipeline order)"],
                      stage_order=[int(g) for g in layout.stage_order],
                      groups=[layout.grid[:, j].tolist() for j in range(objective.d_pp)],
                      group_dp_costs=[float(layout.group_dp_costs[g]) for g in layout.stage_order],
                      hop_costs=layout.edge_costs)
    else:
        layout = objective.layout(ours.labels)
        rng = np.random.default_rng(np.random.SeedSequence(args.seed).spawn(5)[4])
        random_costs = np.array([objective.grid_cost(objective.random_grid(rng))
                                 for _ in range(RANDOM_PLACEMENT_SAMPLES)])
        report.update(cost=layout.cost, dp_cost=layout.sync_per_step, pp_cost=float(layout.replica_fsdp.max()),
                      seconds=ours.seconds, device_order=layout.grid.ravel().tolist(),
                      mesh_shape=[objective.replicas, objective.shard], mesh_axes=["replica", "shard"],
                      groups=layout.grid.tolist(), idle=layout.idle.tolist(),
                      asynchronous=objective.asynchronous, tau=objective.tau, params=objective.params,
                      replica_step_seconds=layout.replica_step.tolist(),
                      replica_compute_seconds=layout.replica_compute.tolist(),
                      replica_fsdp_seconds=layout.replica_fsdp.tolist(),
                      sync_seconds=layout.sync_seconds, sync_per_step_seconds=layout.sync_per_step,
                      throughput_tokens_per_s=layout.throughput_tokens_per_s,
                      random_placement_mean_cost=float(random_costs.mean()),
                      random_placement_samples=RANDOM_PLACEMENT_SAMPLES,
                      speedup_vs_random_placement=float(random_costs.mean() / layout.cost))
    report["cpu_seconds"] = ours.cpu_seconds
    report["baselines"] = {name: {"cost": r.cost, "seconds": r.seconds, "cpu_seconds": r.cpu_seconds,
                                  "evaluations": r.evaluations}
                           for name, r in results.items() if name != "ours"}
    for name in ("kernighan-lin", "random", "random-partitions"):
        if name in results:
            report[name.replace("-", "_") + "_cost"] = results[name].cost
    return report


def print_report(report: dict, objective, topology: Topology) -> None:
    print(f"network {topology.name} ({topology.num_devices} devices), objective {report['objective']}, "
          f"seed {report['seed']}, {report['evaluations']} evaluations per search")
    if report["objective"] == "dtfm":
        print(f"layout: {objective.d_pp} stages (data-parallel groups) in pipeline order")
        for j, (group, dp) in enumerate(zip(report["groups"], report["group_dp_costs"])):
            regions = _region_summary(topology, group)
            print(f"  stage {j}: devices {sorted(group)}  DP {dp:.3f}s" + (f"  [{regions}]" if regions else ""))
        print(f"pipelines (rows of the mesh, {report['mesh_shape'][0]} x {report['mesh_shape'][1]}):")
        for i in range(report["mesh_shape"][0]):
            row = report["device_order"][i * objective.d_pp:(i + 1) * objective.d_pp]
            print(f"  pipeline {i}: {row}")
        hops = " + ".join(f"{h:.3f}" for h in report["hop_costs"])
        print(f"cost: total {report['cost']:.3f} = DP {report['dp_cost']:.3f} + 2 x PP {report['pp_cost']:.3f}"
              f"  (PP hops {hops})")
    else:
        kind = "A-EDiT equivalent step time" if report["asynchronous"] else "EDiT step time"
        print(f"layout: {objective.replicas} replicas x {objective.shard} shards "
              "(rows = replicas, columns = sync groups)")
        for r, row in enumerate(report["groups"]):
            regions = _region_summary(topology, row)
            print(f"  replica {r}: {row}  step {report['replica_step_seconds'][r]:.3f}s (compute "
                  f"{report['replica_compute_seconds'][r]:.3f} + FSDP {report['replica_fsdp_seconds'][r]:.3f})"
                  + (f"  [{regions}]" if regions else ""))
        for k in range(objective.shard):
            column = [row[k] for row in report["groups"]]
            regions = _region_summary(topology, column)
            print(f"  sync group {k}: {column}" + (f"  [{regions}]" if regions else ""))
        if report["idle"]:
            print(f"  idle: {report['idle']}")
        print(f"cost: {kind} {report['cost']:.3f}s = slowest replica + sync {report['sync_seconds']:.3f}s"
              f" / tau {report['tau']} (x (1 - overlap)) = {report['sync_per_step_seconds']:.4f}s per step;"
              f" throughput {report['throughput_tokens_per_s']:.0f} tokens/s")
        print(f"random placement ({report['random_placement_samples']} samples): mean {kind} "
              f"{report['random_placement_mean_cost']:.3f}s, {report['speedup_vs_random_placement']:.2f}x ours")
    if report["baselines"]:
        print("baselines (same number of evaluations):")
        labels = {"kernighan-lin": "Kernighan-Lin GA", "random": "random placement (reference)",
                  "random-partitions": "random partitions + model"}
        for name, entry in report["baselines"].items():
            print(f"  {labels.get(name, name):30s} {entry['cost']:10.3f}   ({entry['seconds']:.1f}s)")
    print(f"search time (ours): {report['seconds']:.1f}s wall, {report['cpu_seconds']:.1f}s CPU")


def plot_convergence(curves: dict, path: str, title: str, ax=None) -> None:
    """Best cost vs evaluations, one line per search (the paper's convergence figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(6, 4))
    styles = {"ours": ("C0", "-"), "kernighan-lin": ("C1", "-"), "random": ("C2", "-"),
              "random-partitions": ("C2", ":")}
    labels = {"ours": "ours (paper gain + structured seeds + swaps)", "kernighan-lin": "Kernighan-Lin GA",
              "random": "random placement", "random-partitions": "random partitions + model",
              "ours-no-seeds": "ours without structured seeds"}
    for name, curve in curves.items():
        color, style = styles.get(name, (None, "--"))
        ax.plot(np.arange(1, len(curve) + 1), curve, color=color, linestyle=style, label=labels.get(name, name))
    ax.set_xlabel("evaluations")
    ax.set_ylabel("best cost (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if own:
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
