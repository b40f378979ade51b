"""Post sizes of the exchange (issue 38/39): float32 vs topk2 vs topk4, measured as the bytes of a
real post object (Post.encode of a random Δ, EF residual zero) for a config's model.

    python tools/post_sizes.py configs/tiny.py configs/demo.py
"""
import sys

import jax
import numpy as np

from edit_jax.elastic import packed as PK
from edit_jax.elastic import rounds as R
from edit_jax.localsgd.codec import Codec
from edit_jax.models.llama import init_params
from edit_jax.validate import load_config

for path in sys.argv[1:]:
    cfg = load_config(path, [])
    shapes = jax.eval_shape(lambda: init_params(cfg.model, jax.random.PRNGKey(0)))  # noqa: B023 - called at once
    rng = np.random.default_rng(0)
    delta = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)  # noqa: B023 - called at once
    n = sum(x.size for x in jax.tree.leaves(delta))
    f32 = len(R.Post(0, 1, jax.tree.leaves(delta), 1, 1, 0.0, "0" * 24).encode())
    print(f"{path}: {n} parameters, float32 post {f32} B ({8 * f32 / n:.3f} bits/param)")
    for wire in ("topk2", "topk4"):
        codec = Codec.from_name(wire)
        rows, norms, _ = jax.jit(lambda d, e, c=codec: PK.encode_post(d, e, c, True))(
            delta, PK.zero_residual(delta, True, codec))
        data = R.Post(0, 1, [np.asarray(r) for r in rows], 1, 1, 0.0, "0" * 24, wire=wire,
                      norms=np.asarray(norms)).encode()
        rows_b = sum(np.asarray(r).nbytes for r in rows)
        print(f"  {wire}: post {len(data)} B ({8 * len(data) / n:.3f} bits/param, {f32 / len(data):.0f}x less), "
              f"packed rows {rows_b} B = {8 * rows_b / n:.4f} bits/param (config figure, padding incl.: "
              f"{8 * PK.post_bytes(delta, True, codec) / n:.4f}; unpadded {codec.bits_per_param():.4f})")
