"""The gain-driven local search of DT-FM's hybrid GA: balance-preserving cyclic moves between groups.

* ``_MoveState``: labels plus per-group link-cost sums, updated move by move (every gain a lookup).
* ``_mover_and_gains``: which device leaves a group, and its gain for every target ("paper" or "kl").
* ``_cyclic_move``: one chain of moves start -> g1 -> ... -> start, kept up to its best closed prefix.
* ``local_search``: cyclic moves from every group, in random order, for some rounds.

The gains read only the link-cost matrix, never the true objective, so the search's budget of
objective evaluations (``search.py``) does not count them, as in the paper.
"""

from __future__ import annotations

import numpy as np


# ----------------------------------------------------------------------------------------------
# Local search: cyclic moves driven by a gain
# ----------------------------------------------------------------------------------------------

class _MoveState:
    """Labels plus the (G, N) sums of gain-link costs from each group to each device, updated
    incrementally so that every gain is a lookup (the pair matrix is symmetric)."""

    def __init__(self, labels: np.ndarray, pair: np.ndarray, num_groups: int, pair_no_self: np.ndarray):
        self.labels = labels.copy()
        self.pair = pair
        self.pair_no_self = pair_no_self  # pair with +inf on the diagonal
        self.num_groups = num_groups
        onehot = np.zeros((num_groups, labels.size))
        onehot[labels, np.arange(labels.size)] = 1.0
        self.sums = onehot @ pair  # sums[g, d] = sum of pair[members of g, d]
        self.counts = np.bincount(labels, minlength=num_groups).astype(np.float64)

    def move(self, device: int, target: int) -> None:
        source = self.labels[device]
        row = self.pair[device]
        self.sums[source] -= row
        self.sums[target] += row
        self.counts[source] -= 1.0
        self.counts[target] += 1.0
        self.labels[device] = target


def _mover_and_gains(state: _MoveState, group: int, locked: np.ndarray, kind: str):
    """Pick the device to move out of ``group`` and its gain for every target group.

    paper: the mover is an endpoint of the group's fastest internal link (a device whose
      cheapest in-group link is smallest; ties broken by the best gain); gain(v, S->T) =
      mean link cost from v to T - v's cheapest link inside S. Moving a device out of a group
      that already holds a fast partner into a group it is far from spreads fast links across
      groups, which is what the pipeline matchings need.
    kl: the textbook Kernighan-Lin gain, keeping fast links inside groups: gain(v, S->T) =
      mean cost to S - mean cost to T; the mover is the device with the best gain.
    Returns (-1, None) when every device of the group is locked."""
    in_group = state.labels == group
    movable = np.flatnonzero(in_group & ~locked)
    if movable.size == 0:
        return -1, None
    denominators = np.maximum(state.counts - (np.arange(state.num_groups) == group), 1.0)
    mean = state.sums[:, movable].T / denominators  # (movable, G): mean cost to each group
    if kind == "paper":
        cheapest_inside = state.pair_no_self[movable][:, in_group].min(axis=1)
        if not np.isfinite(cheapest_inside[0]):
            cheapest_inside[:] = 0.0  # a group of one has no internal link
        fastest = np.flatnonzero(cheapest_inside <= cheapest_inside.min() + 1e-12)
        gains = mean[fastest] - cheapest_inside[fastest, None]
        candidates = movable[fastest]
    else:
        gains = mean[:, [group]] - mean
        candidates = movable
    gains[:, group] = -np.inf
    row = int(gains.max(axis=1).argmax()) if len(candidates) > 1 else 0
    return int(candidates[row]), gains[row]


def _cyclic_move(state: _MoveState, start: int, kind: str) -> float:
    """One balance-preserving chain of moves start -> g1 -> g2 -> ... -> start.

    Each step moves the current group's mover to the unvisited group of best gain; after every
    step, closing the chain (the next mover goes back to ``start``) is considered, and the closed
    prefix of largest total gain is applied if that total is positive. Returns the gain applied."""
    num_groups = state.num_groups
    locked = np.zeros(state.labels.size, dtype=bool)
    visited = np.zeros(num_groups, dtype=bool)
    visited[start] = True
    moves: list[tuple[int, int]] = []  # (device, source group)
    total, best_total, best_prefix, best_closer = 0.0, 1e-12, -1, None
    current = start
    for _ in range(num_groups):
        device, gains = _mover_and_gains(state, current, locked, kind)
        if device < 0:
            break
        if moves:
            closing = total + gains[start]
            if closing > best_total:
                best_total, best_prefix, best_closer = closing, len(moves), (device, current)
        if len(moves) == num_groups - 1:
            break
        gains[visited] = -np.inf
        target = int(gains.argmax())
        if not np.isfinite(gains[target]):
            break
        total += gains[target]
        moves.append((device, current))
        state.move(device, target)
        locked[device] = True
        visited[target] = True
        current = target
    keep = max(best_prefix, 0)
    for device, source in reversed(moves[keep:]):  # undo the moves past the best closed prefix
        state.move(device, source)
    if best_closer is None:
        return 0.0
    state.move(best_closer[0], start)
    return best_total


_NO_SELF_CACHE: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _no_self(pair: np.ndarray) -> np.ndarray:
    """``pair`` with +inf on the diagonal, cached per matrix (the searches reuse one matrix)."""
    cached = _NO_SELF_CACHE.get(id(pair))
    if cached is None or cached[0] is not pair:
        no_self = pair.copy()
        np.fill_diagonal(no_self, np.inf)
        _NO_SELF_CACHE.clear()
        _NO_SELF_CACHE[id(pair)] = cached = (pair, no_self)
    return cached[1]


def local_search(labels: np.ndarray, pair: np.ndarray, num_groups: int, kind: str,
                 rng: np.random.Generator, rounds: int = 1) -> np.ndarray:
    """Cyclic moves from every group (random order), ``rounds`` times or until none helps."""
    state = _MoveState(labels, pair, num_groups, _no_self(pair))
    for _ in range(rounds):
        improved = False
        for start in rng.permutation(num_groups):
            if _cyclic_move(state, int(start), kind) > 0:
                improved = True
        if not improved:
            break
    return state.labels
