"""Issue 22, the cases of the run dir and the command line: a run dir whose parts are the wrong
kind, a path too long for a checkpoint's files, no empty run dir left by an input error, the
summary of a run stopped before its first record, a signal while Python and JAX load, and a JAX
backend the machine does not have. Each was a traceback or lost work before."""

import json
import math
import os
import re
import sys
import time

import pytest

import logging

from edit_jax import cli
from edit_jax.cli import summary_line
from edit_jax.rundir.runlock import RunDirError, check_writable
from edit_jax.training.loop import TrainResult
from tests.helpers import REPO, child_xla_flags, interrupt_when, run_session
from tests.stages import one_stage

FAST = ["--config", "configs/tiny.py", "--no-progress", "mesh.replica=2", "mesh.shard=2", "batch_size=8",
        "data.seq_len=32", "steps=2"]


def _env(**extra):
    env = dict(os.environ, XLA_FLAGS=child_xla_flags())  # the CLI sets its own device count
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _train(run_dir, *extra, env=None, timeout=240):
    return run_session([sys.executable, "-m", "edit_jax", "train", *FAST, "--run-dir", str(run_dir), *extra], timeout,
                       env=env or _env())


def test_checkpoints_a_file_is_refused_before_any_work(tmp_path):
    """``RUN_DIR/checkpoints`` a regular file: before, the run trained to the end and the final
    save failed with NotADirectoryError (exit 1, all work lost). Now one line, exit 2, at once."""
    (tmp_path / "checkpoints").write_text("not a directory")
    t0 = time.time()
    code, out = _train(tmp_path)
    assert code == 2 and "checkpoints' is a file, expected a directory" in out, out[-2000:]
    assert "Traceback" not in out and time.time() - t0 < 60
    assert not (tmp_path / "config.json").exists()  # nothing trained, nothing written


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl"])
def test_run_files_that_are_directories_are_refused(tmp_path, name):
    (tmp_path / name).mkdir()
    with pytest.raises(RunDirError, match=rf"{name}' is a directory, expected a file"):
        check_writable(str(tmp_path))


def test_run_dir_too_long_for_a_checkpoint_is_refused(tmp_path):
    """A run dir path of about 4,000 characters passed the writability probe, trained, and then every
    save failed (373 lines, 18 tracebacks). The check now creates a file as deep as a save will."""
    deep = str(tmp_path)  # 4,000 characters: the run dir itself and its probe file fit (PATH_MAX 4,096)
    while len(deep) < 4000:
        deep = os.path.join(deep, "d" * min(200, 4000 - len(deep) - 1))
    code, out = _train(deep)
    assert code == 2 and "a checkpoint's files would not fit below it" in out, out[-2000:]
    assert "Traceback" not in out
    assert not os.path.exists(deep)  # the dirs the run made for it are gone again
    assert os.listdir(tmp_path) == []


def test_input_error_leaves_no_empty_run_dir(tmp_path):
    """A data error is found after the run dir was checked (and so created): before, an empty run
    dir (and its parents) stayed behind although the README says nothing is written."""
    one_stage("3.12", "an input error leaves no run dir", 5)
    run_dir = tmp_path / "runs" / "new"
    code, out = _train(run_dir, "data.source=text", f"data.paths={tmp_path / 'missing.txt'}",
                       env=_env(EDIT_JAX_COMPILE_CACHE=""))  # the run dir's own cache, made before the data check
    assert code == 2 and "data error" in out, out[-2000:]
    assert not (tmp_path / "runs").exists()
    # A cache dir of the user's (here a new one) may be shared with other runs: it stays.
    shared = tmp_path / "shared_cache"
    code, out = _train(run_dir, "data.source=text", f"data.paths={tmp_path / 'missing.txt'}",
                       env=_env(EDIT_JAX_COMPILE_CACHE=str(shared)))
    assert code == 2 and not (tmp_path / "runs").exists(), out[-2000:]
    assert shared.is_dir()


def test_summary_of_a_run_stopped_before_its_first_record():
    """Before: "train loss nan" for a run stopped before any record, which reads as a divergence."""
    result = TrainResult(steps=1, final_loss=math.nan, final_val_loss=None, final_val_ppl=None, tokens=0,
                         seconds=1.0, run_dir="r", interrupted=True, history=[])
    assert "train loss n/a (no step logged)" in summary_line(result, "r")
    diverged = TrainResult(steps=3, final_loss=math.nan, final_val_loss=None, final_val_ppl=None, tokens=0,
                           seconds=1.0, run_dir="r", history=[{"step": 3, "loss": math.nan}])
    assert "train loss nan" in summary_line(diverged, "r")  # a real non-finite loss is shown as such


@pytest.mark.parametrize("processes", [1, 2])
def test_signal_while_loading_is_one_line(tmp_path, processes):
    """SIGINT while Python and JAX load (before training starts): before, a 30-line
    KeyboardInterrupt traceback (2 processes: tracebacks and exit 5). Now one line and exit 130."""
    mp = ["mesh.processes=2"] if processes == 2 else []
    started = time.time()
    code, out = interrupt_when([sys.executable, "-m", "edit_jax", "train", *FAST, *mp,
                                "--run-dir", str(tmp_path / "r")],
                               lambda: time.time() - started >= 1.0, env=_env())
    assert code == 130, out[-2000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-2000:]
    assert "stopped before" in out, out[-2000:]


def test_missing_jax_backend_is_one_line(tmp_path):
    """``JAX_PLATFORMS=cuda`` on a machine without CUDA: before, JAX's RuntimeError traceback."""
    code, out = _train(tmp_path, env=_env(JAX_PLATFORMS="cuda"))
    if code == 0:
        pytest.skip("this machine has a CUDA backend")
    assert code == 2 and "JAX could not start a backend (JAX_PLATFORMS='cuda')" in out, out[-2000:]
    assert "Traceback" not in out


def test_cuda_plugin_without_an_nvidia_device_asks_for_the_cpu(monkeypatch):
    """``edit-jax[cuda]`` on a machine without a GPU (``plan --target``'s users): JAX would try
    the plugin, log an 11-line traceback at every command and fall back to the CPU; edit-jax asks
    for the CPU at once. A GPU's device node, the user's JAX_PLATFORMS or no plugin: left alone."""
    plugin = lambda name: object() if name.startswith("jax_plugins.xla_cuda") else None
    for nodes, env, find, expected in [([], {}, plugin, "cpu"), (["/dev/nvidia0"], {}, plugin, None),
                                       ([], {"JAX_PLATFORMS": "cuda"}, plugin, "cuda"),
                                       ([], {}, lambda name: None, None)]:
        monkeypatch.setattr(cli.os, "environ", dict(env))
        monkeypatch.setattr(cli.glob, "glob", lambda pattern, nodes=nodes: list(nodes))
        monkeypatch.setattr(cli.importlib.util, "find_spec", find)
        cli._cpu_without_gpus()
        assert cli.os.environ.get("JAX_PLATFORMS") == expected, (nodes, env)


def test_a_plugin_that_fails_to_start_is_one_line(capsys):
    """JAX's ERROR record with the plugin's traceback becomes one edit-jax line naming the cause;
    other records of that logger pass."""
    try:
        raise RuntimeError("operation cuInit(0) failed: Unknown CUDA error 303")
    except RuntimeError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("jax._src.xla_bridge", logging.ERROR, __file__, 1, "Jax plugin configuration error: "
                               "Exception when calling jax_plugins.xla_cuda12.initialize()", None, exc_info)
    keep = cli._PluginErrorAsOneLine()
    assert keep.filter(record) is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cuInit(0) failed" in err and "Traceback" not in err, err
    other = logging.LogRecord("jax._src.xla_bridge", logging.WARNING, __file__, 1, "something else", None, None)
    assert keep.filter(other) is True


def test_fallback_after_a_damaged_ocdbt_index_is_quiet(tmp_path):
    """The newest checkpoint's OCDBT index (``state/manifest.ocdbt``) cut to 10 bytes: the right
    fallback, but before also 45 "RuntimeError: Event loop is closed" tracebacks (275 lines) from
    TensorStore callbacks arriving after orbax closed its loop. Now a handful of lines."""
    one_stage("default", "a damaged OCDBT index", 19,
              other="test_quiet_faults.py::test_a_damaged_compile_cache_is_one_line_and_the_run_is_the_same")
    over = ["checkpoint_every=2", "keep_checkpoints=3"]
    code, out = _train(tmp_path, "steps=4", *over)
    assert code == 0, out[-2000:]
    os.truncate(tmp_path / "checkpoints" / "4" / "state" / "manifest.ocdbt", 10)
    code, out = _train(tmp_path, "steps=6", *over)
    assert code == 0 and "falling back to step 2" in out, out[-3000:]
    assert "Traceback" not in out and "Event loop is closed" not in out, out[-3000:]
    assert len(out.splitlines()) <= 8, out


@pytest.mark.parametrize("processes", [1, 2])
def test_incompatible_checkpoint_is_one_message(tmp_path, processes):
    """A checkpoint of another model shape: one message naming the keys, exit 2, and no advice to
    "re-run the same command" (before, 2 processes printed it once per worker, then that advice).
    The first run's summary gives the workers' mean loss, as one program does (before, 2 processes
    printed worker 0's)."""
    if processes == 2:
        one_stage("3.12", "the 2-process incompatible checkpoint", 22, other="[1] and test_failures.py::"
                  "test_damaged_checkpoint_falls_back_and_restore_step_moves_newer_aside[2]")
    else:  # (the same check in one process; 3.12's jax and orbax meet it in [2])
        one_stage("default", "the 1-process incompatible checkpoint", 15, other="[2]")
    mp = ["mesh.processes=2"] if processes == 2 else []
    code, out = _train(tmp_path, *mp)
    assert code == 0, out[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    last = [r for r in records if "loss" in r and not r.get("sync")][-1]
    printed = float(re.search(r"train loss ([\d.]+)", out).group(1))
    assert abs(printed - sum(last["replica_loss"]) / len(last["replica_loss"])) < 2e-4, (printed, last)
    code, out = _train(tmp_path, *mp, "model.n_layers=3", "steps=4")
    assert code == 2, out[-2000:]
    assert out.count("is incompatible with the config (model.n_layers: checkpoint 2, config 3)") == 1, out[-2000:]
    assert "re-run the same command" not in out and "Traceback" not in out


def test_a_run_dirs_config_json_relaunches_the_run(tmp_path):
    """``--config RUN_DIR/config.json`` (or the run dir itself) gives the same run in another dir:
    the losses equal the first run's. Before: any non-.py config crashed with AttributeError, exit 1.
    Under Python 3.12 only: reading a config back is the CLI's Python, not jax's."""
    one_stage("3.12", "a run dir's config.json relaunched", 10)
    first, second = tmp_path / "a", tmp_path / "b"
    code, out = _train(first)
    assert code == 0, out[-2000:]
    code, out = run_session([sys.executable, "-m", "edit_jax", "train", "--config", str(first / "config.json"),
                             "--no-progress", "--run-dir", str(second)], 240, env=_env())
    assert code == 0, out[-2000:]

    def losses(run_dir):
        return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl") if '"loss"' in line]

    assert losses(first) and losses(first) == losses(second)
    assert json.load(open(first / "config.json")) == json.load(open(second / "config.json"))


@pytest.mark.parametrize("name,text,expected", [
    ("c.yaml", "steps: 2\n", "expected a Python file with get_config() (.py) or a JSON config"),
    ("c.json", "{\"steps\": 2,", "is not valid JSON"),
    ("c.json", "{\"optim\": {\"lr\": \"fast\"}}", "config key 'optim.lr': expected float"),
])
def test_config_file_that_cannot_be_read_is_exit_2_with_its_path(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    code, out = run_session([sys.executable, "-m", "edit_jax", "train", "--config", str(path), "--run-dir",
                             str(tmp_path / "r")], 120, env=_env())
    assert code == 2 and str(path) in out and expected in out, out[-2000:]
    assert not (tmp_path / "r").exists()


def test_checkpoints_removed_by_another_process_meanwhile_is_not_unwritable(tmp_path, monkeypatch):
    """Worker 1 of a 2-process run checks the run dir while process 0's path probe creates and
    removes ``checkpoints/``: the dir gone between worker 1's look and its access check was once
    reported as "exists but is not writable" (exit 2; seen once under Python 3.12). The
    interleaving is made here: the dir is removed just before the access check."""
    from edit_jax.rundir import runlock

    (tmp_path / "checkpoints").mkdir()
    real_access = os.access

    def access_after_the_probe_removed_it(path, mode):
        if os.path.basename(path) == "checkpoints" and os.path.isdir(path):
            os.rmdir(path)  # what process 0's _check_deepest_path does when it created the dir
        return real_access(path, mode)

    monkeypatch.setattr(runlock.os, "access", access_after_the_probe_removed_it)
    check_writable(str(tmp_path), deepest=False)  # no RunDirError
    monkeypatch.undo()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints").chmod(0o500)
    if not os.access(tmp_path / "checkpoints", os.W_OK):  # (root can write anywhere)
        with pytest.raises(RunDirError, match="exists but is not writable"):
            check_writable(str(tmp_path), deepest=False)


def test_a_signal_while_the_workers_start_reaches_every_worker_once():
    """Before: a Ctrl-C that landed while the launcher was starting its workers was written only to
    the ones already running (none before the first Popen returned): the others trained on, and
    the run ended 0 (seen once in the suite, under load). Now each worker is told, once and in
    order, every signal that came before or while it started."""
    import subprocess

    from edit_jax.runtime.launch import Attempt

    attempt = Attempt()
    attempt.signals.append((2, 1))  # came before any worker ran
    for _ in range(2):
        attempt.procs.append(subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        attempt.pass_on()  # as run_workers does after each start
    attempt.signals.append((15, 2))  # a second one, as the handler appends it
    attempt.pass_on()
    attempt.pass_on()  # nothing new: nothing written
    outs = [p.communicate(timeout=10)[0] for p in attempt.procs]
    assert outs == ["2 1\n15 2\n", "2 1\n15 2\n"]


def test_help_says_what_each_command_does(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "plan", "tokenize", "placement", "sample", "export", "plot", "worker"):
        assert re.search(rf"^  {name} +\S", out, re.M), (name, out)  # listed with its line
    assert set(cli.COMMANDS) == {"train", "plan", "tokenize", "placement", "sample", "export", "plot", "worker"}
    assert cli.main(["nonsense"]) == 2 and "commands:" in capsys.readouterr().err
