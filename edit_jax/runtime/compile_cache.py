"""JAX's persistent compilation cache for a run (``train.compile_cache``): a restarted run loads the
compiled step programs from disk instead of compiling them again.

    with compile_cache(cache_dir_for(cfg.train.compile_cache, run_dir)):
        ...  # every compile reads the cache first; a miss compiles and writes an entry

Where (``cache_dir_for``): "auto" is ``$EDIT_JAX_COMPILE_CACHE`` when that is set (one cache for
all of a user's runs; the test suite shares one across its tests this way), else
``RUN_DIR/compile_cache``. The run dir, not a per-user dir,
because a restart is what the cache is for and the run dir is what a restart shares: on a
cluster it is on storage every host sees, and JAX writes entries from process 0 only
(``compiler._cache_write``), so a per-user dir would stay empty on every other host. It also goes
with the run when the run dir is deleted. A user's own directory shares entries across run dirs.

Keys: JAX hashes the program, the jaxlib version, the backend, the XLA flags, the compile options
(the device assignment too, on CPU) into each entry's name, so versions and meshes never collide
in one directory. JAX reads the cache setting once per process, at its first compile; ``compile_cache``
resets that latch on entry and exit, so a process can run several trainings with other dirs (tests).
"""

from __future__ import annotations

import contextlib
import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _cc

DIR_NAME = "compile_cache"
ENV_DIR = "EDIT_JAX_COMPILE_CACHE"  # "auto" means this directory when set (and not empty)
# Every program is written, however fast it compiles (JAX's default leaves out those under 1 s):
# besides the step programs (seconds on CPU, minutes on GPU), a restore compiles a small slice
# program per array shape, 0.05-0.7 s each on the loaded 2-core CPU host; with a 0.2 s floor
# those were 6.6 s of a cached restart's 10 s (scripts/bench_faults.py --part compile). Entries
# are small (a few KB to a few MB); a run writes a few dozen.
MIN_COMPILE_SECONDS = 0.0


def cache_dir_for(setting: str, run_dir: str | None) -> str | None:
    """The cache directory ``train.compile_cache`` asks for (None: no cache)."""
    if setting in ("", "off"):
        return None
    if setting == "auto":
        shared = os.environ.get(ENV_DIR, "").strip()
        if shared:
            return os.path.abspath(os.path.expanduser(shared))
        return run_dir_cache(run_dir) if run_dir else None
    return os.path.abspath(os.path.expanduser(setting))


def run_dir_cache(run_dir: str) -> str:
    """The run dir's own cache directory (what "auto" is without ``$EDIT_JAX_COMPILE_CACHE``)."""
    return os.path.join(os.path.abspath(run_dir), DIR_NAME)


_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


@contextlib.contextmanager
def compile_cache(directory: str | None):
    """JAX's persistent compilation cache in ``directory`` (None: as it was) while inside; the
    previous settings are restored on exit."""
    if directory is None:
        yield None
        return
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # any size: the compile time decides
    _cc.reset_cache()  # JAX decided at its first compile whether a cache is used: decide again
    try:
        yield directory
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        _cc.reset_cache()


__all__ = ["DIR_NAME", "ENV_DIR", "MIN_COMPILE_SECONDS", "cache_dir_for", "compile_cache", "run_dir_cache"]
