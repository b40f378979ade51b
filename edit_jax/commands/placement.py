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

from edit_jax.placement.cost import DtfmCostModel, GPT3_XL_C_DP_GB, GPT3_XL_C_PP_GB
from edit_jax.placement.edit_cost import EditCostModel
from edit_jax.placement.report import build_report, plot_convergence, print_report, run_searches
from edit_jax.placement.topology import SCENARIOS, PlacementError, load_topology, scenario
from edit_jax.exit_codes import EXIT_BAD_INPUT


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the epilog's layout and show every option's default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edit-jax placement", description=__doc__.split("\n\n")[0].replace("``", ""),  # the terminal's
        epilog=__doc__[__doc__.index("Network:"):].replace("``", ""), formatter_class=_HelpFormatter)  # text, not RST
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
        return EXIT_BAD_INPUT


def _check_option(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise PlacementError(f"{field}: {message}")


def _check_writable_file(path: str, option: str) -> None:
    """``path`` can be written: opened for appending (and removed again if this made it), so that a
    directory in its place or a read-only file system is one message before the search runs."""
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise PlacementError(f"{option}: cannot write {path!r}: {e.strerror or e}") from e
    if not existed:
        os.remove(path)


def _run(args) -> int:
    _check_option(args.evaluations >= 2, "--evaluations", f"must be >= 2, got {args.evaluations}")
    _check_option(args.population >= 2, "--population", f"must be >= 2, got {args.population}")
    topology = scenario(args.scenario) if args.scenario else load_topology(args.topology)
    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            _check_option(os.path.isdir(folder), option, f"directory {folder!r} does not exist")
            _check_writable_file(path, option)  # before the search, not after it
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
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(report, fh, indent=1)
        except OSError as e:  # e.g. the disk filled since the check
            raise PlacementError(f"--json: cannot write {args.json!r}: {e.strerror or e}") from e
        print(f"placement written to {args.json}")
    if args.plot:
        plot_convergence({r.method: r.curve for r in results.values()}, args.plot,
                         f"{topology.name}, {args.objective} objective, seed {args.seed}")
        print(f"convergence plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
