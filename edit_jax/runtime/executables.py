"""Compiled programs kept whole on disk, so a restarted process skips tracing and lowering too.

JAX's persistent compilation cache (``compile_cache.py``) spares a restart XLA's compile, but not
the work before it: tracing the Python function and lowering it to HLO, which is how JAX finds the
cache entry. For an elastic worker that restarts every minute on shared cores that work is most of
a restart's CPU (tiny config, warm cache: the local step's trace + lower 0.47-0.67 core-s, its load
from the cache 0.08-0.12; docs/benchmarks/elastic-runs.md). This store keeps the compiled executable itself
(``jax.experimental.serialize_executable``) under a key computed without tracing:

- what the program is: its ``name`` and the caller's ``context`` (the elastic worker passes its
  whole config as JSON: the config decides the program given the code);
- the code: a hash of every ``edit_jax`` source file, and the versions of Python, jax, jaxlib,
  flax, optax and numpy (an edited or upgraded library misses, never loads a stale program);
- the process: ``XLA_FLAGS``, JAX's config values, the backend's platform and version, its devices;
- the arguments: their tree structure, shapes, dtypes and shardings (cheap to read at a call).

Where: ``executables/`` inside the run's compile cache directory (JAX's cache names its entries
``*-cache``; it never touches this directory), so the store is on exactly when
``train.compile_cache`` is. A miss compiles for real (never from JAX's cache: ``FRESH`` says why)
and writes the entry (aside, then renamed: whole or absent; workers writing the same program write
equivalent bytes; written here, not with ``rundir.records.replace_file``, which ``rundir`` importing
``runtime`` rules out and which stops the run on a failed write, where a cache entry must not). An
entry that cannot be loaded (cut short, another jaxlib's bytes) is counted, compiled again and
replaced; it never fails a run. Loading an entry unpickles it: keep the cache directory
as private as the run dir (JAX's own cache deserializes executables from it the same way).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pickle
import sys
import threading
from functools import lru_cache
from typing import Any, Callable

import jax
from jax._src import config as _jax_config  # a setting's thread-local form (jax.config.update: process-wide)
from jax.experimental import serialize_executable

DIR_NAME = "executables"
ENV_OFF = "EDIT_JAX_EXECUTABLE_STORE"  # "off": no store (every program traced, then JAX's cache as before)
# An option at its default value: it changes JAX's cache key, so a miss compiles for real. Why: on
# XLA:CPU an executable that JAX loaded from its persistent cache serializes without its kernels
# (the entry loads, then fails at its first run: "Function wrapped_slice not found"; jaxlib 0.10).
# JAX writes no cache entry under that key (the setting below, for this thread only), so no later
# miss can load one either.
FRESH = {"xla_embed_ir_in_executable": False}
SUFFIX = ".jaxexe"


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of what decides a program besides its config and arguments: this package's source,
    the libraries' versions, the XLA flags and JAX's config values."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # edit_jax/
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    versions = [sys.version]
    for package in ("jax", "jaxlib", "flax", "optax", "numpy"):
        try:
            versions.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    h.update(repr(versions).encode())
    h.update(os.environ.get("XLA_FLAGS", "").encode())
    settings = sorted((k, v) for k, v in jax.config.values.items()
                      if isinstance(v, (str, int, float, bool, type(None))))
    h.update(repr(settings).encode())
    return h.hexdigest()


def signature(args: tuple) -> str:
    """The arguments' tree structure and each leaf's shape, dtype and sharding, as text."""
    leaves, tree = jax.tree.flatten(args)
    parts = [str(tree)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        parts.append(f"{tuple(getattr(x, 'shape', ()))}:{getattr(x, 'dtype', type(x).__name__)}:{sharding!r}")
    return "\n".join(parts)


class ExecutableStore:
    """Compiled programs under ``directory`` (None: off, every program compiles as usual).
    ``context``: what else decides the programs (e.g. the config as JSON). ``loaded`` and
    ``compiled`` name the programs this process took from the store and compiled (and wrote),
    ``damaged`` the entries it could not load."""

    def __init__(self, directory: str | None, context: str = ""):
        self.directory, self.context = directory, context
        self.loaded: list[str] = []
        self.compiled: list[str] = []
        self.damaged: list[str] = []  # "entry: why" for each entry that could not be loaded

    @classmethod
    def in_compile_cache(cls, context: str = "") -> "ExecutableStore":
        """A store inside the compile cache directory JAX uses now (``compile_cache``), or off
        (no cache, or ``$EDIT_JAX_EXECUTABLE_STORE=off``)."""
        cache = jax.config.jax_compilation_cache_dir if os.environ.get(ENV_OFF, "") != "off" else None
        return cls(os.path.join(cache, DIR_NAME) if cache else None, context)

    def path(self, name: str, args: tuple, devices: list) -> str:
        client = devices[0].client
        h = hashlib.sha256()
        for part in (code_fingerprint(), self.context, name, signature(args), client.platform,
                     client.platform_version, repr([(d.id, d.device_kind) for d in devices])):
            h.update(hashlib.sha256(part.encode()).digest())
        return os.path.join(self.directory, f"{name}-{h.hexdigest()[:40]}{SUFFIX}")

    def compile(self, name: str, jitted, args: tuple, devices: list) -> jax.stages.Compiled:
        """``jitted`` (a ``jax.jit`` function) compiled for ``args`` (arrays or
        ``jax.ShapeDtypeStruct``\\ s) on ``devices`` (the program's devices in its mesh's order: a loaded
        program runs on exactly these): loaded from the store when there, else lowered, compiled and kept."""
        if self.directory is None:
            return jitted.lower(*args).compile()
        path = self.path(name, args, devices)
        client = devices[0].client
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = None
        if data is not None:
            try:
                serialized, in_tree, out_tree = pickle.loads(data)
                program = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree, backend=client,
                                                                    execution_devices=list(devices))
                self.loaded.append(name)
                return program
            except Exception as e:  # a damaged or foreign entry: compile instead
                self.damaged.append(f"{os.path.basename(path)}: {type(e).__name__}: {str(e)[:120]}")
        with _jax_config.persistent_cache_min_compile_time_secs(float("inf")):  # nor may a later miss load it
            program = jitted.lower(*args).compile(FRESH)
        self.compiled.append(name)
        self._write(path, program)
        return program

    def _write(self, path: str, program) -> None:
        try:
            data = pickle.dumps(serialize_executable.serialize(program))
        except (ValueError, NotImplementedError, pickle.PicklingError, TypeError):
            return  # a program this backend cannot serialize: it just compiles each time
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # (a background compile thread)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:  # a full disk or a read-only cache: the run goes on without the entry
            try:
                os.remove(tmp)
            except OSError:
                pass

    def lazy(self, name: str, jitted, devices: list) -> Callable[..., Any]:
        """``jitted``, compiled through the store at its first call (for the arguments of that
        call; later calls must match them, as a ``Compiled`` requires)."""
        program = None

        def call(*args):
            nonlocal program
            if program is None:
                program = self.compile(name, jitted, args, devices)
            return program(*args)
        return call

    def summary(self) -> dict:
        """What this process's programs came from, for a record."""
        out = {"loaded": list(self.loaded), "compiled": list(self.compiled)}
        if self.damaged:
            out["damaged"] = self.damaged[:3]
        return out


__all__ = ["ExecutableStore", "code_fingerprint", "signature", "DIR_NAME", "ENV_OFF", "SUFFIX"]
