"""``edit-jax worker``: one A-EDiT worker of a run whose workers meet through ``sync.exchange.url``,
started by the supervisor (``supervisor.py``: forked or spawned), by hand or by SLURM.

    edit-jax worker --config C --run-dir RUN --worker I [key=value ...]

Importing this module starts no JAX backend: the launcher imports it once and forks workers from
itself, each choosing its own devices (``set_cpu_device_count``) before its backend starts.
"""

from __future__ import annotations

import argparse
import sys

from edit_jax.elastic.worker import run_worker
from edit_jax.runtime.compile_cache import cache_dir_for, compile_cache
from edit_jax.runtime.mesh import set_cpu_device_count
from edit_jax.validate import ConfigError, load_config
from edit_jax.exit_codes import EXIT_BAD_INPUT


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edit-jax worker", description="One worker of a run whose workers "
                                     "meet through sync.exchange.url (started by `edit-jax train`, by hand or by "
                                     "SLURM).")
    parser.add_argument("--config", default="configs/demo.py", help="as for `edit-jax train`")
    parser.add_argument("--run-dir", required=True, help="the run's dir (records; shared by its workers)")
    parser.add_argument("--worker", type=int, required=True, help="this worker's slot, 0..mesh.replica-1")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for `edit-jax train`")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if not cfg.sync.exchange.url:
            raise ConfigError("sync.exchange.url: required by `edit-jax worker` (a directory or s3://bucket/prefix)")
        if not 0 <= args.worker < cfg.mesh.replica:
            raise ConfigError(f"--worker: expected a worker slot 0..{cfg.mesh.replica - 1}, got {args.worker}")
    except ConfigError as e:
        print(f"edit-jax: bad config: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    set_cpu_device_count(cfg.mesh.shard)  # (before this process's JAX backend starts)
    with compile_cache(cache_dir_for(cfg.train.compile_cache, args.run_dir)):  # a restarted worker: no compile
        return run_worker(cfg, args.worker, args.run_dir, say=lambda m: print(m, file=sys.stderr, flush=True))


__all__ = ["main"]
