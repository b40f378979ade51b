"""One JAX process per worker (multi-controller JAX): start-up, the two meshes, and moving state
between them.

With ``mesh.processes = mesh.replica = N`` every worker (replica) is its own process, owning its
S devices. Two meshes over the same devices:

- the **local mesh** ``(1, S)`` over this process's devices: inner steps run here, as programs
  over the worker's own devices only (nothing in them can wait for another worker);
- the **global mesh** ``(N, S)``, row i = process i's devices in the same order: synchronous
  steps (HSDP warmup, Baseline) and syncs run here, as one program over every device.

A state lives on the local mesh between syncs. For a global program each leaf becomes a global
array made of this process's shards and the other processes' (``to_global``), and back
(``to_local``): per-replica leaves ([1, ...] locally, [N, ...] globally) are this worker's slice;
outer leaves (θ̄, the outer optimizer state) and scalars are identical on every worker. Only the
shards move by reference; no data is copied.

Start-up: ``edit-jax train ... mesh.processes=N`` on one machine starts N processes
(``launch.py``) that find each other through a coordinator on 127.0.0.1 (environment variables
below) and use gloo for CPU collectives. On a cluster each host runs ``edit-jax train
--distributed ...``, and ``edit_jax.runtime.cluster`` reads the cluster's environment (SLURM, explicit variables,
...). The coordination service's heartbeat timeout (``mesh.heartbeat_seconds``) ends every
process within about that time when one is lost, instead of a hang.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from edit_jax.config import Config, ConfigError, require
from edit_jax.localsgd.sharding import BATCH_SPEC, REPLICA, SHARD, MeshError, named
from edit_jax.runtime.cluster import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ClusterParams, JoinError


def launched_worker() -> int | None:
    """This process's worker index when ``launch.py`` started it, else None."""
    pid = os.environ.get(ENV_PROCESS_ID)
    return int(pid) if pid is not None else None


def initialize(heartbeat_seconds: int, cluster: ClusterParams | None = None) -> None:
    """Joins the other processes (before anything asks JAX for devices): the launcher's workers
    from its environment variables, a cluster job (``--distributed``) from ``cluster``
    (``edit_jax.runtime.cluster``). A failure to join is a ``ClusterError`` of one line."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    timeouts = dict(heartbeat_timeout_seconds=int(heartbeat_seconds),
                    shutdown_timeout_seconds=max(int(heartbeat_seconds), 5), initialization_timeout=120)
    if cluster is None:
        jax.distributed.initialize(os.environ[ENV_COORDINATOR], int(os.environ[ENV_NUM_PROCESSES]),
                                   int(os.environ[ENV_PROCESS_ID]), **timeouts)
        return
    ids = list(cluster.local_device_ids) if cluster.local_device_ids is not None else None
    try:
        jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                                   local_device_ids=ids, **timeouts)
    except Exception as e:  # JAX raises ValueError, RuntimeError, XlaRuntimeError here
        text = " ".join(str(e).split())
        raise JoinError(f"--distributed: could not join the other processes as {cluster.describe()}: "
                           f"{type(e).__name__}: {text[:300]}") from e


def check_runtime(cfg) -> None:
    """Raises MeshError unless this is one of ``mesh.replica`` processes with ``mesh.shard`` devices each."""

    n, s = cfg.mesh.replica, cfg.mesh.shard
    if jax.process_count() != n:
        raise MeshError(f"mesh.processes={cfg.mesh.processes}: expected {n} JAX processes (one per worker), found "
                        f"{jax.process_count()}. Start the run with `edit-jax train` (it starts the processes), or "
                        f"call jax.distributed.initialize() in each of {n} processes first")
    if jax.local_device_count() != s:
        raise MeshError(f"mesh.shard={s}: each worker process needs {s} devices, process {jax.process_index()} "
                        f"has {jax.local_device_count()}")


def meshes(cfg):
    """(global mesh (N, S), local mesh (1, S)); row i of the global mesh is process i's devices."""


    order = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(order, dtype=object).reshape(cfg.mesh.replica, cfg.mesh.shard)
    local = np.array(sorted(jax.local_devices(), key=lambda d: d.id), dtype=object).reshape(1, cfg.mesh.shard)
    auto = (jax.sharding.AxisType.Auto,) * 2
    return Mesh(grid, (REPLICA, SHARD), axis_types=auto), Mesh(local, (REPLICA, SHARD), axis_types=auto)


def local_config(cfg):
    """The config of one worker's own program: one replica and its rows of the global batch."""

    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, replica=1, processes=1),
                               batch_size=cfg.batch_size // cfg.mesh.replica)


def to_global(local: Any, global_abstract: Any) -> Any:
    """A local-mesh state as global arrays (``global_abstract``: shapes and shardings)."""
    return jax.tree.map(lambda x, a: jax.make_array_from_single_device_arrays(
        a.shape, a.sharding, [s.data for s in x.addressable_shards]), local, global_abstract)


def to_local(global_state: Any, local_abstract: Any) -> Any:
    """This process's part of a global state, on the local mesh."""
    return jax.tree.map(lambda x, a: jax.make_array_from_single_device_arrays(
        a.shape, a.sharding, [s.data for s in x.addressable_shards]), global_state, local_abstract)


def global_batch(mesh, local_rows: np.ndarray, global_rows: int):
    """The global batch [B, T+1] of which this process holds rows [i B/N, (i+1) B/N)."""

    return jax.make_array_from_process_local_data(named(mesh, BATCH_SPEC), np.asarray(local_rows),
                                                  (global_rows,) + local_rows.shape[1:])


def local_value(x) -> np.ndarray:
    """This process's copy of a replicated (or per-replica, this worker's) value. A mesh that
    spans several processes cannot be fetched whole; on one process this is the value itself."""
    return np.asarray(x.addressable_shards[0].data)


def _split_over_processes(x) -> bool:
    """A global array whose value lies in several processes (a per-replica metric [N]): gathered."""
    return hasattr(x, "addressable_shards") and not x.is_fully_addressable and not x.sharding.is_fully_replicated


def host_value(x) -> np.ndarray:
    """The whole value of ``x`` on this host, whatever its sharding: a host or fully addressable
    array as it is, a replicated one from this process's copy, and one split over several
    processes (a per-replica metric [N]) gathered from all of them (a collective: every process
    must call it)."""
    if _split_over_processes(x):
        return _gather_split(x)[0]
    if not hasattr(x, "addressable_shards") or x.is_fully_addressable:
        return np.asarray(x)
    return local_value(x)


def _gather_split(*xs) -> list[np.ndarray]:
    """The whole of global arrays split over processes, from one control gather: every process
    sends the distinct blocks it holds (as bytes), and every process knows from the shardings which
    blocks each sends (``devices_indices_map``)."""
    def block(x, index) -> tuple:
        return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, x.shape, strict=True))

    held: dict[int, list] = {}  # process -> (array, block) it holds, distinct, in array and device-id order
    for i, x in enumerate(xs):
        for d, index in sorted(x.sharding.devices_indices_map(x.shape).items(), key=lambda kv: kv[0].id):
            blocks = held.setdefault(d.process_index, [])
            ib = (i, block(x, index))
            if ib not in blocks:
                blocks.append(ib)
    dtypes = [np.dtype(x.dtype) for x in xs]
    size = lambda i, b: int(np.prod([hi - lo for lo, hi in b])) * dtypes[i].itemsize
    mine = {(i, block(x, s.index)): np.ascontiguousarray(np.asarray(s.data))
            for i, x in enumerate(xs) for s in x.addressable_shards}
    payload = b"".join(mine[ib].tobytes() for ib in held[jax.process_index()])
    row = np.zeros(-(-max(sum(size(i, b) for i, b in ibs) for ibs in held.values()) // 4) * 4, np.uint8)
    row[:len(payload)] = np.frombuffer(payload, np.uint8)
    rows = _gather_rows(row.view(np.int32))
    out = [np.empty(x.shape, dt) for x, dt in zip(xs, dtypes, strict=True)]
    for p, blocks in held.items():
        buf, at = np.ascontiguousarray(rows[p]).view(np.uint8), 0
        for i, b in blocks:
            shape = tuple(hi - lo for lo, hi in b)
            n = size(i, b)
            value = np.frombuffer(buf[at:at + n].tobytes(), dtypes[i]).reshape(shape)
            out[i][tuple(slice(lo, hi) for lo, hi in b)] = value
            at += n
    return out


def host_values(tree: Any) -> Any:
    """``host_value`` of every leaf (the metrics of a step); the leaves split over processes in one
    gather (a collective: every process must call it)."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [i for i, x in enumerate(leaves) if _split_over_processes(x)]
    gathered = dict(zip(split, _gather_split(*(leaves[i] for i in split)), strict=True)) if split else {}
    out = [gathered[i] if i in gathered else host_value(x) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def barrier() -> None:
    """Waits until every process gets here (a no-op with one process)."""
    if jax.process_count() > 1:
        exchange([0])


def _control_mesh() -> Mesh:
    """One device per process (its lowest id), in process order: the mesh of the control exchanges.
    An all-gather over every device (``process_allgather``) sends a message between every pair of
    devices; over one device per process it sends one per pair of processes (with EDiT tau 8 and a
    2-bit sync, the control gathers had been two thirds of the bytes between 2 workers: docs/benchmarks/sparse.md)."""
    firsts: dict[int, Any] = {}
    for d in jax.devices():
        if d.process_index not in firsts or d.id < firsts[d.process_index].id:
            firsts[d.process_index] = d
    return Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("process",))


_CONTROL: dict = {}  # the control mesh's device ids -> its gather (one jit: it compiles once per shape)


def _gather_rows(row: np.ndarray) -> np.ndarray:
    """Every process's ``row`` (int32, 1-D, same length everywhere), stacked [processes, len]. Sent
    padded to a power of two of at least 8 values, so that one program serves every short row (a
    barrier, the loop's agreement, a meeting's counts): compiled at the run's first barrier, not
    inside a step."""
    n = row.size
    width = max(8, 1 << max(n - 1, 0).bit_length())
    row = np.concatenate([row.ravel(), np.zeros(width - n, np.int32)])
    mesh = _control_mesh()
    key = tuple(d.id for d in mesh.devices.flat)
    if key not in _CONTROL:
        _CONTROL.clear()  # one mesh per run: a cache, not a store
        _CONTROL[key] = jax.jit(lambda x: x, out_shardings=named(mesh, PartitionSpec()))
    mine = mesh.devices[jax.process_index()]
    arr = jax.make_array_from_single_device_arrays((mesh.size,) + row.shape,
                                                   named(mesh, PartitionSpec("process")),
                                                   [jax.device_put(row[None], mine)])
    return np.asarray(_CONTROL[key](arr).addressable_data(0))[:, :n]


def exchange(values) -> np.ndarray:
    """Every process's ``values`` (a 1-D vector of integers within int32), stacked [N, len]:
    identical on all."""
    v = np.asarray(values, dtype=np.int64)
    if v.size and (v.min() < np.iinfo(np.int32).min or v.max() > np.iinfo(np.int32).max):
        raise OverflowError(f"multihost.exchange: {v.tolist()} does not fit int32")
    return _gather_rows(v.astype(np.int32)).astype(np.int64)


def exchange_floats(values) -> np.ndarray:
    """``exchange`` for float64 values, sent as their bit patterns (so NaN and inf survive) in int32
    halves: without jax_enable_x64 JAX carries int64 as int32."""
    bits = np.ascontiguousarray(np.asarray(values, dtype=np.float64)).view(np.int32)
    return np.ascontiguousarray(_gather_rows(bits)).view(np.float64)


__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "launched_worker", "initialize", "check_runtime",
           "meshes", "local_config", "to_global", "to_local", "global_batch", "local_value", "host_value",
           "host_values", "barrier", "exchange", "exchange_floats"]


# ----------------------------------------------------------------------------- config rules


def parse_slowdown(text: str) -> dict[int, float]:
    """``"1:2.0,3:1.5"`` -> {1: 2.0, 3: 1.5}; raises ValueError on a malformed entry."""
    out: dict[int, float] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        worker, factor = item.split(":")
        out[int(worker)] = float(factor)
        if out[int(worker)] < 1.0 or int(worker) < 0:
            raise ValueError(item)
    return out


def validate(cfg: Config) -> None:
    """The config's multi-process rules: ``mesh.processes``, what one process per worker does not
    support, and ``debug.slowdown`` (A-EDiT's own rules: ``localsgd/timed.py``). No JAX backend:
    checked before JAX starts."""
    mesh = cfg.mesh
    require(mesh.processes in (1, mesh.replica) or cfg.sync.exchange.url, "mesh.processes",  # exchange: timed.py
            f"must be 1 (one program drives every replica) or mesh.replica={mesh.replica} (one process per "
            f"worker), got {mesh.processes}")
    require(mesh.heartbeat_seconds >= 1, "mesh.heartbeat_seconds", f"must be >= 1, got {mesh.heartbeat_seconds}")
    if mesh.processes > 1:
        # The lock-step methods run one program over the global mesh whatever the process count, so
        # everything a single process supports holds (an asynchronous method's own rules: the
        # method table's validate).
        # A device order permutes one program's devices freely; with one process per worker each
        # process owns its replica's devices, so which devices form a replica is decided by which
        # host runs which worker (the launcher), not by a device order.
        require(not mesh.placement, "mesh.placement", "a device order applies to one program's devices; "
                "with mesh.processes > 1 each process owns its replica's devices")
    try:
        slow = parse_slowdown(cfg.debug.slowdown)
    except ValueError:
        raise ConfigError(f"config key 'debug.slowdown': expected WORKER:FACTOR[,WORKER:FACTOR] with FACTOR >= 1, "
                          f"got {cfg.debug.slowdown!r}") from None
    if slow:
        require(mesh.processes > 1, "debug.slowdown", "slows a worker process: needs mesh.processes > 1")
        require(max(slow) < mesh.replica, "debug.slowdown",
                f"worker {max(slow)} does not exist (mesh.replica={mesh.replica})")


__all__ += ["parse_slowdown", "validate"]
