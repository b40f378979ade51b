"""A Flax NNX model as what ``LocalSGD`` trains (``LocalSGD.for_nnx``): the module is split once
(``nnx.split``) into its graph, its ``nnx.Param`` state (the params every worker trains and the
sync averages: an ``nnx.State``, a pytree) and its RNG streams; each step merges them back
(``nnx.merge``) for the user's ``loss_fn(model, batch)``.

Layer-wise rules (EDiT) sync each unit on its way into compute: the root first, then each block
inside the scan over the blocks. A model for them keeps its blocks stacked in one attribute
(``blocks``: a block module built under ``nnx.vmap``, every ``nnx.Param`` with a leading layer
axis) and runs them with ``scan_blocks(self.blocks, x)`` in its ``__call__``. The layout is then
``{"root": every other nnx.Param, "layers": the blocks' params}``; the library passes the root's
params through the sync's hook before the model is merged, and ``scan_blocks`` each block's
inside its scan. Outside a layer-wise step (evaluation, ``to_nnx``, plain use) ``scan_blocks`` is a
plain ``jax.lax.scan``.

RNG streams (``nnx.Rngs`` held by the model, for dropout): a functional step would replay the same
stream state every step, so with ``seed`` each stream is reseeded (``nnx.reseed``) from the key
``LocalSGD`` gives each worker and step; without ``seed``, the streams are as the model was built
(the same masks every step, said in the docs). State of other kinds (``nnx.BatchStat``: BatchNorm's
running statistics, caches) would be silently dropped by a functional step: refused, naming it.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from edit_jax.localsgd.layer_scan import scan_layers


class _Forward:
    """One traced forward of a layer-wise step: the sync's hook, the layers' inputs, their outputs."""

    def __init__(self, hook: Callable, layer_xs: Any):
        self.hook, self.layer_xs, self.layer_ys = hook, layer_xs, []


_FORWARD: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("edit_jax_nnx_forward", default=None)


def scan_blocks(blocks: nnx.Module, x: Any, **kw) -> Any:
    """``x`` through each block of ``blocks`` in turn (a ``jax.lax.scan``): a block module built
    under ``nnx.vmap`` (every ``nnx.Param`` stacked on a leading layer axis), each block taking and
    returning one carry plus ``kw``. In a ``LocalSGD.for_nnx`` layer-wise step each block's params
    pass through the sync's hook first. Other state of the blocks (RNG streams for dropout) is
    indexed per layer where it is stacked, and a stream shared by the layers gets the layer index
    folded into its key."""
    graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
    n = layer_count(params, "scan_blocks: blocks")
    forward = _FORWARD.get()
    hook = forward.hook if forward else (lambda unit, xs, which: (unit, None))
    xs = forward.layer_xs if forward else None
    is_key = lambda v: jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)

    def own(v, i):  # layer i's part of a leaf of the blocks' other state
        if np.ndim(v) and np.shape(v)[0] == n:
            return v[i]
        return jax.random.fold_in(v, i) if is_key(v) else v

    def layer(carry, unit):
        h, i = carry
        p, p_xs = unit
        p, ys = hook(p, p_xs, "layer")
        block = nnx.merge(graphdef, p, jax.tree.map(lambda v: own(v, i), rest))
        return (block(h, **kw), i + 1), ys

    (x, _), ys = scan_layers(layer, (x, 0), params, xs)  # (a staggered group's sync: in segments)
    if forward is not None:
        forward.layer_ys.append(ys)
    return x


def layer_count(stacked: Any, what: str) -> int:
    """The one leading size of every leaf of ``stacked`` (the layer axis); else a ValueError."""
    dims = sorted({np.shape(v)[0] if np.ndim(v) else 0 for v in jax.tree.leaves(stacked)})
    if len(dims) != 1 or dims[0] < 1:
        raise ValueError(f"{what}: every nnx.Param must be stacked on one leading layer axis (build the block under "
                         f"nnx.vmap), got leading sizes {dims}")
    return dims[0]


class NNXModel:
    """``model`` split into (graph, ``nnx.Param`` state, RNG streams); with ``blocks`` (the name of
    the attribute holding the stacked blocks) the params laid out for a layer-wise rule."""

    def __init__(self, model: nnx.Module, blocks: str | None = None):
        if not isinstance(model, nnx.Module):
            raise ValueError(f"model: expected a flax.nnx.Module, got {type(model).__name__}")
        self.graphdef, self.params, self.rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        self.blocks = blocks
        if blocks is not None:
            if not isinstance(getattr(model, blocks, None), nnx.Module) or blocks not in self.params:
                raise ValueError(f"blocks: the model has no attribute {blocks!r} holding a block module with "
                                 f"nnx.Param state (its params' top-level names: {sorted(self.params)})")
            layer_count(self.params[blocks], f"blocks: model.{blocks}")
            self.params = {"root": nnx.State({k: v for k, v in self.params.items() if k != blocks}),
                           "layers": self.params[blocks]}
        others = sorted({f"{type(v).__name__} at {'.'.join(map(str, path))}"
                         for path, v in nnx.to_flat_state(rest)}) if jax.tree.leaves(rest) else []
        if others:
            raise ValueError(f"model: holds state other than nnx.Param and RNG streams ({', '.join(others[:3])}"
                             f"{' ...' if len(others) > 3 else ''}): a functional step would drop its updates; "
                             "LocalSGD trains nnx.Param only (BatchNorm: use LayerNorm / RMSNorm)")
        is_var = lambda x: isinstance(x, nnx.Variable)
        self.streams = sorted({v.tag for v in jax.tree.leaves(self.rng_state, is_leaf=is_var) if is_var(v)})

    def merge(self, params: Any, key: jax.Array | None = None) -> nnx.Module:
        """The module at ``params`` (laid out as ``self.params``); with ``key``, each RNG stream
        reseeded from it (a stream stacked over the blocks: a key per layer)."""
        if self.blocks is not None:
            params = nnx.State({**params["root"], self.blocks: params["layers"]})
        # The streams rebuilt here (a tree map makes new variables): the split's belong to the trace
        # they were made in, and reseeding them inside a jitted step would be a mutation across traces.
        model = nnx.merge(self.graphdef, params, jax.tree.map(lambda x: x, self.rng_state))
        if key is not None and self.streams:
            keys = {s: jax.random.fold_in(key, i) for i, s in enumerate(self.streams)}
            nnx.reseed(model, policy="match_shape", **keys)  # (a stream stacked over blocks: a key per layer)
        return model

    def loss_fn(self, user_loss: Callable) -> Callable:
        """``LocalSGD``'s ``loss_fn(params, batch, hook, hook_xs[, key])`` from the user's
        ``user_loss(model, batch) -> loss | (loss, metrics)``. Without ``blocks`` (whole-model rules)
        the hook is the identity; with them, the root's params pass through it here and each
        block's inside ``scan_blocks``."""
        def loss(params, batch, hook, hook_xs, *key):
            key = key[0] if key else None
            if self.blocks is None:
                out, ys = user_loss(self.merge(params, key), batch), None
            else:
                xs = hook_xs if hook_xs is not None else {"root": None, "layers": None}
                root, root_ys = hook(params["root"], xs["root"], "root")
                forward = _Forward(hook, xs["layers"])
                token = _FORWARD.set(forward)
                try:
                    out = user_loss(self.merge({"root": root, "layers": params["layers"]}, key), batch)
                finally:
                    _FORWARD.reset(token)
                if len(forward.layer_ys) != 1:
                    raise ValueError(f"loss_fn: the model's forward must run its blocks with "
                                     f"edit_jax.scan_blocks(self.{self.blocks}, x) once; it ran it "
                                     f"{len(forward.layer_ys)} times")
                ys = {"root": root_ys, "layers": forward.layer_ys[0]}
            if isinstance(out, tuple):
                if len(out) != 2 or not isinstance(out[1], dict):
                    raise ValueError("loss_fn: must return loss or (loss, metrics), metrics a dict of scalars; got "
                                     f"a tuple of {len(out)}")
                return out[0], ys, out[1]
            return out, ys, {}
        return loss


def transformation(optimizer) -> Any:
    """An optax transformation, or the one an ``nnx.Optimizer`` holds (its ``tx``)."""
    if isinstance(optimizer, nnx.Optimizer):
        return optimizer.tx
    if not hasattr(optimizer, "update") or not hasattr(optimizer, "init"):
        raise ValueError(f"optimizer: expected an optax GradientTransformation or an nnx.Optimizer, got "
                         f"{type(optimizer).__name__}")
    return optimizer


__all__ = ["NNXModel", "layer_count", "scan_blocks", "transformation"]
