"""What sparse pseudo-gradient compression costs per sync step on CPU (issue 39).

    python benchmarks/bench_sparse_wire.py [--compress none,int8,topk4,topk2] [--repeats 5] [overrides]

On the demo config (``configs/demo.py``, its 2 x 4 CPU-emulated mesh) it compiles the EDiT step
programs once per ``sync.wire.kind`` (with error feedback for the lossy ones) and times, median
of ``--repeats`` after a warm-up: the local step, the sync step (``sync_forward``: the layer-wise
sync inside the forward, then the step) and the whole-model sync alone (``sync_fn``). The cost of
a compression is its sync step minus the uncompressed one (the exchange itself is a memcpy between
emulated devices here, so the difference is the encode, the decode and the sum). Also, on one
device, encode + decode of every unit's block as a demo device holds it (jit, median).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

REPO = common.REPO
# --smoke: the demo config made small (one layer, 2 x 1 mesh, 4 x 32 tokens), one compression
SMOKE_OVERRIDES = ["model.n_layers=1", "mesh.shard=1", "batch_size=4", "data.seq_len=32"]


def _median(fn, repeats: int, before=None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after a warm-up one; ``before()`` (untimed)
    runs ahead of each call."""
    import jax

    times = []
    for _ in range(repeats + 1):
        if before is not None:
            jax.block_until_ready(before())
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def bench(compress: str, overrides: list[str], repeats: int) -> dict:
    import jax
    import numpy as np

    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.runtime.mesh import make_mesh
    from edit_jax.validate import load_config

    ef = [] if compress == "none" else ["sync.wire.error_feedback=true"]
    cfg = load_config(os.path.join(REPO, "configs", "demo.py"),
                      ["sync.method=edit", f"sync.wire.kind={compress}", *ef, *overrides])
    m = StepPrograms.for_config(cfg, make_mesh(cfg.mesh, jax.devices()[: cfg.mesh.replica * cfg.mesh.shard]))
    state = m.init_state(0)
    rng = np.random.default_rng(0)
    batch = m.put_batch(rng.integers(0, cfg.model.vocab_size, (cfg.batch_size, cfg.data.seq_len + 1)).astype(np.int32))
    local, sync_step, sync_only = m.step_fn("local"), m.step_fn("sync_forward"), m.sync_fn()
    box = [state]  # the programs donate their state: each call runs on the last one's output

    def run(fn, *args):
        box[0], metrics = fn(box[0], *args)
        return metrics

    step = lambda: run(local, batch)  # (untimed before a sync: it moves the workers apart)
    return {"local_s": _median(step, repeats),
            "sync_step_s": _median(lambda: run(sync_step, batch), repeats, before=step),
            "sync_fn_s": _median(lambda: run(sync_only), repeats, before=step)}


def codec(wire: str, repeats: int, cfg) -> float:
    """encode + decode of each unit's block of one demo device (params / shard), on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from edit_jax.localsgd.codec import Codec
    from edit_jax.localsgd.fragments import unit_param_counts

    codec = Codec.from_name(wire)
    chunk = codec.chunk
    sizes = [u // cfg.mesh.shard for u in unit_param_counts(cfg)]
    xs = [jnp.asarray(np.random.default_rng(i).standard_normal(-(-m // chunk) * chunk).astype(np.float32)
                      .reshape(-1, chunk)) for i, m in enumerate(sizes)]
    n = cfg.mesh.replica
    f = jax.jit(lambda xs: [jnp.sum(codec.decode(jnp.stack([codec.encode(x)] * n)), 0) for x in xs])
    return _median(lambda: f(xs), repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compress", default="none,int8,topk4,topk2")
    p.add_argument("--repeats", type=int, default=5)
    common.add_common(p, "bench_sparse_wire")
    args, overrides = p.parse_known_args(argv)
    if args.smoke:
        args.compress, args.repeats, overrides = "topk2", 1, [*SMOKE_OVERRIDES, *overrides]
    common.ensure_cpu_devices(8)  # the demo's 2 x 4 mesh (before JAX starts)
    from edit_jax.localsgd.codec import Codec
    from edit_jax.validate import load_config

    rows = {c: bench(c, overrides, args.repeats) for c in args.compress.split(",")}
    base = rows.get("none")
    print(f"{'compress':<10}{'local ms':>10}{'sync step ms':>14}{'sync_fn ms':>12}{'sync step - none':>18}")
    for c, r in rows.items():
        extra = f"{(r['sync_step_s'] - base['sync_step_s']) * 1e3:>+14.1f} ms" if base else ""
        print(f"{c:<10}{r['local_s'] * 1e3:>10.1f}{r['sync_step_s'] * 1e3:>14.1f}"
              f"{r['sync_fn_s'] * 1e3:>12.1f}{extra:>18}")
    cfg = load_config(os.path.join(REPO, "configs", "demo.py"), overrides)
    codecs = {}
    for c in rows:
        if Codec.from_name(c).is_sparse:
            codecs[c] = codec(c, args.repeats, cfg)
            print(f"{c}: encode + decode x {cfg.mesh.replica} of one device's units: {codecs[c] * 1e3:.2f} ms")
    common.write_json(args.json, {"env": common.env_info(), "args": vars(args), "overrides": overrides, "rows": rows,
                                  "codec_s": codecs})
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
