"""Tests run on CPU-emulated devices: 64 of them, so that both 8-device meshes (2 x 4, 4 x 2)
and the 8 x 8 mesh can be built in one process. Must run before jax is imported."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=64").strip()
# XLA:CPU's LLVM backend at -O0: the tests' programs are tiny, so LLVM's optimisation passes were
# most of each compile and the programs run about as fast without them (docs/developer/tests-and-ci.md:
# a 2-process tiny run 0.69x the time). The HLO, the sharding and the collectives are XLA's own
# passes and do not change. The CLI processes the tests start keep it (helpers.child_xla_flags);
# the demo, the benches and users get XLA's default.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags

# No compiling ahead (train.compile_ahead): the tests' short runs use few of a run's programs, and
# compiling all of them would cost each run seconds; tests/test_compile_ahead.py turns it on. The
# CLI processes the tests start inherit it.
os.environ.setdefault("EDIT_JAX_COMPILE_AHEAD", "0")

# One JAX compilation cache for the whole session (edit_jax/runtime/compile_cache.py: "auto" means
# $EDIT_JAX_COMPILE_CACHE when set): the tests train the same tiny programs again and again, in
# this process and in the CLI processes they start, which inherit the variable (docs/developer/tests-and-ci.md:
# the suite 0.91x the time). Tests of the run dir's own cache unset it.
if "EDIT_JAX_COMPILE_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="edit_jax_test_compile_cache_")
    os.environ["EDIT_JAX_COMPILE_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, True)
