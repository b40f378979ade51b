"""The exchange waits out its storage (edit_jax/elastic/patience.py, exchange.py, s3.py, supervisor.py):
transient faults injected at the storage boundary as real OSErrors, a directory renamed away and
back, a real moto S3 server killed and started again, the launcher's own writes failing, and the
exchange URLs that are config errors (exit 2, one line, no run dir)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from edit_jax.elastic import rounds as R
from edit_jax.elastic.exchange import DirExchange, ExchangeError
from edit_jax.elastic.keys import ExchangeUnavailable
from edit_jax.elastic.patience import PatientExchange, open_patient
from edit_jax.elastic.s3 import S3Exchange
from tests.stages import one_stage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "edit-jax-storage"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_MAX_ATTEMPTS": "1",
           "AWS_EC2_METADATA_DISABLED": "true"}


class Flaky:
    """``inner`` whose ``op`` raises ``OSError(err)`` for its first ``times`` calls (``after``: the
    call is made first, then the error: an answer lost)."""

    def __init__(self, inner, op: str, err: int, times: int, after: bool = False):
        self.inner, self.op, self.err, self.left, self.after, self.calls = inner, op, err, times, after, 0
        self.url = inner.url

    def __getattr__(self, name):
        fn = getattr(self.__dict__["inner"], name)
        if name != self.__dict__["op"]:
            return fn

        def call(*args):
            self.calls += 1
            out = fn(*args) if self.after else None
            if self.left > 0:
                self.left -= 1
                raise OSError(self.err, os.strerror(self.err))
            return out if self.after else fn(*args)
        return call


def _patient(inner, patience_s=5.0):
    said = []
    return PatientExchange(inner, patience_s, said.append, "edit-jax worker 1", backoff_s=0.01, cap_s=0.05), said


def test_transient_write_errors_are_retried_said_once_and_recovery_said_once(tmp_path):
    flaky = Flaky(DirExchange(str(tmp_path)), "put", errno.EROFS, times=4)
    ex, said = _patient(flaky)
    ex.put("a/b", b"x")
    assert ex.get("a/b") == b"x" and flaky.calls == 5
    assert len(said) == 2, said
    assert said[0] == (f"edit-jax worker 1: exchange {tmp_path}: writes fail (read-only file system); "
                       f"retrying for up to 5 s")
    assert "answering again" in said[1]
    ex.put("a/c", b"y")  # no outage, no line
    assert len(said) == 2


def test_patience_spent_raises_exchange_unavailable_and_zero_means_no_retry(tmp_path):
    flaky = Flaky(DirExchange(str(tmp_path)), "get", errno.EIO, times=10**9)
    ex, said = _patient(flaky, patience_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(ExchangeUnavailable, match="sync.exchange.patience"):
        ex.get("k")
    assert 0.3 <= time.monotonic() - t0 < 2 and len(said) == 1 and "reads fail (input/output error)" in said[0]
    flaky = Flaky(DirExchange(str(tmp_path)), "put", errno.ENOSPC, times=10**9)
    ex, _ = _patient(flaky, patience_s=0)
    with pytest.raises(ExchangeUnavailable, match="no space left"):
        ex.put("k", b"")
    assert flaky.calls == 1


def test_permanent_errors_are_not_retried(tmp_path):
    ex, said = _patient(DirExchange(str(tmp_path)))
    with pytest.raises(ValueError):
        ex.put("../up", b"")
    flaky = Flaky(DirExchange(str(tmp_path)), "put", errno.ENOENT, times=1)  # the root is there: not an outage
    ex, said = _patient(flaky)
    with pytest.raises(FileNotFoundError):
        ex.put("k", b"")
    assert flaky.calls == 1 and said == []
    assert ex.get("missing") is None and said == []


def test_retried_create_whose_first_attempt_wrote_is_ours_and_anothers_is_not(tmp_path):
    flaky = Flaky(DirExchange(str(tmp_path)), "create", errno.EIO, times=1, after=True)
    ex, _ = _patient(flaky)
    assert ex.create("run/config.json", b"mine") is True and flaky.calls == 2
    assert ex.create("run/config.json", b"mine") is False  # no failure in between: an existing key is not ours
    flaky.left = 1
    assert ex.create("run/config.json", b"theirs") is False


def test_directory_renamed_away_for_a_second_the_put_waits_and_succeeds(tmp_path):
    root, away = tmp_path / "x", tmp_path / "x.away"
    ex, said = _patient(DirExchange(str(root)), patience_s=20)
    ex.put("posts/r1/w0", b"before")
    os.rename(root, away)
    back = threading.Timer(1.0, os.rename, (away, root))
    back.start()
    t0 = time.monotonic()
    ex.put("posts/r1/w1", b"during")
    back.join()
    assert time.monotonic() - t0 >= 0.8
    assert ex.list("posts/") == ["posts/r1/w0", "posts/r1/w1"] and not away.exists()
    assert len(said) == 2 and f"its directory {root} is missing" in said[0]


def test_stale_temporaries_are_swept_at_open_and_fresh_ones_kept(tmp_path):
    (tmp_path / "posts" / "r1").mkdir(parents=True)
    old, fresh = tmp_path / "posts" / "r1" / ".tmp-old", tmp_path / "posts" / "r1" / ".tmp-fresh"
    old.write_bytes(b"killed writer")
    fresh.write_bytes(b"live writer")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    ex = DirExchange(str(tmp_path))
    assert not old.exists() and fresh.exists() and ex.list("") == []
    assert ex.sweep_temporaries(older_than_s=0) == 1 and not fresh.exists()


# -- S3: a real moto server, stopped and started again ----------------------------------------------

_SERVER = """
import sys
from moto.backends import get_backend
from moto.server import ThreadedMotoServer
get_backend("s3")["123456789012"]["global"].create_bucket(sys.argv[2], "us-east-1")  # before it listens
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("up", flush=True)
sys.stdin.read()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), BUCKET], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, **AWS_ENV})
    assert proc.stdout.readline().strip() == b"up"
    return proc


@pytest.fixture
def moto_server(monkeypatch):
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    port = _free_port()
    procs = [_serve(port)]
    yield port, procs
    for p in procs:
        p.kill()
        p.wait()


def test_s3_put_waits_through_a_server_restart(moto_server):
    port, procs = moto_server
    ex, said = _patient(S3Exchange.from_url(f"s3://{BUCKET}/run?endpoint=http://127.0.0.1:{port}"), patience_s=30)
    ex.put("a", b"1")
    procs[0].kill()
    procs[0].wait()
    restart = threading.Timer(1.0, lambda: procs.append(_serve(port)))
    restart.start()
    t0 = time.monotonic()
    ex.put("b", b"2")
    restart.join()
    assert time.monotonic() - t0 >= 0.8 and ex.get("b") == b"2"
    assert len(said) == 2 and "writes fail (cannot put 'b': cannot reach" in said[0], said


def test_s3_missing_bucket_and_unreachable_endpoint(moto_server):
    port, _ = moto_server
    t0 = time.monotonic()
    with pytest.raises(ExchangeError, match="does not exist") as e:  # permanent: at once
        open_patient(f"s3://no-such-bucket/p?endpoint=http://127.0.0.1:{port}", 30, print)
    assert not isinstance(e.value, ExchangeUnavailable) and time.monotonic() - t0 < 5
    said = []
    with pytest.raises(ExchangeUnavailable, match="cannot reach"):
        open_patient(f"s3://{BUCKET}/p?endpoint=http://127.0.0.1:{_free_port()}", 0.5, said.append)
    assert len(said) == 1


# -- the launcher: its retracts never kill it; exit 75 restarts ---------------------------------------

_WORKER = """
import sys
path = sys.argv[1]
with open(path, "a+") as f:
    f.seek(0)
    n = len(f.read())
    f.write("x")
sys.exit(75 if n < 3 else 0)
"""


def test_launcher_restarts_exit_75_once_per_outage_and_skips_failing_retracts(tmp_path, monkeypatch):
    from edit_jax.elastic import supervisor  # (imports the worker's modules)

    counter, root = tmp_path / "starts", tmp_path / "x"
    ex = DirExchange(str(root))
    os.rename(root, tmp_path / "gone")  # every retract fails
    monkeypatch.setenv(supervisor.ENV_START, "spawn")
    monkeypatch.setattr(supervisor, "worker_argv", lambda *a: [sys.executable, "-c", _WORKER, str(counter)])
    monkeypatch.setattr(supervisor, "RETRY_PAUSE_S", 0.05)
    monkeypatch.setattr(supervisor, "RETRACT_S", 0.2)
    said = []
    code = supervisor.launch_workers("c", str(tmp_path / "run"), [], 1, 1, max_restarts=1, say=said.append,
                                     poll_s=0.02, exchange=ex)
    assert code == 0 and counter.read_text() == "xxxx"
    restarts = [m for m in said if "starting it again" in m]
    assert len(restarts) == 3 and all("(1 of 1 restarts" in m for m in restarts), said
    assert sum("could not tell the exchange that worker 0 stopped" in m for m in said) == 3


# -- URL errors: config errors before any write -----------------------------------------------------

def _train(tmp_path, exchange: str, env: dict | None = None):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "edit_jax", "train", "--config", "configs/tiny.py", "sync.method=a_edit",
            "sync.warmup_steps=0", "mesh.replica=2", "mesh.shard=1", "batch_size=4", f"sync.exchange.url={exchange}",
            "--run-dir", str(run)]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    return out, run


def test_unusable_exchange_urls_are_one_line_exit_2_and_no_run_dir(tmp_path, moto_server):
    one_stage("default", "unusable exchange URLs", 11)
    port, _ = moto_server
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for url in [str(afile), "ftp://host/x", f"s3://missing-bucket/x?endpoint=http://127.0.0.1:{port}"]:
        out, run = _train(tmp_path, url, AWS_ENV)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (url, out.stderr)
        assert "sync.exchange.url" in lines[0] and "Traceback" not in out.stderr, lines
        assert not run.exists(), url


def test_probe_refuses_what_cannot_work_at_once(tmp_path, moto_server, monkeypatch):
    from edit_jax.elastic.supervisor import probe_exchange

    port, _ = moto_server
    (tmp_path / "afile").write_text("")
    cases = {f"{tmp_path}/afile/under": "a part of its path is a file",
             f"s3://{BUCKET}/x?endpoint=http://": "malformed endpoint",
             f"s3://{BUCKET}/x?endpoint=http://host:port": "not a valid URI"}
    for url, why in cases.items():
        with pytest.raises(ExchangeError, match=why) as e:
            probe_exchange(url, print, patience_s=30)
        assert str(e.value).startswith("sync.exchange.url") and not isinstance(e.value, ExchangeUnavailable)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ExchangeError, match="no AWS credentials"):
        probe_exchange(f"s3://{BUCKET}/x?endpoint=http://127.0.0.1:{port}", print, patience_s=30)


def test_worker_start_exits_2_on_a_bad_exchange_and_75_when_it_stays_unreachable(tmp_path, moto_server):
    from edit_jax.elastic.worker import run_worker
    from edit_jax.validate import load_config

    base = ["sync.method=a_edit", "sync.warmup_steps=0", "mesh.replica=2", "mesh.shard=1", "batch_size=4"]
    said = []
    cfg = load_config(os.path.join(REPO, "configs/tiny.py"), [*base, "sync.exchange.url=ftp://x/y"])
    assert run_worker(cfg, 1, str(tmp_path / "run"), said.append) == 2
    assert len(said) == 1 and said[0].startswith("edit-jax: bad config: sync.exchange.url"), said
    cfg = load_config(os.path.join(REPO, "configs/tiny.py"),
                      [*base, f"sync.exchange.url=s3://{BUCKET}/x?endpoint=http://127.0.0.1:{_free_port()}",
                       "sync.exchange.patience=0.5"])
    said.clear()
    assert run_worker(cfg, 1, str(tmp_path / "run"), said.append) == 75
    assert len(said) == 2 and "retrying for up to 0.5 s" in said[0] and "exit 75" in said[1], said
    assert not (tmp_path / "run").exists()


def test_probe_of_an_unreachable_exchange_gives_up_after_its_deadline(monkeypatch):
    from edit_jax.elastic.supervisor import probe_exchange

    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    said = []
    t0 = time.monotonic()
    with pytest.raises(ExchangeError, match="unusable for 0.5 s at the start") as e:
        probe_exchange(f"s3://{BUCKET}/x?endpoint=http://127.0.0.1:{_free_port()}", said.append, patience_s=0.5)
    assert not isinstance(e.value, ExchangeUnavailable) and time.monotonic() - t0 < 10 and len(said) == 1


def test_a_run_outlives_its_exchange_directory_gone_for_seconds(tmp_path):
    """Real processes: the launcher and two workers; mid-run the exchange directory is renamed away
    (an unmounted share) for 4 s, then back. Every worker waits it out (one line each when it starts
    and when it ends), the run finishes by itself, exit 0, one θ̄ on both workers, no traceback."""

    one_stage("3.12", "an exchange run outliving its storage gone for seconds", 30,
              other="test_exchange_trust's run given junk")
    import json as _json

    from tests.helpers import REPO, exchange_run_through

    run, ex_dir = str(tmp_path / "run"), str(tmp_path / "run.x")
    args = ["--config", os.path.join(REPO, "configs", "tiny.py"), "--run-dir", run, f"sync.exchange.url={ex_dir}",
            "sync.method=a_edit", "sync.warmup_steps=0", "mesh.replica=2", "mesh.shard=1", "mesh.processes=2",
            "sync.time.tau=0.3", "sync.exchange.grace=1", "batch_size=4", "steps=20", "eval_every=0",
            "sync.exchange.patience=60"]

    def away_for_4_s():
        os.rename(ex_dir, ex_dir + ".away")
        time.sleep(4)
        os.rename(ex_dir + ".away", ex_dir)

    out = exchange_run_through(tmp_path, args, ex_dir, away_for_4_s)
    assert "retrying for up to 60 s" in out and "answering again" in out, out[-3000:]
    with open(os.path.join(run, "metrics.jsonl")) as f:
        ends = [r for r in map(_json.loads, f) if "finished_round" in r]
    assert len(ends) == 2 and len({e["theta_hash"] for e in ends}) == 1


def test_two_publishers_of_one_round_state_create_it_once(tmp_path):
    """A round state is the same on every worker, so two publishers' bytes were equal: a closer whose
    create was retried after a fault took the other's object for its own (a lost answer) and recorded
    the round a second time (seen in bench_outages' read-only run). Its publisher (host:pid) in the
    state's header makes them differ; readers decode either."""
    state = R.RoundState(3, [np.ones(4, np.float32)], [np.zeros(2, np.float32)], [np.zeros(1, np.float32)], 10, [5, 5])
    inner = DirExchange(str(tmp_path))
    assert inner.create(R.state_key(3), state.encode("run", None, "host-b:2"))  # the other publisher, first
    ex, _ = _patient(Flaky(inner, "create", errno.EIO, times=1))  # this one's first try fails, then finds it
    assert ex.create(R.state_key(3), state.encode("run", None, "host-a:1")) is False
    assert state.encode("run") == state.encode("run")  # (without a publisher: alike)
    back = R.RoundState.decode(inner.get(R.state_key(3)), state, "k", R.PostCheck("run"))
    assert back.digest() == state.digest() and back.round == 3
