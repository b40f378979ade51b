"""Issue 31 (3): fast restarts. JAX's persistent compilation cache (``train.compile_cache``) is read
by a restarted run, and checkpoints are written in the background (``train.async_checkpoint``)
without weakening the never-lose-a-good-checkpoint rules: the finite check and the checksums
stay, a checkpoint counts only once orbax finished it, and a crash while one is written leaves
the previous one the newest. Hits are counted from JAX's own events, never from timings."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from edit_jax.config import ConfigError, apply_overrides
from edit_jax.localsgd.methods import plan_for
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.rundir.checkpoint import Checkpointer, steps_on_disk
from edit_jax.runtime.compile_cache import DIR_NAME, ENV_DIR, cache_dir_for
from edit_jax.runtime.mesh import make_mesh
from edit_jax.training.train import train
from edit_jax.validate import validate
from tests.helpers import REPO, random_batch, tiny_config
from tests.stages import one_stage

# One training in a fresh process: JAX's cache-hit events counted, the names of the programs
# read from the cache (JAX's debug log line) listed, both printed as JSON on the last line.
_RUN = """
import json, logging, sys
import jax
from jax import monitoring
sys.path.insert(0, {repo!r})
from tests.helpers import tiny_config
from edit_jax.training.train import train
hits, names = [], []
monitoring.register_event_listener(lambda event, **kw: hits.append(1) if event.endswith("/cache_hits") else None)
class Names(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Persistent compilation cache hit for"):
            names.append(record.args[0])
log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.addHandler(Names())
cfg = tiny_config(2, 2, steps=4, checkpoint_every=2, **{kw})
result = train(cfg, {run_dir!r}, progress=False, devices=jax.devices()[:4], stop_after=2)
print(json.dumps({{"hits": len(hits), "names": names, "resumed_from": result.resumed_from}}))
"""


def _run(run_dir, kw="{}") -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_DIR}  # "auto": the run dir's own cache
    proc = subprocess.run([sys.executable, "-c", _RUN.format(repo=REPO, run_dir=str(run_dir), kw=kw)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_restart_reads_the_compiled_programs_from_the_cache(tmp_path):
    """The first run compiles its step program and writes RUN_DIR/compile_cache; the restart, a new
    process, loads the step program from it (JAX's cache-hit events), and adds nothing new for it."""
    one_stage("default", "a restart reading the compile cache", 21)
    cold = _run(tmp_path)
    entries = sorted(os.listdir(tmp_path / DIR_NAME))
    # (hits in the first run are programs it compiles twice, e.g. the same small op from two places)
    assert "jit_step" not in cold["names"] and cold["resumed_from"] is None, cold
    assert any(e.startswith("jit_step-") for e in entries), entries
    warm = _run(tmp_path)
    assert warm["resumed_from"] == 2, warm
    assert warm["hits"] >= 2 and "jit_step" in warm["names"], warm
    new = sorted(set(os.listdir(tmp_path / DIR_NAME)) - set(entries))
    assert not any(e.startswith("jit_step-") for e in new), new  # read, not compiled and written again


def test_compile_cache_setting(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "shared"))  # "auto" is the user's shared cache when set
    assert cache_dir_for("auto", str(tmp_path)) == str(tmp_path / "shared")
    assert cache_dir_for("off", str(tmp_path)) is None
    monkeypatch.delenv(ENV_DIR)
    assert cache_dir_for("auto", str(tmp_path)) == os.path.join(str(tmp_path), DIR_NAME)
    assert cache_dir_for("auto", None) is None and cache_dir_for("off", str(tmp_path)) is None
    assert cache_dir_for("", str(tmp_path)) is None
    assert cache_dir_for(str(tmp_path / "c"), "run") == str(tmp_path / "c")
    cfg = apply_overrides(tiny_config(2, 2, steps=1), ["train.compile_cache=off"])
    train(cfg, str(tmp_path / "run"), progress=False, devices=jax.devices()[:4])
    assert not os.path.exists(tmp_path / "run" / DIR_NAME)
    (tmp_path / "file").write_text("x")
    for bad in [str(tmp_path / "file"), " auto", "a\nb"]:
        with pytest.raises(ConfigError, match="train.compile_cache"):
            validate(apply_overrides(cfg, [f"train.compile_cache={bad}"]))
    with pytest.raises(ConfigError, match="train.async_checkpoint"):
        apply_overrides(cfg, ["train.async_checkpoint=maybe"])


def test_async_save_of_a_state_the_next_steps_donate_verifies(tmp_path):
    """The save returns before the write; the steps that follow donate (reuse) the state's buffers.
    What is written is the state as saved: its checksums verify on restore."""
    one_stage("3.12", "an async save of a donated state", 6)
    cfg = tiny_config(2, 2, steps=8)
    plan = plan_for(cfg)
    programs = StepPrograms(plan, make_mesh(cfg.mesh, jax.devices()[:4]))
    state = programs.init_state(0)
    step = programs.step_fn(programs.schedule.kind(0))
    state, _ = step(state, programs.put_batch(random_batch(cfg, 0)))
    saved = jax.tree.map(np.asarray, state)
    ckpt = Checkpointer(str(tmp_path), keep=2, asynchronous=True)
    ckpt.save(1, state, {"step": 1}, cfg)
    assert ckpt.pending is not None
    for i in range(1, 4):  # donates the buffers the save was given
        state, _ = step(state, programs.put_batch(random_batch(cfg, i)))
    jax.block_until_ready(state)
    ckpt.finish()
    restored, data = ckpt.restore(1, programs.abstract_state())
    ckpt.close()
    assert data == {"step": 1}
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


# The background write of checkpoint 4 never finishes (orbax's final rename waits forever); the
# loop goes on, and the process kills itself (SIGKILL, as a crash) once step 5 ran.
_CRASH = """
import asyncio, os, signal, sys
import jax
sys.path.insert(0, {repo!r})
from orbax.checkpoint._src.path import atomicity
from tests.helpers import tiny_config
from edit_jax.training import loop
from edit_jax.training.train import train
real_finalize, real_records = atomicity.AtomicRenameTemporaryPath.finalize, loop.Training.write_records
async def finalize(self, *a, **kw):
    if self.get_final().name == "4":
        await asyncio.sleep(3600)
    return await real_finalize(self, *a, **kw)
def write_records(self, adv, before, now):
    real_records(self, adv, before, now)
    if now >= 5:
        print("step", now, "ran while checkpoint 4 was written; pending", self.setup.ckpt.pending[0], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
atomicity.AtomicRenameTemporaryPath.finalize, loop.Training.write_records = finalize, write_records
cfg = tiny_config(2, 2, steps=8, checkpoint_every=2, keep_checkpoints=1)
cfg.train.async_checkpoint = True
train(cfg, {run_dir!r}, progress=False, devices=jax.devices()[:4])
"""


def test_a_crash_while_a_checkpoint_is_written_keeps_the_previous_one(tmp_path):
    """keep_checkpoints=1: checkpoint 2 would be deleted once 4 is finished. Killed while 4 is
    written (after step 5 ran: the save did not block the loop), 2 stays the newest checkpoint, 4
    is not one, and the re-run resumes from 2 (verified) and finishes."""
    one_stage("3.12", "a crash during a save", 12)
    proc = subprocess.run([sys.executable, "-c", _CRASH.format(repo=REPO, run_dir=str(tmp_path))], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "step 5 ran while checkpoint 4 was written; pending 4" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert steps_on_disk(str(tmp_path)) == [2], os.listdir(tmp_path / "checkpoints")
    cfg = tiny_config(2, 2, steps=8, checkpoint_every=2, keep_checkpoints=1)
    result = train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4])
    assert result.resumed_from == 2 and result.steps == 8
    assert steps_on_disk(str(tmp_path)) == [8]
