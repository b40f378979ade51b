"""A post that misses its round: carried into the next one, or dropped? (issue 38, item 3)

    python benchmarks/bench_late_posts.py [--workers 3] [--steps 150] [--seeds 0,1] [overrides]

Exchange-mode A-EDiT on ``configs/tiny.py`` (one device per worker), the workers as threads of
this process (``ElasticWorker``, each its own compiled programs, meeting through a directory).
Worker ``--workers - 1`` is late by design: before every ``--every``-th post it pauses for 1.5 x
``sync.exchange.grace``, so the others close that round without it. Once with ``sync.exchange.late_posts=carry``
(its Δ re-based onto the new θ̄ and part of its next post), once with ``drop`` (it restarts from
θ̄, those steps lost), same seeds, same token budget. Reported per policy: the final validation
loss of θ̄ (evaluated by the last round's closer at the budget), rounds, late posts, steps lost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

REPO = common.REPO
SMOKE = ["model.n_layers=1", "data.seq_len=32"]


def late_worker_class(every: int, pause_s: float):
    from edit_jax.elastic.worker import ElasticWorker

    class LateWorker(ElasticWorker):
        """Pauses before every ``every``-th post (of rounds r with r % every == every - 1)."""

        def post(self, shared, local, loss):
            if shared.round % every == every - 1:
                time.sleep(pause_s)
            return super().post(shared, local, loss)

    return ElasticWorker, LateWorker


def one_run(policy: str, seed: int, workers: int, every: int, overrides: list[str]) -> dict:
    import json

    from edit_jax.validate import load_config

    root = tempfile.mkdtemp(prefix=f"late_{policy}_")
    cfg = load_config(os.path.join(REPO, "configs", "tiny.py"), [
        "sync.method=a_edit", f"sync.exchange.url={root}/ex", "sync.warmup_steps=0", f"mesh.replica={workers}",
        "mesh.shard=1", f"mesh.processes={workers}", "sync.time.tau=0.5", "sync.exchange.grace=1.0", f"seed={seed}",
        f"data.seed={seed}", f"sync.exchange.late_posts={policy}", f"batch_size={2 * workers}", "eval_batches=4",
        *overrides])
    plain, late = late_worker_class(every, 1.5 * cfg.sync.exchange.grace)
    ws = [(late if w == workers - 1 else plain)(cfg, w, f"{root}/run", say=lambda m: None) for w in range(workers)]
    codes = {}
    threads = [threading.Thread(target=lambda w=w: codes.__setitem__(w.me, w.run())) for w in ws]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    with open(f"{root}/run/metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    rounds = [r for r in recs if r.get("sync")]
    lates = [r for r in recs if r.get("late_post")]
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    return {"policy": policy, "seed": seed, "codes": codes, "wall_s": wall, "rounds": len(rounds),
            "late_posts": len(lates), "late_steps": sum(r["late_steps"] for r in lates),
            "carried_in_rounds": sum(sum(r.get("carried", [])) for r in rounds),
            "tally": sum(sum(r["steps"]) for r in rounds),
            "final_val_loss": val[-1] if val else float("nan")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=150, help="the token budget, in steps per worker slot")
    p.add_argument("--every", type=int, default=3, help="the late worker misses every N-th round")
    p.add_argument("--seeds", default="0,1")
    common.add_common(p, "bench_late_posts")
    args, overrides = p.parse_known_args(argv)
    if args.smoke:
        args.workers, args.steps, args.seeds, args.every, overrides = 2, 12, "0", 2, [*SMOKE, *overrides]
    common.ensure_cpu_devices(1)
    from edit_jax.runtime.compile_cache import compile_cache

    runs = []
    with compile_cache(os.environ.get("EDIT_JAX_COMPILE_CACHE") or None):
        for seed in (int(s) for s in args.seeds.split(",")):
            for policy in ("carry", "drop"):  # side by side per seed
                runs.append(one_run(policy, seed, args.workers, args.every, [f"steps={args.steps}", *overrides]))
    rows = [[r["policy"], r["seed"], r["rounds"], r["late_posts"], r["late_steps"], r["final_val_loss"], r["wall_s"]]
            for r in runs]
    common.print_table("late posts: carried or dropped", ["policy", "seed", "rounds", "late posts", "late steps",
                                                          "final val loss", "wall s"], rows)
    means = {pol: statistics.fmean(r["final_val_loss"] for r in runs if r["policy"] == pol)
             for pol in ("carry", "drop")}
    print(f"mean final val loss: carry {means['carry']:.4f}, drop {means['drop']:.4f} "
          f"(drop / carry = {means['drop'] / means['carry']:.4f})")
    common.write_json(args.json, {"env": common.env_info(), "args": vars(args), "overrides": overrides, "runs": runs,
                                  "mean_final_val_loss": means})
    print(f"JSON: {args.json}")
    bad = [r for r in runs if set(r["codes"].values()) != {0}]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
