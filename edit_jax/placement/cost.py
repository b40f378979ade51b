"""DT-FM's cost model for a (pipeline x data-parallel) layout on a heterogeneous network.

A layout is a balanced partition of N devices into D_PP groups of D_DP devices: group j is the
data-parallel group of one pipeline stage (PLACEMENT.md). It is encoded as ``labels``, an int
array of length N with labels[d] = the group of device d. The model (which ranks layouts; it is
not a time predictor):

* DP(C) = max over d in C of sum_{d' in C, d' != d} 2 * (alpha/1000 + 8 c_DP / (D_DP beta)):
  a sharded parameter server (reduce-scatter + all-gather) whose sends are serial per device.
  DP cost = max over groups.
* PP: one node per group; the edge between two groups is the bottleneck perfect matching of
  alpha/1000 + 8 c_PP / beta; the stage order is the shortest open Hamiltonian path (exact
  Held-Karp); PP cost = its length.
* total = DP + 2 PP (forward activations and backward gradients both cross the pipeline).

Everything that depends only on the topology (per-pair link costs) is precomputed; bottleneck
matchings are cached by the pair of group memberships, since offspring in the search share most
groups with their parents.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.optimize import linear_sum_assignment

from edit_jax.placement.topology import PlacementError, Topology

# Message sizes as the reference feeds them into 8c/beta (PLACEMENT.md): GPT3-XL, 24 layers in 8
# stages. c_PP keeps the reference's 2024 (a typo for 2048) so that the published targets match.
GPT3_XL_C_DP_GB = 1.3e9 * 4 * 3 / 24 / 1e9
GPT3_XL_C_PP_GB = 2024 * 2048 * 2 * (125000 / 2048) / 1024**3


# ----------------------------------------------------------------------------------------------
# Per-pair link costs
# ----------------------------------------------------------------------------------------------

def transfer_seconds(topology: Topology, gigabytes: float) -> np.ndarray:
    """alpha/1000 + 8c/beta for every pair: seconds to send ``gigabytes`` over each link."""
    cost = topology.delay_ms / 1000.0 + 8.0 * gigabytes / topology.bandwidth_gbps
    np.fill_diagonal(cost, 0.0)
    return cost


def pairwise_dp_cost(topology: Topology, c_dp_gb: float, d_dp: int) -> np.ndarray:
    """Per-peer data-parallel cost 2*(alpha/1000 + 8 c_DP/(D_DP beta)): one shard there, one back."""
    cost = 2.0 * (topology.delay_ms / 1000.0 + 8.0 * c_dp_gb / (d_dp * topology.bandwidth_gbps))
    np.fill_diagonal(cost, 0.0)
    return cost


def pairwise_pp_cost(topology: Topology, c_pp_gb: float) -> np.ndarray:
    """Per-link pipeline cost alpha/1000 + 8 c_PP/beta: one stage's activations over the link."""
    return transfer_seconds(topology, c_pp_gb)


# ----------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------

def group_members(labels: np.ndarray, num_groups: int) -> list[np.ndarray]:
    """Sorted device indices of each group (works for unequal group sizes too)."""
    order = np.argsort(labels, kind="stable")
    bounds = np.cumsum(np.bincount(labels, minlength=num_groups))[:-1]
    return np.split(order, bounds)


def balanced_members(labels: np.ndarray, num_groups: int) -> np.ndarray:
    """(G, D) matrix of sorted members when every group has the same size D."""
    return np.argsort(labels, kind="stable").reshape(num_groups, -1)


def group_internal_cost(pair_cost: np.ndarray, members: np.ndarray) -> np.ndarray:
    """For each group (rows of ``members``): max over members of the summed cost to the others.

    This is the serial-sends all-to-all cost of DP(C) (and of an FSDP shard group in EDiT)."""
    sub = pair_cost[members[:, :, None], members[:, None, :]]  # (G, D, D)
    return sub.sum(axis=2).max(axis=1)


# ----------------------------------------------------------------------------------------------
# Bottleneck perfect matching
# ----------------------------------------------------------------------------------------------

def _has_perfect_matching(allowed: np.ndarray) -> bool:
    """Whether the bipartite graph ``allowed`` (k x k bools) has a perfect matching."""
    rows, cols = linear_sum_assignment(~allowed)  # minimise the number of forbidden pairs used
    return bool(allowed[rows, cols].all())


def bottleneck_value(cost: np.ndarray) -> float:
    """min over perfect matchings of the max matched cost, for a square ``cost`` matrix.

    Threshold search: the answer is one of the entries; it is at least the largest row minimum
    and the largest column minimum (every row and column must be matched), which is usually
    already feasible, so most calls need a single matching test."""
    lower = max(cost.min(axis=1).max(), cost.min(axis=0).max())
    if _has_perfect_matching(cost <= lower):
        return float(lower)
    candidates = np.unique(cost[cost > lower])
    lo, hi = 0, len(candidates) - 1  # candidates[hi] = max entry: always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _has_perfect_matching(cost <= candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(candidates[lo])


@lru_cache(maxsize=None)
def _hall_tables(k: int) -> tuple[np.ndarray, np.ndarray]:
    """Popcount of every k-bit mask, and the masks' sizes, for Hall-condition checks."""
    masks = np.arange(1 << k)
    popcount = np.array([bin(m).count("1") for m in range(1 << k)], dtype=np.int64)
    return popcount, popcount[masks]


def _perfect_matching_exists_batch(allowed: np.ndarray) -> np.ndarray:
    """Hall's condition, exactly and for a whole batch: (B, k, k) bools -> (B,) bools.

    A perfect matching exists iff every set X of rows has at least |X| neighbouring columns.
    Each row's neighbourhood is a k-bit mask; the neighbourhood of every row subset is built by
    doubling (subsets containing row i = subsets without it OR row i's mask), k vector steps."""
    batch, k, _ = allowed.shape
    row_masks = (allowed.astype(np.int64) << np.arange(k)).sum(axis=2)  # (B, k)
    neighbours = np.zeros((batch, 1 << k), dtype=np.int64)
    for i in range(k):
        half = 1 << i
        neighbours[:, half:2 * half] = neighbours[:, :half] | row_masks[:, i:i + 1]
    popcount, subset_size = _hall_tables(k)
    return (popcount[neighbours] >= subset_size).all(axis=1)


def bottleneck_values(subs: np.ndarray, levels: np.ndarray | None = None) -> np.ndarray:
    """``bottleneck_value`` for a batch of square matrices (B, k, k), vectorised over the batch.

    ``levels`` is a sorted array containing every entry of ``subs`` (e.g. all distinct link
    costs of the topology); a per-matrix binary search over it starts from the row/column-minimum
    lower bound. For k > 10 the 2^k Hall table gets large, so it falls back to the scalar path."""
    batch, k, _ = subs.shape
    if batch == 0:
        return np.zeros(0)
    if k > 10:
        return np.array([bottleneck_value(s) for s in subs])
    if levels is None:
        levels = np.unique(subs)
    lower = np.maximum(subs.min(axis=2).max(axis=1), subs.min(axis=1).max(axis=1))
    result = lower.copy()
    todo = ~_perfect_matching_exists_batch(subs <= lower[:, None, None])
    if todo.any():
        idx = np.flatnonzero(todo)
        sub_todo = subs[idx]
        lo = np.searchsorted(levels, lower[idx], side="right")  # first level above the bound
        hi = np.searchsorted(levels, sub_todo.max(axis=(1, 2)), side="left")  # always feasible
        while np.any(lo < hi):
            mid = (lo + hi) // 2
            feasible = _perfect_matching_exists_batch(sub_todo <= levels[mid][:, None, None])
            hi = np.where(feasible, mid, hi)
            lo = np.where(feasible, lo, mid + 1)
        result[idx] = levels[lo]
    return result


def bottleneck_matching(cost: np.ndarray) -> tuple[float, np.ndarray]:
    """Bottleneck value and one optimal matching (cols[i] = partner of row i).

    Among the bottleneck-optimal matchings it returns one of least total cost, which is the
    sensible tie-break for the device grid (it does not change the model's cost)."""
    value = bottleneck_value(cost)
    penalty = 1.0 + float(np.abs(cost).sum())
    rows, cols = linear_sum_assignment(np.where(cost <= value, cost, cost + penalty))
    return value, cols[np.argsort(rows)]


# ----------------------------------------------------------------------------------------------
# Open-loop TSP (shortest Hamiltonian path, free endpoints), exact Held-Karp
# ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _held_karp_layers(n: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """For each subset size s = 2..n: the masks of that size and, per (mask, last), mask - last."""
    masks = np.arange(1 << n)
    popcount = np.array([bin(m).count("1") for m in range(1 << n)])
    bits = 1 << np.arange(n)
    layers = []
    for size in range(2, n + 1):
        layer = masks[popcount == size]
        layers.append((layer, layer[:, None] ^ bits[None, :]))
    return tuple(layers)


def open_tsp(weights: np.ndarray) -> tuple[float, list[int]]:
    """Shortest path visiting every node once, any start and end; returns (length, order).

    Vectorised Held-Karp: best[mask, k] = cheapest path over ``mask`` ending at k, computed one
    subset size at a time with a (masks, k, j) gather. Entries for k outside the mask read rows
    of a larger, not yet computed size, which are still +inf, so no explicit validity mask is
    needed. O(2^n n^2); n <= ~15."""
    n = weights.shape[0]
    if n == 1:
        return 0.0, [0]
    if n > 16:
        raise PlacementError(f"open_tsp: {n} stages is too many for exact Held-Karp (max 16)")
    best = np.full((1 << n, n), np.inf)
    parent = np.full((1 << n, n), -1, dtype=np.int64)
    best[1 << np.arange(n), np.arange(n)] = 0.0
    into = weights.T  # into[k, j] = weight of the edge j -> k
    for layer, previous in _held_karp_layers(n):
        candidates = best[previous] + into[None, :, :]  # (masks, k, j)
        arg = candidates.argmin(axis=2)
        best[layer] = np.take_along_axis(candidates, arg[:, :, None], axis=2)[:, :, 0]
        parent[layer] = arg
    full = (1 << n) - 1
    last = int(np.argmin(best[full]))
    length = float(best[full, last])
    order = [last]
    mask = full
    while parent[mask, last] >= 0:
        prev = int(parent[mask, last])
        mask ^= 1 << last
        last = prev
        order.append(last)
    return length, order[::-1]


def open_tsp_length(weights: np.ndarray) -> float:
    """Length only of ``open_tsp`` (no back-pointers): the hot path of the search."""
    n = weights.shape[0]
    if n == 1:
        return 0.0
    best = np.full((1 << n, n), np.inf)
    best[1 << np.arange(n), np.arange(n)] = 0.0
    into = weights.T
    for layer, previous in _held_karp_layers(n):
        best[layer] = (best[previous] + into[None, :, :]).min(axis=2)
    return float(best[-1].min())


def path_length(weights: np.ndarray, order) -> float:
    return float(sum(weights[a, b] for a, b in zip(order[:-1], order[1:], strict=True)))


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DtfmLayout:
    """A fully decoded layout: costs, stage order and the (pipeline x stage) device grid."""

    cost: float
    dp_cost: float
    pp_cost: float
    stage_order: list[int]  # group ids in pipeline order
    grid: np.ndarray  # (D_DP, D_PP): grid[i, j] = device of pipeline i at stage j (stage_order[j])
    group_dp_costs: np.ndarray  # DP cost of each group (by group id)
    edge_costs: list[float]  # bottleneck cost of each pipeline hop, in order


class DtfmCostModel:
    """total = DP + 2 PP for labels of a D_PP x D_DP layout on ``topology``."""

    gain_kind = "spread"  # the group is the DP group; fast links should cross groups (for PP)

    def __init__(self, topology: Topology, d_pp: int = 8, d_dp: int | None = None,
                 c_dp_gb: float = GPT3_XL_C_DP_GB, c_pp_gb: float = GPT3_XL_C_PP_GB,
                 cache_size: int = 400_000):
        n = topology.num_devices
        if d_dp is None:
            d_dp = n // d_pp if d_pp > 0 else 0
        if d_pp < 1 or d_dp < 1 or d_pp * d_dp != n:
            raise PlacementError(f"D_PP x D_DP = {d_pp} x {d_dp} must equal the number of devices {n}")
        if d_pp > 16:
            raise PlacementError(f"D_PP = {d_pp}: exact Held-Karp supports at most 16 stages")
        self.topology = topology
        self.d_pp, self.d_dp = d_pp, d_dp
        self.num_groups = d_pp
        self.sizes = np.full(d_pp, d_dp)
        self.c_dp_gb, self.c_pp_gb = c_dp_gb, c_pp_gb
        self.dp_pair = pairwise_dp_cost(topology, c_dp_gb, d_dp)
        self.pp_pair = pairwise_pp_cost(topology, c_pp_gb)
        self.gain_pair = self.pp_pair  # what the local-search gains look at
        self._matching_cache: dict[tuple[bytes, bytes], float] = {}
        self._cache_size = cache_size
        self._iu = np.triu_indices(d_pp, 1)
        self._levels = np.unique(self.pp_pair)

    # -- pieces ------------------------------------------------------------------------------
    def dp_costs(self, members: np.ndarray) -> np.ndarray:
        return group_internal_cost(self.dp_pair, members)

    def stage_graph(self, members: np.ndarray) -> np.ndarray:
        """(G, G) bottleneck-matching costs between groups; cached per pair of memberships and
        computed in one batch for the pairs not in the cache."""
        keys = [m.tobytes() for m in members]
        g = len(keys)
        cache = self._matching_cache
        values = np.empty(len(self._iu[0]))
        pair_keys = []
        missing = []
        for p, (a, b) in enumerate(zip(*self._iu, strict=True)):
            key = (keys[a], keys[b]) if keys[a] < keys[b] else (keys[b], keys[a])
            value = cache.get(key)
            if value is None:
                missing.append(p)
                pair_keys.append(key)
            else:
                values[p] = value
        if missing:
            a_idx, b_idx = self._iu[0][missing], self._iu[1][missing]
            subs = self.pp_pair[members[a_idx][:, :, None], members[b_idx][:, None, :]]
            fresh = bottleneck_values(subs, self._levels)
            values[missing] = fresh
            if len(cache) + len(missing) > self._cache_size:
                cache.clear()
            cache.update(zip(pair_keys, fresh.tolist(), strict=True))
        graph = np.zeros((g, g))
        graph[self._iu] = values
        return graph + graph.T

    # -- objective ---------------------------------------------------------------------------
    def cost(self, labels: np.ndarray) -> float:
        members = balanced_members(labels, self.num_groups)
        dp = float(self.dp_costs(members).max())
        return dp + 2.0 * open_tsp_length(self.stage_graph(members))

    def index_order_cost(self, labels: np.ndarray) -> float:
        """Cost with the pipeline in group-index order instead of the TSP order (for the targets
        table's 'random layout, pipeline in index order' column)."""
        members = balanced_members(labels, self.num_groups)
        dp = float(self.dp_costs(members).max())
        graph = self.stage_graph(members)
        return dp + 2.0 * path_length(graph, list(range(self.num_groups)))

    def grid_cost(self, grid: np.ndarray) -> float:
        """Cost of a fully specified grid (rows = pipelines, columns = stages in pipeline order)
        with no scheduling at all: DP over the columns, and each pipeline hop paid at the slowest
        of the given pairs (no matching, no TSP). This is how the reference scores a random
        placement ('random layout, pipeline in index order' in PLACEMENT.md's targets)."""
        grid = np.asarray(grid)
        dp = float(self.dp_costs(grid.T).max())
        pp = float(self.pp_pair[grid[:, :-1], grid[:, 1:]].max(axis=0).sum())
        return dp + 2.0 * pp

    def random_grid(self, rng: np.random.Generator) -> np.ndarray:
        """A random placement: devices in random (pipeline, stage) positions."""
        return rng.permutation(self.topology.num_devices).reshape(self.d_dp, self.d_pp)

    def layout(self, labels: np.ndarray) -> DtfmLayout:
        """Decode labels into costs, stage order and the chained-matching device grid."""
        members = balanced_members(labels, self.num_groups)
        group_dp = self.dp_costs(members)
        graph = self.stage_graph(members)
        pp, order = open_tsp(graph)
        grid = np.empty((self.d_dp, self.d_pp), dtype=np.int64)
        grid[:, 0] = members[order[0]]
        for j in range(1, self.d_pp):
            prev = grid[:, j - 1]
            nxt = members[order[j]]
            _, cols = bottleneck_matching(self.pp_pair[np.ix_(prev, nxt)])
            grid[:, j] = nxt[cols]
        edges = [float(graph[a, b]) for a, b in zip(order[:-1], order[1:], strict=True)]
        dp = float(group_dp.max())
        return DtfmLayout(cost=dp + 2.0 * pp, dp_cost=dp, pp_cost=pp, stage_order=order, grid=grid,
                          group_dp_costs=group_dp, edge_costs=edges)


# ----------------------------------------------------------------------------------------------
# Brute-force references (for tests and tiny instances)
# ----------------------------------------------------------------------------------------------

def brute_force_bottleneck(cost: np.ndarray) -> float:
    k = cost.shape[0]
    return float(min(max(cost[i, p[i]] for i in range(k)) for p in itertools.permutations(range(k))))


def brute_force_open_tsp(weights: np.ndarray) -> float:
    n = weights.shape[0]
    return float(min(path_length(weights, p) for p in itertools.permutations(range(n))))
