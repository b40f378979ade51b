"""Running and reporting placement searches: ``run_searches`` (ours plus the baselines, at the same
number of evaluations), ``build_report`` / ``print_report`` (the JSON report and its printout, see
``cli``'s docstring for the keys) and ``plot_convergence`` (best cost vs evaluations). Used by
``edit-jax placement`` and ``benchmarks/reproduce_placement.py``."""

from __future__ import annotations

from collections import Counter

import numpy as np

from edit_jax.placement.cost import DtfmCostModel
from edit_jax.placement.search import genetic_search, random_placement_search, random_search
from edit_jax.placement.topology import Topology

RANDOM_PLACEMENT_SAMPLES = 1000  # for the reported mean step time of a random placement


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
        for j, (group, dp) in enumerate(zip(report["groups"], report["group_dp_costs"], strict=True)):
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
