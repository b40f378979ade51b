"""Sampling speed on one device: tokens/s of `edit-jax sample`'s KV-cache generation, against
re-running the whole window for every token (no cache; what nanoGPT's sample.py does).

    PYTHONPATH=$PWD python benchmarks/bench_sample.py --run-dir runs/demo [--tokens 200] [--out runs/bench_sample.json]

Every figure is the best of --repeats runs after a warm-up run (compilation excluded). "tokens/s"
counts generated tokens after the first (the first comes from the prompt's prefill, timed apart),
over all rows of the batch; with --tokens past the context the figure includes the re-prefills.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common


def _smoke_run_dir() -> str:
    """A run dir of configs/tiny.py (one layer, 4 x 32 tokens a step) trained 2 steps (the smoke run
    samples from it)."""
    import tempfile

    from edit_jax.training.train import train
    from edit_jax.validate import load_config

    run_dir = os.path.join(tempfile.mkdtemp(prefix="bench_sample_"), "run")
    cfg = load_config(os.path.join(common.REPO, "configs", "tiny.py"),
                      ["steps=2", "method=baseline", "eval_every=0", "checkpoint_every=0", "mesh.replica=1",
                       "mesh.shard=1", "model.n_layers=1", "batch_size=4", "data.seq_len=32", "eval_batches=1"])
    train(cfg, run_dir, progress=False, verbose=False, devices=common.pick_devices(1))
    return run_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=None, help="a trained run dir (required unless --smoke)")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench_sample.json")
    parser.add_argument("--smoke", action="store_true", help="a 2-step tiny run, 4 tokens, batch 1, 1 repeat (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.batches, args.repeats = 4, "1", 1
        args.run_dir = args.run_dir or _smoke_run_dir()
    if args.run_dir is None:
        parser.error("--run-dir is required")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from edit_jax.models import llama as model_lib
    from edit_jax.commands.sample import Sampler, choose
    from edit_jax.rundir.trained import load_tokenizer, load_trained

    model = load_trained(args.run_dir)
    tok = load_tokenizer(model.cfg, run_dir=model.run_dir)
    cfg, w = model.cfg.model, model.cfg.data.seq_len
    sampler = Sampler(cfg, model.params, w, tok.eos_id, tok.vocab_size)
    prompt = np.concatenate([[tok.eos_id], tok.encode("def ")]).astype(np.int32)
    rows = []

    for b in [int(x) for x in args.batches.split(",")]:
        def cached():
            g = sampler.generate(prompt, args.tokens, temperature=0.8, top_k=40, seed=0,
                                 num_samples=b, stop_at_eos=False)  # noqa: B023 - called at once
            return g.prefill_s, g.steps * b / g.decode_s  # noqa: B023 - called at once

        cached()  # compile
        runs = [cached() for _ in range(args.repeats)]
        rows.append({"mode": "kv-cache", "batch": b, "tokens": args.tokens, "prefill_ms": 1e3 * min(r[0] for r in runs),
                     "tokens_per_s": max(r[1] for r in runs)})

        # No cache: the whole (right-padded, fixed-length: one compile) window through the plain forward.
        @jax.jit
        def full_step(params, window, n, key, t):
            logits, _ = model_lib.forward(cfg, params, window)
            last = jax.lax.dynamic_index_in_dim(logits, n - 1, axis=1, keepdims=False)
            return choose(last, jax.random.fold_in(key, t), 0.8, 40, tok.vocab_size)

        params = sampler.params

        def uncached():
            seq = np.tile(prompt[None], (b, 1))  # noqa: B023 - called at once
            key = jax.random.key(0)
            t0 = time.perf_counter()
            for t in range(args.tokens):
                window = seq[:, -w:]
                n = window.shape[1]
                padded = np.zeros((b, w), np.int32)  # noqa: B023 - called at once
                padded[:, :n] = window
                nxt = np.asarray(full_step(params, jnp.asarray(padded), n, key, t))  # noqa: B023 - called at once
                seq = np.concatenate([seq, nxt[:, None]], axis=1)
                if t == 0:
                    t1 = time.perf_counter()
            return t1 - t0, (args.tokens - 1) * b / (time.perf_counter() - t1)  # noqa: B023 - called at once

        uncached()
        runs = [uncached() for _ in range(args.repeats)]
        rows.append({"mode": "no cache (full window per token)", "batch": b, "tokens": args.tokens,
                     "prefill_ms": 1e3 * min(r[0] for r in runs), "tokens_per_s": max(r[1] for r in runs)})

    params_m = model_lib.count_params(model.params) / 1e6
    info = {"run_dir": args.run_dir, "step": model.step, "params_M": round(params_m, 3), "context": w,
            "device": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
            "python": platform.python_version(), "jax": jax.__version__, "rows": rows, "env": common.env_info()}
    print(f"model {params_m:.2f} M params, context {w}, {info['device']}, {os.cpu_count()} cores, "
          f"load {info['load_avg'][0]:.1f}")
    print(f"{'mode':34s} {'batch':>5s} {'prefill ms':>10s} {'tokens/s':>10s}")
    for r in rows:
        print(f"{r['mode']:34s} {r['batch']:5d} {r['prefill_ms']:10.1f} {r['tokens_per_s']:10.0f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(info, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
