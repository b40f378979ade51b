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
  llama family makes them ``model.loss_chunk`` positions at a time); used where present;
- optionally ``attention_impl(cfg, backend) -> str``: the attention kernel the family will use on
  ``backend`` ("gpu", "cpu"), which the step programs resolve for their mesh's devices;
- optionally ``causal_flops_per_token(cfg, seq_len) -> float``: the same FLOPs with causal attention
  counted for the half it computes (records then carry ``mfu_causal`` beside ``mfu``);
- ``forward``'s ``layer_segments`` (the streaming sync, ``sync.fragments > 1``): a list of
  ``(n, xs)`` covering the layers in order; the stack is scanned segment by segment, a segment's
  layers with its own hook inputs ``xs`` (None: a segment that only gathers), and ``ys["layers"]``
  is then the list of the segments' ys (None for an empty segment).

The same contract as typing Protocols: ``ModelFamily`` (a family module), ``Hook``, and
``ScannedModel``, the smaller part of it that ``localsgd/api.py``'s layer-wise rules need of any
model (a user's own Flax model, no config): params ``{"root", "layers"}`` with the layers stacked,
every unit through the hook, ``hook_xs`` in and ``ys`` out laid out like the params.

The hook is where FSDP gathers a unit and where EDiT syncs it, so any model with this contract
trains with every method. To add a family: a module with those four functions and one line,
``register(name, module, config_class)``. ``config_class`` (a ``config.FamilyConfig`` subclass with
the family's own fields) is what the config's ``model`` section parses as when ``model.family`` is
``name``: register before a config of that family is read (without one, the family reads Llama's
``ModelConfig``). Optionally the module's ``validate(cfg)`` checks its own fields (raising
``ConfigError`` naming the key) before any work. This module does not import JAX (configs are
validated, ``validate`` below, before JAX starts).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Protocol, runtime_checkable

from edit_jax.config import MODEL_CONFIGS, Config, FamilyConfig, ModelConfig, model_config_class, require
from edit_jax.models import sizes

FAMILIES = {"llama": "edit_jax.models.llama"}
# The name (``jax.ad_checkpoint.checkpoint_name``) of a hook's value that a family's remat keeps
# for the backward pass instead of recomputing it. EDiT's hook names each synced unit so: what
# made it crosses ``replica`` (the sync's all-reduce), and recomputing it in the backward would
# send the whole sync a second time. Everything after it (the FSDP gather within ``shard``, the
# layer's compute) is still recomputed.
HOOK_SAVED = "hook_saved"
CONTRACT = ("init_params", "forward", "token_loss_sum", "flops_per_token")  # and OPTIONAL, below


Params = Any  # {"root": {...}, "layers": {... every leaf stacked on a leading layer axis ...}}
OPTIONAL = ("loss_sum", "attention_impl", "validate", "causal_flops_per_token")  # used where a family has them


class Hook(Protocol):
    """``hook(unit, unit_xs, which) -> (params ready for compute, unit_ys)``; ``which`` is "root" or
    "layer"; ``unit_xs`` None: no input for this unit (the hook then returns its ys as None)."""

    def __call__(self, unit: Any, unit_xs: Any, which: str) -> tuple[Any, Any]: ...


class ScannedModel(Protocol):
    """A forward (or a loss) whose units pass a hook, what a layer-wise sync needs of a model.

    ``params`` is ``{"root": ..., "layers": ...}``, every leaf of ``"layers"`` stacked on a leading
    layer axis of one size L. The call passes ``params["root"]`` through ``hook(root, xs["root"],
    "root")`` first, then each layer l, inside its ``jax.lax.scan`` over the stacked layers, through
    ``hook(layer_l, xs["layers"][l], "layer")``, and computes only with what the hooks return (a
    unit used around the hook would miss the sync). ``hook_xs`` is ``{"root": ..., "layers": ...}``
    (the layers' entry scanned with the layers) or None (every unit's input None); the call returns
    ``(output, ys)``, ``ys = {"root": root's ys, "layers": the scan's stacked ys}``."""

    def __call__(self, params: Params, batch: Any, hook: Hook, hook_xs: Any = None) -> tuple[Any, Any]: ...


@runtime_checkable
class ModelFamily(Protocol):
    """A family module (see the module's docstring; ``loss_sum`` and ``attention_impl`` are optional
    and looked up with ``hasattr``, so they are not members here): ``isinstance(module, ModelFamily)``."""

    def init_params(self, cfg: Any, key: Any) -> Params: ...

    def forward(self, cfg: Any, params: Params, tokens: Any, hook: Hook = ..., hook_xs: Any = None,
                layer_segments: Any = None) -> tuple[Any, Any]: ...

    def token_loss_sum(self, logits: Any, targets: Any) -> Any: ...

    def flops_per_token(self, cfg: Any, seq_len: int) -> float: ...


def identity_hook(unit, unit_xs, which):
    """The hook of a forward without a sync: the unit unchanged, no output (``Hook``)."""
    del unit_xs, which
    return unit, None


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


def register(name: str, module: str, config_class: type | None = None) -> None:
    """Adds family ``name``: ``module`` (an importable module path) meets the contract;
    ``config_class`` (a ``FamilyConfig`` subclass; None: Llama's ``ModelConfig``) is its ``model``
    section. The module is imported when the family is first used, not here."""
    config_class = ModelConfig if config_class is None else config_class
    if not (isinstance(config_class, type) and issubclass(config_class, FamilyConfig)):
        raise TypeError(f"model family {name!r}: its config class must subclass edit_jax.config.FamilyConfig "
                        f"(the fields every family has), got {config_class!r}")
    FAMILIES[name] = module
    MODEL_CONFIGS[name] = config_class


def validate(cfg: Config) -> None:
    """``model.family`` names a family of ``FAMILIES`` and the model section is its config class;
    Llama's sizes fit XLA's int64 (``sizes.py``); another family's own ``validate`` where it has one."""
    name = cfg.model.family
    require(name in FAMILIES, "model.family", f"expected one of {', '.join(FAMILIES)}; got {name!r}")
    expected = model_config_class(name)
    require(type(cfg.model) is expected, "model.family",
            f"{name!r} reads its model section as {expected.__module__}.{expected.__qualname__}, but the config's "
            f"model section is a {type(cfg.model).__qualname__}: build it with {expected.__qualname__}(...)")
    if name == "llama":  # sizes XLA cannot address abort in C++: refused here, in Python ints
        sizes.validate(cfg)
        return
    own = getattr(model_family(name), "validate", None)
    if own is not None:
        own(cfg)


__all__ = ["FAMILIES", "CONTRACT", "OPTIONAL", "HOOK_SAVED", "Params", "Hook", "ScannedModel", "ModelFamily",
           "SplitHook", "identity_hook", "model_family", "register", "validate"]
