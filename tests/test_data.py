"""Data pipeline: sources, packing, splits, per-replica streams, state restore, errors."""

import builtins
import json
import os
import sys
import time

import numpy as np
import pytest

from edit_jax import data as D
from edit_jax.config import ConfigError, DataConfig


def _arange_corpus(n_windows: int, seq_len: int, n_val_windows: int = 4) -> D.Corpus:
    """A corpus whose token at position p is p, so every window is identified by its first token."""
    w = seq_len + 1
    train = np.arange(n_windows * w, dtype=np.uint32)
    val = np.arange(n_val_windows * w, dtype=np.uint32) + 10**7
    return D.Corpus(train, val, vocab_size=2**31, eos_id=0, description="arange")


def _ids(batch: np.ndarray, seq_len: int) -> list[int]:
    return [int(row[0]) // (seq_len + 1) for row in batch]


def _write(path, content: bytes):
    with open(path, "wb") as f:
        f.write(content)
    return str(path)


# ----------------------------------------------------------------------------- tokenizer and packing


def test_byte_tokenizer_roundtrip():
    tok = D.make_tokenizer("byte")
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    ids = tok.encode("hé\n")
    assert ids.tolist() == [104, 195, 169, 10]
    assert tok.decode(list(ids) + [256]) == "hé\n"


def test_pack_appends_eos_after_each_document():
    out = D._pack([np.array([1, 2]), np.array([], dtype=np.int64), np.array([3])], 9, np.uint16)
    assert out.tolist() == [1, 2, 9, 9, 3, 9]


def test_packing_windows_exact(tmp_path):
    # One file -> token-level split: 39 bytes + EOS = 40 tokens; val_fraction 0.1 -> last 4 are val.
    text = bytes(range(65, 65 + 39))
    path = _write(tmp_path / "one.txt", text)
    corpus = D.load_corpus(DataConfig(source="text", paths=(path,), seq_len=3, val_fraction=0.1))
    stream = list(text) + [256]
    assert corpus.train_tokens.tolist() == stream[:36]
    assert corpus.val_tokens.tolist() == stream[36:]
    assert "token-level" in corpus.info["split"]
    # 36 train tokens = 9 windows of seq_len+1 = 4; windows never straddle the cut into val.
    windows = [stream[4 * i:4 * i + 4] for i in range(9)]
    s = D.make_train_stream(corpus, seq_len=3, batch_size=3, num_replicas=1, seed=0)
    assert s.steps_per_epoch == 3
    seen = [row.tolist() for _ in range(3) for row in s.next()]
    assert sorted(seen) == sorted(windows)  # one epoch = each window exactly once
    batch = s.next()
    x, y = D.inputs_targets(batch)
    assert x.shape == y.shape == (3, 3) and batch.dtype == np.int32
    assert (x[:, 1:] == y[:, :-1]).all()
    assert [b.tolist() for b in D.val_batches(corpus, 3, 1, 10)] == [[stream[36:]]]


# ----------------------------------------------------------------------------- train stream


def test_same_seed_same_batches_different_seed_differs():
    c = _arange_corpus(64, 7)
    a = D.make_train_stream(c, 7, 8, 2, seed=3)
    b = D.make_train_stream(c, 7, 8, 2, seed=3)
    other = D.make_train_stream(c, 7, 8, 2, seed=4)
    xs, ys, zs = ([s.next() for _ in range(20)] for s in (a, b, other))
    assert all((x == y).all() for x, y in zip(xs, ys, strict=True))
    assert any((x != z).any() for x, z in zip(xs, zs, strict=True))
    assert xs[0].shape == (8, 8) and xs[0].dtype == np.int32
    # The stream is shuffled, not in corpus order.
    assert _ids(xs[0], 7) != list(range(8))


def test_replicas_disjoint_within_epoch_and_reshuffled_next_epoch():
    L, B, N = 5, 12, 3
    c = _arange_corpus(100, L)
    s = D.make_train_stream(c, L, B, N, seed=1)
    assert s.steps_per_epoch == 100 // B
    per_replica = [[] for _ in range(N)]
    epochs = []
    for _ in range(2):
        order = []
        for _ in range(s.steps_per_epoch):
            for r in range(N):
                assert (s.replica_batch(r) == s.peek()[r * B // N:(r + 1) * B // N]).all()
            batch = s.next()
            order += _ids(batch, L)
            for r in range(N):
                per_replica[r] += _ids(batch[r * B // N:(r + 1) * B // N], L)
        epochs.append(order)
        # Whole windows only: each row is a contiguous run of the packed stream.
        assert (np.diff(batch, axis=1) == 1).all()
    for order in epochs:
        assert len(order) == len(set(order)) == s.steps_per_epoch * B  # no window twice in an epoch
    first = [set(ids[:len(ids) // 2]) for ids in per_replica]
    for r in range(N):
        for q in range(r + 1, N):
            assert not first[r] & first[q], f"replicas {r} and {q} share windows within epoch 0"
    assert epochs[0] != epochs[1]  # a new permutation each epoch
    assert s.epoch == 2


def test_state_roundtrip_across_epoch_boundary():
    c = _arange_corpus(40, 4)
    a = D.make_train_stream(c, 4, 8, 2, seed=7)  # 5 steps per epoch
    for _ in range(3):
        a.next()
    state = json.loads(json.dumps(a.get_state()))  # must be JSON-serialisable
    expected = [a.next() for _ in range(6)]  # crosses into epoch 1 and past it
    assert a.epoch == 1
    b = D.make_train_stream(c, 4, 8, 2, seed=7)
    b.next()  # a restored stream must not depend on where it was before set_state
    b.set_state(state)
    got = [b.next() for _ in range(6)]
    assert all((x == y).all() for x, y in zip(expected, got, strict=True))


def test_elastic_restart_with_other_replica_count_continues_same_global_batches():
    c = _arange_corpus(48, 3)
    two = D.make_train_stream(c, 3, 8, 2, seed=0)
    four = D.make_train_stream(c, 3, 8, 4, seed=0)
    assert all((two.next() == four.next()).all() for _ in range(8))  # same batches for any N
    state = two.get_state()
    rest = [two.next() for _ in range(4)]
    one = D.make_train_stream(c, 3, 8, 1, seed=0)
    one.set_state(state)
    assert all((x == one.next()).all() for x in rest)


def test_set_state_rejects_mismatches():
    c = _arange_corpus(40, 4)
    state = D.make_train_stream(c, 4, 8, 2, seed=7).get_state()
    with pytest.raises(D.DataError, match="seed"):
        D.make_train_stream(c, 4, 8, 2, seed=8).set_state(state)
    with pytest.raises(D.DataError, match="batch_size"):
        D.make_train_stream(c, 4, 4, 2, seed=7).set_state(state)
    with pytest.raises(D.DataError, match="corpus changed"):
        D.make_train_stream(_arange_corpus(41, 4), 4, 8, 2, seed=7).set_state(state)
    with pytest.raises(D.DataError, match="step"):
        D.make_train_stream(c, 4, 8, 2, seed=7).set_state({"seed": 7})


def test_stream_too_small_and_bad_replicas():
    c = _arange_corpus(7, 4)
    with pytest.raises(D.DataError, match="batch_size = 8"):
        D.make_train_stream(c, 4, 8, 2, seed=0)
    with pytest.raises(D.DataError, match="divisible"):
        D.make_train_stream(c, 4, 6, 4, seed=0)


def test_val_batches_deterministic_non_overlapping():
    c = _arange_corpus(10, 4, n_val_windows=13)
    a = D.val_batches(c, 4, 4, max_batches=10)
    assert len(a) == 3  # 13 windows -> 3 full batches
    ids = [i for b in a for i in _ids(b - 10**7, 4)]
    assert ids == list(range(12))
    assert all((x == y).all() for x, y in zip(a, D.val_batches(c, 4, 4, 10), strict=True))
    assert len(D.val_batches(c, 4, 4, 2)) == 2
    with pytest.raises(D.DataError, match="validation split"):
        D.val_batches(c, 4, 16, 1)


# ----------------------------------------------------------------------------- stdlib


@pytest.fixture(scope="module")
def stdlib_corpus():
    start = time.perf_counter()
    corpus = D.load_corpus(DataConfig())
    return corpus, time.perf_counter() - start


def test_stdlib_file_level_split(stdlib_corpus):
    corpus, seconds = stdlib_corpus
    assert seconds < 10, f"stdlib corpus took {seconds:.1f}s to load"
    root, rels = D.stdlib_files()
    assert rels == sorted(rels) and not any("site-packages" in r or "__pycache__" in r for r in rels)
    train, val = [], []
    for rel in rels:
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        if raw:
            (val if D._is_val(rel.encode(), 0.05) else train).append(np.frombuffer(raw, np.uint8))
    # Each file lands whole in exactly one split, in sorted order, followed by EOS.
    assert np.array_equal(corpus.val_tokens, D._pack(val, 256, np.uint16))
    assert np.array_equal(corpus.train_tokens, D._pack(train, 256, np.uint16))
    assert corpus.info["val_files"] == len(val) and corpus.info["train_files"] == len(train)
    assert 0.02 < len(val) / (len(val) + len(train)) < 0.10
    assert (corpus.vocab_size, corpus.eos_id) == (257, 256)
    assert f"{len(val) + len(train)} files" in corpus.description


def test_split_hash_is_stable_across_processes():
    # sha256, not Python's per-process salted hash(): pinned values must never change.
    paths = ("os.py", "json/__init__.py", "a/b.py", "zz.py", "re/_parser.py", "x.py")
    assert [D._is_val(p.encode(), 0.5) for p in paths] == [False, False, False, False, True, True]
    pinned = int.from_bytes(__import__("hashlib").sha256(b"os.py").digest()[:8], "little") / 2**64
    assert D._is_val(b"os.py", pinned + 1e-9) and not D._is_val(b"os.py", pinned - 1e-9)


def test_stdlib_stream_shapes(stdlib_corpus):
    corpus, _ = stdlib_corpus
    s = D.make_train_stream(corpus, 128, 16, 2, seed=0)
    b = s.next()
    assert b.shape == (16, 129) and b.dtype == np.int32 and b.max() <= 256
    assert len(D.val_batches(corpus, 128, 16, 8)) == 8


# ----------------------------------------------------------------------------- other sources


def test_text_glob_file_level_split(tmp_path):
    for i in range(60):
        _write(tmp_path / f"doc{i:02d}.txt", f"document number {i}\n".encode() * 3)
    cfg = DataConfig(source="text", paths=(str(tmp_path / "*.txt"),), seq_len=4, val_fraction=0.2)
    c = D.load_corpus(cfg)
    assert c.info["files"] == 60 and "file-level" in c.info["split"]
    assert c.info["val_files"] + c.info["train_files"] == 60 and c.info["val_files"] > 0
    docs_val = bytes(t for t in c.val_tokens.tolist() if t != 256)
    for i in range(60):
        in_val = D._is_val(str(tmp_path / f"doc{i:02d}.txt").encode(), 0.2)
        assert (f"number {i}\n".encode() in docs_val) == in_val


def test_tokens_npy_and_bin_sources(tmp_path):
    a = np.arange(100, dtype=np.int64) % 200
    b = (np.arange(50) % 256).astype(np.uint16)
    pa, pb = str(tmp_path / "a.npy"), str(tmp_path / "b.bin")
    np.save(pa, a)
    b.tofile(pb)
    c = D.load_corpus(DataConfig(source="tokens", paths=(pa, pb), seq_len=3, val_fraction=0.1))
    # The last val_fraction of EACH array is validation.
    assert c.train_tokens.tolist() == a[:90].tolist() + b[:45].tolist()
    assert c.val_tokens.tolist() == a[90:].tolist() + b[45:].tolist()
    b32 = str(tmp_path / "c.bin")
    np.arange(40, dtype=np.uint32).tofile(b32)
    c32 = D.load_corpus(DataConfig(source="tokens", paths=(b32,), token_dtype="uint32", seq_len=3, val_fraction=0.25))
    assert c32.train_tokens.tolist() == list(range(30)) and c32.val_tokens.tolist() == list(range(30, 40))


def test_parquet_source(tmp_path):
    """Streamed: nothing is read at load; the training rows and validation rows together are the
    non-empty rows, each followed by EOS (the per-replica order is tests/test_parquet_stream.py's)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [f"row {i} says hello" for i in range(80)] + [None, ""]
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"body": rows, "n": list(range(82))}), path, row_group_size=41)
    c = D.load_corpus(DataConfig(source="parquet", paths=(path,), text_column="body", seq_len=8, val_fraction=0.2,
                                 workers=0))
    assert c.info["rows"] == 82 and c.info["row_groups"] == 2 and c.train_tokens is None
    val = c.streamed.val_tokens(None)
    stream = D.make_train_stream(c, 8, 2, 2, 0)  # one row of 9 tokens per replica
    train = []
    for r in range(2):  # one replica's whole epoch: the first row group's train tokens
        unit = D.parquet_stream.replica_units(2, 0, 0, r, 2)[0]
        n = c.streamed.result(c.streamed.submit(int(unit), "test"), int(unit))[0].size
        train += [stream.replica_batch(r, k).ravel() for k in range(n // 9)]
        rest = n % 9
        if rest:
            train.append(stream.replica_batch(r, n // 9).ravel()[:rest])
    total = bytes(t for t in np.concatenate(train + [val]).tolist() if t != 256)
    assert sorted(total) == sorted("".join(rows[:80]).encode())
    assert int(sum((t == 256).sum() for t in train) + (val == 256).sum()) == 80
    with pytest.raises(D.DataError, match=r"d\.parquet.*no column 'text'"):
        D.load_corpus(DataConfig(source="parquet", paths=(path,), seq_len=8))


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = _write(tmp_path / "x.parquet", b"not really")
    with pytest.raises(D.DataError, match=r"pip install edit-jax\[parquet\]"):
        D.load_corpus(DataConfig(source="parquet", paths=(path,)))


# ----------------------------------------------------------------------------- errors


def _err(cfg: DataConfig) -> str:
    with pytest.raises(D.DataError) as e:
        D.load_corpus(cfg)
    return str(e.value)


def test_errors_name_the_path(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope.txt")
    assert missing in _err(DataConfig(source="text", paths=(missing,))) and "does not exist" in \
        _err(DataConfig(source="text", paths=(missing,)))
    pattern = str(tmp_path / "*.none")
    assert pattern in _err(DataConfig(source="text", paths=(pattern,))) and "matched no files" in \
        _err(DataConfig(source="text", paths=(pattern,)))
    empty = _write(tmp_path / "empty.txt", b"")
    msg = _err(DataConfig(source="text", paths=(empty,)))
    assert empty in msg and "empty" in msg
    assert "is a directory" in _err(DataConfig(source="text", paths=(str(tmp_path),)))

    locked = _write(tmp_path / "locked.txt", b"secret")
    real_open = builtins.open

    def fake_open(p, *a, **k):  # chmod 000 does not stop root, so simulate the OS refusing
        if str(p) == locked:
            raise PermissionError(13, "Permission denied", p)
        return real_open(p, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    msg = _err(DataConfig(source="text", paths=(locked,)))
    monkeypatch.undo()
    assert locked in msg and "cannot read" in msg and "Permission denied" in msg

    small = _write(tmp_path / "small.txt", b"tiny")
    msg = _err(DataConfig(source="text", paths=(small,), seq_len=128))
    assert "too small" in msg and "129" in msg


def test_token_file_errors(tmp_path):
    big = str(tmp_path / "big.npy")  # ids are checked as they are read (no scan at start)
    np.save(big, np.array([1, 2, 300, 4, 5, 6, 7, 8], dtype=np.int32))
    with pytest.raises(D.DataError) as e:
        D.load_corpus(DataConfig(source="tokens", paths=(big,), seq_len=1, val_fraction=0.25)).train_tokens[:]
    assert big in str(e.value) and "id 300 at token 2" in str(e.value) and "257" in str(e.value)
    neg = str(tmp_path / "neg.npy")
    np.save(neg, np.array([1, 3, 3, 4, 5, 6, 7, -2], dtype=np.int32))
    with pytest.raises(D.DataError, match=r"neg\.npy.*id -2 at token 7"):
        D.load_corpus(DataConfig(source="tokens", paths=(neg,), seq_len=1, val_fraction=0.25)).val_tokens[:]
    flt = str(tmp_path / "f.npy")
    np.save(flt, np.ones(10, dtype=np.float32))
    assert "integer" in _err(DataConfig(source="tokens", paths=(flt,), seq_len=1))
    odd = _write(tmp_path / "odd.bin", b"\x01\x00\x02")
    msg = _err(DataConfig(source="tokens", paths=(odd,), seq_len=1))
    assert odd in msg and "multiple of 2" in msg
    empty = _write(tmp_path / "empty.bin", b"")
    assert empty in _err(DataConfig(source="tokens", paths=(empty,), seq_len=1))
    bad = _write(tmp_path / "bad.npy", b"garbage")
    assert bad in _err(DataConfig(source="tokens", paths=(bad,), seq_len=1))
    ext = _write(tmp_path / "t.txt", b"\x01\x00")
    assert ".npy" in _err(DataConfig(source="tokens", paths=(ext,), seq_len=1))


def test_tokenizer_errors_and_vocab_check(tmp_path):
    missing = str(tmp_path / "tokenizer.json")
    msg = _err(DataConfig(tokenizer=missing))
    assert missing in msg and "not found" in msg
    try:
        import tokenizers  # noqa: F401 - only whether it is installed
    except ImportError:
        present = _write(tmp_path / "tok.json", b"{}")
        assert "pip install" in _err(DataConfig(tokenizer=present))
    corpus = _arange_corpus(4, 3)
    corpus.vocab_size = 257
    D.check_model_vocab(corpus, 320)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        D.check_model_vocab(corpus, 256)
