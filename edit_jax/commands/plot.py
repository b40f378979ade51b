"""Training curves and sync statistics of run dirs: ``edit-jax plot``.

    edit-jax plot runs/edit runs/diloco --out plots/compare.png [--x tokens|time|step] [--label NAME ...]

Reads each run dir's ``config.json`` and ``metrics.jsonl`` (train.py writes them) and draws, one
colour per run:

1. training loss (a light moving average, the raw records thin behind it) and validation loss
   (markers) against tokens (step x batch_size x data.seq_len), training time or step;
2. per worker, the norm of the pseudo gradient at each sync (one line per worker; a red x where a
   worker had a flagged unit);
3. per worker, its weight in the sync (thin), and the sync's clip factor (thick).

Panels 2 and 3 only exist when a run has sync records; a run without (the baseline) is named in a
note there. Runs are labelled by method plus the config keys whose values differ among the
plotted runs (``edit outer.lr=0.5``); a single run by method and mesh.

A killed run's cut last line is skipped; a record repeated for the same step (a resume that redid
steps) counts once, the last one written. matplotlib is imported only when a figure is drawn, and
without pyplot (a bare Agg figure), so neither ``import edit_jax`` nor a caller's pyplot backend is
touched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edit_jax.localsgd.methods import METHODS
from edit_jax.exit_codes import EXIT_BAD_INPUT

X_AXES = ("tokens", "time", "step")
# Config keys that change how a run is logged or kept, not what it learns: never in a label.
NOISE_KEYS = frozenset({"log_every", "checkpoint_every", "keep_checkpoints", "log.tensorboard", "log.peak_tflops",
                        "mesh.heartbeat_seconds", "debug.pin_cores"})
WIDTH_IN, PANEL_IN, DPI = 10.0, 3.2, 100  # figure width and height per panel (inches), dots per inch


class PlotError(ValueError):
    """A run dir that cannot be plotted, or a bad argument (the CLI exits with 2)."""


@dataclass
class Run:
    path: str
    config: dict
    train: list[dict]  # training records, one per step (multi-process runs: the workers' mean)
    evals: list[dict]  # evaluation records, one per step
    syncs: list[dict]  # sync records, one per step
    label: str = ""
    rounds: list[dict] = field(default_factory=list)  # exchange-mode A-EDiT: who was in each round


# ----------------------------------------------------------------------------- reading


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise PlotError(f"{path}: not found; expected {what}") from None
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 text at all
        raise PlotError(f"{path}: cannot read {what}: {e}") from None


def read_records(path: str) -> list[dict]:
    """The JSON objects of a metrics.jsonl, in file order. Lines that do not parse are skipped:
    the last one of a killed run is usually cut (train.MetricsLog does the same on resume). A
    line that is not UTF-8 text (damaged bytes) is one lost record too, not a reason to lose the
    plot of all the others: skipped the same way."""
    try:
        with open(path, "rb") as f:  # bytes: each line decoded on its own
            lines = f.readlines()
    except FileNotFoundError:
        raise PlotError(f"{path}: not found; expected the metrics.jsonl that `edit-jax train` writes") from None
    except OSError as e:
        raise PlotError(f"{path}: cannot read: {e}") from None
    records = []
    for line in lines:
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)):
            records.append(rec)
    return records


def _last_per_key(records: list[dict], key) -> list[dict]:
    """One record per ``key(rec)``, the last written (a resume may log a step again), by step."""
    last = {key(r): r for r in records}
    return sorted(last.values(), key=lambda r: r["step"])


def _mean_over_workers(records: list[dict]) -> list[dict]:
    """Multi-process runs log one training record per worker and step: one record per step, loss
    the workers' mean, step time the slowest worker's (the run moves at its pace)."""
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    return [{"step": s, "loss": float(np.mean([r["loss"] for r in rs])),
             "step_time": max(r.get("step_time", 0.0) for r in rs), "workers": len(rs)}
            for s, rs in sorted(by_step.items())]


def load_run(run_dir: str, label: str | None = None) -> Run:
    """Reads a run dir written by ``edit-jax train``. Raises ``PlotError`` naming the path and what
    was expected when config.json or metrics.jsonl is missing or holds no training loss."""
    if not os.path.isdir(run_dir):
        raise PlotError(f"{run_dir}: not a directory; expected a run dir of `edit-jax train` "
                        "(config.json, metrics.jsonl)")
    config = _read_json(os.path.join(run_dir, "config.json"), "the run's config (written by `edit-jax train`)")
    if not isinstance(config, dict) or not isinstance(config.get("sync"), dict):
        raise PlotError(f"{os.path.join(run_dir, 'config.json')}: expected an edit-jax config (with a 'sync' "
                        "section), got something else")
    records = read_records(os.path.join(run_dir, "metrics.jsonl"))
    train = [r for r in records if "loss" in r and not r.get("sync")]
    if not train:
        raise PlotError(f"{os.path.join(run_dir, 'metrics.jsonl')}: no training loss records (a run that "
                        "stopped before its first logged step?)")
    train = _last_per_key(train, lambda r: (r.get("worker", 0), r["step"]))
    if any("worker" in r for r in train):
        train = _mean_over_workers(train)
    evals = _last_per_key([r for r in records if "val_loss" in r], lambda r: r["step"])
    syncs = _last_per_key([r for r in records if r.get("sync") and "pseudo_grad_norm" in r], lambda r: r["step"])
    rounds = sorted((r for r in records if r.get("sync") and "members" in r), key=lambda r: r["round"])
    return Run(path=run_dir, config=config, train=train, evals=evals, syncs=syncs, label=label or "", rounds=rounds)


# ----------------------------------------------------------------------------- labels


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"sync": {"tau": 4}} -> {"sync.tau": 4}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _fmt(v: Any) -> str:
    """A value as an override would write it: true, 0.5, a,b."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(_fmt(x) for x in v)
    return str(v)


def _method(config: dict) -> str:
    return str(config.get("sync", {}).get("method", "?"))


def _bears_on(key: str, method: str) -> bool:
    """Whether ``key`` is this method's choice: not for a sync field the method fixes (its name
    already says so: baseline vs edit is not a label "anomaly=false"), nor any sync field of a
    method without syncs."""
    if not key.startswith("sync."):
        return True
    m = METHODS.get(method)
    if m is None:  # a method this version does not know: show everything
        return True
    return m.keeps_outer and key[len("sync."):] not in m.fixed


def _shortest_tail(key: str, keys: set[str]) -> str:
    """The fewest last parts of ``key`` no other key of ``keys`` ends in (``outer.lr``: ``lr`` is
    also ``optim.lr``'s), else the whole key."""
    parts = key.split(".")
    for n in range(1, len(parts)):
        tail = ".".join(parts[-n:])
        if sum(k == tail or k.endswith("." + tail) for k in keys) == 1:
            return tail
    return key


def run_labels(configs: list[dict], paths: list[str] | None = None) -> list[str]:
    """Method plus the keys whose values differ among the runs (``diloco seed=1``); one run:
    method and mesh. Keys are shortened to their fewest last parts that no other key ends in. Runs
    whose labels still coincide (the same config twice) get their dir's name from ``paths``."""
    methods = [_method(c) for c in configs]
    if len(configs) == 1:
        mesh = configs[0].get("mesh", {})
        procs = mesh.get("processes", 1)
        return [f"{methods[0]} mesh {mesh.get('replica', '?')}x{mesh.get('shard', '?')}"
                + (f", {procs} processes" if procs and procs > 1 else "")]
    flats = [flatten(c) for c in configs]
    keys = sorted(set().union(*flats) - NOISE_KEYS - {"sync.method"})
    missing = "(unset)"
    differing = [k for k in keys
                 if len({_fmt(f.get(k, missing)) for f, m in zip(flats, methods, strict=True) if _bears_on(k, m)}) > 1]
    everything = set().union(*flats)
    short = {k: _shortest_tail(k, everything) for k in differing}
    labels = []
    for f, m in zip(flats, methods, strict=True):
        parts = [f"{short[k]}={_fmt(f.get(k, missing))}" for k in differing if _bears_on(k, m)]
        labels.append(" ".join([m] + [p if len(p) <= 40 else p[:37] + "..." for p in parts]))
    if paths:
        labels = [f"{label} [{os.path.basename(os.path.normpath(path)) or path}]" if labels.count(label) > 1
                  else label for label, path in zip(labels, paths, strict=True)]
    return labels


# ----------------------------------------------------------------------------- axes


def _x_mapper(run: Run, x: str):
    """step -> tokens, seconds of training or step. Time is the sum of the training records' step
    times (evaluation excluded; it restarts with nothing on resume, unlike the records' "time"),
    interpolated for evaluation and sync steps."""
    if x == "step":
        return lambda steps: np.asarray(steps, dtype=float)
    if x == "tokens":
        per_step = run.config.get("batch_size", 0) * run.config.get("data", {}).get("seq_len", 0)
        if not per_step:
            raise PlotError(f"{run.path}/config.json: no batch_size / data.seq_len to count tokens; use --x step")
        return lambda steps: np.asarray(steps, dtype=float) * per_step
    steps, elapsed, prev = [0.0], [0.0], 0
    for r in run.train:
        elapsed.append(elapsed[-1] + r.get("step_time", 0.0) * (r["step"] - prev))
        steps.append(float(r["step"]))
        prev = r["step"]
    return lambda s: np.interp(np.asarray(s, dtype=float), steps, elapsed)


X_LABELS = {"tokens": "tokens", "time": "training time (s, evaluation excluded)", "step": "step"}


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the first points average what there is)."""
    if window <= 1 or len(y) == 0:
        return y
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def _per_worker(syncs: list[dict], name: str) -> np.ndarray:
    """[syncs, workers] of a per-worker sync field (NaN where a record lacks it)."""
    rows = [np.atleast_1d(np.asarray(s.get(name, np.nan), dtype=float)) for s in syncs]
    n = max(len(r) for r in rows)
    return np.array([np.pad(r, (0, n - len(r)), constant_values=np.nan) for r in rows])


WORKER_STYLES = ("-", "--", "-.", ":")


def make_figure(runs: list[Run], x: str = "tokens"):
    """The figure (a matplotlib Figure, not yet saved): loss panel, and the sync panels if any run
    synced. Its axes carry the data, so tests can look at what was drawn."""
    from matplotlib.figure import Figure  # lazily: only plotting needs matplotlib

    if x not in X_AXES:
        raise PlotError(f"--x {x!r}: expected one of {', '.join(X_AXES)}")
    synced = [r for r in runs if r.syncs]
    n_panels = (3 if synced else 1) + any(r.rounds for r in runs)
    fig = Figure(figsize=(WIDTH_IN, PANEL_IN * n_panels + 0.4), dpi=DPI, layout="constrained")
    axes = fig.subplots(n_panels, 1, sharex=True, squeeze=False)[:, 0]
    colors = [f"C{i % 10}" for i in range(len(runs))]

    ax = axes[0]
    for run, color in zip(runs, colors, strict=True):
        to_x = _x_mapper(run, x)
        steps = np.array([r["step"] for r in run.train], dtype=float)
        loss = np.array([r["loss"] for r in run.train], dtype=float)
        ax.plot(to_x(steps), loss, color=color, linewidth=0.6, alpha=0.35)
        ax.plot(to_x(steps), smooth(loss, max(1, len(loss) // 20)), color=color, linewidth=1.6,
                label=f"{run.label} (train)")
        if run.evals:
            ev = np.array([[r["step"], r["val_loss"]] for r in run.evals], dtype=float)
            ax.plot(to_x(ev[:, 0]), ev[:, 1], color=color, linestyle=":", marker="o", markersize=5,
                    label=f"{run.label} (val)")
    ax.set_ylabel("loss")
    ax.set_title("training loss (moving average; raw thin) and validation loss (markers)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)

    if synced:
        norm_ax, weight_ax = axes[1], axes[2]
        # The clip factor (1 = no clip, far below when clipping) on its own scale: on the weights'
        # axis a change of the weights (~1/N each) could not be seen beside it.
        clip_ax = weight_ax.twinx()
        for run, color in zip(runs, colors, strict=True):
            if not run.syncs:
                continue
            to_x = _x_mapper(run, x)
            xs = to_x([s["step"] for s in run.syncs])
            norms, weights = _per_worker(run.syncs, "pseudo_grad_norm"), _per_worker(run.syncs, "weight")
            flagged = _per_worker(run.syncs, "flagged")
            for w in range(norms.shape[1]):
                style = WORKER_STYLES[w % len(WORKER_STYLES)]
                norm_ax.plot(xs, norms[:, w], color=color, linestyle=style, linewidth=1.0,
                             label=run.label if w == 0 else None)
                hit = flagged[:, w] > 0 if w < flagged.shape[1] else np.zeros(len(xs), bool)
                if hit.any():
                    norm_ax.plot(xs[hit], norms[hit, w], linestyle="none", marker="x", color="red", markersize=8,
                                 markeredgewidth=2)
                if w < weights.shape[1]:
                    weight_ax.plot(xs, weights[:, w], color=color, linestyle=style, linewidth=0.8, alpha=0.7)
            clip = np.array([s.get("clip_factor", np.nan) for s in run.syncs], dtype=float)
            clip_ax.plot(xs, clip, color=color, linewidth=2.2, marker="s", markersize=3, alpha=0.6, label=run.label)
        norm_ax.set_ylabel("pseudo-gradient norm")
        norm_ax.set_title("pseudo-gradient norm per worker at each sync (line style = worker: -, --, -., :); "
                          "red x: a unit of that worker flagged as an anomaly", fontsize=9)
        weight_ax.set_ylabel("worker weight (thin)")
        clip_ax.set_ylabel("clip factor (thick squares)")
        weight_ax.set_title("worker weights (thin, left axis; line style = worker) and clip factor (thick squares, "
                            "right axis; 1 = no clip)", fontsize=9)
        for a in (norm_ax, weight_ax):
            a.grid(alpha=0.3)
        norm_ax.legend(fontsize=7)
        clip_ax.legend(fontsize=7)
        quiet = [r.label for r in runs if not r.syncs]
        if quiet:  # say why a plotted run is missing here (a baseline never syncs)
            norm_ax.text(0.01, 0.02, "no sync records: " + "; ".join(quiet), transform=norm_ax.transAxes,
                         fontsize=7, color="0.3", va="bottom")
    if any(r.rounds for r in runs):
        _membership(axes[-1], runs, colors, x)
    axes[-1].set_xlabel(X_LABELS[x])
    return fig


def _membership(ax, runs: list[Run], colors: list[str], x: str) -> None:
    """Exchange-mode A-EDiT: a mark at (round, worker) for each round's member, the runs side by
    side within a worker's row (workers that left, stalled or joined show as gaps)."""
    for i, (run, color) in enumerate(zip(runs, colors, strict=True)):
        if not run.rounds:
            continue
        to_x = _x_mapper(run, x)
        xs = to_x([r["step"] for r in run.rounds])
        offset = 0.15 * (i - (len(runs) - 1) / 2)
        for at, r in zip(xs, run.rounds, strict=True):
            ax.plot([at] * len(r["members"]), np.asarray(r["members"], dtype=float) + offset, linestyle="none",
                    marker="|", markersize=8, color=color)
        ax.plot([], [], linestyle="none", marker="|", color=color, label=run.label)
    slots = max(w for run in runs for r in run.rounds for w in r["members"]) + 1
    ax.set_yticks(range(slots))
    ax.set_ylim(-0.5, slots - 0.5)
    ax.set_ylabel("worker")
    ax.set_title("round membership: a mark per round per worker that took part", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


# ----------------------------------------------------------------------------- entry points


def plot_runs(run_dirs: list[str], out: str, labels: list[str] | None = None, x: str = "tokens") -> str:
    """Loads ``run_dirs``, draws them and writes the figure to ``out`` (its format from the
    extension: .png, .pdf, .svg). Returns ``out``. Raises ``PlotError`` on bad input."""
    if not run_dirs:
        raise PlotError("no run dirs given")
    if x not in X_AXES:
        raise PlotError(f"--x {x!r}: expected one of {', '.join(X_AXES)}")
    if labels and len(labels) != len(run_dirs):
        raise PlotError(f"{len(labels)} labels for {len(run_dirs)} run dirs: give one --label per run dir, or none")
    runs = [load_run(d) for d in run_dirs]
    names = labels or run_labels([r.config for r in runs], run_dirs)
    for run, name in zip(runs, names, strict=True):
        run.label = name
    fig = make_figure(runs, x)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(out, dpi=DPI)
    except (OSError, ValueError) as e:  # ValueError: an extension matplotlib has no writer for
        raise PlotError(f"cannot write {out}: {e}") from None
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edit-jax plot",
                                     description="Plot the loss curves and sync statistics of run dirs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs of `edit-jax train`")
    parser.add_argument("--out", required=True, help="image file to write (.png; .pdf and .svg work too)")
    parser.add_argument("--x", default="tokens", choices=X_AXES,
                        help="x axis: tokens (step x batch_size x data.seq_len; default), time (training "
                             "seconds), step")
    parser.add_argument("--label", action="extend", nargs="+", default=None, metavar="NAME",
                        help="legend names of the runs, one per RUN_DIR in order: `--label A B` after the run "
                             "dirs, or `--label A --label B` (default: method + the config keys that differ)")
    args = parser.parse_intermixed_args(argv)
    try:
        path = plot_runs(args.run_dirs, args.out, labels=args.label, x=args.x)
    except PlotError as e:
        print(f"edit-jax: plot error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(path)
    return 0


__all__ = ["Run", "PlotError", "load_run", "read_records", "run_labels", "make_figure", "plot_runs", "main"]
