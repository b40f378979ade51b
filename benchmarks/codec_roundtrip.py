"""How faithfully each wire's codec sends one round of pseudo gradients (issue 59).

    python benchmarks/codec_roundtrip.py [--syncs 3] [--json OUT] [--smoke]

For each wire (topk2, topk4 and int8 as they ship, ``codec.Codec``; and a candidate for the sparse
rows, written here in NumPy: ``candidate``) the relative error of one round,
‖decode(encode(x)) − x‖ / ‖x‖, and of ten rounds with error feedback (Δ fixed, e carried at β = 1:
‖Σ sent − 10Δ‖ / ‖10Δ‖), on

- the adversarial chunks of issue 59: one value of 2.0 among 1e-3 noise, 10 nonzeros (fewer than
  k), values at the shipped topk2's level boundary, Student-t with 1.5 degrees of freedom (7 seeds:
  the worst), and a Gaussian chunk (top-k alone loses most of it: the floor column);
- pseudo gradients as training makes them: the demo config's EDiT programs (``configs/demo.py``,
  2 workers; ``--smoke``: the demo made tiny), every worker's Δ_i = θ̄ − θ_i after τ local steps on
  the run's own data, at ``--syncs`` consecutive syncs (each followed by the sync itself),
  flattened per leaf and cut into chunks of 4096.

The floor column sends the top k of each chunk exactly: what no k-sparse codec can beat.

The candidate (2026-11-29): of the k kept values the largest h = 4 sent whole in bfloat16, the rest
on a grid with a zero level, ±j/L·s (2 bits: L = 1, s the rest's magnitude at rank (k − h)/4, an
order statistic; 4 bits: L = 7, s the rest's largest); 0.242 (0.273) bits per parameter. It meets
issue 59's one-round bounds (<= 0.5 on every adversarial chunk) but trains worse: on the demo's 300
steps (seed 0, EDiT, error feedback) its best of five settings is 1.048x uncompressed EDiT's
validation loss against the shipped topk2's 1.031x (docs/benchmarks/streaming.md), so it does not
ship; the table says why one round's fidelity is not the measure (on training's chunks both are at
the top-k floor).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

REPO = common.REPO
CHUNK, K = 4096, 64
WIRES = ("topk2", "topk4", "topk2 candidate", "topk4 candidate", "int8", "floor (top-k exact)")
HEAD = 4  # the candidate's kept values sent whole


def _bf16(v):
    """float32 -> bfloat16 -> float32, rounded to nearest even."""
    import numpy as np

    b = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def _candidate(x, bits: int, k: int = K):
    """The candidate's round trip per chunk [nc, chunk] (the module's docstring)."""
    import numpy as np

    out, top, h = np.zeros_like(x), 2 ** (bits - 1) - 1, min(HEAD, k // 2)
    for r, row in enumerate(x):
        idx = np.argsort(-np.abs(row), kind="stable")[:k]
        v = row[idx]
        a = np.abs(v[h:])
        s = a[0] if bits == 4 else a[max(0, min(len(a) // 4, int(np.count_nonzero(a)) - 1))]
        j = np.clip(np.round(a / (s if s > 0 else np.float32(1)) * top), 0, top)
        out[r, idx[:h]] = _bf16(v[:h])
        out[r, idx[h:]] = np.where(v[h:] < 0, -1.0, 1.0) * np.float32(j / top) * s
    return out


def _floor(x, k: int = K):
    import numpy as np

    out = np.zeros_like(x)
    for r, row in enumerate(x):
        idx = np.argsort(-np.abs(row), kind="stable")[:k]
        out[r, idx] = row[idx]
    return out


def roundtrip(wire: str):
    """x [nc, CHUNK] float32 -> what the receivers decode (NumPy in, NumPy out)."""
    import jax.numpy as jnp
    import numpy as np

    from edit_jax.localsgd.codec import Codec

    if wire.endswith("candidate"):
        return lambda x: _candidate(x, 2 if wire.startswith("topk2") else 4)
    if wire.startswith("floor"):
        return _floor
    codec = Codec.from_name(wire)

    def run(x):
        rows = x.reshape(-1, codec.block)
        return np.asarray(codec.decode(codec.encode(jnp.asarray(rows)))).reshape(x.shape)
    return run


def errors(send, x) -> tuple[float, float]:
    """(one round's relative error, ten rounds' with error feedback at β = 1)."""
    import numpy as np

    norm = float(np.linalg.norm(x))
    one = float(np.linalg.norm(send(x) - x)) / norm
    e, sent = np.zeros_like(x), np.zeros_like(x)
    for _ in range(10):
        xi = x + e
        got = send(xi)
        e, sent = xi - got, sent + got
    return one, float(np.linalg.norm(sent - 10 * x)) / (10 * norm)


def adversarial() -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    x = (1e-3 * rng.standard_normal(CHUNK)).astype(np.float32)
    x[7] = 2.0
    out["one outlier in 1e-3 noise"] = [x]
    x = np.zeros(CHUNK, np.float32)
    x[:10] = rng.standard_normal(10)
    out["10 nonzeros (< k)"] = [x]
    x = (1e-4 * rng.standard_normal(CHUNK)).astype(np.float32)  # topk2's boundary: |x| = s/4 at 2 bits
    x[0], x[1:64] = 2.0, 0.5 * 1.0001 * np.sign(rng.standard_normal(63))
    out["at topk2's level boundary"] = [x]
    out["Student-t, 1.5 d.o.f. (7 seeds)"] = [np.random.default_rng(100 + s).standard_t(1.5, CHUNK).astype(np.float32)
                                              for s in range(7)]
    out["Gaussian"] = [rng.standard_normal(CHUNK).astype(np.float32)]
    return out


def training_chunks(syncs: int, smoke: bool) -> list:
    """Each worker's Δ_i at ``syncs`` consecutive syncs of EDiT on the demo config, as flat chunks."""
    import jax
    import numpy as np

    from edit_jax.data.corpus import load_corpus
    from edit_jax.data.streams import make_train_stream
    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.runtime.mesh import make_mesh
    from edit_jax.validate import load_config

    over = ["sync.method=edit", "sync.warmup_steps=0"] + (["model.n_layers=1", "data.seq_len=32", "batch_size=4",
                                                           "mesh.shard=1", "sync.tau=2"] if smoke else [])
    cfg = load_config(os.path.join(REPO, "configs", "demo.py"), over)
    m = StepPrograms.for_config(cfg, make_mesh(cfg.mesh, jax.devices()[: cfg.mesh.replica * cfg.mesh.shard]))
    stream = make_train_stream(load_corpus(cfg.data), cfg.data.seq_len, cfg.batch_size, cfg.mesh.replica,
                               cfg.data.seed)
    state, step, out = m.init_state(0), 0, []
    local, sync = m.step_fn("local"), m.sync_fn()
    for _ in range(syncs):
        for _ in range(cfg.sync.tau):
            rows = np.concatenate([stream.replica_batch(r, step) for r in range(cfg.mesh.replica)])
            state, _ = local(state, m.put_batch(rows))
            step += 1
        host = jax.device_get(state)
        for w in range(cfg.mesh.replica):
            flat = np.concatenate([(t - p[w]).reshape(-1) for t, p in zip(jax.tree.leaves(host.outer.params),
                                                                           jax.tree.leaves(host.params), strict=True)])
            flat = np.pad(flat.astype(np.float32), (0, -len(flat) % CHUNK))
            out.append(flat.reshape(-1, CHUNK))
        state, _ = sync(state)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--syncs", type=int, default=3, help="syncs of the demo whose pseudo gradients are measured")
    common.add_common(p, "codec_roundtrip")
    args = p.parse_args(argv)
    common.ensure_cpu_devices(8)
    import numpy as np

    sets = {name: [x.reshape(1, CHUNK) for x in xs] for name, xs in adversarial().items()}
    sets["demo EDiT pseudo gradients"] = training_chunks(1 if args.smoke else args.syncs, args.smoke)
    table = {}
    for name, xs in sets.items():
        row = {}
        for wire in WIRES:
            send = roundtrip(wire)
            pairs = [errors(send, x) for x in xs]
            one, ten = [a for a, _ in pairs], [b for _, b in pairs]
            row[wire] = {"one_round_worst": max(one), "one_round_median": float(np.median(one)),
                         "ten_rounds_ef_worst": max(ten), "ten_rounds_ef_median": float(np.median(ten))}
        table[name] = row
    head = f"| chunks | {' | '.join(WIRES)} |"
    lines = [head, "|" + "---|" * (len(WIRES) + 1)]
    for name, row in table.items():
        cells = [f"{row[w]['one_round_worst']:.3f} / {row[w]['ten_rounds_ef_worst']:.3f}" for w in WIRES]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    print("relative error, worst over the set: one round / ten rounds with error feedback")
    print("\n".join(lines))
    result = {"env": common.env_info(), "chunk": CHUNK, "k": K, "syncs": 1 if args.smoke else args.syncs,
              "smoke": args.smoke, "table": table}
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
