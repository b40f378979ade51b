"""Network topologies for the placement scheduler: N devices, their links, optional attributes.

A topology is a delay matrix (ms) and a bandwidth matrix (Gbit/s) over N devices, plus optional
per-device compute speed (TFLOP/s), memory (GB) and a region label. Links may be asymmetric in
the input; the scheduler works on the symmetric mean of both directions (PLACEMENT.md), so
``Topology`` always stores symmetrised matrices. The diagonal is meaningless (a device does not
talk to itself over the network) and is ignored: it is stored as delay 0 and bandwidth +inf.

Built-in scenarios (the five 64-GPU networks of the DT-FM paper) are available by name through
``scenario(name)``; names are ``ondemand``, ``spot``, ``multi_dc``, ``regional``, ``world``
(cases 1-5, also accepted as ``1``..``5``).

File formats accepted by ``load_topology(path)``:

JSON (``*.json``)::

    {"delay_ms": [[...N floats...], ...N rows],        # required, N x N, >= 0
     "bandwidth_gbps": [[...], ...],                    # required, N x N, > 0 off the diagonal
     "speed_tflops": [...N floats...],                  # optional, > 0 (default 50 each)
     "memory_gb": [...N floats...],                     # optional, > 0 (default 32 each)
     "regions": ["name", ...N strings],                 # optional labels, used only for reports
     "name": "my-cluster"}                              # optional

CSV (any other extension): one link per line, ``src,dst,delay_ms,bandwidth_gbps`` with 0-based
device indices; a header line starting with a non-digit is skipped, ``#`` starts a comment. N is
the largest index + 1. Every unordered pair must appear at least once; a pair given in both
directions is averaged (that is the symmetrisation), a pair given once is used for both
directions. Per-device attributes are not expressible in CSV (use JSON).

Every validation failure raises ``PlacementError`` naming the file and the field.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field

import numpy as np

DEFAULT_SPEED_TFLOPS = 50.0  # effective (not peak) mixed-precision rate of a V100-class GPU
DEFAULT_MEMORY_GB = 32.0  # V100 32 GB, the paper's devices


class PlacementError(ValueError):
    """Bad placement input: a malformed topology, option or placement file. Names the culprit."""


@dataclass(frozen=True)
class Topology:
    """Symmetrised link matrices plus per-device attributes. Build with ``make_topology``."""

    delay_ms: np.ndarray  # (N, N), symmetric, diagonal 0
    bandwidth_gbps: np.ndarray  # (N, N), symmetric, diagonal +inf
    speed_tflops: np.ndarray  # (N,)
    memory_gb: np.ndarray  # (N,)
    regions: tuple[str, ...] = field(default=())  # () when unknown
    name: str = "custom"

    @property
    def num_devices(self) -> int:
        return int(self.delay_ms.shape[0])

    def region_ids(self) -> np.ndarray:
        """Integer region id per device (order of first appearance); all 0 when unlabelled."""
        if not self.regions:
            return np.zeros(self.num_devices, dtype=np.int64)
        index: dict[str, int] = {}
        return np.array([index.setdefault(r, len(index)) for r in self.regions], dtype=np.int64)


def _as_square_matrix(value, what: str, source: str) -> np.ndarray:
    try:
        matrix = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PlacementError(f"{source}: {what} is not a numeric matrix ({exc})") from None
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise PlacementError(f"{source}: {what} must be a square N x N matrix, got shape {matrix.shape}")
    if matrix.shape[0] < 2:
        raise PlacementError(f"{source}: {what} needs at least 2 devices, got {matrix.shape[0]}")
    return matrix


def _check_off_diagonal(matrix: np.ndarray, what: str, source: str, *, positive: bool) -> None:
    """Reject NaN/inf and out-of-range values off the diagonal, naming the first bad entry."""
    off = ~np.eye(matrix.shape[0], dtype=bool)
    bad_finite = off & ~np.isfinite(matrix)
    if bad_finite.any():
        i, j = np.argwhere(bad_finite)[0]
        raise PlacementError(f"{source}: {what}[{i}][{j}] = {matrix[i, j]} is not a finite number")
    bad_range = off & ((matrix <= 0) if positive else (matrix < 0))
    if bad_range.any():
        i, j = np.argwhere(bad_range)[0]
        rule = "must be > 0" if positive else "must be >= 0"
        raise PlacementError(f"{source}: {what}[{i}][{j}] = {matrix[i, j]} {rule}")


def _per_device(value, n: int, what: str, source: str, default: float) -> np.ndarray:
    if value is None:
        return np.full(n, default, dtype=np.float64)
    try:
        vector = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PlacementError(f"{source}: {what} is not a list of numbers ({exc})") from None
    if vector.shape != (n,):
        raise PlacementError(f"{source}: {what} must have one value per device ({n}), got shape {vector.shape}")
    if not np.all(np.isfinite(vector)) or np.any(vector <= 0):
        i = int(np.argmax(~np.isfinite(vector) | (vector <= 0)))
        raise PlacementError(f"{source}: {what}[{i}] = {vector[i]} must be a finite number > 0")
    return vector


def make_topology(delay_ms, bandwidth_gbps, *, speed_tflops=None, memory_gb=None, regions=None,
                  name: str = "custom", source: str = "topology") -> Topology:
    """Validate and symmetrise raw matrices. ``source`` names the origin in error messages."""
    delay = _as_square_matrix(delay_ms, "delay_ms", source)
    bandwidth = _as_square_matrix(bandwidth_gbps, "bandwidth_gbps", source)
    if delay.shape != bandwidth.shape:
        raise PlacementError(f"{source}: delay_ms is {delay.shape} but bandwidth_gbps is {bandwidth.shape}")
    _check_off_diagonal(delay, "delay_ms", source, positive=False)
    _check_off_diagonal(bandwidth, "bandwidth_gbps", source, positive=True)
    n = delay.shape[0]
    delay = (delay + delay.T) / 2.0
    bandwidth = (bandwidth + bandwidth.T) / 2.0
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    region_labels: tuple[str, ...] = ()
    if regions is not None:
        region_labels = tuple(str(r) for r in regions)
        if len(region_labels) != n:
            raise PlacementError(f"{source}: regions must have one label per device ({n}), got {len(region_labels)}")
    return Topology(delay_ms=delay, bandwidth_gbps=bandwidth,
                    speed_tflops=_per_device(speed_tflops, n, "speed_tflops", source, DEFAULT_SPEED_TFLOPS),
                    memory_gb=_per_device(memory_gb, n, "memory_gb", source, DEFAULT_MEMORY_GB),
                    regions=region_labels, name=name)


# ----------------------------------------------------------------------------------------------
# The paper's five scenarios
# ----------------------------------------------------------------------------------------------

def _from_clusters(cluster_of_device: np.ndarray, within: tuple[float, float],
                   across_delay: np.ndarray, across_bandwidth: np.ndarray,
                   labels: list[str], name: str) -> Topology:
    """Devices in clusters: one (delay, bandwidth) inside a cluster, a cluster-pair table across."""
    same = cluster_of_device[:, None] == cluster_of_device[None, :]
    delay = np.where(same, within[0], across_delay[np.ix_(cluster_of_device, cluster_of_device)])
    bandwidth = np.where(same, within[1], across_bandwidth[np.ix_(cluster_of_device, cluster_of_device)])
    return make_topology(delay, bandwidth, regions=[labels[c] for c in cluster_of_device], name=name)


def _symmetric_table(names: list[str], entries: dict[tuple[str, str], tuple[float, float]]):
    k = len(names)
    delay = np.zeros((k, k))
    bandwidth = np.full((k, k), np.inf)
    pos = {n: i for i, n in enumerate(names)}
    for (a, b), (ms, gbps) in entries.items():
        delay[pos[a], pos[b]] = delay[pos[b], pos[a]] = ms
        bandwidth[pos[a], pos[b]] = bandwidth[pos[b], pos[a]] = gbps
    return delay, bandwidth


def ondemand() -> Topology:
    """Case 1: 8 nodes x 8 GPUs; 100 Gbit/s inside a node, 25 Gbit/s NIC per node = 3.125 per GPU."""
    node = np.arange(64) // 8
    k = 8
    return _from_clusters(node, (0.0, 100.0), np.zeros((k, k)), np.full((k, k), 3.125),
                          [f"node{i}" for i in range(k)], "ondemand")


def spot() -> Topology:
    """Case 2: devices 0-31 on 8 nodes of 4 GPUs, 32-63 single-GPU hosts; 1.25 Gbit/s across."""
    node = np.concatenate([np.arange(32) // 4, 8 + np.arange(32)])
    k = 40
    return _from_clusters(node, (0.0, 100.0), np.zeros((k, k)), np.full((k, k), 1.25),
                          [f"node{i}" for i in range(8)] + [f"host{i}" for i in range(32)], "spot")


def multi_dc() -> Topology:
    """Case 3: two data centers, Ohio 0-31 and Virginia 32-63."""
    region = np.arange(64) // 32
    delay, bandwidth = _symmetric_table(["Ohio", "Virginia"], {("Ohio", "Virginia"): (11.0, 1.12)})
    return _from_clusters(region, (1.0, 5.0), delay, bandwidth, ["Ohio", "Virginia"], "multi_dc")


REGIONAL_NAMES = ["Virginia", "Oregon", "California", "Ohio"]
REGIONAL_LINKS = {
    ("Virginia", "Oregon"): (67.0, 1.15), ("Virginia", "California"): (59.0, 1.05),
    ("Virginia", "Ohio"): (11.0, 1.12), ("Oregon", "California"): (12.0, 1.25),
    ("Oregon", "Ohio"): (49.0, 1.10), ("California", "Ohio"): (52.0, 1.02),
}


def regional() -> Topology:
    """Case 4: four US regions of 16 GPUs (Virginia, Oregon, California, Ohio)."""
    region = np.arange(64) // 16
    delay, bandwidth = _symmetric_table(REGIONAL_NAMES, REGIONAL_LINKS)
    return _from_clusters(region, (5.0, 2.0), delay, bandwidth, REGIONAL_NAMES, "regional")


WORLD_NAMES = ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]
_WORLD_ROWS = {  # upper triangle of PLACEMENT.md's case-5 table, (ms, Gbit/s)
    "Oregon": [(67, 0.79), (49, 1.10), (96, 0.523), (124, 0.46), (136, 0.42), (143, 0.404), (124, 0.482)],
    "Virginia": [(11, 1.12), (143, 0.524), (172, 0.500), (76, 1.16), (90, 1.02), (67, 1.05)],
    "Ohio": [(130, 0.694), (159, 0.529), (86, 1.05), (99, 0.799), (77, 1.14)],
    "Tokyo": [(34, 1.10), (210, 0.366), (223, 0.36), (199, 0.465)],
    "Seoul": [(238, 0.342), (235, 0.358), (228, 0.335)],
    "London": [(14, 1.14), (12, 1.09)],
    "Frankfurt": [(24, 1.08)],
}
WORLD_LINKS = {(a, WORLD_NAMES[WORLD_NAMES.index(a) + 1 + i]): (float(ms), float(gbps))
               for a, row in _WORLD_ROWS.items() for i, (ms, gbps) in enumerate(row)}


def world() -> Topology:
    """Case 5: eight cities x 8 GPUs, world-wide links."""
    region = np.arange(64) // 8
    delay, bandwidth = _symmetric_table(WORLD_NAMES, WORLD_LINKS)
    return _from_clusters(region, (5.0, 2.0), delay, bandwidth, WORLD_NAMES, "world")


SCENARIOS = {"ondemand": ondemand, "spot": spot, "multi_dc": multi_dc, "regional": regional, "world": world}

SCENARIO_ALIASES = {"1": "ondemand", "2": "spot", "3": "multi_dc", "4": "regional", "5": "world"}


def scenario(name: str) -> Topology:
    """One of the paper's five networks by name (or case number)."""
    key = SCENARIO_ALIASES.get(str(name), str(name))
    if key not in SCENARIOS:
        raise PlacementError(f"--scenario: unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    return SCENARIOS[key]()


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------

def load_topology(path: str) -> Topology:
    """Read a JSON or CSV topology (formats in the module docstring); errors name the file."""
    if not os.path.isfile(path):
        raise PlacementError(f"--topology: file {path!r} not found")
    if path.lower().endswith(".json"):
        return _load_json(path)
    return _load_csv(path)


def _load_json(path: str) -> Topology:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlacementError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PlacementError(f"{path}: expected a JSON object with delay_ms and bandwidth_gbps")
    for key in ("delay_ms", "bandwidth_gbps"):
        if key not in data:
            raise PlacementError(f"{path}: missing field {key!r}")
    unknown = set(data) - {"delay_ms", "bandwidth_gbps", "speed_tflops", "memory_gb", "regions", "name"}
    if unknown:
        raise PlacementError(f"{path}: unknown field(s) {sorted(unknown)}")
    name = str(data.get("name", os.path.splitext(os.path.basename(path))[0]))
    return make_topology(data["delay_ms"], data["bandwidth_gbps"], speed_tflops=data.get("speed_tflops"),
                         memory_gb=data.get("memory_gb"), regions=data.get("regions"), name=name, source=path)


def _load_csv(path: str) -> Topology:
    links: dict[tuple[int, int], list[tuple[float, float]]] = {}
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError) as exc:
        raise PlacementError(f"{path}: cannot read ({exc})") from None
    for lineno, row in enumerate(rows, start=1):
        cells = [c.strip() for c in row]
        if not cells or not cells[0] or cells[0].startswith("#"):
            continue
        if lineno == 1 and not cells[0].lstrip("-").isdigit():
            continue  # header
        if len(cells) != 4:
            raise PlacementError(f"{path}:{lineno}: expected src,dst,delay_ms,bandwidth_gbps, got {len(cells)} fields")
        try:
            src, dst = int(cells[0]), int(cells[1])
            delay, bandwidth = float(cells[2]), float(cells[3])
        except ValueError:
            raise PlacementError(f"{path}:{lineno}: cannot parse {','.join(cells)!r} as int,int,float,float") from None
        if src < 0 or dst < 0:
            raise PlacementError(f"{path}:{lineno}: device indices must be >= 0")
        if src == dst:
            continue
        links.setdefault((src, dst), []).append((delay, bandwidth))
    if not links:
        raise PlacementError(f"{path}: no links found")
    n = 1 + max(max(pair) for pair in links)
    delay = np.full((n, n), np.nan)
    bandwidth = np.full((n, n), np.nan)
    for (src, dst), values in links.items():
        delay[src, dst] = np.mean([v[0] for v in values])
        bandwidth[src, dst] = np.mean([v[1] for v in values])
    # a pair listed in only one direction is used for both
    delay = np.where(np.isnan(delay), delay.T, delay)
    bandwidth = np.where(np.isnan(bandwidth), bandwidth.T, bandwidth)
    missing = ~np.eye(n, dtype=bool) & np.isnan(delay)
    if missing.any():
        i, j = np.argwhere(missing)[0]
        raise PlacementError(f"{path}: no link given between devices {i} and {j} (need every pair of 0..{n - 1})")
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bandwidth, 1.0)
    return make_topology(delay, bandwidth, name=os.path.splitext(os.path.basename(path))[0], source=path)
