"""Model families: the seam between the training machinery and a model's maths.

``model.family`` in the config names a module that provides the forward-with-hook contract, and
the step code reaches the model only through it:

- ``init_params(cfg: ModelConfig, key) -> params``: full fp32 params laid out as
  ``{"root": {...}, "layers": {... stacked along a leading layer axis ...}}``;
- ``forward(cfg, params, tokens, hook, hook_xs=None) -> (logits, ys)``: every unit's params (the
  root first, then each layer inside a scan) pass through ``hook(unit, unit_xs, which)`` on their
  way into compute (``which`` is "root" or "layer"); ``hook_xs``/``ys`` are per-unit inputs and
  outputs laid out like the params (``{"root": ..., "layers": ...}``);
- ``token_loss_sum(logits, targets) -> scalar``;
- with remat, the family keeps the values the hook names ``HOOK_SAVED`` (its checkpoint policy
  saves them) and recomputes the rest;
- the hook may be a ``SplitHook`` (its two halves, ``sync`` and ``gather``): the family may then
  call the halves apart, to issue layer l+1's sync while layer l computes (the llama family does
  for the layers that sync: their all-reduce across ``replica`` then overlaps a layer's compute);
- ``flops_per_token(cfg: ModelConfig, seq_len) -> float``: training FLOPs per token (forward and
  backward, remat's recomputation not counted), for the MFU of every training record;
- optionally ``loss_sum(cfg, params, tokens, targets, hook, hook_xs=None) -> (scalar, ys)``: the
  forward and the loss in one, so that a family can avoid materialising the whole logits (the
  llama family makes them ``model.loss_chunk`` positions at a time); used where present.

The hook is where FSDP gathers a unit and where EDiT syncs it, so any model with this contract
trains with every method. To add a family: a module with those four functions and one line in
``FAMILIES``. This module does not import JAX (configs are validated, ``validate`` below, before
JAX starts).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from edit_jax.config import Config, require

FAMILIES = {"llama": "edit_jax.models.llama"}
# The name (``jax.ad_checkpoint.checkpoint_name``) of a hook's value that a family's remat keeps
# for the backward pass instead of recomputing it. EDiT's hook names each synced unit so: what
# made it crosses ``replica`` (the sync's all-reduce), and recomputing it in the backward would
# send the whole sync a second time. Everything after it (the FSDP gather within ``shard``, the
# layer's compute) is still recomputed.
HOOK_SAVED = "hook_saved"
CONTRACT = ("init_params", "forward", "token_loss_sum", "flops_per_token")  # loss_sum is optional


@dataclass(frozen=True)
class SplitHook:
    """A hook in two halves. ``sync(unit, xs, which) -> (unit', ys)``: EDiT's sync of the unit's
    shard (the unit unchanged and ys None when ``xs`` is None); ``gather(unit', which)``: the params
    ready for compute (the FSDP gather). Called whole, it is the plain hook."""
    sync: Callable[[Any, Any, str], tuple[Any, Any]]
    gather: Callable[[Any, str], Any]

    def __call__(self, unit, xs, which):
        unit, ys = self.sync(unit, xs, which)
        return self.gather(unit, which), ys


def model_family(name: str) -> ModuleType:
    """The module of family ``name`` (checked by ``validate``)."""
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    module = importlib.import_module(FAMILIES[name])
    missing = [f for f in CONTRACT if not hasattr(module, f)]
    if missing:  # a family without e.g. flops_per_token would report a wrong MFU silently
        raise TypeError(f"model family {name!r} ({FAMILIES[name]}) lacks {', '.join(missing)} of the family contract")
    return module


def validate(cfg: Config) -> None:
    """``model.family`` names a family of ``FAMILIES``."""
    require(cfg.model.family in FAMILIES, "model.family",
            f"expected one of {', '.join(FAMILIES)}; got {cfg.model.family!r}")


__all__ = ["FAMILIES", "CONTRACT", "HOOK_SAVED", "SplitHook", "model_family", "validate"]
