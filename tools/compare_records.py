#!/usr/bin/env python
"""Do two sets of runs write the same records? For a refactor that must change no behaviour.

    python tools/compare_records.py RUNS_BEFORE RUNS_AFTER [--per-worker]

Each argument is a folder of run dirs (``NAME/metrics.jsonl``); runs of the same NAME are compared
record by record with the timing fields left out (throughput, step and wall times, MFU, whether a
step included a compile). ``--per-worker``: A-EDiT's records, whose interleaving and sync points
follow the wall clock, are compared per worker up to the first record that differs, and that
record is named. Exit 0 when every lock-step run is equal."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

TIMING = ("time", "second", "tokens_per", "mfu", "compile")  # in a key's name: a timing field


def _timing(key: str) -> bool:
    return any(t in key for t in TIMING) or key.endswith("_s")


# The learning rate a record reports is computed on the host in float64 since 2026-11-29 (optax's
# float32 before): the same schedule to ~1e-6, not to the bit. The training math is unchanged.
CLOSE = {"lr": 1e-5}


def _same(x: dict, y: dict) -> bool:
    if set(x) != set(y):
        return False
    return all(x[k] == y[k] or (k in CLOSE and isinstance(x[k], float) and isinstance(y[k], float)
                                and math.isclose(x[k], y[k], rel_tol=CLOSE[k])) for k in x)


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not _timing(k)} for line in f]


def compare(a: list[dict], b: list[dict]) -> str | None:
    """None when equal, else the first difference."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if not _same(x, y):
            keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            return f"record {i}: " + ", ".join(f"{k} {x.get(k)!r} vs {y.get(k)!r}" for k in keys[:4])
    return None if len(a) == len(b) else f"{len(a)} vs {len(b)} records"


def per_worker(a: list[dict], b: list[dict]) -> str:
    out = []
    for w in sorted({r.get("worker", -1) for r in a}):
        ra, rb = [r for r in a if r.get("worker", -1) == w], [r for r in b if r.get("worker", -1) == w]
        n = next((i for i, (x, y) in enumerate(zip(ra, rb, strict=False)) if not _same(x, y)), min(len(ra), len(rb)))
        out.append(f"worker {w}: {n} records equal" + (f", then step {ra[n].get('step')} ({ra[n].get('kind')}) vs "
                                                         f"step {rb[n].get('step')} ({rb[n].get('kind')})"
                                                         if n < min(len(ra), len(rb)) else ""))
    return "; ".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--per-worker", action="append", default=[], metavar="NAME",
                   help="compare run NAME per worker (A-EDiT); may be repeated")
    a = p.parse_args(argv)
    bad = 0
    for name in sorted(os.listdir(a.before)):
        pa, pb = (os.path.join(d, name, "metrics.jsonl") for d in (a.before, a.after))
        if not os.path.exists(pa):
            continue
        if not os.path.exists(pb):
            print(f"{name}: missing in {a.after}")
            bad += 1
            continue
        ra, rb = load(pa), load(pb)
        if name in a.per_worker:
            print(f"{name}: {per_worker(ra, rb)}")
            continue
        diff = compare(ra, rb)
        bad += diff is not None
        print(f"{name}: {len(ra)} records equal" if diff is None else f"{name}: DIFFER at {diff}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
