"""Times the sparse wire's codec on this machine's first device (a GPU where there is one): encode,
the decode of N workers' rows and their weighted sum, ``top_k`` alone, and the whole local part of
an exchange (``sparse.sparse_encode``, decode, residual, sum), for vectors of ROWS chunks of 4096
values: how docs/benchmarks/sparse.md timed one 7B layer's share per device on an H100.

    python tools/sparse_codec_time.py 6177,8001 --json codec.json   # a 7B layer's and the root's share (8 x 8)

N workers are emulated: this device's own packed rows, repeated N times, stand in for what the
all-gather would bring. Medians of ``--reps`` calls after one warm call, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_ms(f, *args, reps: int) -> float:
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", help="comma-separated: chunks of 4096 values per timed vector")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from edit_jax.localsgd import sparse
    from edit_jax.localsgd.codec import Codec

    n = a.workers
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "workers": n, "results": []}
    for rows in (int(r) for r in a.rows.split(",")):
        flat = jax.random.normal(jax.random.PRNGKey(0), (rows * sparse.CHUNK,), jnp.float32)
        e = 0.1 * jax.random.normal(jax.random.PRNGKey(1), flat.shape, jnp.float32)
        w = jnp.full((n,), 1.0 / n, jnp.float32)
        for wire in ("topk2", "topk4"):
            codec = Codec.from_name(wire)
            bits, k, chunk = codec.bits, codec.k, codec.chunk
            every = lambda p: jnp.broadcast_to(p, (n,) + p.shape)  # (the all-gather's result)

            def local_exchange(flat, e, w):
                packed, x = sparse.sparse_encode(flat, e, codec)  # noqa: B023 - called at once
                got = sparse.decode(every(packed), bits, k, chunk)  # noqa: B023 - called at once
                return jnp.sum(w.reshape((n, 1, 1)) * got, axis=0).reshape(-1), (x - got[0]).reshape(-1)

            encode = jax.jit(lambda x: sparse.encode(x.reshape(-1, chunk), bits, k))  # noqa: B023 - called at once
            packed = encode(flat)
            decode_sum = jax.jit(
                lambda p: sparse.decode(every(p), bits, k, chunk).sum(0))  # noqa: B023 - called at once
            top_k = jax.jit(lambda x: jax.lax.top_k(jnp.abs(x.reshape(-1, chunk)), k)[1])  # noqa: B023 - called at once
            row = {"rows": rows, "values": int(flat.size), "wire": wire,
                   "encode_ms": _median_ms(encode, flat, reps=a.reps),
                   "top_k_only_ms": _median_ms(top_k, flat, reps=a.reps),
                   "decode_n_and_sum_ms": _median_ms(decode_sum, packed, reps=a.reps),
                   "local_exchange_ms": _median_ms(jax.jit(local_exchange), flat, e, w, reps=a.reps)}
            out["results"].append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
