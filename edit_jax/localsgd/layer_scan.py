"""The layer loop of a layer-wise sync whose units sync in staggered groups (``fragments``).

A sync inside the forward hands each layer its hook inputs through ``hook_xs["layers"]``, stacked
like the layers, and the model's ``jax.lax.scan`` over ``(layers, xs)`` meets each layer with its
own. When only a group of the layers syncs (``LocalSGD(..., fragments=F)``, the trainer's
``sync.fragments``), the layers before and after the group have no inputs: ``hook_xs["layers"]``
is then a ``LayerSegments``, the layers cut into ``[(n, xs or None), ...]`` in order, and the loop
runs one scan per segment (a segment without inputs only computes: the hook is the identity
there). ``scan_layers`` is that loop, the one ``LayerStack`` and ``scan_blocks`` run; a model that
writes its own scan calls it instead of ``jax.lax.scan``. Its ``ys`` are then the list of the
segments' ys (None for an empty segment), which the rule's ``assemble`` reads (the trainer's
``layer_segments``, ``models.family``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax


@dataclass(frozen=True)
class LayerSegments:
    """The layers' hook inputs of a staggered group's sync: ``((n, xs or None), ...)`` covering the
    layers in order (``layerwise.forward_inputs``'s segments)."""

    parts: tuple


def _refuse(segments: LayerSegments):
    raise ValueError("hook_xs['layers'] holds a staggered group's sync (LocalSGD fragments > 1): the layers run in "
                     "segments, which jax.lax.scan over (layers, hook_xs['layers']) cannot do; run them with "
                     "edit_jax.scan_layers(body, carry, layers, hook_xs['layers']) (LayerStack and scan_blocks do)")


# A pytree node only so that a model scanning hook_xs["layers"] itself gets one line saying what to call.
jax.tree_util.register_pytree_node(LayerSegments, _refuse, lambda aux, children: LayerSegments(aux))


def scan_layers(body: Callable, carry: Any, layers: Any, xs: Any, **scan_kw) -> tuple[Any, Any]:
    """``jax.lax.scan(body, carry, (layers, xs))``, the layers stacked on their leading axis; with
    ``xs`` a ``LayerSegments``, one scan per segment over its slice of ``layers`` (the carry passing
    on), and the ys the list of the segments' (None for an empty segment)."""
    if not isinstance(xs, LayerSegments):
        return jax.lax.scan(body, carry, (layers, xs), **scan_kw)
    ys, start = [], 0
    for n, seg_xs in xs.parts:
        if n == 0:
            ys.append(None)
            continue
        seg = jax.tree.map(lambda p: p[start:start + n], layers)  # noqa: B023 - called at once
        carry, seg_ys = jax.lax.scan(body, carry, (seg, seg_xs), **scan_kw)
        ys.append(seg_ys)
        start += n
    return carry, ys


__all__ = ["LayerSegments", "scan_layers"]
