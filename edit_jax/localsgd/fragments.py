"""Streaming sync (``sync.fragments=F``): which units form which fragment group.

The units (0: the root; 1 + l: layer l) are split into F contiguous groups, the root in group 0,
balanced by parameter count: of all contiguous splits, the one whose largest group is smallest
(ties: the earliest cuts), so the peak sync moves as little as whole units allow. Group f syncs at
the steps ``methods.StepSchedule.kind`` names ``"sync_forward@f"`` / ``"local_then_sync@f"``, one
compiled program per group holding only that group's collectives (programs.py; the sync of a group's
units, its ``fragment_layers`` span, is sync.py's).
"""

from __future__ import annotations

import math
from functools import partial

import jax

from edit_jax.config import Config
from edit_jax.models.family import model_family


def unit_param_counts(cfg: Config) -> list[int]:
    """Parameters of each unit: [root, layer 0, ..., layer L-1]."""
    abstract = jax.eval_shape(partial(model_family(cfg.model.family).init_params, cfg.model), jax.random.key(0))
    return unit_sizes(abstract, cfg.model.n_layers)


def group_span(params, n_layers: int, fragments: int, f: int) -> tuple[bool, int, int]:
    """``fragment_layers`` of group ``f`` of ``params`` (``{"root", "layers"}``, arrays or shapes)
    split into ``fragments`` groups as a run's units are (the API's, from its params' shapes)."""
    return fragment_layers(balanced_groups(unit_sizes(params, n_layers), fragments), f)


def unit_sizes(params, n_layers: int) -> list[int]:
    """Parameters of each unit of ``{"root": ..., "layers": <stacked>}`` (arrays or shapes)."""
    root = sum(math.prod(x.shape) for x in jax.tree.leaves(params["root"]))
    layer = sum(math.prod(x.shape) // n_layers for x in jax.tree.leaves(params["layers"]))
    return [root] + [layer] * n_layers


def balanced_groups(sizes: list[int], groups: int) -> tuple[int, ...]:
    """Group of each unit: the split of ``sizes`` (in order) into ``groups`` contiguous non-empty
    groups with the smallest largest group (ties: the earliest cuts). Unit 0 (the root) is in group 0."""
    n = len(sizes)
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(groups + 1)]  # best[g][i]: units [0, i) in g groups
    cut = [[0] * (n + 1) for _ in range(groups + 1)]
    best[0][0] = 0
    for g in range(1, groups + 1):
        for i in range(g, n + 1):
            for j in range(g - 1, i):
                v = max(best[g - 1][j], prefix[i] - prefix[j])
                if v < best[g][i]:
                    best[g][i], cut[g][i] = v, j
    out, i = [0] * n, n
    for g in range(groups, 0, -1):
        j = cut[g][i]
        out[j:i] = [g - 1] * (i - j)
        i = j
    return tuple(out)


def fragment_of_unit(cfg: Config) -> tuple[int, ...]:
    """Group of each unit (0: root, 1 + l: layer l) for ``sync.fragments``."""
    return balanced_groups(unit_param_counts(cfg), cfg.sync.fragments)


def fragment_layers(groups: tuple[int, ...], f: int) -> tuple[bool, int, int]:
    """(root in group f, first layer, end layer) of group f."""
    units = [u for u, g in enumerate(groups) if g == f]
    layers = [u - 1 for u in units if u > 0]
    lo = layers[0] if layers else 0
    return 0 in units, lo, (layers[-1] + 1) if layers else lo


__all__ = ["unit_param_counts", "balanced_groups", "fragment_of_unit", "fragment_layers"]
