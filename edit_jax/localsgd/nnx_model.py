"""A Flax NNX model as what ``LocalSGD`` trains (``LocalSGD.for_nnx``): the module is split once
(``nnx.split``) into its graph, its ``nnx.Param`` state (the params every worker trains and the
sync averages: an ``nnx.State``, a pytree) and its RNG streams; each step merges them back
(``nnx.merge``) for the user's ``loss_fn(model, batch)``.

RNG streams (``nnx.Rngs`` held by the model, for dropout): a functional step would replay the same
stream state every step, so with ``seed`` each stream is reseeded (``nnx.reseed``) from the key
``LocalSGD`` gives each worker and step; without ``seed``, the streams are as the model was built
(the same masks every step, said in the docs). State of other kinds (``nnx.BatchStat``: BatchNorm's
running statistics, caches) would be silently dropped by a functional step: refused, naming it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx


class NNXModel:
    """``model`` split into (graph, ``nnx.Param`` state, RNG streams)."""

    def __init__(self, model: nnx.Module):
        if not isinstance(model, nnx.Module):
            raise ValueError(f"model: expected a flax.nnx.Module, got {type(model).__name__}")
        self.graphdef, self.params, self.rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        others = sorted({f"{type(v).__name__} at {'.'.join(map(str, path))}"
                         for path, v in nnx.to_flat_state(rest)}) if jax.tree.leaves(rest) else []
        if others:
            raise ValueError(f"model: holds state other than nnx.Param and RNG streams ({', '.join(others[:3])}"
                             f"{' ...' if len(others) > 3 else ''}): a functional step would drop its updates; "
                             "LocalSGD trains nnx.Param only (BatchNorm: use LayerNorm / RMSNorm)")
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        self.streams = sorted({v.tag for v in jax.tree.leaves(self.rng_state, is_leaf=is_var) if is_var(v)})

    def merge(self, params: Any, key: jax.Array | None = None) -> nnx.Module:
        """The module at ``params``; with ``key``, each RNG stream reseeded from it."""
        # The streams rebuilt here (a tree map makes new variables): the split's belong to the trace
        # they were made in, and reseeding them inside a jitted step would be a mutation across traces.
        model = nnx.merge(self.graphdef, params, jax.tree.map(lambda x: x, self.rng_state))
        if key is not None and self.streams:
            nnx.reseed(model, **{s: jax.random.fold_in(key, i) for i, s in enumerate(self.streams)})
        return model

    def loss_fn(self, user_loss: Callable) -> Callable:
        """``LocalSGD``'s ``loss_fn(params, batch, hook, hook_xs[, key])`` from the user's
        ``user_loss(model, batch) -> loss | (loss, metrics)`` (whole-model rules: no hook)."""
        def loss(params, batch, hook, hook_xs, *key):
            del hook, hook_xs  # a whole-model rule: the hook is the identity
            out = user_loss(self.merge(params, key[0] if key else None), batch)
            if isinstance(out, tuple):
                if len(out) != 2 or not isinstance(out[1], dict):
                    raise ValueError("loss_fn: must return loss or (loss, metrics), metrics a dict of scalars; got "
                                     f"a tuple of {len(out)}")
                return out[0], None, out[1]
            return out, None, {}
        return loss


def transformation(optimizer) -> Any:
    """An optax transformation, or the one an ``nnx.Optimizer`` holds (its ``tx``)."""
    if isinstance(optimizer, nnx.Optimizer):
        return optimizer.tx
    if not hasattr(optimizer, "update") or not hasattr(optimizer, "init"):
        raise ValueError(f"optimizer: expected an optax GradientTransformation or an nnx.Optimizer, got "
                         f"{type(optimizer).__name__}")
    return optimizer


__all__ = ["NNXModel", "transformation"]
