"""DiLoCo and layer-wise EDiT on a Flax NNX model, in your own loop; killed and resumed exactly.

A byte-level language model written in Flax NNX (below): its blocks built once under ``nnx.vmap``
(stacked, as ``nnx.scan`` users write them) and run with ``edit_jax.scan_blocks``; its own optax
AdamW; its own loop over the bytes of a Python standard-library source file. ``LocalSGD.for_nnx``
takes the module as it is, splits its params into N workers on a (replica, shard) device mesh and
syncs them every tau steps:

    python examples/own_nnx_model.py --rule diloco    # the whole model after the step (any NNX model)
    python examples/own_nnx_model.py --rule edit      # layer by layer inside the forward (stacked blocks)
    python examples/own_nnx_model.py --rule edit --checkpoint ckpt --save-every 40
    # ... kill it (Ctrl-C, kill -9) and run the same command again: it resumes from its newest
    # checkpoint and ends where the uninterrupted run ends, bit for bit

On CPU it emulates 8 devices (4 workers x 2 devices each); a run takes well under a minute.
"""

from __future__ import annotations

import argparse
import os
import time

import edit_jax

edit_jax.set_cpu_device_count(8)  # on CPU: 8 emulated devices; must run before JAX starts

import jax  # (after set_cpu_device_count)
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

SIZES = {"small": dict(d_model=64, n_layers=3, n_heads=4, seq_len=64, batch=8, tau=8, steps=160),
         "tiny": dict(d_model=32, n_layers=2, n_heads=2, seq_len=32, batch=4, tau=4, steps=40)}
# The outer step for a run of a few dozen syncs (the paper's Nesterov 0.7-0.8 / 0.85-0.9 pays off
# over hundreds; over 20 it overshoots and the loss stalls near the bytes' unigram entropy).
OUTER = dict(outer_lr=0.5, outer_momentum=0.5)


# ----------------------------------------------------------------------------- the model (Flax NNX)


class Block(nnx.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP with dropout."""

    def __init__(self, d: int, n_heads: int, rngs: nnx.Rngs):
        self.n_heads = n_heads
        self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3 * self.n_heads, d // self.n_heads), 3, axis=2)
        x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))
        return x + self.drop(self.down(nnx.gelu(self.up(self.norm2(x)))))


class ByteLM(nnx.Module):
    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, rngs: nnx.Rngs, vocab: int = 256):
        self.tok, self.pos = nnx.Embed(vocab, d_model, rngs=rngs), nnx.Embed(seq_len, d_model, rngs=rngs)
        # The blocks stacked: each nnx.Param gets a leading layer axis (a dropout stream per layer).
        make = nnx.split_rngs(splits=n_layers)(nnx.vmap(lambda r: Block(d_model, n_heads, r), in_axes=0, out_axes=0))
        self.blocks = make(rngs)
        self.norm, self.head = nnx.LayerNorm(d_model, rngs=rngs), nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        x = edit_jax.scan_blocks(self.blocks, x)  # a jax.lax.scan over the blocks; EDiT syncs each inside it
        return self.head(self.norm(x))


def loss_fn(model: ByteLM, batch):
    """Mean next-byte cross-entropy of batch [B, T + 1]."""
    return optax.softmax_cross_entropy_with_integer_labels(model(batch[:, :-1]), batch[:, 1:]).mean()


# ----------------------------------------------------------------------------- data


def load_bytes() -> np.ndarray:
    """The source of Python's ``os`` module as bytes (a built-in, always-there text)."""
    with open(os.__file__, "rb") as f:
        return np.frombuffer(f.read(), np.uint8).astype(np.int32)


def batch_at(data: np.ndarray, shape: tuple[int, ...], seq_len: int, seed: int, step: int) -> np.ndarray:
    """Random windows of seq_len + 1 bytes, shaped shape + (seq_len + 1,): a function of the step, so
    a resumed run reads the batches the uninterrupted one would."""
    starts = np.random.default_rng((seed, step)).integers(0, len(data) - seq_len - 1, shape)
    return data[starts[..., None] + np.arange(seq_len + 1)]


# ----------------------------------------------------------------------------- training


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule", choices=("diloco", "edit"), default="edit")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--fragments", type=int, default=1, help="sync the units in this many staggered groups")
    ap.add_argument("--tiny", action="store_true", help="a smaller model and batch (for tests)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--shard", type=int, default=2, help="devices per worker (data parallel within it)")
    ap.add_argument("--checkpoint", metavar="DIR", help="save the whole state here; resume from its newest")
    ap.add_argument("--save-every", type=int, default=0, metavar="K", help="with --checkpoint: every K steps")
    args = ap.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "small"]
    steps, tau, n = args.steps or size["steps"], size["tau"], args.workers

    mesh = jax.make_mesh((n, args.shard), ("replica", "shard"), devices=jax.devices()[: n * args.shard])
    model = ByteLM(size["d_model"], size["n_layers"], size["n_heads"], size["seq_len"], nnx.Rngs(0, dropout=1))
    rule = {"diloco": edit_jax.diloco, "edit": edit_jax.edit}[args.rule](**OUTER)
    # The module as it is; blocks= names its stacked blocks, which a layer-wise rule syncs one by one.
    trainer = edit_jax.LocalSGD.for_nnx(rule, mesh, tau, model=model, optimizer=optax.adamw(3e-3, weight_decay=0.01),
                                        loss_fn=loss_fn, blocks="blocks" if rule.layerwise else None, seed=0,
                                        fragments=args.fragments)
    state = trainer.init()
    if args.checkpoint and edit_jax.saved_local_sgd_steps(args.checkpoint):  # a run killed before: go on
        state = edit_jax.restore_local_sgd(args.checkpoint, state)
        print(f"resumed from {args.checkpoint} at step {int(state.step)}", flush=True)

    data = load_bytes()
    split = int(0.9 * len(data))
    print(f"{rule.name} on NNX: {n} workers x {args.shard} devices, tau={tau}, {steps} steps", flush=True)
    start, losses = time.time(), []
    for k in range(int(state.step), steps):
        state, metrics = trainer.step(state, batch_at(data[:split], (n, size["batch"]), size["seq_len"], 0, k))
        losses.append(float(metrics["inner"]["loss"].mean()))  # each worker's loss: [N]
        if "sync" in metrics:
            print(f"step {k:4d}  loss {losses[-1]:.3f}  synced", flush=True)
        if args.checkpoint and args.save_every and (k + 1) % args.save_every == 0:
            edit_jax.save_local_sgd(args.checkpoint, state)
            print(f"step {k:4d}  saved", flush=True)

    state, _ = trainer.sync(state)  # a last sync: evaluate θ̄, the model the workers agree on
    synced = trainer.to_nnx(state)  # an ordinary ByteLM again
    synced.eval()  # dropout off
    val_loss = float(loss_fn(synced, batch_at(data[split:], (32,), size["seq_len"], 1, 0)))
    trained = f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}, " if losses else ""
    print(f"done in {time.time() - start:.1f}s: {trained}validation loss of the synced model {val_loss:.6f} "
          f"(uniform bytes: {np.log(256):.3f})", flush=True)
    return {"losses": losses, "val_loss": val_loss, "state": state}


if __name__ == "__main__":
    main()
