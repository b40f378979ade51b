"""Streaming parquet (data.source=parquet): each replica's stream against a NumPy re-computation
from the parquet rows, disjoint replicas, O(1) cursors that resume to identical batches (also in
reader processes and end to end through training), and the errors. The expected tokens are
rebuilt here from pyarrow's rows, hashlib and the byte values, not with the library's readers."""

import hashlib
import json
import os

import numpy as np
import pytest

from edit_jax import data as D
from edit_jax.config import ConfigError, DataConfig
from edit_jax.data import parquet_stream as PS
from edit_jax.data import parquet_units as PU
from tests.stages import one_stage

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SEQ, BATCH, N = 15, 8, 2  # windows of 16 tokens, 4 per replica a step
EOS = 256


def _rows(seed: int, n: int) -> list:
    rng = np.random.default_rng(seed)
    rows = [f"doc {seed}-{i} " + "".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(3, 90))))
            for i in range(n)]
    rows[3] = None  # null and empty rows are not documents
    rows[5] = ""
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three parquet files of 40 rows in row groups of 10 (12 units)."""
    d = tmp_path_factory.mktemp("pq")
    paths = []
    for k in range(3):
        p = str(d / f"part{k}.parquet")
        pq.write_table(pa.table({"text": _rows(k, 40), "n": list(range(40))}), p, row_group_size=10)
        paths.append(p)
    return paths


def _expected_units(paths, val_fraction):
    """Per row group, in file order: (train tokens, val tokens) from pyarrow's rows (NumPy)."""
    out = []
    for p in paths:
        f = pq.ParquetFile(p)
        for g in range(f.metadata.num_row_groups):
            split = {"train": [], "val": []}
            for v in f.read_row_group(g).column("text").to_pylist():
                if not v:
                    continue
                raw = v.encode()
                h = int.from_bytes(hashlib.sha256(raw).digest()[:8], "little")
                split["val" if h < val_fraction * 2.0**64 else "train"] += list(raw) + [EOS]
            out.append((np.array(split["train"], np.int64), np.array(split["val"], np.int64)))
    return out


def _cfg(paths, **kw):
    return DataConfig(**{"source": "parquet", "paths": tuple(paths), "seq_len": SEQ, "val_fraction": 0.2, "workers": 0,
                         **kw})


def test_each_replica_streams_its_row_groups_concatenated(files):
    """Replica r's tokens are the train tokens of its units (perm_e[r::N] each epoch) back to back,
    across unit and epoch boundaries; the replicas' units are disjoint in an epoch and together
    all of them; validation is the val documents of the units in file order."""
    units = _expected_units(files, 0.2)
    corpus = D.load_corpus(_cfg(files))
    assert corpus.train_tokens is None and corpus.info["row_groups"] == 12 and corpus.info["rows"] == 120
    stream = D.make_train_stream(corpus, SEQ, BATCH, N, seed=3)
    steps = 60  # about 2.5 epochs of each replica
    batches = [stream.next() for _ in range(steps)]
    rows = BATCH // N
    for r in range(N):
        got = np.concatenate([b[r * rows:(r + 1) * rows].ravel() for b in batches])
        want = np.concatenate([units[u][0] for e in range(8) for u in PS.replica_units(12, 3, e, r, N)])
        np.testing.assert_array_equal(got, want[:got.size])
    for e in range(3):
        parts = [set(PS.replica_units(12, 3, e, r, N).tolist()) for r in range(N)]
        assert not parts[0] & parts[1] and parts[0] | parts[1] == set(range(12))
    orders = {tuple(PS.replica_units(12, 3, e, 0, N)) for e in range(4)}
    assert len(orders) > 1  # epochs reshuffle
    val = D.val_batches(corpus, SEQ, BATCH, 2)
    want_val = np.concatenate([v for _, v in units])
    np.testing.assert_array_equal(np.concatenate(val).ravel(), want_val[:2 * BATCH * (SEQ + 1)])
    assert all(np.array_equal(a, b) for a, b in zip(val, D.val_batches(corpus, SEQ, BATCH, 2), strict=True))


@pytest.mark.parametrize("workers", [0, 1], ids=["thread", "process"])
def test_resume_from_any_cursor_gives_identical_batches(files, tmp_path, monkeypatch, workers):
    """Stopped after k steps (mid unit, across units and epochs), a fresh stream with the saved
    state (through JSON) produces the very same batches; it reads only the cursor's unit and its
    read-ahead, not the units before it."""
    # The thread reader under the default Python, the process reader under 3.12 (~20 s each).
    one_stage("default" if workers == 0 else "3.12",
              f"a resumed parquet stream ({'thread' if workers == 0 else 'process'} reader)", 20,
              other="the other reader")
    cfg = _cfg(files, workers=workers)
    ref = D.make_train_stream(D.load_corpus(cfg), SEQ, BATCH, N, seed=1)
    want = [ref.next() for _ in range(45)]
    ref.close()
    trace = str(tmp_path / "trace.jsonl")
    monkeypatch.setenv(PU.TRACE_ENV, trace)
    for k in (1, 7, 20, 33):
        first = D.make_train_stream(D.load_corpus(cfg), SEQ, BATCH, N, seed=1)
        for _ in range(k):
            first.next()
        state = json.loads(json.dumps(first.get_state()))
        first.close()
        assert state["step"] == k and [c[0] for c in state["cursors"]] == [k, k]
        if os.path.exists(trace):
            os.remove(trace)
        again = D.make_train_stream(D.load_corpus(cfg), SEQ, BATCH, N, seed=1)
        again.set_state(state)
        np.testing.assert_array_equal(again.next(), want[k])
        reads = [json.loads(line) for line in open(trace)]
        assert len(reads) <= N * (2 + PS.PREFETCH_UNITS), reads  # O(1): no replay from the start
        for r, (_, epoch, pos, _) in enumerate(state["cursors"]):  # from the cursor's unit on
            allowed = set(PS.replica_units(12, 1, epoch, r, N)[pos:]) | set(PS.replica_units(12, 1, epoch + 1, r, N))
            assert {x["unit"] for x in reads if x["replica"] == r} <= allowed
        for j in range(k + 1, 45):
            np.testing.assert_array_equal(again.next(), want[j])
        again.close()


def test_a_process_reads_only_the_replicas_it_trains(files, tmp_path, monkeypatch):
    """What each of mesh.processes=2 does: one stream per process, each asking only its replica's
    rows. The row groups read for training are disjoint, and each is the replica's own; the
    merged state (the exchange at a checkpoint) has each replica's cursor from its process."""
    trace = str(tmp_path / "trace.jsonl")
    monkeypatch.setenv(PU.TRACE_ENV, trace)
    cfg = _cfg(files)
    streams = [D.make_train_stream(D.load_corpus(cfg), SEQ, BATCH, N, seed=0) for _ in range(N)]
    together = D.make_train_stream(D.load_corpus(cfg), SEQ, BATCH, N, seed=0)
    read = []
    for r, s in enumerate(streams):
        os.path.exists(trace) and os.remove(trace)
        for k in range(12):
            np.testing.assert_array_equal(s.replica_batch(r, k), together.replica_batch(r, k))
        read.append({x["unit"] for x in map(json.loads, open(trace)) if x["purpose"] == "train" and x["replica"] == r})
    assert read[0] and read[1] and not read[0] & read[1]
    for r in range(N):
        assert read[r] <= (set(PS.replica_units(12, 0, 0, r, N).tolist())
                           | set(PS.replica_units(12, 0, 1, r, N).tolist()))
    # The exchange at a checkpoint, as multihost.exchange_floats stacks it (one row per process).
    def gather(mine):
        return np.stack([np.asarray(s.local_cursors(), np.float64) for s in streams])

    merged = [s.get_state(gather=gather) for s in streams]
    assert merged[0] == merged[1] and merged[0]["cursors"] == together.get_state()["cursors"]
    assert merged[0]["cursors"][1][0] == 12 and streams[0].get_state()["cursors"][1] == [0, 0, 0, 0]


def test_errors_name_the_field_or_file(files, tmp_path, monkeypatch):
    with pytest.raises(D.DataError, match=r"part0\.parquet.*no column 'body'"):
        D.load_corpus(_cfg(files, text_column="body"))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(D.DataError, match=r"bad\.parquet.*cannot read it as parquet"):
        D.load_corpus(_cfg([str(bad)]))
    ints = str(tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": list(range(30))}), ints, row_group_size=10)
    s = D.make_train_stream(D.load_corpus(_cfg([ints])), SEQ, BATCH, N, 0)
    with pytest.raises(D.DataError, match=r"ints\.parquet.*must hold text, row group \d row 0 is int"):
        s.next()
    one = str(tmp_path / "one.parquet")  # one row group of one row cannot feed two replicas
    pq.write_table(pa.table({"text": ["a single document"]}), one)
    with pytest.raises(D.DataError, match=r"hold 1 rows for mesh.replica=2"):
        D.make_train_stream(D.load_corpus(_cfg([one])), SEQ, BATCH, N, 0)
    with pytest.raises(D.DataError, match=r"data.unit_bytes must be a positive int"):
        D.load_corpus(_cfg([one], unit_bytes=0))
    stream = D.make_train_stream(D.load_corpus(_cfg(files)), SEQ, BATCH, N, 0)
    stream.next()
    stream.next()
    with pytest.raises(D.DataError, match="replica 0 was asked for step 0 after step 1"):
        stream.replica_batch(0, 0)
    state = stream.get_state()
    for key, value, match in [("num_replicas", 4, "mesh.replica=4"), ("seed", 9, "saved seed=9"),
                              ("fingerprint", 1, "parquet files, data.text_column"),
                              ("cursors", [[1, 0, 99, 0], [1, 0, 0, 0]], "past its epoch"),
                              ("cursors", [[2, 0, 0, 10**6], [2, 0, 0, 0]], "at token 1000000 of parquet file"),
                              ("kind", None, "not a streamed parquet one")]:
        restored = D.make_train_stream(D.load_corpus(_cfg(files)), SEQ, BATCH, N, 0)
        with pytest.raises(D.DataError, match=match):
            restored.set_state({**state, key: value})
            restored.next()  # (an offset past its row group shows when that row group is read)
    with pytest.raises(D.DataError, match="not a streamed parquet one"):  # a token stream's state
        stream.set_state({"version": 1, "step": 3, "seed": 0})
    with pytest.raises(D.DataError, match="num_windows"):  # and the other way round
        D.make_train_stream(D.load_corpus(DataConfig(seq_len=SEQ)), SEQ, BATCH, N, 0).set_state(
            {**state, "num_windows": 1})
    every_row_val = D.make_train_stream(D.load_corpus(_cfg(files[:1], val_fraction=0.999999)), SEQ, BATCH, N, 0)
    with pytest.raises(D.DataError, match="hold no training documents"):
        every_row_val.next()
    from edit_jax.validate import load_config
    from tests.helpers import REPO

    with pytest.raises(ConfigError, match="data.workers"):
        load_config(os.path.join(REPO, "configs/tiny.py"),
                    ["data.source=parquet", f"data.paths={files[0]}", "data.workers=-1"])
    with pytest.raises(ConfigError, match="data.unit_bytes"):
        load_config(os.path.join(REPO, "configs/tiny.py"),
                    ["data.source=parquet", f"data.paths={files[0]}", "data.unit_bytes=0"])
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(D.DataError, match=r"pip install edit-jax\[parquet\]"):
        D.load_corpus(_cfg(files))


def test_training_on_streamed_parquet_resumes_bit_exactly(files, tmp_path):
    """End to end (2 replicas x 2 devices, reader process): a run stopped at step 3 and resumed
    logs the same losses and validation loss as an uninterrupted one."""
    one_stage("3.12", "streamed parquet's exact resume", 13, other="test_multiprocess' 2-process streamed parquet")
    from tests.helpers import assert_stop_and_resume_is_exact, tiny_config

    paths = []
    for k in range(2):  # larger files: 8 row groups of 60 documents
        paths.append(str(tmp_path / f"big{k}.parquet"))
        pq.write_table(pa.table({"text": _rows(10 + k, 240)}), paths[-1], row_group_size=60)
    cfg = tiny_config(2, 2, steps=6, checkpoint_every=3, eval_every=6)
    cfg.data.source, cfg.data.paths, cfg.data.workers, cfg.data.val_fraction = "parquet", tuple(paths), 1, 0.2
    assert_stop_and_resume_is_exact(cfg, str(tmp_path))


def test_validation_reads_at_most_val_max_units(files, monkeypatch):
    """Validation comes from the first VAL_MAX_UNITS row groups at most: fewer batches than asked
    when they hold no more, and an error naming the fields when they hold less than one."""
    units = _expected_units(files, 0.2)
    monkeypatch.setattr(PU.ParquetCorpus, "VAL_MAX_UNITS", 2)
    corpus = D.load_corpus(_cfg(files))
    have = units[0][1].size + units[1][1].size
    val = D.val_batches(corpus, 3, 4, 1000)
    assert len(val) == have // (4 * 4) and len(val) < 1000
    np.testing.assert_array_equal(np.concatenate(val).ravel(),
                                  np.concatenate([units[0][1], units[1][1]])[:len(val) * 16])
    with pytest.raises(D.DataError, match="data.val_fraction.*first 2 row groups at most"):
        D.val_batches(D.load_corpus(_cfg(files)), SEQ, 64, 1)


def test_a_reader_process_that_dies_is_named(files):
    import signal

    corpus = D.load_corpus(_cfg(files, workers=1)).streamed
    first = corpus.submit(0, "test")
    corpus.result(first, 0)  # the reader process is up
    for proc in list(corpus._executor()._processes.values()):
        os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(D.DataError, match=r"part0\.parquet.*row group 1: the reader process died"):
        corpus.result(corpus.submit(1, "test"), 1)  # submit or result sees it, depending on timing
    with pytest.raises(D.DataError, match=r"row group 2: the reader process died"):
        corpus.result(corpus.submit(2, "test"), 2)  # (the pool may know by now: then submit says it)
    corpus.close()


def test_readers_end_with_a_killed_training_process(files):
    """SIGKILL of the process that started the readers (no shutdown runs): they end within seconds."""
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import REPO, kill_group

    code = ("import sys; from edit_jax import data as D; from edit_jax.config import DataConfig\n"
            f"c = D.load_corpus(DataConfig(source='parquet', paths={tuple(files)!r}, workers=1)).streamed\n"
            "c.result(c.submit(0, 'test'), 0)\n"
            "print(*[p.pid for p in c._executor()._processes.values()], flush=True)\n"
            "import time; time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        readers = [int(p) for p in proc.stdout.readline().split()]
        assert readers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.time() + 10
        alive = readers
        while alive and time.time() < deadline:
            time.sleep(0.2)
            alive = [p for p in readers if subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode == 0
                     and "Z" not in subprocess.run(["ps", "-o", "stat=", "-p", str(p)], capture_output=True,
                                                   text=True).stdout]
        assert not alive, f"reader processes {alive} outlived their training process"
    finally:
        kill_group(proc)


def _docs_tokens(rows: list, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) tokens of ``rows`` recomputed here: bytes + EOS per non-empty row, split by sha256."""
    split = {"train": [], "val": []}
    for v in rows:
        if not v:
            continue
        raw = v.encode()
        h = int.from_bytes(hashlib.sha256(raw).digest()[:8], "little")
        split["val" if h < val_fraction * 2.0**64 else "train"] += list(raw) + [EOS]
    return np.array(split["train"], np.int64), np.array(split["val"], np.int64)


def test_one_big_row_group_is_sliced_across_replicas(tmp_path, monkeypatch):
    """A file written with pyarrow's defaults (pandas' to_parquet writes the same way): one row
    group. With data.unit_bytes well below its text, it is cut into slices of consecutive rows that
    together cover it once; the 2 replicas take alternate slices (disjoint, complete), each
    replica's tokens equal the train documents of its slices recomputed from pyarrow's rows, the
    trace names file, row group and rows of each read, and a stream restored from the JSON state
    (mid slice, across slices and epochs) gives the same batches. A row group smaller than a unit
    still feeds 2 replicas (cut in 2)."""
    path = str(tmp_path / "defaults.parquet")
    rows = _rows(21, 120)
    pq.write_table(pa.table({"text": rows, "n": list(range(120))}), path)  # the defaults: one row group
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    text = pq.ParquetFile(path).metadata.row_group(0).column(0).total_uncompressed_size
    cfg = _cfg([path], unit_bytes=text // 5)
    monkeypatch.setattr(PU, "BATCH_TEXT_BYTES", text // 17)  # pyarrow batches straddle the slices' ends
    trace = str(tmp_path / "trace.jsonl")
    monkeypatch.setenv(PU.TRACE_ENV, trace)
    stream = D.make_train_stream(D.load_corpus(cfg), SEQ, BATCH, N, seed=5)
    units = stream.unit_list
    assert 5 <= len(units) <= 6 and [u.row_group for u in units] == [0] * len(units)
    assert all(0 < u.batch_rows < u.stop - u.start and (u.stop - u.start) % u.batch_rows for u in units)
    bounds = [(u.start, u.stop) for u in units]
    assert (bounds[0][0] == 0 and bounds[-1][1] == 120
            and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False)))
    rows_per, total = BATCH // N, _docs_tokens(rows, 0.2)[0]
    steps = int(2.5 * total.size / N / (rows_per * (SEQ + 1)))  # about 2.5 epochs of each replica
    batches = [stream.next() for _ in range(steps)]
    epochs = stream.get_state()["cursors"]
    stream.close()
    assert min(c[1] for c in epochs) >= 2, epochs
    for r in range(N):
        mine = list(range(r, len(units), N))  # one row group: every epoch the same alternate slices
        assert PS.replica_units(stream.slices, 5, 1, r, N).tolist() == mine
        got = np.concatenate([b[r * rows_per:(r + 1) * rows_per].ravel() for b in batches])
        want = np.concatenate([_docs_tokens(rows[units[u].start:units[u].stop], 0.2)[0]
                               for _ in range(6) for u in mine])
        np.testing.assert_array_equal(got, want[:got.size])
    reads = [json.loads(x) for x in open(trace)]
    assert {(x["file"], x["row_group"]) for x in reads} == {(path, 0)}
    for x in reads:  # each read is one slice, read by the replica it belongs to
        assert tuple(x["rows"]) == bounds[x["unit"]] and x["unit"] % N == x["replica"]
    assert sum(_docs_tokens(rows[a:b], 0.2)[0].size for a, b in bounds) == total.size
    for k in (3, steps // 3, steps // 2, steps - 12):  # mid slice, other slices, other epochs
        first = D.make_train_stream(D.load_corpus(cfg), SEQ, BATCH, N, seed=5)
        for _ in range(k):
            first.next()
        state = json.loads(json.dumps(first.get_state()))
        first.close()
        again = D.make_train_stream(D.load_corpus(cfg), SEQ, BATCH, N, seed=5)
        again.set_state(state)
        for j in range(k, k + 12):
            np.testing.assert_array_equal(again.next(), batches[j])
        again.close()
    one = D.make_train_stream(D.load_corpus(cfg), SEQ, 4, 1, seed=5)  # one replica reads the slices in row order
    got = np.concatenate([one.next().ravel() for _ in range(int(1.5 * total.size / (4 * (SEQ + 1))))])
    one.close()
    np.testing.assert_array_equal(got, np.concatenate([total, total])[:got.size])
    small = D.make_train_stream(D.load_corpus(_cfg([path])), SEQ, BATCH, N, seed=5)  # default: 1 unit of text
    assert [(u.start, u.stop) for u in small.unit_list] == [(0, 60), (60, 120)]
    b = small.next()
    small.close()
    for r in range(N):
        want = _docs_tokens(rows[60 * r:60 * (r + 1)], 0.2)[0]
        np.testing.assert_array_equal(b[r * rows_per:(r + 1) * rows_per].ravel(), want[:rows_per * (SEQ + 1)])
