"""Issue 42: faults whose outcome was right but whose output buried it, and the races around them.
Each test forces its input deterministically and fails on the code before the fix:

- a damaged compile cache (entries garbled, truncated, emptied) or one that cannot be written (a
  full disk): one line of ours per run instead of 17-22 raw JAX warnings; a compile cache path
  that cannot be a directory, through ``$EDIT_JAX_COMPILE_CACHE`` too, refused up front (exit 2);
- a restore that fails on one damaged array file while the reads of the others are pending: no
  unawaited read left behind ("Exception ignored in: <coroutine object
  _read_array_index_and_device_put ...>", up to 345 tracebacks), one short line naming it;
- a second Ctrl-C arriving while the process exits after a clean stop: 130, not -2 or 5;
- gloo's connection line cut in two by another line; a finished 2-process run rerun; a damaged
  rollback target whose only way on is a checkpoint in ``checkpoints.spike/``.
"""

import asyncio
import dataclasses
import errno
import gc
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest

from edit_jax.config import ConfigError, apply_overrides
from edit_jax.localsgd.methods import plan_for
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.rundir.checkpoint import Checkpointer, CheckpointError, steps_on_disk
from edit_jax.runtime.compile_cache import ENV_DIR, compile_cache
from edit_jax.runtime.launch import Relay
from edit_jax.runtime.mesh import make_mesh
from edit_jax.training.train import train
from edit_jax.validate import validate
from tests.helpers import REPO, child_xla_flags, kill_group, tiny_config
from tests.stages import one_stage

JAX_CACHE_WARNING = "persistent compilation cache entry"


def _cli_env(**extra):
    env = dict(os.environ, XLA_FLAGS=child_xla_flags())  # the CLI sets its own device count
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _losses(result):
    return [(r["step"], r["loss"]) for r in result.history]


# ----------------------------------------------------------------------------- 1. the compile cache


def test_a_damaged_compile_cache_is_one_line_and_the_run_is_the_same(tmp_path, capfd):
    """A tiny run fills a cache; every entry is then garbled, cut in half or emptied; the same run
    again (its in-memory programs dropped, so that JAX reads the cache) prints one line of ours
    and no JAX warning (before: a UserWarning per program, 21-22 of them), and logs the same
    losses."""
    one_stage("3.12", "a damaged compile cache", 20,
              other="test_cli_faults.py::test_fallback_after_a_damaged_ocdbt_index_is_quiet")
    cache = tmp_path / "cache"
    cfg = apply_overrides(tiny_config(2, 2, steps=2), [f"train.compile_cache={cache}"])
    jax.clear_caches()  # this process compiled these programs before: a cold start writes the cache
    first = train(cfg, str(tmp_path / "a"), progress=False, devices=jax.devices()[:4])
    entries = sorted(cache.iterdir())
    assert len(entries) >= 5, entries
    for i, entry in enumerate(entries):
        size = entry.stat().st_size
        if i % 3 == 0:
            entry.write_bytes(np.random.default_rng(i).bytes(size))
        elif i % 3 == 1:
            os.truncate(entry, size // 2)
        else:
            entry.write_bytes(b"")
    jax.clear_caches()
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = train(cfg, str(tmp_path / "b"), progress=False, devices=jax.devices()[:4])
    err = capfd.readouterr().err
    raw = [str(w.message)[:120] for w in caught if JAX_CACHE_WARNING in str(w.message)]
    assert not raw and JAX_CACHE_WARNING not in err, (raw, err[-2000:])
    ours = [line for line in err.splitlines() if "compile cache" in line]
    assert len(ours) == 1 and f"compile cache {cache} has damaged entries" in ours[0], err[-2000:]
    assert "compiles those programs again" in ours[0]
    assert _losses(again) == _losses(first) and again.final_val_loss == first.final_val_loss


def test_a_compile_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capfd):
    """Every write of a cache entry fails with ENOSPC (a full disk; before: a "No space left"
    UserWarning per program, 17 in a run): one line naming the cause, JAX's warnings only with
    ``--debug`` (``EDIT_JAX_DEBUG=1``), and other warnings untouched."""
    from jax._src import path as jax_path  # the path class JAX's file cache writes its entries with

    cls = type(jax_path.Path(str(tmp_path)))
    real = cls.write_bytes

    def full_disk(self, data):
        if str(self).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data)

    monkeypatch.setattr(cls, "write_bytes", full_disk)
    for debug in ("", "1"):
        monkeypatch.setenv("EDIT_JAX_DEBUG", debug)
        capfd.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with compile_cache(str(tmp_path / f"cache{debug}")):
                for k in range(3):  # three new programs, three failed writes
                    jax.jit(lambda x, k=k: x * (k + 2.5) - k)(np.arange(4.0)).block_until_ready()
                warnings.warn("another warning", UserWarning, stacklevel=1)
        said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("edit-jax:")]
        raw = [w for w in caught if JAX_CACHE_WARNING in str(w.message)]
        assert [str(w.message) for w in caught if "another" in str(w.message)] == ["another warning"]
        assert len(said) == 1 and "cannot be written (no space left on the device)" in said[0], said
        assert "not kept for a restart" in said[0] and "--debug" in said[0]
        assert len(raw) == (3 if debug else 0), [str(w.message)[:100] for w in raw]


def test_a_compile_cache_that_cannot_be_a_directory_is_refused_up_front(tmp_path, monkeypatch):
    """``$EDIT_JAX_COMPILE_CACHE`` naming a file, or a cache path under a file (through the variable
    or ``train.compile_cache``): refused by the config check, as ``train.compile_cache=<a file>``
    was (before: accepted; JAX then warned "Error reading persistent compilation cache entry" and
    the run went on without a cache), naming the variable or the key. Through the command line:
    one line, exit 2, nothing written."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = tiny_config(2, 2, steps=1)
    cases = [(str(blocker), "auto", "$EDIT_JAX_COMPILE_CACHE", "is not a directory"),
             (str(blocker / "cache"), "auto", "$EDIT_JAX_COMPILE_CACHE", f"{str(blocker)!r} is a file"),
             (None, str(blocker / "cache" / "deeper"), "train.compile_cache", f"{str(blocker)!r} is a file")]
    for env, setting, names, why in cases:
        if env is None:
            monkeypatch.delenv(ENV_DIR, raising=False)
        else:
            monkeypatch.setenv(ENV_DIR, env)
        with pytest.raises(ConfigError) as e:
            validate(apply_overrides(cfg, [f"train.compile_cache={setting}"]))
        assert names in str(e.value) and why in str(e.value), str(e.value)
    monkeypatch.setenv(ENV_DIR, str(blocker / "cache"))
    monkeypatch.setenv("XLA_FLAGS", child_xla_flags())
    out = subprocess.run([sys.executable, "-m", "edit_jax", "train", "--config", "configs/tiny.py", "--run-dir",
                          str(tmp_path / "run"), "--no-progress", "steps=1"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and len(text.strip().splitlines()) == 1, text[-2000:]
    assert text.startswith("edit-jax: bad config: $EDIT_JAX_COMPILE_CACHE=") and "is a file" in text, text
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- 2. a failed restore


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A tiny run on a 2 x 2 mesh with checkpoints 2 and 4 (copied by each test)."""
    run_dir = tmp_path_factory.mktemp("two_checkpoints")
    cfg = tiny_config(2, 2, steps=4, checkpoint_every=2, keep_checkpoints=3)
    train(cfg, str(run_dir), progress=False, devices=jax.devices()[:4])
    assert steps_on_disk(str(run_dir)) == [2, 4]
    return run_dir, cfg


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_failed_restore_leaves_no_reads_behind(tmp_path, monkeypatch, capfd, two_checkpoints, damage):
    """The largest array file of checkpoint 4 truncated or deleted; every read that succeeds before
    the first failure then waits (as on a loaded machine, where those reads are still in flight
    when one fails: the count of tracebacks was 0-345 from run to run). Before, each read left
    pending printed "Exception ignored in: <coroutine object _read_array_index_and_device_put>"
    when collected (hundreds, with their TensorStore specs). Now none; the fallback is one line
    under 200 characters naming the checkpoint and the array, and the run resumes from 2."""
    one_stage("default" if damage == 'truncated' else "3.12", "a failed restore's reads", 9, other="the other damage")
    from orbax.checkpoint._src.serialization import serialization

    src, cfg = two_checkpoints
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    files = [os.path.join(r, f) for r, _, fs in os.walk(run_dir / "checkpoints" / "4" / "state") for f in fs
             if os.path.basename(r) == "d"]
    victim = max(files, key=os.path.getsize)
    if damage == "truncated":
        os.truncate(victim, os.path.getsize(victim) // 2)
    else:
        os.remove(victim)
    real, failed, waiting = serialization._read_shard, [], []

    async def read_then_wait(*args, **kwargs):
        try:
            out = await real(*args, **kwargs)
        except BaseException:
            if not failed:  # the first failure waits until other reads are pending, then fails the restore
                for _ in range(500):
                    if waiting:
                        break
                    await asyncio.sleep(0.02)
                failed.append(len(waiting))
            raise
        if not failed:  # still pending when a read fails (checkpoint 4 only: 2 is read after)
            waiting.append(1)
            await asyncio.sleep(60)
        return out

    monkeypatch.setattr(serialization, "_read_shard", read_then_wait)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.object!r}: {u.exc_value!r}"[:300]))
    capfd.readouterr()
    t0 = time.time()
    result = train(dataclasses.replace(cfg, steps=5), str(run_dir), progress=False, verbose=True,
                   devices=jax.devices()[:4])
    gc.collect()
    err = capfd.readouterr().err
    assert failed and failed[0] > 0 and result.resumed_from == 2 and result.steps == 5  # reads were pending
    assert not unraisable, unraisable[:3]
    assert "Exception ignored" not in err and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "falling back" in line]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert line.startswith("edit-jax: checkpoints/4 is damaged: ") and "falling back to step 2" in line, line
    assert "TensorStore" not in line and len(line) < 200, (len(line), line)
    assert any(part in line for part in ("params.", "opt_state.", "outer.")), line  # the array
    assert sorted(os.listdir(run_dir / "checkpoints.bad")) == ["4"]
    assert time.time() - t0 < 50  # the waiting reads were ended, not waited for


# ----------------------------------------------------------------------------- 3. a late second signal


@pytest.mark.parametrize("processes", [1, 2])
def test_a_late_second_signal_still_exits_130(tmp_path, processes):
    """A first SIGINT stops the run before its first step; once the summary is out (the run is
    over, the process exiting) SIGINTs keep coming every 20 ms until it is gone. Before, one
    landing in Python's shutdown (where its handlers are back to the default) ended the run with
    -2; with 2 processes the launcher passed it on as "the second signal", one worker left at once
    and the other aborted in JAX's shutdown barrier: exit 5; or one landing after the training
    returned said "stopped before training started". Now 130 and nothing more."""
    one_stage("default" if processes == 1 else "3.12", "a late second signal", 10, other="the other process count")
    mp = ["mesh.processes=2"] if processes == 2 else []
    cmd = [sys.executable, "-u", "-m", "edit_jax", "train", "--config", "configs/tiny.py", "--run-dir", str(tmp_path),
           "--no-progress", "mesh.replica=2", "mesh.shard=2", *mp, "data.seq_len=32", "batch_size=8", "steps=5",
           "method=edit"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_cli_env(), start_new_session=True)
    lines = []
    try:
        deadline = time.time() + 240
        while not (tmp_path / "config.json").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGINT)
        for line in proc.stdout:
            lines.append(line)
            if "stopped at step" in line:
                break
        stop_at = time.time() + 20
        while proc.poll() is None and time.time() < stop_at:
            try:
                os.kill(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        lines.append(proc.stdout.read())
        proc.wait(timeout=60)
    finally:
        kill_group(proc)
    out = "".join(lines)
    assert proc.returncode == 130, (proc.returncode, out[-3000:])
    assert "stopped before the first step" in out and "stopped before training started" not in out, out[-3000:]
    assert "Traceback" not in out and "was ended by signal" not in out, out[-3000:]


# ----------------------------------------------------------------------------- 4. smaller


def test_gloo_connection_line_cut_in_two_is_dropped():
    """gloo writes its connection line in pieces; a line the worker prints meanwhile cuts it: the
    head lands before that line, the rest is a line of its own. Neither piece is shown, the line in
    between is (before: "1 is connected to 1 peer ranks. Expected number ..." got through)."""
    relay, out = Relay(), io.StringIO()
    segments = ["[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
                "[Gloo] Rank edit-jax: step 2 val_loss 5.6864\n",
                "1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
                "[Gloo] Rank 0 is connected to 1 peer ranks. edit-jax: resumed from step 2\n",
                "Expected number of connected peer ranks is : 1\n",
                " peer ranks. Expected number of connected peer ranks is : 1\n",
                "edit-jax: done at step 4\n", "a line of the user's own\n"]
    for text in segments:
        relay.segment(0, text, out)
    assert out.getvalue().splitlines() == ["edit-jax: step 2 val_loss 5.6864", "edit-jax: resumed from step 2",
                                           "edit-jax: done at step 4", "a line of the user's own"], out.getvalue()


def test_a_finished_2_process_run_is_said_once_without_workers(tmp_path):
    """A finished 2-process run rerun: the launcher looks at the run dir first and says so once,
    in seconds, no worker started (before: both workers started, 4-9 s, and "already finished"
    twice)."""
    one_stage("default", "a finished 2-process run said once", 5)
    cfg = tiny_config(2, 2, steps=2)
    programs = StepPrograms(plan_for(cfg), make_mesh(cfg.mesh, jax.devices()[:4]))
    ckpt = Checkpointer(str(tmp_path), keep=2)
    ckpt.save(2, programs.init_state(0), {"step": 2}, cfg)
    ckpt.close()
    before = sorted(os.listdir(tmp_path))
    out = subprocess.run([sys.executable, "-m", "edit_jax", "train", "--config", "configs/tiny.py", "--run-dir",
                          str(tmp_path), "--no-progress", "mesh.replica=2", "mesh.shard=2", "mesh.processes=2",
                          "steps=2"], cwd=REPO, env=_cli_env(), capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and text.count("already finished") == 1, text
    assert "already finished at step 2" in text and "started 2 worker" not in text, text
    assert sorted(os.listdir(tmp_path)) == before


def test_a_damaged_rollback_target_names_the_way_out(tmp_path):
    """A loss spike's rollback left the run with checkpoint 2 (healthy; here damaged) and 4 (written
    during the spike) in checkpoints.spike/. Every rerun exits 2 as before, and now its message
    names the way on: move checkpoints.spike/4 back and rerun with --restore-step 4 (before:
    "move it away to start over", nothing about 4). Doing so resumes from 4."""
    one_stage("3.12", "a damaged rollback target", 6)
    cfg = tiny_config(2, 2, steps=4, checkpoint_every=2, keep_checkpoints=3)
    train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4])
    meta4 = tmp_path / "checkpoints" / "4" / "meta" / "metadata"
    meta4.write_text(json.dumps({**json.loads(meta4.read_text()), "healthy": False}))  # written during the spike
    os.makedirs(tmp_path / "checkpoints.spike")
    shutil.move(str(tmp_path / "checkpoints" / "4"), str(tmp_path / "checkpoints.spike" / "4"))  # the rollback
    meta = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    key = next(k for k in sorted(saved["checksums"]) if "params" in k)
    saved["checksums"][key] = (saved["checksums"][key] + 1) % 2**32  # damaged: its checksum no longer matches
    meta.write_text(json.dumps(saved))
    cfg = dataclasses.replace(cfg, steps=6)
    with pytest.raises(CheckpointError) as e:
        train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4])
    message = str(e.value)
    spike = tmp_path / "checkpoints.spike" / "4"
    assert "checkpoints/2 is damaged" in message and f"move {spike} back" in message, message
    assert "--restore-step 4" in message, message
    shutil.move(str(spike), str(tmp_path / "checkpoints" / "4"))
    result = train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4], restore_step=4)
    assert result.resumed_from == 4 and result.steps == 6
