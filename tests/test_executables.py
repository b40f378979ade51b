"""Compiled programs kept whole (``runtime/executables.py``): a program loaded from the store gives
the bits a fresh compile gives, keeps its donation, and a key of another program, argument or
context misses; a damaged entry is compiled again and replaced; an entry is never written from a
program JAX loaded from its own cache (on XLA:CPU those lack their kernels)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from edit_jax.runtime.compile_cache import compile_cache
from edit_jax.runtime.executables import SUFFIX, ExecutableStore


def _program():
    """A donated, sharded step with slices, a reduction and a scan (kernels of several kinds)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("shard",))
    sharding = NamedSharding(mesh, P("shard"))

    def step(x, y):
        def body(c, row):
            return c + jnp.tanh(row[1:3]).sum(), None
        total, _ = jax.lax.scan(body, 0.0, x.reshape(-1, 4))
        return x * 0.5 + y[::-1] + total, jnp.sum(x ** 2)
    jitted = jax.jit(step, donate_argnums=0, out_shardings=(sharding, None))
    x = jax.device_put(np.arange(16, dtype=np.float32) / 7, sharding)
    y = jax.device_put(np.linspace(-1, 1, 16, dtype=np.float32), sharding)
    return jitted, x, y, list(mesh.devices.flat)


def _copy(x):
    """A new array of ``x``'s values and sharding (``x`` itself would be donated)."""
    return jax.device_put(np.asarray(x), x.sharding)


def _entries(d):
    return sorted(f for f in os.listdir(d) if f.endswith(SUFFIX)) if os.path.isdir(d) else []


def test_a_loaded_program_equals_a_fresh_compile_and_keeps_its_donation(tmp_path):
    jitted, x, y, devices = _program()
    want = jax.device_get(jitted(_copy(x), y))  # plain jit, for reference
    first = ExecutableStore(str(tmp_path), "ctx")
    got = jax.device_get(first.compile("step", jitted, (x, y), devices)(_copy(x), y))
    assert (first.loaded, first.compiled) == ([], ["step"]) and len(_entries(tmp_path)) == 1
    again = ExecutableStore(str(tmp_path), "ctx")  # as a restarted process: from the entry
    program = again.compile("step", jitted, (x, y), devices)
    assert (again.loaded, again.compiled, again.damaged) == (["step"], [], [])
    arg = _copy(x)
    loaded = jax.device_get(program(arg, y))
    assert arg.is_deleted()  # donated, as the jitted function donates
    for a, b, c in zip(want, got, loaded, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    # Another program name, context or argument shape is another key: a miss, never a wrong program.
    for store, name, args in ((ExecutableStore(str(tmp_path), "ctx"), "other", (x, y)),
                              (ExecutableStore(str(tmp_path), "other ctx"), "step", (x, y)),
                              (ExecutableStore(str(tmp_path), "ctx"), "step", (x[:8], y[:8]))):
        store.compile(name, jitted, args, devices)
        assert (store.loaded, store.compiled) == ([], [name])
    assert len(_entries(tmp_path)) == 4


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path):
    jitted, x, y, devices = _program()
    ExecutableStore(str(tmp_path)).compile("step", jitted, (x, y), devices)
    path = os.path.join(tmp_path, _entries(tmp_path)[0])
    whole = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(whole[:len(whole) // 2])  # cut short, as a crash mid-copy would
    store = ExecutableStore(str(tmp_path))
    out = jax.device_get(store.compile("step", jitted, (x, y), devices)(_copy(x), y))
    assert (store.loaded, store.compiled, len(store.damaged)) == ([], ["step"], 1), store.summary()
    assert os.path.basename(path) in store.damaged[0] and store.summary()["damaged"] == store.damaged
    assert len(open(path, "rb").read()) > len(whole) // 2  # replaced by a whole entry
    again = ExecutableStore(str(tmp_path))
    np.testing.assert_array_equal(
        jax.device_get(again.compile("step", jitted, (x, y), devices)(_copy(x), y))[0], out[0])
    assert (again.loaded, again.damaged) == (["step"], [])
    off = ExecutableStore(None)  # off: compiles, writes nothing
    off.compile("step", jitted, (x, y), devices)
    assert (off.loaded, off.compiled) == ([], []) and _entries(tmp_path) == [os.path.basename(path)]


def test_an_entry_is_never_a_reserialized_cache_load(tmp_path):
    """With JAX's persistent cache on and holding the program (a plain jit call wrote it), a store
    miss still compiles for real: an entry written from a program JAX loaded from its cache fails
    at its first run on XLA:CPU ("Function ... not found"). The entry must run and give the bits of
    the plain call."""
    store_dir = str(tmp_path / "store")
    with compile_cache(str(tmp_path / "cache")):
        jax.clear_caches()
        jitted, x, y, devices = _program()
        want = jax.device_get(jitted(_copy(x), y))  # compiled, and written to JAX's cache
        jax.clear_caches()
        jitted, x, y, devices = _program()
        second = ExecutableStore(store_dir)
        second.compile("step", jitted, (x, y), devices)
        assert second.compiled == ["step"]
        jax.clear_caches()
        jitted, x, y, devices = _program()
        third = ExecutableStore(store_dir)
        got = jax.device_get(third.compile("step", jitted, (x, y), devices)(_copy(x), y))
        assert third.loaded == ["step"]
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
