"""DiLoCo and EDiT on your own model, optimizer and loop: no edit-jax harness, no config.

A GPT-2-style byte-level language model written the usual way in plain Flax linen (root modules
and one block module, below), its own optax AdamW, its own loop over the bytes of a Python
standard-library source file. edit_jax wraps the step into N workers on a (replica, shard) device
mesh and syncs them every tau steps:

    python examples/own_model.py --rule diloco        # whole model after the step, any train step
    python examples/own_model.py --rule edit          # layer by layer inside the forward (EDiT)
    python examples/own_model.py --rule edit --tiny --steps 40
    python examples/own_model.py --rule co2           # CO2: the all-reduce one round stale
    python examples/own_model.py --rule edit --wire topk2    # 2-bit sparse pseudo gradients, error feedback
    python examples/own_model.py --rule edit --checkpoint ckpt --save-every 40   # kill it, run it again: it resumes

On CPU it emulates 8 devices (4 workers x 2 devices each); each run takes well under a minute.

The layer-wise sync (EDiT) needs each unit's params on their way into compute: the root first,
then each block inside a scan over the stacked blocks. ``edit_jax.LayerStack`` builds that from
the modules and a forward written over them (``make_model``); a whole-model rule (DiLoCo, CO2)
needs none of it and takes any train step.
"""

from __future__ import annotations

import argparse
import os
import time

import edit_jax

edit_jax.set_cpu_device_count(8)  # on CPU: 8 emulated devices; must run before JAX starts

import flax.linen as nn  # (after set_cpu_device_count)
import jax
import jax.numpy as jnp
import numpy as np
import optax

SIZES = {"small": dict(d_model=64, n_layers=3, n_heads=4, seq_len=64, batch=8, tau=8, steps=160),
         "tiny": dict(d_model=32, n_layers=2, n_heads=2, seq_len=32, batch=4, tau=4, steps=40)}
# The outer step for a run of a few dozen syncs. The paper's Nesterov momentum (DiLoCo 0.7 / 0.9,
# EDiT 0.8 / 0.85) pays off over hundreds of syncs; over 20 it overshoots, and this model's loss
# stalls at the bytes' unigram entropy (~3.1) from step 15 on. 0.5 / 0.5 keeps it falling.
OUTER = dict(outer_lr=0.5, outer_momentum=0.5)


# ----------------------------------------------------------------------------- the model (plain Flax)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP."""

    n_heads: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        qkv = nn.Dense(3 * d, use_bias=False)(nn.LayerNorm()(x)).reshape(b, t, 3 * self.n_heads, d // self.n_heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        x = x + nn.Dense(d, use_bias=False)(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))
        return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x))))


def make_model(d_model, n_layers, n_heads, seq_len, vocab=256) -> edit_jax.LayerStack:
    """The model as it is usually written: root modules, a block repeated n_layers times, a forward.
    ``init`` gives {"root": each root module's params, "layers": the blocks' params stacked}."""
    def forward(m, tokens):  # m.NAME: a root module; m.blocks: every block in turn
        x = m.tok(tokens) + m.pos(jnp.arange(tokens.shape[1]))
        return m.head(m.norm(m.blocks(x)))

    root = {"tok": nn.Embed(vocab, d_model), "pos": nn.Embed(seq_len, d_model), "norm": nn.LayerNorm(),
            "head": nn.Dense(vocab, use_bias=False)}
    return edit_jax.LayerStack(root=root, block=Block(n_heads), n_layers=n_layers, forward=forward)


def make_loss(model):
    def loss_fn(params, batch, hook=None, hook_xs=None):
        """Mean next-byte cross-entropy of batch [B, T + 1], and the hooks' outputs (EDiT's)."""
        logits, ys = model.apply(params, batch[:, :-1], hook=hook, hook_xs=hook_xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), ys
    return loss_fn


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
    ap.add_argument("--rule", choices=("diloco", "edit", "co2"), default="edit")
    ap.add_argument("--wire", choices=("none", "bf16", "int8", "topk2", "topk4"), default="none",
                    help="pseudo gradients on a lossy wire, with error feedback")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--tau", type=int, default=None, help="inner steps between syncs")
    ap.add_argument("--fragments", type=int, default=1, help="sync the units in this many staggered groups")
    ap.add_argument("--tiny", action="store_true", help="a smaller model and batch (for tests)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--shard", type=int, default=2, help="devices per worker (data parallel within it)")
    ap.add_argument("--checkpoint", metavar="DIR", help="save the whole state here; resume from its newest")
    ap.add_argument("--save-every", type=int, default=0, metavar="K", help="with --checkpoint: every K steps")
    args = ap.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "small"]
    steps, tau = args.steps or size["steps"], args.tau or size["tau"]

    # The mesh: one row of devices per worker. Nothing else about edit_jax's harness is used.
    n = args.workers
    mesh = jax.make_mesh((n, args.shard), ("replica", "shard"), devices=jax.devices()[: n * args.shard])
    model = make_model(size["d_model"], size["n_layers"], size["n_heads"], size["seq_len"])
    loss_fn = make_loss(model)
    tx = optax.adamw(3e-3, weight_decay=0.01)

    def train_step(params, opt_state, batch):  # an ordinary train step: DiLoCo takes it as it is
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    rule = {"diloco": edit_jax.diloco, "edit": edit_jax.edit, "co2": edit_jax.co2}[args.rule](**OUTER)
    if args.wire != "none":
        rule = edit_jax.compressed(rule, args.wire, error_feedback=True)
    if not rule.layerwise:  # DiLoCo, CO2: the whole model after the step
        trainer = edit_jax.LocalSGD(rule, mesh, tau, inner_step=train_step, fragments=args.fragments)
    else:  # EDiT syncs inside the forward: it runs the update itself, so it takes the loss and tx
        trainer = edit_jax.LocalSGD(rule, mesh, tau, loss_fn=loss_fn, optimizer=tx, fragments=args.fragments)

    data = load_bytes()
    split = int(0.9 * len(data))
    params = model.init(jax.random.key(0), data[None, : size["seq_len"]])
    state = trainer.init(params, tx.init(params))
    if args.checkpoint and edit_jax.saved_local_sgd_steps(args.checkpoint):  # a run killed before: go on
        state = edit_jax.restore_local_sgd(args.checkpoint, state)
        print(f"resumed from {args.checkpoint} at step {int(state.step)}")

    print(f"{rule.name}: {n} workers x {args.shard} devices, tau={tau}, {steps} steps")
    start, losses = time.time(), []
    for k in range(int(state.step), steps):
        batch = batch_at(data[:split], (n, size["batch"]), size["seq_len"], 0, k)  # [N, B, T + 1]: per worker
        state, metrics = trainer.step(state, batch)  # one plain call per step
        losses.append(float(metrics["inner"]["loss"].mean()))  # each worker's loss: [N]
        if "sync" in metrics:  # every tau steps: the sync's figures
            weights = np.asarray(metrics["sync"]["weight"], np.float64).round(3).tolist()
            print(f"step {k:4d}  loss {losses[-1]:.3f}  synced, worker weights {weights}", flush=True)
        if args.checkpoint and args.save_every and (k + 1) % args.save_every == 0:
            edit_jax.save_local_sgd(args.checkpoint, state)

    before = jax.device_get(state)  # (kept for the tests: they recompute this last sync with NumPy)
    # A last sync: evaluate θ̄, the model the workers agree on (CO2: land the round still in flight).
    state, _ = trainer.flush(state) if args.rule == "co2" else trainer.sync(state)
    val = batch_at(data[split:], (32,), size["seq_len"], 1, 0)
    val_loss = float(jax.jit(loss_fn)(jax.device_get(state.outer_params), val)[0])
    trained = f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}, " if losses else ""
    print(f"done in {time.time() - start:.1f}s: {trained}validation loss of the synced model {val_loss:.3f} "
          f"(uniform bytes: {np.log(256):.3f})")
    return {"losses": losses, "val_loss": val_loss, "state": state, "before_sync": before}


if __name__ == "__main__":
    main()
