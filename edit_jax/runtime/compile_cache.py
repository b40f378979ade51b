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

A cache that cannot be used never fails a run: JAX compiles what it cannot read and warns once per
program (a ``UserWarning`` "Error reading / writing persistent compilation cache entry ..."; a
damaged cache gave 21-22 of them, 45-47 lines, a full disk 17). While inside ``compile_cache``
those warnings become one line of ours for the whole run, saying what was wrong and that the run
compiles instead (``CacheReport``); ``--debug`` (``EDIT_JAX_DEBUG=1``) shows JAX's own too. A
directory that cannot be made at all (a file in its path) is refused before the run starts, for
``$EDIT_JAX_COMPILE_CACHE`` as for ``train.compile_cache`` (``validate``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as _cc

from edit_jax.config import Config, ConfigError, require
from edit_jax.runtime.restarts import ENV_DEBUG

DIR_NAME = "compile_cache"
ENV_DIR = "EDIT_JAX_COMPILE_CACHE"  # "auto" means this directory when set (and not empty)
# Every program is written, however fast it compiles (JAX's default leaves out those under 1 s):
# besides the step programs (seconds on CPU, minutes on GPU), a restore compiles a small slice
# program per array shape, 0.05-0.7 s each on the loaded 2-core CPU host; with a 0.2 s floor
# those were 6.6 s of a cached restart's 10 s (benchmarks/bench_faults.py --part compile). Entries
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


def compile_cache_problem(path: str) -> str | None:
    """Why ``path`` cannot be a compile cache directory, or None: it exists and is not a directory,
    or a part of it is a file (it cannot be created). Checked before a run: JAX itself only warns
    that it cannot read an entry ("Error reading ..."), and runs without a cache."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
        return None if os.path.isdir(path) else "exists and is not a directory"
    parent = os.path.dirname(path)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.exists(parent) and not os.path.isdir(parent):
        return f"cannot be created: {parent!r} is a file, not a directory"
    return None


def validate(cfg: Config) -> None:
    """``train.compile_cache``, and ``$EDIT_JAX_COMPILE_CACHE`` when it is "auto", must be a
    directory or a path one can be made at (``config.checks.check_fields`` checks the value's form)."""
    key, value = "train.compile_cache", cfg.train.compile_cache
    if value not in ("", "auto", "off"):
        problem = compile_cache_problem(value)
        require(problem is None, key, f"{value!r} {problem} (expected auto, off or a directory)")
    shared = os.environ.get(ENV_DIR, "").strip()
    if value == "auto" and shared and compile_cache_problem(shared):
        raise ConfigError(f"${ENV_DIR}={shared!r} (the compile cache of {key}=auto) "
                          f"{compile_cache_problem(shared)}: set it to a directory, unset it, or set {key}")


def run_dir_cache(run_dir: str) -> str:
    """The run dir's own cache directory (what "auto" is without ``$EDIT_JAX_COMPILE_CACHE``)."""
    return os.path.join(os.path.abspath(run_dir), DIR_NAME)


_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


# JAX's warning for an entry it could not read (a damaged entry; also a cache dir it could not make)
# or write (a full disk): jax/_src/compiler.py, _cache_read / _is_executable_in_cache / _cache_write.
_JAX_CACHE_WARNING = re.compile(r"Error (reading|writing) persistent compilation cache entry for '[^']*': "
                                r"(\w+): (.*)", re.S)
_SHOWWARNING_ORIG = getattr(warnings, "_showwarning_orig", warnings.showwarning)


class CacheReport:
    """Turns JAX's compilation-cache warnings into one line of ours (``say``) for the whole time it
    is installed (``warnings.showwarning``), the first one's kind deciding what it says; the others
    are counted (``count``). With ``debug`` JAX's warnings are shown as well. Any other warning is
    shown as it would have been without this (``warnings.catch_warnings(record=True)`` included)."""

    def __init__(self, directory: str, say, debug: bool = False):
        self.directory, self.say, self.debug = directory, say, debug
        self.count = 0
        self.previous = None

    def line(self, kind: str, error: str, text: str) -> str:
        """Our one line for JAX's first warning: ``kind`` reading / writing, the exception's type and text."""
        more = "--debug shows JAX's warnings"
        flat = " ".join(text.split())
        if not os.path.isdir(self.directory):  # JAX makes the directory at its first use of the cache
            return (f"edit-jax: compile cache {self.directory} cannot be created ({error}: {flat[:120]}); the run "
                    f"compiles every program without it ({more})")
        if kind == "reading":  # the same line in every worker (the launcher shows it once)
            return (f"edit-jax: compile cache {self.directory} has damaged entries JAX cannot read; the run compiles "
                    f"those programs again (delete the directory to rebuild it; {more})")
        no_space = "No space left" in flat or f"[Errno {errno.ENOSPC}]" in flat or "ENOSPC" in flat
        why = "no space left on the device" if no_space else f"{error}: {flat[:120]}"
        return (f"edit-jax: compile cache {self.directory} cannot be written ({why}); the run goes on, but the "
                f"programs it compiles are not kept for a restart ({more})")

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        found = _JAX_CACHE_WARNING.search(str(message)) if isinstance(category, type) and \
            issubclass(category, UserWarning) else None
        if found is None or self.debug:
            self._show_as_before(message, category, filename, lineno, file, line)
        if found is None:
            return
        self.count += 1
        if self.count == 1:
            self.say(self.line(found[1], found[2], found[3]))

    def _show_as_before(self, *args) -> None:
        if self.previous is _SHOWWARNING_ORIG and hasattr(warnings, "_showwarnmsg_impl"):
            # what warnings does with its own showwarning installed: catch_warnings(record=True)
            # (pytest) records through this, not through showwarning
            warnings._showwarnmsg_impl(warnings.WarningMessage(*args))
        else:
            self.previous(*args)

    def __enter__(self) -> "CacheReport":
        self.previous = warnings.showwarning
        warnings.showwarning = self.showwarning
        return self

    def __exit__(self, *exc) -> None:
        if warnings.showwarning == self.showwarning:  # (bound methods: equal, not identical)
            warnings.showwarning = self.previous


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def compile_cache(directory: str | None, say=_stderr_line):
    """JAX's persistent compilation cache in ``directory`` (None: as it was) while inside; the
    previous settings are restored on exit. JAX's warnings about the cache become at most one
    line, through ``say`` (``CacheReport``). A directory that cannot be made (a file in its path)
    raises ``ConfigError`` naming it, before any compile."""
    if directory is None:
        yield None
        return
    problem = compile_cache_problem(directory)
    if problem:
        raise ConfigError(f"compile cache {directory!r}: {problem}")
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # any size: the compile time decides
    _cc.reset_cache()  # JAX decided at its first compile whether a cache is used: decide again
    try:
        with CacheReport(directory, say, debug=os.environ.get(ENV_DEBUG, "") not in ("", "0")):
            yield directory
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        _cc.reset_cache()


__all__ = ["DIR_NAME", "ENV_DIR", "MIN_COMPILE_SECONDS", "CacheReport", "cache_dir_for", "compile_cache",
           "compile_cache_problem", "run_dir_cache", "validate"]
