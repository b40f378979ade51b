"""Loose token arrays (nanoGPT-style ``.bin`` shards, ``.npy``) with no scan at start: nothing is
read while the corpus and the stream are built, ids are checked as windows are read (a bad id is
an error naming the file and its offset), and a checkpoint made when the fingerprint was sampled
from the tokens still resumes. (Streamed parquet's row-group slices: tests/test_parquet_stream.py.)"""

import os

import jax
import numpy as np
import pytest

from edit_jax import data as D
from edit_jax.config import DataConfig
from edit_jax.data.sources import tokens as TK

SEQ, BATCH = 8, 8  # windows of 9 tokens


def _shards(where, bad: dict[int, tuple[int, int]] | None = None) -> tuple[list[str], list[np.ndarray]]:
    """Two nanoGPT-style uint16 shards of 1000 tokens (ids < 257); ``bad``: {file: (token, id)}."""
    where.mkdir(exist_ok=True)
    paths, arrays = [], []
    for k in range(2):
        a = (np.random.default_rng(k).integers(0, 257, 1000)).astype(np.uint16)
        if k in (bad or {}):
            a[bad[k][0]] = bad[k][1]
        paths.append(str(where / f"train_{k:06d}.bin"))
        a.tofile(paths[-1])
        arrays.append(a)
    return paths, arrays


def _cfg(paths):
    return DataConfig(source="tokens", paths=tuple(paths), seq_len=SEQ, val_fraction=0.1)


def test_nothing_is_read_at_start_and_windows_are_the_files(tmp_path, monkeypatch):
    """load_corpus + make_train_stream read no token through the checked arrays (the identity
    reads each file's first and last 1024 tokens); every window of an epoch equals NumPy's over
    the files' train parts concatenated, each window once."""
    paths, arrays = _shards(tmp_path)
    reads = []
    real = TK.CheckedTokens.__getitem__
    monkeypatch.setattr(TK.CheckedTokens, "__getitem__", lambda self, key: reads.append(key) or real(self, key))
    corpus = D.load_corpus(_cfg(paths))
    stream = D.make_train_stream(corpus, SEQ, BATCH, 2, seed=0)
    assert reads == []
    train = np.concatenate([a[:900] for a in arrays]).astype(np.int64)
    windows = train.reshape(-1, SEQ + 1)  # 200 windows = 25 steps, no remainder
    got = np.concatenate([stream.next() for _ in range(25)])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, windows.tolist()))
    val = np.concatenate(D.val_batches(corpus, SEQ, 2)).ravel()
    assert val.size == 22 * (SEQ + 1)  # 200 validation tokens: 22 windows, 11 batches of 2
    np.testing.assert_array_equal(val, np.concatenate([a[900:] for a in arrays])[:val.size])


def test_a_bad_id_is_an_error_naming_the_file_and_offset(tmp_path):
    """A .bin shard with an id past the byte tokenizer's 257 in its train part, another in its
    validation part: the corpus and the stream are built (no scan), and reading the window that
    holds the id is a DataError naming the file, the token offset and the byte offset. Same for
    a .npy with a negative id (its byte offset counts the header)."""
    paths, _ = _shards(tmp_path, {1: (450, 40000), 0: (950, 300)})
    corpus = D.load_corpus(_cfg(paths))
    stream = D.make_train_stream(corpus, SEQ, BATCH, 2, seed=0)
    with pytest.raises(D.DataError) as e:
        for _ in range(25):  # one epoch reads every train window once
            stream.next()
    msg = str(e.value)
    assert "train_000001.bin" in msg and "id 40000 at token 450 (byte offset 900)" in msg, msg
    with pytest.raises(D.DataError, match=r"train_000000\.bin'.*id 300 at token 950 \(byte offset 1900\)"):
        D.val_batches(corpus, SEQ, 2)
    npy = str(tmp_path / "tokens.npy")
    arr = np.arange(2000, dtype=np.int64) % 257
    arr[1234] = -5
    np.save(npy, arr)
    header = np.load(npy, mmap_mode="r").offset
    stream = D.make_train_stream(D.load_corpus(_cfg([npy])), SEQ, BATCH, 1, seed=0)
    with pytest.raises(D.DataError, match=rf"tokens\.npy'.*id -5 at token 1234 \(byte offset {header + 1234 * 8}\)"):
        for _ in range(1800 // (BATCH * (SEQ + 1)) + 1):
            stream.next()


def test_a_checkpoint_with_the_sampled_fingerprint_resumes(tmp_path):
    """The stream's identity of loose arrays reads nothing; a state saved when it was sampled from
    the tokens (streams.fingerprint) is still accepted, another corpus's is not."""
    paths, _ = _shards(tmp_path)
    corpus = D.load_corpus(_cfg(paths))
    stream = D.make_train_stream(corpus, SEQ, BATCH, 2, seed=0)
    want = [stream.next() for _ in range(6)]
    state = {**stream.get_state(), "step": 3}
    old = {**state, "fingerprint": D.fingerprint(corpus.train_tokens)}
    assert old["fingerprint"] != state["fingerprint"]
    for saved in (state, old):
        again = D.make_train_stream(D.load_corpus(_cfg(paths)), SEQ, BATCH, 2, seed=0)
        again.set_state(saved)
        np.testing.assert_array_equal(again.next(), want[3])
    with pytest.raises(D.DataError, match="fingerprint"):
        D.make_train_stream(D.load_corpus(_cfg(paths)), SEQ, BATCH, 2, seed=0).set_state({**state, "fingerprint": 7})
    other, _ = _shards(tmp_path / "other", {0: (3, 4)})
    changed = D.make_train_stream(D.load_corpus(_cfg(other)), SEQ, BATCH, 2, seed=0)
    with pytest.raises(D.DataError, match="fingerprint"):
        changed.set_state(state)  # one token changed in the first 1024 of a file: another corpus


def test_npy_arrays_are_flattened_in_c_order(tmp_path):
    """A 2-D .npy is flattened row by row whether it is stored in C or Fortran order (the Fortran
    one cannot be read as a byte range of the file: it is read through the map)."""
    grid = (np.arange(600, dtype=np.int32) % 251).reshape(20, 30)
    for order in ("C", "F"):
        path = str(tmp_path / f"grid_{order}.npy")
        np.save(path, np.asarray(grid, order=order))
        corpus = D.load_corpus(DataConfig(source="tokens", paths=(path,), seq_len=SEQ, val_fraction=0.1))
        np.testing.assert_array_equal(np.asarray(corpus.train_tokens), grid.reshape(-1)[:540])
        np.testing.assert_array_equal(corpus.train_tokens[100:200:3], grid.reshape(-1)[100:200:3])
        np.testing.assert_array_equal(np.asarray(corpus.val_tokens), grid.reshape(-1)[540:])


def test_a_bad_id_at_the_first_read_leaves_nothing_in_the_run_dir(tmp_path):
    """Issue 42 item 3: an id past the vocabulary in a loose .bin shard, found at the first training
    read (after config.json was written): before, config.json stayed in the run dir (the README's
    exit-2 row: nothing written) and the message had a stray "'byte' ; set". Every training window
    holds a bad id, the validation part (read at set-up) none. Files that were in the run dir before
    the run stay, whatever their names."""
    from dataclasses import replace

    from edit_jax.training.train import train
    from tests.helpers import tiny_config

    tokens = (np.arange(2000) % 200).astype(np.uint16)
    tokens[0:1700:8] = 400  # the byte tokenizer's ids are < 257; the train part is tokens [0, 1800)
    path = str(tmp_path / "train_000000.bin")
    tokens.tofile(path)
    cfg = tiny_config(1, 1, steps=2, batch_size=2, seq_len=8)
    cfg = replace(cfg, data=replace(cfg.data, source="tokens", paths=(path,), val_fraction=0.1))
    run_dir = tmp_path / "runs" / "new"
    with pytest.raises(D.DataError) as e:
        train(cfg, str(run_dir), progress=False, devices=jax.devices()[:1])
    msg = str(e.value)
    assert "train_000000.bin" in msg and "id 400 at token" in msg and "outside [0, 257)" in msg, msg
    assert "'byte'; set data.tokenizer" in msg and " ; " not in msg, msg
    assert not (tmp_path / "runs").exists(), os.listdir(run_dir)  # no config.json, no empty run dir
    # A run dir that existed: what was in it stays (an old config.json too), nothing new is left.
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}\n")
    (run_dir / "notes.txt").write_text("mine\n")
    with pytest.raises(D.DataError):
        train(cfg, str(run_dir), progress=False, devices=jax.devices()[:1])
    assert sorted(os.listdir(run_dir)) == ["config.json", "notes.txt"]
    assert (run_dir / "notes.txt").read_text() == "mine\n"
