"""Balanced partitions of devices into groups, as labels, and the structured layouts that seed a search.

* ``base_labels`` / ``random_partition``: the labels of a partition with the given group sizes.
* ``canonical_key``: a partition's identity, whatever the numbering of interchangeable groups.
* ``is_balanced`` / ``rebalance``: whether every group has its size; moving surplus devices to fill holes.
* ``cluster_levels``: single-linkage clusterings of the devices at increasing link-cost thresholds.
* ``block_layout`` / ``stripe_layout`` / ``structured_layouts``: groups of whole clusters, or one device per cluster.

A layout is ``labels`` (int array, labels[d] = group of device d) with fixed group sizes
(``search.py`` describes the searches that use them).
"""

from __future__ import annotations

import numpy as np


# ----------------------------------------------------------------------------------------------
# Partitions
# ----------------------------------------------------------------------------------------------

def base_labels(sizes: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


def random_partition(sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(base_labels(sizes))


def canonical_key(labels: np.ndarray, num_groups: int, fixed_groups=()) -> bytes:
    """Identity of the partition, independent of how interchangeable groups are numbered:
    groups are renamed in order of their first device (fixed groups keep their label)."""
    first = np.full(num_groups, labels.size)
    np.minimum.at(first, labels, np.arange(labels.size))
    rename = np.arange(num_groups)
    free = np.array([g for g in range(num_groups) if g not in fixed_groups])
    rename[free[np.argsort(first[free], kind="stable")]] = free
    return rename[labels].astype(np.int16).tobytes()


def is_balanced(labels: np.ndarray, sizes: np.ndarray) -> bool:
    return bool(np.array_equal(np.bincount(labels, minlength=len(sizes)), sizes))


def rebalance(labels: np.ndarray, sizes: np.ndarray, rng: np.random.Generator | None = None,
              protected: np.ndarray | None = None) -> np.ndarray:
    """Move surplus devices of over-full groups into under-full ones (in place, returned).

    Surplus devices are chosen at random (deterministically, last first, without ``rng``),
    preferring devices that are not ``protected`` (the ones crossover just copied)."""
    counts = np.bincount(labels, minlength=len(sizes))
    surplus = []
    for g in np.flatnonzero(counts > sizes):
        members = np.flatnonzero(labels == g)
        if protected is not None:  # unprotected devices leave first
            free, kept = members[~protected[members]], members[protected[members]]
            if rng is not None:
                free = rng.permutation(free)
            members = np.concatenate([free, kept])
        elif rng is not None:
            members = rng.permutation(members)
        else:
            members = members[::-1]
        surplus.extend(members[: counts[g] - sizes[g]].tolist())
    holes = np.repeat(np.arange(len(sizes)), np.maximum(sizes - counts, 0))
    if rng is not None:
        holes = rng.permutation(holes)
    labels[np.array(surplus, dtype=np.int64)] = holes
    return labels


# ----------------------------------------------------------------------------------------------
# Structured layouts from the topology's link-cost clusters
# ----------------------------------------------------------------------------------------------

def cluster_levels(pair_cost: np.ndarray, max_levels: int = 6) -> list[np.ndarray]:
    """Clusterings of the devices at increasing link-cost thresholds (single linkage).

    Level t joins devices connected by links of cost <= the t-th distinct cost: on the paper's
    networks the first level is the nodes / regions, later ones merge nearby regions. Returns a
    list of cluster-id arrays (ids in order of first device), coarsest all-in-one dropped."""
    n = pair_cost.shape[0]
    off = pair_cost[~np.eye(n, dtype=bool)]
    levels = np.unique(off)
    result: list[np.ndarray] = []
    seen: set[bytes] = set()
    for threshold in levels:
        cluster = _components(pair_cost <= threshold)
        if cluster.max() == 0:
            break
        key = cluster.tobytes()
        if key not in seen:
            seen.add(key)
            result.append(cluster)
        if len(result) >= max_levels:
            break
    return result


def _components(adjacent: np.ndarray) -> np.ndarray:
    n = adjacent.shape[0]
    cluster = np.full(n, -1)
    next_id = 0
    for start in range(n):
        if cluster[start] >= 0:
            continue
        stack = [start]
        cluster[start] = next_id
        while stack:
            d = stack.pop()
            for e in np.flatnonzero(adjacent[d] & (cluster < 0)):
                cluster[e] = next_id
                stack.append(int(e))
        next_id += 1
    return cluster


def block_layout(cluster: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Fill groups in order with the devices sorted by cluster: 'each group = one node/region'."""
    order = np.lexsort((np.arange(cluster.size), cluster))
    labels = np.empty(cluster.size, dtype=np.int64)
    labels[order] = base_labels(sizes)
    return labels


def stripe_layout(cluster: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The i-th device of every cluster goes to group i (mod G), then balance is repaired:
    'each group takes one device per node/region'. With 4-GPU nodes and single hosts (case 2)
    the node devices fill groups 0-3 and the single hosts spill into the others."""
    rank_in_cluster = np.zeros(cluster.size, dtype=np.int64)
    for c in np.unique(cluster):
        members = np.flatnonzero(cluster == c)
        rank_in_cluster[members] = np.arange(members.size)
    labels = rank_in_cluster % len(sizes)
    return rebalance(labels, sizes)


def structured_layouts(pair_cost: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Blocks and stripes for every cluster level, plus the plain index blocks and stripes."""
    n = pair_cost.shape[0]
    layouts = [block_layout(np.arange(n) // max(1, n // len(sizes)), sizes),
               stripe_layout(np.arange(n) // max(1, n // len(sizes)), sizes)]
    for cluster in cluster_levels(pair_cost):
        layouts.append(block_layout(cluster, sizes))
        layouts.append(stripe_layout(cluster, sizes))
    return layouts
