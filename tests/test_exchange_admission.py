"""Only the run writes the run (issue 57, classes 5, 6, 8, 9): admission to an exchange run.

- a worker whose config does not fit the run the exchange holds (another model field, slot count,
  wire) exits 2 with one line and writes nothing: no run-dir file, no record, nothing in the exchange;
- a second launcher on a run dir another holds is refused (exit 4), and one naming another exchange
  (exit 2), before any work;
- absurd model sizes (XLA aborts in C++ past int64 bytes) and ``debug.lr_spike`` with an exchange:
  exit 2, one line, no run dir;
- the ``steps`` rule: a hand-started worker adopts the run's budget, a launcher sets it.

One finished tiny exchange run (module fixture, real ``edit-jax train``) serves every case.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from edit_jax.elastic.admission import CONFIG_KEY, NotAdmitted, admit
from edit_jax.elastic.exchange import DirExchange
from edit_jax.rundir.runlock import RunLock
from edit_jax.validate import ConfigError, load_config
from tests.stages import one_stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
ARGS = ["sync.method=a_edit", "sync.warmup_steps=0", "mesh.replica=2", "mesh.shard=1", "sync.time.tau=0.3",
        "sync.exchange.grace=1", "batch_size=4", "steps=6", "eval_batches=1"]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=1")


def _edit_jax(*argv, cwd, timeout=120):
    return subprocess.run([sys.executable, "-m", "edit_jax", *argv], env=_env(), capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def _snapshot(*dirs) -> dict:
    """Every file under ``dirs`` with a hash of its content (the compile cache aside: JAX's own)."""
    out = {}
    for d in dirs:
        for folder, subdirs, files in os.walk(d):
            subdirs[:] = [s for s in subdirs if s != "compile_cache"]
            for name in files:
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-worker exchange run: (run dir, exchange dir, cwd). Its tests (the refusals of
    a worker or a launcher that does not belong) run under Python 3.12 only: admission is decided
    in Python before JAX computes anything (the run's files are compared byte for byte), so the jax
    version does not enter; the default stage runs test_steps_rule's admission without a run."""
    one_stage("3.12", "the refusals against a finished exchange run (its 2-worker run and 7 CLI processes)", 45,
              other="test_steps_rule")
    base = tmp_path_factory.mktemp("admission")
    run, ex = str(base / "run"), str(base / "run.x")
    out = _edit_jax("train", "--config", TINY, "--run-dir", run, f"sync.exchange.url={ex}", *ARGS, cwd=str(base),
                    timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.path.exists(os.path.join(ex, *CONFIG_KEY.split("/")))
    return run, ex, str(base)


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


@pytest.mark.parametrize("override, named", [
    ("model.ffn_dim=192", "model.ffn_dim (the run's 128, this 192)"),
    ("mesh.replica=4", "mesh.replica (the run's 2, this 4)"),
    ("sync.wire.kind=topk2 sync.wire.error_feedback=true", "sync.wire.kind (the run's 'none', this 'topk2')")])
def test_refused_worker_writes_nothing(finished, override, named):
    """A worker of another model, slot count or wire: exit 2 (the launcher does not restart it), one
    line naming the field and both values, and the run dir and the exchange byte for byte as they were
    (before: config.json replaced, a traceback, exit 1)."""
    run, ex, cwd = finished
    before = _snapshot(run, ex)
    out = _edit_jax("worker", "--worker", "1", "--config", TINY, "--run-dir", run, f"sync.exchange.url={ex}", *ARGS,
                    *override.split(), cwd=cwd)
    assert out.returncode == 2, out.stderr[-3000:]
    line = _one_line(out.stderr)
    assert line.startswith("edit-jax: bad config:") and named in line, line
    assert _snapshot(run, ex) == before


def test_second_launcher_refused(finished):
    """A run dir whose lock another launcher holds: the second `train` exits 4, one line, nothing written."""
    run, ex, cwd = finished
    before = _snapshot(run, ex)
    with RunLock(run):  # (a real flock, as a live launcher holds it)
        out = _edit_jax("train", "--config", TINY, "--run-dir", run, f"sync.exchange.url={ex}", *ARGS, cwd=cwd)
    assert out.returncode == 4, out.stderr[-3000:]
    assert "is in use by another run" in _one_line(out.stderr)
    assert _snapshot(run, ex) == before


@pytest.mark.parametrize("command", ["train", "worker", "in-program train"])
def test_another_exchange_refused(finished, tmp_path, command):
    """A `train` or a worker on a run dir that names another sync.exchange.url, or an in-program `train`
    on an exchange run's dir: exit 2, one line, nothing written, the other exchange never made
    (before: one metrics.jsonl got both runs' rounds, config.json named the other exchange)."""
    run, ex, cwd = finished
    before, other = _snapshot(run, ex), str(tmp_path / "other.x")
    argv, more = {"train": (["train"], [f"sync.exchange.url={other}"]),
                  "worker": (["worker", "--worker", "1"], [f"sync.exchange.url={other}"]),
                  "in-program train": (["train"], ["sync.method=diloco", "sync.tau=2"])}[command]
    out = _edit_jax(*argv, "--config", TINY, "--run-dir", run, *ARGS, *more, cwd=cwd)
    assert out.returncode == 2, out.stderr[-3000:]
    line = _one_line(out.stderr)
    assert "belongs to another run" in line and (f"sync.exchange.url={ex}" in line if command == "in-program train"
                                                  else f"not {other}" in line), line
    assert _snapshot(run, ex) == before and not os.path.exists(other)


@pytest.mark.parametrize("argv, named", [
    (["plan", "model.d_model=1000000000"], "'model.d_model'"),
    (["train", "model.d_model=1000000000"], "'model.d_model'"),
    (["train", "sync.exchange.url=EX", "debug.lr_spike=2-3:100"], "'debug.lr_spike'")])
def test_config_errors_before_any_work(tmp_path, argv, named):
    """Sizes past XLA's int64 bytes (it aborted in C++, exit 134, `train` after making its run dir) and
    a fault injection the exchange's workers would ignore: exit 2, one line, no run dir."""
    command, *overrides = argv
    run = tmp_path / "run"
    overrides = [o.replace("EX", str(tmp_path / "ex")) for o in overrides]
    more = ["--run-dir", str(run)] if command == "train" else []
    out = _edit_jax(command, "--config", TINY, *more, *ARGS, *overrides, cwd=str(tmp_path))
    assert out.returncode == 2, out.stderr[-3000:]
    line = _one_line(out.stderr)
    assert line.startswith("edit-jax: bad config:") and named in line, line
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("override, key", [
    ("model.n_layers=1000000000000", "model.n_layers"), ("batch_size=33554432", "batch_size"),
    ("steps=3000000000", "steps"), ("optim.warmup_steps=3000000000", "optim.warmup_steps"),
    ("sync.tau=3000000000", "sync.tau"), ("data.seq_len=3000000000", "data.seq_len")])
def test_int32_counts_refused(override, key):
    """Counts JAX takes as int32 (x64 is off; past 2^31 - 1 it raised a traceback while tracing):
    the layer scan's length, a worker's tokens per step (2^31 here: 16777216 rows x 128), the step
    counts. Refused by validate (what `plan` and `train` run first), naming the key."""
    with pytest.raises(ConfigError, match=f"'{key}'.*int32"):
        load_config(TINY, ["data.seq_len=128", override])
    load_config(TINY, ["batch_size=67108856", "data.seq_len=64"])  # 2^31 - 256 tokens per worker: allowed


def test_plan_step_kinds_without_stepping():
    """`plan` asks the schedule only around the warmup's end and each group's due step: the same kinds
    as stepping through warmup + 2 tau (checked on small schedules), and at once for tau = 2^31 - 1
    (before: a Python loop of 4e9 steps)."""
    from types import SimpleNamespace

    from edit_jax.localsgd.methods import StepSchedule
    from edit_jax.commands.plan import step_kinds

    def stepped(schedule, tau):
        kinds = []
        for k in range(schedule.warmup + 2 * tau + 2):
            kinds += [str(schedule.kind(k))] if str(schedule.kind(k)) not in kinds else []
        return kinds

    for outer, layerwise, warmup, tau in [(o, lw, w, t) for o in (True, False) for lw in (True, False)
                                          for w in (0, 1, 3) for t in (1, 2, 4, 6, 12)]:
        for f in [f for f in range(1, tau + 1) if tau % f == 0]:
            schedule = StepSchedule(outer, layerwise, warmup, tau, fragments=f)
            cfg = SimpleNamespace(sync=SimpleNamespace(tau=tau, fragments=f))
            assert step_kinds(schedule, cfg) == stepped(schedule, tau), (outer, layerwise, warmup, tau, f)
    big = SimpleNamespace(sync=SimpleNamespace(tau=2 ** 31 - 1, fragments=1))
    assert step_kinds(StepSchedule(True, False, 2 ** 31 - 1, 2 ** 31 - 1), big) == ["hsdp", "local", "local_then_sync"]


def test_steps_rule(tmp_path):
    """The run's budget is the exchange's: a worker with other `steps` adopts it (one line); the
    launcher (owner) sets it; a run config that does not parse refuses everyone, naming its key."""
    ex = DirExchange(str(tmp_path / "ex"))
    cfg = lambda *o: load_config(TINY, [*ARGS, f"sync.exchange.url={ex.url}", *o])
    said = []
    assert admit(ex, cfg(), str(tmp_path / "run"), said.append).steps == 6 and not said  # the first: creates it
    assert admit(ex, cfg("steps=3"), str(tmp_path / "run"), said.append).steps == 6
    assert len(said) == 1 and "trains to the run's steps=6" in said[0]
    assert admit(ex, cfg("steps=9"), str(tmp_path / "run"), said.append, owner=True).steps == 9
    assert json.loads(ex.get(CONFIG_KEY))["steps"] == 9
    assert admit(ex, cfg(), str(tmp_path / "run"), said.append).steps == 9
    ex.put(CONFIG_KEY, b"{garbled")
    with pytest.raises(NotAdmitted, match="run/config.json"):
        admit(ex, cfg(), str(tmp_path / "run"), said.append)


def test_llama_sizes_match_the_model():
    """The size check's parameter count is the llama family's, exactly (tied and untied)."""
    import jax
    from functools import partial

    from edit_jax.models.llama import init_params
    from edit_jax.models.sizes import llama_param_count

    for tie in ("false", "true"):
        cfg = load_config(TINY, ["model.d_model=48", "model.ffn_dim=80", "model.n_layers=3", "model.vocab_size=72",
                                 f"model.tie_embeddings={tie}"])
        shapes = jax.eval_shape(partial(init_params, cfg.model), jax.random.key(0))
        assert llama_param_count(cfg) == sum(x.size for x in jax.tree.leaves(shapes))
