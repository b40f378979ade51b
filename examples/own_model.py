"""DiLoCo and EDiT on your own model, optimizer and loop: no edit-jax harness, no config.

A GPT-2-style byte-level language model written in plain Flax (below, ~40 lines), its own optax
AdamW, its own loop over the bytes of a Python standard-library source file. edit_jax wraps the
step into N workers on a (replica, shard) device mesh and syncs them every tau steps:

    python examples/own_model.py --rule diloco        # whole model after the step, any train step
    python examples/own_model.py --rule edit          # layer by layer inside the forward (EDiT)
    python examples/own_model.py --rule edit --tiny --steps 40
    python examples/own_model.py --rule co2           # CO2: the all-reduce one round stale
    python examples/own_model.py --rule edit --wire topk2    # 2-bit sparse pseudo gradients, error feedback

On CPU it emulates 8 devices (4 workers x 2 devices each); each run takes well under a minute.

For the layer-wise sync the model meets edit_jax's ScannedModel contract (docs/api.md): params
{"root": ..., "layers": <stacked on a leading layer axis>}, and a forward that passes the root and
then each layer (inside its scan) through ``hook(unit_params, unit_xs, which)``, taking ``hook_xs``
and returning the hooks' outputs ``ys``, both laid out like the params. Without a sync the hook is
the identity; a whole-model rule (DiLoCo) needs none of this and takes any train step.
"""

from __future__ import annotations

import argparse
import os
import time

import edit_jax

edit_jax.set_cpu_device_count(8)  # on CPU: 8 emulated devices; must run before JAX starts

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from edit_jax.localsgd.api import identity_hook  # noqa: E402

SIZES = {"small": dict(d_model=64, n_layers=3, n_heads=4, seq_len=64, batch=8, tau=8, steps=150),
         "tiny": dict(d_model=32, n_layers=2, n_heads=2, seq_len=32, batch=4, tau=4, steps=40)}


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


def init_params(key, d_model, n_layers, n_heads, seq_len, vocab=256):
    """{"root": embeddings and final norm, "layers": every block's params stacked on axis 0}."""
    k_tok, k_pos, k_layers = jax.random.split(key, 3)
    x = jnp.zeros((1, seq_len, d_model))
    layers = jax.vmap(lambda k: Block(n_heads).init(k, x)["params"])(jax.random.split(k_layers, n_layers))
    root = {"tok": 0.02 * jax.random.normal(k_tok, (vocab, d_model)),
            "pos": 0.01 * jax.random.normal(k_pos, (seq_len, d_model)),
            "norm": nn.LayerNorm().init(key, x)["params"]}
    return {"root": root, "layers": layers}


def forward(params, tokens, n_heads, hook=identity_hook, hook_xs=None):
    """Logits [B, T, 256], and the hooks' outputs. Every unit's params reach compute through hook."""
    xs = hook_xs if hook_xs is not None else {"root": None, "layers": None}
    root, root_ys = hook(params["root"], xs["root"], "root")
    x = root["tok"][tokens] + root["pos"][: tokens.shape[1]]

    def layer(x, unit):
        block_params, block_xs = unit
        block_params, ys = hook(block_params, block_xs, "layer")
        return Block(n_heads).apply({"params": block_params}, x), ys

    x, layer_ys = jax.lax.scan(layer, x, (params["layers"], xs["layers"]))
    x = nn.LayerNorm().apply({"params": root["norm"]}, x)
    return x @ root["tok"].T, {"root": root_ys, "layers": layer_ys}


def make_loss(n_heads):
    def loss_fn(params, batch, hook=identity_hook, hook_xs=None):
        """Mean next-byte cross-entropy of batch [B, T + 1], and the forward's hook outputs."""
        logits, ys = forward(params, batch[:, :-1], n_heads, hook, hook_xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), ys
    return loss_fn


# ----------------------------------------------------------------------------- data


def load_bytes() -> np.ndarray:
    """The source of Python's ``os`` module as bytes (a built-in, always-there text)."""
    with open(os.__file__, "rb") as f:
        return np.frombuffer(f.read(), np.uint8).astype(np.int32)


def batches(data: np.ndarray, shape: tuple[int, ...], seq_len: int, seed: int):
    """Endless batches of random windows of seq_len + 1 bytes, shaped shape + (seq_len + 1,)."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, shape)
        yield data[starts[..., None] + np.arange(seq_len + 1)]


# ----------------------------------------------------------------------------- training


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule", choices=("diloco", "edit", "co2"), default="edit")
    ap.add_argument("--wire", choices=("none", "bf16", "int8", "topk2", "topk4"), default="none",
                    help="pseudo gradients on a lossy wire, with error feedback")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--tau", type=int, default=None, help="inner steps between syncs")
    ap.add_argument("--tiny", action="store_true", help="a smaller model and batch (for tests)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--shard", type=int, default=2, help="devices per worker (data parallel within it)")
    args = ap.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "small"]
    steps, tau = args.steps or size["steps"], args.tau or size["tau"]

    # The mesh: one row of devices per worker. Nothing else about edit_jax's harness is used.
    n = args.workers
    mesh = jax.make_mesh((n, args.shard), ("replica", "shard"), devices=jax.devices()[: n * args.shard])
    loss_fn = make_loss(size["n_heads"])
    tx = optax.adamw(3e-3, weight_decay=0.01)

    def train_step(params, opt_state, batch):  # an ordinary train step: DiLoCo takes it as it is
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    rule = {"diloco": edit_jax.diloco, "edit": edit_jax.edit, "co2": edit_jax.co2}[args.rule]()
    if args.wire != "none":
        rule = edit_jax.compressed(rule, args.wire, error_feedback=True)
    if not rule.layerwise:  # DiLoCo, CO2: the whole model after the step
        trainer = edit_jax.LocalSGD(rule, mesh, tau, inner_step=train_step)
    else:  # EDiT syncs inside the forward: it runs the update itself, so it takes the loss and tx
        trainer = edit_jax.LocalSGD(rule, mesh, tau, loss_fn=loss_fn, optimizer=tx)

    data = load_bytes()
    split = int(0.9 * len(data))
    train = batches(data[:split], (n, size["batch"]), size["seq_len"], seed=0)  # [N, B, T + 1]: per worker
    params = init_params(jax.random.key(0), size["d_model"], size["n_layers"], size["n_heads"], size["seq_len"])
    state = trainer.init(params, tx.init(params))

    print(f"{rule.name}: {n} workers x {args.shard} devices, tau={tau}, {steps} steps")
    start, losses = time.time(), []
    for k in range(steps):
        state, metrics = trainer.step(state, next(train))  # one plain call per step
        losses.append(float(metrics["inner"]["loss"].mean()))  # each worker's loss: [N]
        if "sync" in metrics:  # every tau steps: the sync's figures
            weights = np.asarray(metrics["sync"]["weight"], np.float64).round(3).tolist()
            print(f"step {k:4d}  loss {losses[-1]:.3f}  synced, worker weights {weights}")

    before = jax.device_get(state)  # (kept for the tests: they recompute this last sync with NumPy)
    # A last sync: evaluate θ̄, the model the workers agree on (CO2: land the round still in flight).
    state, _ = trainer.flush(state) if args.rule == "co2" else trainer.sync(state)
    val = next(batches(data[split:], (32,), size["seq_len"], seed=1))
    val_loss = float(jax.jit(loss_fn)(jax.device_get(state.outer_params), val)[0])
    print(f"done in {time.time() - start:.1f}s: train loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"validation loss of the synced model {val_loss:.3f} (uniform bytes: {np.log(256):.3f})")
    return {"losses": losses, "val_loss": val_loss, "state": state, "before_sync": before}


if __name__ == "__main__":
    main()
