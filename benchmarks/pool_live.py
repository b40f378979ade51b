"""The kill loop's ABBA runs pooled: goodput and loss at equal tokens over runs, with 95% intervals.

    python benchmarks/pool_live.py docs/bench_faults_live_abba*.json --json docs/bench_live_pool.json

Each input is one ``bench_faults.py --part live --abba`` JSON (fault-free, live, live, fault-free).
Runs are grouped by setting (config, workers, tau_time, grace, MTBF, duration, the stop, the saves'
period, carried_weight); per group:

- goodput: each ABBA run's live / fault-free of the means (its own drift cancelled), the mean over
  runs with a Student-t interval and one-sided lower bound, and how many runs reach ``--goodput-target``;
- val loss at equal tokens: every run's θ̄ line (bench_live.abba_val_loss) read at one tally, the
  smallest last tally in the group; the live runs' mean against the fault-free runs' mean with a
  Welch interval and one-sided upper bound (each fault-free run is the same command again: their
  scatter is the bench's own noise; the bound answers "no more than x% worse"), the same per ABBA
  run (paired, t over runs), and how many runs of each kind a 95% interval of +-``--loss-target``
  would take at the scatter seen.

A single pair of 600 s runs lands 0.2-4.2% apart in loss with no fault in either (wall-clock rounds
make each run's trajectory its own), so a 1% target can only be judged over many runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common
from benchmarks.bench_live import abba_kept, abba_val_loss

SETTING = ("kill_config", "live_workers", "tau_time", "grace", "mtbf", "duration", "stop_s", "progress_every",
           "carried_weight")
DEFAULTS = {"carried_weight": 1.0, "progress_every": 0.0}  # what a field absent from an older JSON meant then
# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom; between rows linear in 1/df
T975 = ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (6, 2.447), (7, 2.365), (8, 2.306),
        (9, 2.262), (10, 2.228), (12, 2.179), (15, 2.131), (20, 2.086), (30, 2.042), (60, 2.000), (120, 1.980))
Z975 = 1.960
# the one-sided 95% bound's (the 0.95 quantile), same rows; and the normal's
T95 = ((1, 6.314), (2, 2.920), (3, 2.353), (4, 2.132), (5, 2.015), (6, 1.943), (7, 1.895), (8, 1.860),
       (9, 1.833), (10, 1.812), (12, 1.782), (15, 1.753), (20, 1.725), (30, 1.697), (60, 1.671), (120, 1.658))
Z95 = 1.645


def _t_quantile(table: tuple, z: float, df: float) -> float:
    if df < 1:
        raise ValueError(f"t quantile: df {df} < 1 (an interval needs at least two values)")
    if df >= table[-1][0]:  # toward the normal's, linear in 1 / df
        return table[-1][1] + (z - table[-1][1]) * (1 - table[-1][0] / df)
    for (d0, q0), (d1, q1) in zip(table, table[1:], strict=False):
        if d0 <= df <= d1:
            return q0 + (q1 - q0) * (1 / d0 - 1 / df) / (1 / d0 - 1 / d1)
    raise AssertionError(df)


def t975(df: float) -> float:
    """Student's t's 0.975 quantile (a two-sided 95% interval), ``df`` >= 1, not necessarily whole."""
    return _t_quantile(T975, Z975, df)


def t95(df: float) -> float:
    """Student's t's 0.95 quantile (a one-sided 95% bound), ``df`` >= 1."""
    return _t_quantile(T95, Z95, df)


def mean_interval(xs: list[float]) -> dict:
    """Mean, sample SD and the 95% t interval of the mean (None under two values)."""
    x = np.asarray(xs, dtype=float)
    out = {"n": len(x), "mean": float(x.mean()), "sd": float(x.std(ddof=1)) if len(x) > 1 else None}
    if len(x) > 1:
        se = out["sd"] / math.sqrt(len(x))
        h = t975(len(x) - 1) * se
        out["ci95"] = [out["mean"] - h, out["mean"] + h]
        out["lower95"], out["upper95"] = out["mean"] - t95(len(x) - 1) * se, out["mean"] + t95(len(x) - 1) * se
    return out


def welch(a: list[float], b: list[float]) -> dict:
    """mean(a) / mean(b) - 1 with a Welch 95% interval and one-sided 95% upper bound (the difference
    of means over mean(b); the denominator's own scatter left out: a few % of the width here)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb > 0 else float("inf")
    se = math.sqrt(va + vb) / b.mean()
    h, u = (t975(df), t95(df)) if math.isfinite(df) else (Z975, Z95)
    d = a.mean() / b.mean() - 1
    return {"rel_diff": float(d), "ci95": [float(d - h * se), float(d + h * se)], "upper95": float(d + u * se),
            "welch_df": float(df)}


def runs_for(target: float, rel_sd: float) -> int:
    """Runs of each kind for a 95% interval of the relative difference of two means as narrow as
    +-``target``, both kinds scattering by ``rel_sd`` (normal approximation: 1.96 sd sqrt(2 / n))."""
    return math.ceil(2 * (Z975 * rel_sd / target) ** 2)


def setting_of(args: dict) -> dict:
    return {k: (DEFAULTS.get(k) if args.get(k) is None else args.get(k)) for k in SETTING}


def load(path: str) -> dict:
    """One ABBA JSON: its setting, goodput, the two pairs' evaluated states and the four runs' smallest last tally."""
    with open(path) as f:
        d = json.load(f)
    live = d.get("live") or {}
    if not d.get("args", {}).get("abba") or "states_b" not in live:
        raise ValueError("not an ABBA run of bench_faults --part live (expected args.abba and live.states_b: "
                         "run it with --abba)")
    try:
        return {"file": path, "commit": d["env"].get("git_commit", "")[:7], "date_utc": d["env"].get("date_utc"),
                "setting": setting_of(d["args"]), "goodput": live["abba"]["ratio"],
                "goodput_pairs": [live["abba"]["ratio_first_pair"], live["abba"]["ratio_second_pair"]],
                "states": live["states"], "states_b": live["states_b"],
                "last_tally": min(k[-1][1] for k in abba_kept(live["states"], live["states_b"]).values())}
    except KeyError as e:
        raise ValueError(f"no field {e} (expected a complete bench_faults --part live --abba JSON)") from None


def pool(runs: list[dict], goodput_target: float = 0.95, loss_target: float = 0.01) -> dict:
    """One group's runs (one setting) pooled; see the module's docstring."""
    tally = min(r["last_tally"] for r in runs)
    rows = []
    for r in runs:
        v = abba_val_loss(r["states"], r["states_b"], tally)
        if v is None:
            raise ValueError(f"{r['file']}: a run with under 3 published rounds (expected a run of >= 3 rounds)")
        rows.append({k: r[k] for k in ("file", "commit", "date_utc", "goodput", "goodput_pairs")} |
                    {"fit": v["fit"], "loss_rel_diff_of_means": v["rel_diff_of_means"]})
    ff = [x["fit"][n] for x in rows for n in ("fault_free", "fault_free_b")]
    lv = [x["fit"][n] for x in rows for n in ("live", "live_b")]
    good = mean_interval([x["goodput"] for x in rows])
    good["runs_at_target"] = sum(x["goodput"] >= goodput_target for x in rows)
    loss = {"tally": tally, "fault_free": mean_interval(ff), "live": mean_interval(lv)}
    if len(rows) > 1:
        loss |= welch(lv, ff)
        loss["paired"] = mean_interval([x["loss_rel_diff_of_means"] for x in rows])
        rel_sd = math.sqrt((loss["fault_free"]["sd"] ** 2 + loss["live"]["sd"] ** 2) / 2) / loss["fault_free"]["mean"]
        loss["rel_sd_per_run"], loss["runs_for_target"] = rel_sd, runs_for(loss_target, rel_sd)
    return {"setting": runs[0]["setting"], "targets": {"goodput": goodput_target, "loss": loss_target},
            "runs": rows, "goodput": good, "val_loss": loss}


def group(loaded: list[dict]) -> list[list[dict]]:
    """The runs by setting, in the order each setting first appears."""
    by: dict[str, list[dict]] = {}
    for r in loaded:
        by.setdefault(json.dumps(r["setting"], sort_keys=True), []).append(r)
    return list(by.values())


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _ci(c: list | None, pct: bool) -> str:
    if not c:
        return "-"
    return f"[{_pct(c[0])}, {_pct(c[1])}]" if pct else f"[{c[0]:.3f}, {c[1]:.3f}]"


def report(groups: list[dict]) -> None:
    for g in groups:
        s = g["setting"]
        title = (f"kill loop pooled: {s['kill_config']}, {s['live_workers']} workers, MTBF {s['mtbf']} s, "
                 f"{s['duration']} s, saves every {s['progress_every']} s, carried_weight {s['carried_weight']}")
        rows = [[os.path.basename(r["file"]), r["commit"], round(r["goodput"], 3), _pct(r["loss_rel_diff_of_means"])]
                for r in g["runs"]]
        gp, vl = g["goodput"], g["val_loss"]
        if gp["n"] > 1:
            rows.append(["pooled (95% interval)", f"{gp['n']} runs", f"{gp['mean']:.3f} {_ci(gp.get('ci95'), False)}",
                         f"{_pct(vl.get('rel_diff'))} {_ci(vl.get('ci95'), True)}"])
        note = f"goodput >= {g['targets']['goodput']}: {gp['runs_at_target']} of {gp['n']} runs"
        note += f" (one-sided 95% lower bound of the mean {gp['lower95']:.3f})" if "lower95" in gp else ""
        note += f". val loss at {vl['tally']:,} tokens"
        if "rel_sd_per_run" in vl:
            note += (f"; pooled: live / fault-free of the means over all runs (Welch), one-sided 95% upper bound "
                     f"{_pct(vl['upper95'])}; paired per ABBA run {_pct(vl['paired']['mean'])} "
                     f"{_ci(vl['paired'].get('ci95'), True)}, upper bound {_pct(vl['paired']['upper95'])}")
            note += (f"; one run's scatter {100 * vl['rel_sd_per_run']:.2f}%: a +-{100 * g['targets']['loss']:g}% "
                     f"interval takes ~{vl['runs_for_target']} runs of each kind")
        common.print_table(title, ["ABBA run", "commit", "live / fault-free tokens/s", "val loss, live vs fault-free"],
                           rows, note)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="bench_faults --part live --abba JSONs")
    p.add_argument("--goodput-target", type=float, default=0.95)
    p.add_argument("--loss-target", type=float, default=0.01, help="relative (0.01: 1%%)")
    p.add_argument("--json", default=os.path.join(common.DEFAULT_JSON_DIR, "pool_live.json"))
    args = p.parse_args(argv)
    loaded = []
    for path in args.inputs:
        try:
            loaded.append(load(path))
        except (OSError, ValueError) as e:  # (load names a missing field as a ValueError)
            print(f"pool_live: skipping {path}: {e}", file=sys.stderr)
    if not loaded:
        p.error("no ABBA run among the inputs")
    try:
        groups = [pool(g, args.goodput_target, args.loss_target) for g in group(loaded)]
    except ValueError as e:
        p.error(str(e))
    report(groups)
    common.write_json(args.json, {"env": common.env_info(), "args": vars(args), "groups": groups})
    return 0


if __name__ == "__main__":
    sys.exit(main())
