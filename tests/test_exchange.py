"""The elastic exchange's two backends through one set of tests (edit_jax/elastic/exchange.py,
s3.py): a directory, and object storage over the S3 API served by a real moto server on a local
port (started here, once per module; boto3 talks HTTP to it as to AWS).

moto answers a conditional PUT by checking then writing without a lock, so two requests at the same
instant can both pass its check; S3 itself makes the conditional PUT atomic. The fixture makes
moto's PUT handler atomic (a lock), so the race test checks this code against the store's promise,
not moto's race. It also scripts the store's rarer answers (409 ConditionalRequestConflict, a PUT
done whose answer was lost)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import boto3
import pytest
from moto.s3.responses import S3Response
from moto.server import ThreadedMotoServer

from edit_jax.elastic.exchange import DirExchange, ExchangeError, open_exchange
from edit_jax.elastic.s3 import S3Exchange, parse_s3_url

BUCKET = "edit-jax-exchange"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _error_xml(code: str, message: str) -> str:
    return f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'


@pytest.fixture(scope="module")
def moto_s3():
    """A moto S3 server on 127.0.0.1:<free port> with the bucket ``BUCKET``; ``faults[bucket/key]``
    is a list of scripted answers to the next conditional PUTs of that key: "conflict" (409, nothing
    written), "lost" (written, then a 500: botocore sends it again), "error" (a 500, nothing written)."""
    mp = pytest.MonkeyPatch()
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_MAX_ATTEMPTS"):
        mp.delenv(name, raising=False)
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_CONFIG_FILE", os.devnull)  # a developer's ~/.aws must not change the test
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    lock, faults, real_put = threading.Lock(), {}, S3Response.put_object

    def put_object(self):
        with lock:  # S3's conditional PUT is atomic; moto's is check-then-write
            script = faults.get(f"{self.bucket_name}/{self.parse_key_name()}")
            fault = script.pop(0) if script and self.headers.get("If-None-Match") else None
            if fault == "conflict":
                return 409, {}, _error_xml("ConditionalRequestConflict", "A conflicting operation occurred")
            if fault == "error":
                return 500, {}, _error_xml("InternalError", "scripted")
            answer = real_put(self)
            return (500, {}, _error_xml("InternalError", "scripted")) if fault == "lost" else answer

    mp.setattr(S3Response, "put_object", put_object)
    werkzeug_log = logging.getLogger("werkzeug")
    level = werkzeug_log.level
    werkzeug_log.setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield SimpleNamespace(endpoint=endpoint, faults=faults, client=client)
    finally:
        server.stop()
        werkzeug_log.setLevel(level)
        mp.undo()


@pytest.fixture(params=["dir", "s3"])
def ex(request, tmp_path):
    """An empty exchange of each backend (the S3 one under a prefix of its own in the bucket)."""
    if request.param == "dir":
        return DirExchange(str(tmp_path / "exchange"))
    s3 = request.getfixturevalue("moto_s3")
    return S3Exchange.from_url(f"s3://{BUCKET}/{tmp_path.name}/exchange?endpoint={s3.endpoint}")


def test_put_get_round_trip_overwrite_and_missing_key(ex):
    assert ex.get("posts/r00000001/w0000.npz") is None
    payload = bytes(range(256)) * 3 + b"\x00"
    ex.put("posts/r00000001/w0000.npz", payload)
    assert ex.get("posts/r00000001/w0000.npz") == payload
    ex.put("posts/r00000001/w0000.npz", b"second")
    assert ex.get("posts/r00000001/w0000.npz") == b"second"
    ex.put("empty", b"")
    assert ex.get("empty") == b""
    assert ex.get("posts/r00000001/w0001.npz") is None


def test_create_is_exclusive_and_keeps_the_first_content(ex):
    assert ex.create("rounds/r00000003", b"members 0 1 2") is True
    assert ex.create("rounds/r00000003", b"members 1 2") is False
    assert ex.get("rounds/r00000003") == b"members 0 1 2"
    ex.put("rounds/r00000004", b"put first")
    assert ex.create("rounds/r00000004", b"created") is False
    assert ex.get("rounds/r00000004") == b"put first"
    # Exclusive even when the second create brings the same bytes.
    assert ex.create("rounds/r00000005", b"same") is True and ex.create("rounds/r00000005", b"same") is False


def test_create_racing_from_8_workers_has_exactly_one_winner(ex):
    """8 workers (each its own exchange opened from the URL: its own client or file handles) create
    the same key at once, 3 times over: one True each time, and the key holds the winner's bytes."""
    workers = [open_exchange(ex.url) for _ in range(8)]

    def create(i, key, barrier, won):
        barrier.wait()
        won[i] = workers[i].create(key, f"worker {i} of {key}".encode())

    for round_ in range(3):
        key, barrier, won = f"rounds/r{round_:08d}", threading.Barrier(8), [None] * 8
        threads = [threading.Thread(target=create, args=(i, key, barrier, won)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert won.count(True) == 1 and won.count(False) == 7, won
        assert ex.get(key) == f"worker {won.index(True)} of {key}".encode()


def test_list_filters_by_prefix_and_sorts(ex):
    keys = ["posts/r00000002/w0001.npz", "posts/r00000010/w0000.npz", "rounds/r00000001",
            "posts/r00000001/w0003.npz", "posts/r00000001/w0000.npz", "posts/r00000001/w0010.npz"]
    for key in keys:
        ex.put(key, key.encode())
    if isinstance(ex, S3Exchange):
        ex.page_size = 2  # several pages for each listing below
    else:  # a writer that died between writing its temporary file and renaming it
        with open(os.path.join(ex.root, "posts", "r00000001", ".tmp-crashed"), "wb") as f:
            f.write(b"half")
    assert ex.list("") == sorted(keys)
    assert ex.list("posts/") == sorted(k for k in keys if k.startswith("posts/"))
    assert ex.list("posts/r00000001/") == ["posts/r00000001/w0000.npz", "posts/r00000001/w0003.npz",
                                           "posts/r00000001/w0010.npz"]
    assert ex.list("posts/r0000001") == ["posts/r00000010/w0000.npz"]  # a prefix that ends mid-name
    assert ex.list("posts/r00000001/w001") == ["posts/r00000001/w0010.npz"]
    assert ex.list("nothing/") == [] and ex.list("rounds/r00000002") == []


def test_delete_removes_the_key_and_ignores_a_missing_one(ex):
    ex.put("posts/r00000001/w0000.npz", b"a")
    ex.put("posts/r00000001/w0001.npz", b"b")
    ex.delete("posts/r00000001/w0000.npz")
    assert ex.get("posts/r00000001/w0000.npz") is None
    assert ex.list("posts/") == ["posts/r00000001/w0001.npz"]
    ex.delete("posts/r00000001/w0000.npz")
    ex.delete("never/written")
    assert ex.create("posts/r00000001/w0000.npz", b"again") is True


def test_bad_keys_raise_value_error(ex):
    for key in ["", "/abs", "a//b", "a/", "a/./b", "../x", "a/..", ".tmp-x", "a/.tmp1/b"]:
        for call, args in ((ex.put, (key, b"x")), (ex.create, (key, b"x")), (ex.get, (key,)), (ex.delete, (key,))):
            with pytest.raises(ValueError, match="exchange key"):
                call(*args)
    assert ex.list("") == []


def test_dir_put_failing_mid_write_keeps_the_old_object_and_leaves_no_file(tmp_path, monkeypatch):
    ex = DirExchange(str(tmp_path))
    ex.put("posts/w0", b"old")

    def fail(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space left"):
        ex.put("posts/w0", b"new" * 1000)
    with pytest.raises(OSError, match="No space left"):
        ex.create("posts/w1", b"new")
    monkeypatch.undo()
    assert ex.get("posts/w0") == b"old" and ex.get("posts/w1") is None
    assert sorted(os.listdir(tmp_path / "posts")) == ["w0"]


def test_dir_writer_killed_before_its_rename_leaves_the_old_object(tmp_path):
    """A process killed (SIGKILL) after writing its temporary file and before renaming it over the
    key: the key keeps its old content, and the leftover temporary file is never listed."""
    ex = DirExchange(str(tmp_path))
    ex.put("posts/w0", b"old")
    child = (
        "import os, signal, sys\n"
        "from edit_jax.elastic.exchange import DirExchange\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "DirExchange(sys.argv[1]).put('posts/w0', b'new' * 100000)\n"
    )
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path)], cwd=REPO, capture_output=True, timeout=60,
                          check=False)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    leftovers = [n for n in os.listdir(tmp_path / "posts") if n.startswith(".tmp")]
    assert len(leftovers) == 1 and os.path.getsize(tmp_path / "posts" / leftovers[0]) == 300000
    assert ex.get("posts/w0") == b"old" and ex.list("") == ["posts/w0"]


def test_s3_keys_live_under_the_prefix_and_prefixes_do_not_mix(moto_s3):
    """run1's keys are the objects run1/KEY; run10 (a name that starts with run1) sees none of them."""
    run1 = S3Exchange.from_url(f"s3://{BUCKET}/mix/run1?endpoint={moto_s3.endpoint}")
    run10 = S3Exchange.from_url(f"s3://{BUCKET}/mix/run10/?endpoint={moto_s3.endpoint}")
    run1.put("a/b", b"1")
    run10.put("a/c", b"10")
    objects = moto_s3.client.list_objects_v2(Bucket=BUCKET, Prefix="mix/")["Contents"]
    assert sorted(o["Key"] for o in objects) == ["mix/run1/a/b", "mix/run10/a/c"]
    assert run1.list("") == ["a/b"] and run10.list("") == ["a/c"]
    for name in ("mix/run1/a/", "mix/run1/a/.tmp-x", "mix/run1//c"):  # not keys: never listed
        moto_s3.client.put_object(Bucket=BUCKET, Key=name, Body=b"")
    assert run1.list("") == ["a/b"] and run1.list("a/") == ["a/b"]
    assert run1.get("a/c") is None and run10.create("a/b", b"x") is True


def test_s3_create_retries_after_a_409_conflict_and_loses_to_an_existing_object(moto_s3):
    ex = S3Exchange.from_url(f"s3://{BUCKET}/conflict?endpoint={moto_s3.endpoint}")
    # The conflicting write did not leave an object: try again (S3's advice), and win.
    moto_s3.faults[f"{BUCKET}/conflict/k1"] = ["conflict", "conflict"]
    assert ex.create("k1", b"mine") is True and ex.get("k1") == b"mine"
    assert moto_s3.faults[f"{BUCKET}/conflict/k1"] == []
    # The conflicting write was another worker's create that landed: the key is taken.
    ex.put("k2", b"theirs")
    moto_s3.faults[f"{BUCKET}/conflict/k2"] = ["conflict"]
    assert ex.create("k2", b"mine") is False and ex.get("k2") == b"theirs"


def test_s3_create_whose_answer_was_lost_is_still_this_workers(moto_s3):
    """The PUT lands but its answer is a 500; botocore sends it again and gets 412. The object holds
    this call's bytes, so the create is this worker's (True); a 412 over another worker's bytes is
    not (False)."""
    ex = S3Exchange.from_url(f"s3://{BUCKET}/lost?endpoint={moto_s3.endpoint}")
    moto_s3.faults[f"{BUCKET}/lost/k1"] = ["lost"]
    assert ex.create("k1", b"mine") is True and ex.get("k1") == b"mine"
    ex.put("k2", b"theirs")
    moto_s3.faults[f"{BUCKET}/lost/k2"] = ["error"]
    assert ex.create("k2", b"mine") is False and ex.get("k2") == b"theirs"
    assert moto_s3.faults[f"{BUCKET}/lost/k2"] == []


def test_open_exchange_dispatches_on_the_url(tmp_path, moto_s3, monkeypatch):
    plain = open_exchange(str(tmp_path / "a"))
    assert isinstance(plain, DirExchange) and plain.root == str(tmp_path / "a")
    by_file_url = open_exchange(f"file://{tmp_path}/b")
    assert isinstance(by_file_url, DirExchange) and by_file_url.root == str(tmp_path / "b")
    url = f"s3://{BUCKET}/runs/r1?endpoint={moto_s3.endpoint}"
    s3 = open_exchange(url)
    assert isinstance(s3, S3Exchange) and (s3.bucket, s3.prefix, s3.endpoint, s3.url) == (
        BUCKET, "runs/r1/", moto_s3.endpoint, url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)  # no ?endpoint=: the environment's
    from_env = open_exchange(f"s3://{BUCKET}/runs/r1")
    s3.put("k", b"v")
    assert from_env.endpoint == moto_s3.endpoint and from_env.get("k") == b"v"
    assert parse_s3_url(f"s3://{BUCKET}") == (BUCKET, "", None)
    for bad in ("gs://bucket/x", "http://host/x", f"s3://{BUCKET}/x?region=eu-west-1", "s3:///x",
                f"s3://{BUCKET}/a/../b", f"s3://{BUCKET}/x?endpoint=localhost:9000"):
        with pytest.raises(ExchangeError, match="sync.exchange.url"):
            open_exchange(bad)


def test_s3_missing_bucket_or_unreachable_endpoint_is_a_clear_error(moto_s3, monkeypatch):
    url = f"s3://no-such-bucket/x?endpoint={moto_s3.endpoint}"
    with pytest.raises(ExchangeError, match="does not exist") as missing:
        open_exchange(url)
    assert "sync.exchange.url" in str(missing.value) and url in str(missing.value)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"s3://{BUCKET}/x?endpoint=http://127.0.0.1:{port}"
    with pytest.raises(ExchangeError, match="cannot reach") as unreachable:
        open_exchange(url)
    assert "sync.exchange.url" in str(unreachable.value) and url in str(unreachable.value)


def test_s3_without_boto3_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` raises ImportError
    with pytest.raises(ExchangeError, match=rf"sync.exchange.url 's3://{BUCKET}/x'.*pip install 'edit-jax\[s3\]'"):
        open_exchange(f"s3://{BUCKET}/x")
