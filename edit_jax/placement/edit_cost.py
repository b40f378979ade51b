"""Cost model for placing EDiT's (replica, shard) mesh on a heterogeneous network.

The mesh has N replicas (rows) of S devices (columns). A replica is one FSDP/ZeRO-3 worker: its S
devices talk every inner step (all-gather of the parameters for the forward and again for the
backward, reduce-scatter of the gradients: about 3 x params/S bytes to every peer). A sync group
(column k: the devices holding shard k in every replica) talks once every tau steps (the
pseudo-gradient: params/S bytes, reduce-scatter + all-gather over the N members, so each member
sends 2 x params/(S N) to every peer, divided by any compression ratio). PLACEMENT.md's analogy:
a replica is like a DT-FM pipeline row that must sit on fast links, a sync group is like a DT-FM
data-parallel column whose c_DP is divided by tau.

Per-step model (seconds; ranks placements, not a time predictor):

* compute_r = flops_per_token x tokens_per_device / speed of the slowest member of replica r
* fsdp_r = max over d in r of sum over peers d' in r of 3 (alpha/1000 + 8 c_shard / beta)
  (serial sends per device, as in DT-FM's DP cost), c_shard = params x comm_bytes / S in GB
* step_r = compute_r + fsdp_r
* sync = max over columns k of max over d in k of sum over d' in k of
  2 (alpha/1000 + 8 c_shard / (N beta compression)); per step it costs sync (1 - overlap) / tau
  (``overlap``: the fraction EDiT's layer-wise sync hides behind the forward)
* EDiT (synchronous): cost = max_r step_r + sync (1 - overlap) / tau
* A-EDiT (asynchronous): replicas step at their own pace; throughput = sum_r tokens_r / t_r with
  t_r = step_r + sync (1 - overlap) / tau. The cost minimised is the equivalent step time
  (sum_r tokens_r) / throughput, the inverse of throughput in step units, so heterogeneity
  across replicas costs little but a slow device inside a replica still slows that replica.

Memory is a hard constraint: every placed device holds 1/S of the parameters and of the AdamW
and outer (anchor + Nesterov trace) states: params x state_bytes / S. Devices without that much
memory can only be left idle; with more devices than N x S the search also chooses which devices
stay idle (group N, the idle group), otherwise a device that lacks memory is an error.

Search labels: labels[d] = replica of device d (N = idle). Given the replicas, the columns (which
device of each replica holds which shard) are chosen greedily: replica after replica, a linear
assignment of its devices to the columns built so far, minimising the summed sync link cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from edit_jax.placement.cost import group_internal_cost, group_members
from edit_jax.placement.partitions import block_layout, cluster_levels, stripe_layout
from edit_jax.placement.topology import PlacementError, Topology


@dataclass(frozen=True)
class EditLayout:
    cost: float  # the objective: seconds per step (EDiT) or equivalent step time (A-EDiT)
    grid: np.ndarray  # (N, S): grid[r, s] = device of replica r, shard s
    replica_step: np.ndarray  # (N,) compute + FSDP seconds of each replica
    replica_compute: np.ndarray
    replica_fsdp: np.ndarray
    sync_seconds: float  # one pseudo-gradient sync (slowest column)
    sync_per_step: float  # sync (1 - overlap) / tau
    throughput_tokens_per_s: float
    idle: np.ndarray  # devices left out of the mesh


class EditCostModel:
    """EDiT / A-EDiT objective over labels (replica of each device, N = idle)."""

    gain_kind = "cluster"  # a group is a replica: its fast links must stay inside it

    def __init__(self, topology: Topology, replicas: int, shard: int, *, tau: int = 128,
                 params: float = 1.3e9, asynchronous: bool = False, comm_bytes_per_param: float = 2.0,
                 state_bytes_per_param: float = 20.0, tokens_per_device: int = 4096,
                 flops_per_token: float | None = None, overlap: float = 0.0, compression: float = 1.0):
        n = topology.num_devices
        _require(replicas >= 1, "--replica", f"must be >= 1, got {replicas}")
        _require(shard >= 1, "--shard", f"must be >= 1, got {shard}")
        _require(replicas * shard <= n, "--replica/--shard",
                 f"mesh {replicas} x {shard} = {replicas * shard} needs more devices than the topology has ({n})")
        _require(tau >= 1, "--tau", f"must be >= 1, got {tau}")
        _require(np.isfinite(params) and params > 0, "--params", f"must be > 0, got {params}")
        _require(0.0 <= overlap < 1.0, "--overlap", f"must be in [0, 1), got {overlap}")
        _require(compression >= 1.0, "--compression", f"must be >= 1 (a ratio), got {compression}")
        _require(tokens_per_device >= 1, "--tokens-per-device", f"must be >= 1, got {tokens_per_device}")
        self.topology = topology
        self.replicas, self.shard, self.tau = int(replicas), int(shard), int(tau)
        self.params = float(params)
        self.asynchronous = bool(asynchronous)
        self.overlap, self.compression = float(overlap), float(compression)
        self.tokens_per_device = int(tokens_per_device)
        self.flops_per_token = float(flops_per_token if flops_per_token is not None else 6.0 * params)

        idle = n - self.replicas * self.shard
        self.num_groups = self.replicas + (1 if idle else 0)
        self.sizes = np.array([self.shard] * self.replicas + ([idle] if idle else []))
        self.fixed_groups = (self.replicas,) if idle else ()

        self.memory_need_gb = self.params * state_bytes_per_param / self.shard / 1e9
        self.fits = topology.memory_gb >= self.memory_need_gb
        if self.fits.sum() < self.replicas * self.shard:
            short = np.flatnonzero(~self.fits)
            raise PlacementError(
                f"memory_gb: every placed device needs {self.memory_need_gb:.2f} GB (params {self.params:.3g} x "
                f"{state_bytes_per_param:g} B / S={self.shard}); devices {short.tolist()[:10]}"
                f"{'...' if short.size > 10 else ''} have less, leaving {int(self.fits.sum())} for "
                f"{self.replicas * self.shard} mesh slots")

        delay_s = topology.delay_ms / 1000.0
        shard_gb = self.params * comm_bytes_per_param / self.shard / 1e9
        self.fsdp_pair = 3.0 * (delay_s + 8.0 * shard_gb / topology.bandwidth_gbps)
        self.sync_pair = 2.0 * (delay_s + 8.0 * shard_gb / (self.replicas * topology.bandwidth_gbps * self.compression))
        np.fill_diagonal(self.fsdp_pair, 0.0)
        np.fill_diagonal(self.sync_pair, 0.0)
        self.compute_seconds = self.flops_per_token * self.tokens_per_device / (topology.speed_tflops * 1e12)
        # what the local-search gain looks at: per-step link cost, plus speed dissimilarity so that
        # devices of similar speed are pulled into the same replica (the slowest member paces it)
        self.gain_pair = self.fsdp_pair + np.abs(self.compute_seconds[:, None] - self.compute_seconds[None, :])

    # -- decoding ----------------------------------------------------------------------------
    def replica_members(self, labels: np.ndarray) -> np.ndarray:
        groups = group_members(labels, self.num_groups)
        return np.stack(groups[: self.replicas])

    def assign_columns(self, members: np.ndarray) -> np.ndarray:
        """(N, S) grid: which device of each replica holds which shard (greedy, see module doc)."""
        grid = np.empty_like(members)
        grid[0] = members[0]
        for r in range(1, self.replicas):
            affinity = self.sync_pair[grid[:r][:, :, None], members[r][None, None, :]].sum(axis=0)  # (col, dev)
            rows, cols = linear_sum_assignment(affinity)
            grid[r, rows] = members[r][cols]
        return grid

    def grid_cost(self, grid: np.ndarray) -> float:
        """Objective for a fully specified grid (rows replicas, columns sync groups)."""
        return self.layout_from_grid(grid).cost

    def layout_from_grid(self, grid: np.ndarray, idle: np.ndarray | None = None) -> EditLayout:
        grid = np.asarray(grid)
        compute = self.compute_seconds[grid].max(axis=1)
        fsdp = group_internal_cost(self.fsdp_pair, grid) if self.shard > 1 else np.zeros(self.replicas)
        step = compute + fsdp
        sync = float(group_internal_cost(self.sync_pair, grid.T).max()) if self.replicas > 1 else 0.0
        per_step = sync * (1.0 - self.overlap) / self.tau
        tokens = self.shard * self.tokens_per_device
        throughput = float(np.sum(tokens / (step + per_step)))
        if self.asynchronous:
            cost = self.replicas * tokens / throughput
        else:
            cost = float(step.max() + per_step)
            throughput = self.replicas * tokens / cost
        if not self.fits[grid].all():
            cost = np.inf
        if idle is None:
            idle = np.setdiff1d(np.arange(self.topology.num_devices), grid.ravel())
        return EditLayout(cost=float(cost), grid=grid, replica_step=step, replica_compute=compute,
                          replica_fsdp=fsdp, sync_seconds=sync, sync_per_step=per_step,
                          throughput_tokens_per_s=throughput, idle=idle)

    def layout(self, labels: np.ndarray) -> EditLayout:
        members = self.replica_members(labels)
        return self.layout_from_grid(self.assign_columns(members), np.flatnonzero(labels == self.replicas))

    def cost(self, labels: np.ndarray) -> float:
        return self.layout(labels).cost

    # -- search hooks ------------------------------------------------------------------------
    def repair(self, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Swap devices that lack memory out of replicas with idle devices that have it."""
        if not self.fixed_groups:
            return labels
        idle_label = self.replicas
        misplaced = np.flatnonzero((labels != idle_label) & ~self.fits)
        if misplaced.size == 0:
            return labels
        labels = labels.copy()
        spare = rng.permutation(np.flatnonzero((labels == idle_label) & self.fits))
        for device, substitute in zip(misplaced, spare, strict=False):
            labels[device], labels[substitute] = labels[substitute], labels[device]
        return labels

    def swap_allowed(self, labels: np.ndarray, u: int, v: int) -> bool:
        idle_label = self.replicas
        return (labels[v] == idle_label or self.fits[u]) and (labels[u] == idle_label or self.fits[v])

    def structured_layouts(self) -> list[np.ndarray]:
        """Replicas = link clusters (blocks), stripes across them, and speed-sorted blocks.

        Devices that lack memory are ordered last, so with an idle group they end up idle."""
        n = self.topology.num_devices
        layouts = []
        # fastest, memory-fitting devices first: fill the replicas from that order
        by_speed = np.lexsort((np.arange(n), self.compute_seconds, ~self.fits))
        speed_rank = np.empty(n, dtype=np.int64)
        speed_rank[by_speed] = np.arange(n)
        layouts.append(block_layout(speed_rank, self.sizes))
        unfit_last = (~self.fits).astype(np.int64) * n * n
        for cluster in cluster_levels(self.gain_pair):
            # block_layout fills replicas in increasing key order: fitting devices first, then by
            # cluster, then fastest first inside a cluster
            layouts.append(block_layout(unfit_last + cluster * n + speed_rank, self.sizes))
            layouts.append(stripe_layout(cluster, self.sizes))
        return layouts

    # -- random placement baseline -----------------------------------------------------------
    def random_grid(self, rng: np.random.Generator) -> np.ndarray:
        """A random placement: N x S random memory-fitting devices in random mesh positions."""
        chosen = rng.permutation(np.flatnonzero(self.fits))[: self.replicas * self.shard]
        return chosen.reshape(self.replicas, self.shard)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise PlacementError(f"{field}: {message}")
