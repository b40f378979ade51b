"""Which process of a cluster job this is, and which of its host's accelerators it owns
(``edit-jax train --distributed``): the arguments of ``jax.distributed.initialize``.

One process per worker: process i drives worker i's ``mesh.shard`` devices, all on its own host.
Read from the environment, first match wins:

1. ``EDIT_JAX_COORDINATOR`` (host:port of process 0; ``JAX_COORDINATOR_ADDRESS`` also works),
   ``EDIT_JAX_NUM_PROCESSES``, ``EDIT_JAX_PROCESS_ID``, and optionally ``EDIT_JAX_LOCAL_RANK``
   (or torchrun's ``LOCAL_RANK``: which process of its host this is, default 0);
2. SLURM (``SLURM_JOB_ID``, ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``,
   ``SLURM_STEP_NODELIST``; JAX derives the coordinator from the node list);
3. Open MPI (``OMPI_COMM_WORLD_SIZE`` / ``_RANK`` / ``_LOCAL_RANK``, ``OMPI_MCA_orte_hnp_uri``);
4. any other environment JAX detects itself (Cloud TPU, Kubernetes, ...): left to JAX.

Why pass ``local_device_ids``: on SLURM and Open MPI, JAX's own detection gives each process
exactly one device, ``[local rank]``, a layout of one process per GPU. With the cluster guide's
``--ntasks-per-node=1 --gpus-per-node=8`` every process would see one GPU and ``mesh.shard=8``
would be refused. Here the process with local rank r owns devices ``r*S .. r*S+S-1`` of those
its host shows it (``CUDA_VISIBLE_DEVICES``), or all of them when the host shows exactly S (a
launcher that binds GPUs per task renumbers them from 0). JAX applies the ids to GPUs only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from edit_jax.localsgd.sharding import MeshError

ENV_COORDINATOR = "EDIT_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "EDIT_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "EDIT_JAX_PROCESS_ID"
ENV_LOCAL_RANK = "EDIT_JAX_LOCAL_RANK"
EXPLICIT = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
SLURM = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")
OPEN_MPI = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_MCA_orte_hnp_uri")


class ClusterError(MeshError):
    """The environment does not say how this process joins the others (CLI exit 2)."""


class JoinError(ClusterError):
    """The environment says how, but joining the others failed (``--distributed``: exit 75, retry)."""


@dataclass(frozen=True)
class ClusterParams:
    coordinator: str | None  # None: JAX derives it from the cluster's environment
    num_processes: int | None  # None (with process_id): left to JAX's detection
    process_id: int | None
    local_device_ids: tuple[int, ...] | None  # None: every device the host shows
    source: str  # where they came from, for messages

    def describe(self) -> str:
        devices = (f"devices {self.local_device_ids[0]}..{self.local_device_ids[-1]} of this host"
                   if self.local_device_ids else "all devices of this host")
        who = f"process {self.process_id} of {self.num_processes}" if self.num_processes else "a process"
        return f"{who} ({self.source}), {devices}"


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ClusterError(f"{name}={env[name]!r}: expected an integer") from None


def local_device_ids(env: Mapping[str, str], local_rank: int, shard: int) -> tuple[int, ...]:
    """The ids of the ``shard`` devices the process with ``local_rank`` on its host owns."""
    visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) == shard:  # the launcher bound this task's GPUs (renumbered 0..S-1 for it)
        return tuple(range(shard))
    first = local_rank * shard
    if visible and first + shard > len(visible):
        raise ClusterError(f"mesh.shard={shard}: the process with local rank {local_rank} needs devices "
                           f"{first}..{first + shard - 1} of its host, which shows {len(visible)} "
                           f"(CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}); give each process "
                           f"mesh.shard devices (e.g. --gpus-per-task={shard})")
    return tuple(range(first, first + shard))


def _check_count(num: int, pid: int, processes: int, names: tuple[str, str]) -> None:
    if num != processes:
        raise ClusterError(f"{names[0]}={num} processes, but mesh.processes={processes}: start one process per "
                           "worker (mesh.processes = mesh.replica)")
    if not 0 <= pid < num:
        raise ClusterError(f"{names[1]}={pid}: expected 0..{num - 1}")


def _jax_detects() -> str | None:
    """The name of another cluster environment JAX's own detection finds here, or None. (JAX's
    list of environments is internal: if it moves, such clusters need the explicit variables.)"""
    try:
        from jax._src import clusters

        found = [c for c in clusters.ClusterEnv._cluster_types
                 if not getattr(c, "opt_in_only_method", False) and c.is_env_present()]
    except Exception:  # an internal API: any change means "not detected"
        return None
    return found[0].__name__ if found else None


def cluster_params(env: Mapping[str, str], processes: int, shard: int) -> ClusterParams:
    """How this process joins a ``processes``-process job with ``shard`` devices each, from
    ``env`` (``os.environ``); ``ClusterError`` naming what is missing or inconsistent."""
    given = [name for name in EXPLICIT if name in env]
    if given or "JAX_COORDINATOR_ADDRESS" in env:
        coordinator = env.get(ENV_COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS")
        missing = [name for name in EXPLICIT[1:] if name not in env] + ([] if coordinator else [ENV_COORDINATOR])
        if missing:
            have = ", ".join(given) or "only JAX_COORDINATOR_ADDRESS"
            raise ClusterError(f"--distributed: {', '.join(missing)} not set (have {have}); set {ENV_COORDINATOR}="
                               f"HOST:PORT of process 0, {ENV_NUM_PROCESSES}={processes} and "
                               f"{ENV_PROCESS_ID}=0..{processes - 1} in each")
        num, pid = _int(env, ENV_NUM_PROCESSES), _int(env, ENV_PROCESS_ID)
        _check_count(num, pid, processes, (ENV_NUM_PROCESSES, ENV_PROCESS_ID))
        rank_var = ENV_LOCAL_RANK if ENV_LOCAL_RANK in env else "LOCAL_RANK" if "LOCAL_RANK" in env else None
        rank = _int(env, rank_var) if rank_var else 0
        return ClusterParams(coordinator, num, pid, local_device_ids(env, rank, shard), "EDIT_JAX_* variables")
    for name, keys in (("SLURM", SLURM), ("Open MPI", OPEN_MPI)):
        if keys[0] in env:
            missing = [k for k in keys if k not in env]
            if missing:
                raise ClusterError(f"--distributed: a {name} job ({keys[0]} is set) without {', '.join(missing)}: "
                                   f"run edit-jax under srun / mpirun, or set {', '.join(EXPLICIT)}")
            num, pid, rank = _int(env, keys[1]), _int(env, keys[2]), _int(env, keys[3])
            _check_count(num, pid, processes, (keys[1], keys[2]))
            return ClusterParams(None, num, pid, local_device_ids(env, rank, shard), name)
    other = _jax_detects()
    if other:
        return ClusterParams(None, None, None, None, f"{other}, detected by JAX")
    raise ClusterError(f"--distributed: no cluster environment found (SLURM: {', '.join(SLURM[:3])}; Open MPI: "
                       f"{OPEN_MPI[0]}) and {', '.join(EXPLICIT)} not set. Run it under srun / mpirun, or set "
                       f"those three in each of the {processes} processes (and {ENV_LOCAL_RANK} where several "
                       "share a host)")


def from_environment(processes: int, shard: int) -> ClusterParams:
    return cluster_params(os.environ, processes, shard)


__all__ = ["ClusterParams", "ClusterError", "cluster_params", "from_environment", "local_device_ids"]
