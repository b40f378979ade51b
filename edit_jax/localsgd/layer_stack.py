"""A linen model written the usual way, as the layout a layer-wise sync needs (``LayerStack``).

EDiT syncs unit by unit inside the forward: the root (embeddings, final norm, head) first, then
each block inside the scan over the stacked blocks (``models.family.ScannedModel``). A model
written the usual way has root modules and one block module, called in a plain forward. Give
them to ``LayerStack`` with that forward, written over the modules as callables:

    model = LayerStack(root={"embed": nn.Embed(256, d), "norm": nn.LayerNorm(), "head": nn.Dense(256)},
                       block=Block(n_heads), n_layers=4,
                       forward=lambda m, tokens: m.head(m.norm(m.blocks(m.embed(tokens)))))
    params = model.init(key, tokens)                   # {"root": {...}, "layers": stacked [L, ...]}
    logits, ys = model.apply(params, tokens, hook, hook_xs)

``init`` runs the forward once with every module initialising as it is first called (each root
module once, the block once per layer with its own key, stacked); ``apply`` passes the root's
params through ``hook(root, xs, "root")`` before anything computes and each block's through
``hook(block, xs, "layer")`` inside the ``jax.lax.scan`` (``m.blocks``), so the forward computes
only with synced params. ``hook`` defaults to the identity: the same ``apply`` serves the local
steps and evaluation. ``rngs``: linen's rngs for ``apply`` (dropout), folded per layer.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from edit_jax.localsgd.layer_scan import scan_layers
from edit_jax.models.family import identity_hook


class _Bound:
    """The modules as callables in one pass: ``m.NAME(...)`` (a root module) and ``m.blocks(x)``."""

    def __init__(self, call: Callable, blocks: Callable):
        self._call, self.blocks = call, blocks

    def __getattr__(self, name: str):
        return lambda *args, **kw: self._call(name, *args, **kw)


class LayerStack:
    """Root modules, one block module repeated ``n_layers`` times, and the forward over them; see
    the module docstring. Every block takes and returns one array (the residual stream) plus the
    keyword arguments given to ``m.blocks``."""

    def __init__(self, root: dict[str, Any], block: Any, n_layers: int, forward: Callable):
        if not isinstance(root, dict) or not root:
            raise ValueError(f"root: expected a dict of linen modules by name, got {root!r}")
        if "blocks" in root:
            raise ValueError("root: 'blocks' names the stacked block in the forward (m.blocks); rename that module")
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers: expected an integer >= 1, got {n_layers!r}")
        self.root, self.block, self.n_layers, self.forward = root, block, n_layers, forward

    def init(self, key: jax.Array, *args, **kw) -> dict:
        """``{"root": {name: params}, "layers": the block's params stacked [n_layers, ...]}``, from one
        run of the forward on example inputs ``args`` (shapes matter, values do not)."""
        root_params: dict[str, Any] = {}
        layers: list[Any] = []
        k_root, k_layers = jax.random.split(key)

        def call(name, *a, **k):
            if name not in self.root:
                raise ValueError(f"forward: called m.{name}, which is not a root module ({', '.join(self.root)})")
            if name not in root_params:
                out, variables = self.root[name].init_with_output(jax.random.fold_in(k_root, len(root_params)),
                                                                  *a, **k)
                root_params[name] = variables["params"]
                return out
            return self.root[name].apply({"params": root_params[name]}, *a, **k)

        def blocks(x, **k):
            if layers:
                raise ValueError("forward: m.blocks is called once per forward (it runs every layer)")
            keys = jax.random.split(k_layers, self.n_layers)
            layers.append(jax.vmap(lambda kk: self.block.init(kk, x, **k)["params"])(keys))
            return self._scan(layers[0], None, identity_hook, x, None, k)[0]

        self.forward(_Bound(call, blocks), *args, **kw)
        missing = [name for name in self.root if name not in root_params]
        if missing or not layers:
            raise ValueError(f"forward: every root module and m.blocks must be called once; not called: "
                             f"{missing + ([] if layers else ['blocks'])}")
        return {"root": root_params, "layers": layers[0]}

    def apply(self, params: dict, *args, hook: Callable | None = None, hook_xs: Any = None,
              rngs: dict | None = None, **kw) -> tuple[Any, dict]:
        """``(the forward's output, ys)``: the root's params through ``hook`` first (None: the
        identity), then each block's inside the scan; ``ys = {"root": ..., "layers": ...}``."""
        hook = identity_hook if hook is None else hook
        xs = hook_xs if hook_xs is not None else {"root": None, "layers": None}
        root, root_ys = hook(params["root"], xs["root"], "root")
        layer_ys = []

        def call(name, *a, **k):
            return self.root[name].apply({"params": root[name]}, *a, rngs=rngs, **k)

        def blocks(x, **k):
            x, ys = self._scan(params["layers"], xs["layers"], hook, x, rngs, k)
            layer_ys.append(ys)
            return x

        out = self.forward(_Bound(call, blocks), *args, **kw)
        if len(layer_ys) != 1:
            raise ValueError(f"forward: m.blocks must be called once per forward, got {len(layer_ys)}")
        return out, {"root": root_ys, "layers": layer_ys[0]}

    def _scan(self, stacked, stacked_xs, hook, x, rngs, kw):
        def layer(carry, unit):
            x, i = carry
            block_params, block_xs = unit
            block_params, ys = hook(block_params, block_xs, "layer")
            r = None if rngs is None else {n: jax.random.fold_in(k, i) for n, k in rngs.items()}
            return (self.block.apply({"params": block_params}, x, rngs=r, **kw), i + 1), ys

        (x, _), ys = scan_layers(layer, (x, 0), stacked, stacked_xs)  # (a staggered group's: in segments)
        return x, ys


__all__ = ["LayerStack"]
