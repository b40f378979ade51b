"""Token shards: `edit-jax tokenize` (deterministic, resumable) and training on them (data.source=tokens
with a shard directory: memory-mapped, no scan at start, same batches across a resume, replicas
reading only their own windows). Every expected token stream is recomputed here with numpy from
the documents themselves."""

import hashlib
import json
import os

import numpy as np
import pytest

from edit_jax import data as D
from edit_jax.cli import main as cli_main
from edit_jax.config import DataConfig
from edit_jax.data import shards as S
from edit_jax.data import tokenize as T
from tests.stages import one_stage

SEQ = 7  # windows of 8 tokens


def _docs(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {seed}-{i}: " + "".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(5, 60))))
            for i in range(n)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Two parquet files (three row groups each), a jsonl file and a text file; their documents in order."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    d = tmp_path_factory.mktemp("inputs")
    files, docs = [], []
    for k in range(2):
        rows = _docs(60, k)
        p = str(d / f"part{k}.parquet")
        pq.write_table(pa.table({"text": rows + [None, ""], "id": list(range(62))}), p, row_group_size=21)
        files.append(p)
        docs += rows
    lines = _docs(30, 7)
    p = str(d / "more.jsonl")
    with open(p, "w") as f:
        for t in lines:
            f.write(json.dumps({"text": t, "meta": 1}) + "\n")
    files.append(p)
    docs += lines
    p = str(d / "notes.txt")
    with open(p, "w") as f:
        f.write("a plain text file is one document\nwith two lines")
    files.append(p)
    docs.append("a plain text file is one document\nwith two lines")
    return files, docs


def _expected(docs: list[str], val_fraction: float) -> dict[str, np.ndarray]:
    """Independent recomputation: bytes of each document + EOS 256, split by sha256 of the text."""
    out = {"train": [], "val": []}
    for t in docs:
        raw = t.encode()
        h = int.from_bytes(hashlib.sha256(raw).digest()[:8], "little")
        out["val" if h < val_fraction * 2.0**64 else "train"] += list(raw) + [256]
    return {k: np.array(v, dtype=np.uint16) for k, v in out.items()}


def _read_split(out: str, split: str) -> np.ndarray:
    index = json.load(open(os.path.join(out, "index.json")))
    return np.concatenate([np.fromfile(os.path.join(out, e["file"]), dtype=index["dtype"])
                           for e in index["splits"][split]])


def _files(out: str) -> dict[str, bytes]:
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}


@pytest.fixture(scope="module")
def shard_dir(inputs, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shards") / "tok")
    T.tokenize(inputs[0], out, val_fraction=0.2, shard_tokens=500, progress=False)
    return out


def test_tokenize_writes_documents_eos_and_split(inputs, shard_dir):
    index = json.load(open(os.path.join(shard_dir, "index.json")))
    want = _expected(inputs[1], 0.2)
    for split in ("train", "val"):
        got = _read_split(shard_dir, split)
        assert np.array_equal(got, want[split]), split
        sizes = [e["tokens"] for e in index["splits"][split]]
        assert all(s == 500 for s in sizes[:-1]) and 0 < sizes[-1] <= 500  # fixed size, last shorter
    assert index["dtype"] == "uint16" and index["tokenizer"]["name"] == "byte"
    assert index["documents"]["train"] + index["documents"]["val"] == len(inputs[1])
    assert not os.path.exists(os.path.join(shard_dir, ".parts"))


def test_tokenize_is_deterministic_across_workers(inputs, shard_dir, tmp_path):
    out = str(tmp_path / "again")
    T.tokenize(inputs[0], out, val_fraction=0.2, shard_tokens=500, workers=2, progress=False)
    assert _files(out) == _files(shard_dir)


def test_tokenize_reads_large_row_groups_in_slices(inputs, shard_dir, tmp_path, monkeypatch):
    """A row group of more text than a batch (a million-row group of pandas' defaults, here 21
    documents against a batch of 300 bytes) is read in slices of consecutive rows, pyarrow's
    batches straddling their ends; the shards are byte-identical to reading it whole."""
    calls = []
    real = T.row_range_documents
    monkeypatch.setattr(T, "row_range_documents", lambda *a, **k: calls.append(a[3:5]) or real(*a, **k))
    monkeypatch.setattr(T, "JSONL_BATCH_BYTES", 300)
    monkeypatch.setattr(T, "BATCH_TEXT_BYTES", 100)
    out = str(tmp_path / "sliced")
    T.tokenize(inputs[0], out, val_fraction=0.2, shard_tokens=500, progress=False)
    assert _files(out) == _files(shard_dir)
    assert len(calls) > 3 * 6 and (0, calls[1][0]) == calls[0] and calls[1][0] > 0  # several slices a row group


def test_killed_tokenize_resumes_to_the_same_shards(inputs, shard_dir, tmp_path, monkeypatch):
    out = str(tmp_path / "killed")
    # Killed after 3 of 8 units: parts on disk, no index.
    assert T.tokenize(inputs[0], out, val_fraction=0.2, shard_tokens=500, progress=False, stop_after_units=3) is None
    assert not os.path.exists(os.path.join(out, "index.json"))
    done = sorted(n for n in os.listdir(os.path.join(out, ".parts")) if n.endswith(".json") and n.startswith("u"))
    assert len(done) == 3
    # Killed while assembling: train shards written, then the val split fails.
    real = T._assemble_split
    calls = []

    def dies_on_val(out_, parts, split, *a):
        calls.append(split)
        if split == "val":
            raise KeyboardInterrupt
        return real(out_, parts, split, *a)

    monkeypatch.setattr(T, "_assemble_split", dies_on_val)
    with pytest.raises(KeyboardInterrupt):
        T.tokenize(inputs[0], out, val_fraction=0.2, shard_tokens=500, progress=False)
    monkeypatch.undo()
    tokenized = []
    real_unit = T.tokenize_unit
    monkeypatch.setattr(T, "tokenize_unit", lambda u, j: tokenized.append(u) or real_unit(u, j))
    T.tokenize(inputs[0], out, val_fraction=0.2, shard_tokens=500, progress=False)
    assert tokenized == []  # every unit was done before: the resumed run only assembled
    assert _files(out) == _files(shard_dir)


def test_tokenize_a_handful_of_files_holds_one_out(tmp_path):
    docs = [f"document {i}: " + "some text " * (i + 3) for i in range(4)]
    paths = []
    for i, d in enumerate(docs):
        (tmp_path / f"f{i}.txt").write_text(d)
        paths.append(str(tmp_path / f"f{i}.txt"))
    keys = [int.from_bytes(hashlib.sha256(d.encode()).digest()[:8], "little") for d in docs]  # the split rule
    assert min(keys) >= 0.005 * 2**64  # the default fraction alone would hold out none of them
    index = T.tokenize(paths, str(tmp_path / "out"), progress=False)
    assert index["documents"] == {"train": 3, "val": 1}
    held = docs[int(np.argmin(keys))]  # the document of the smallest key, with its EOS
    val = np.fromfile(tmp_path / "out" / index["splits"]["val"][0]["file"], dtype=index["dtype"])
    assert val.tolist() == list(held.encode()) + [index["eos_id"]]
    assert not os.path.exists(tmp_path / "out" / T.PARTS)
    with pytest.raises(D.DataError, match=r"--val-fraction 0.001 holds out none of the 4 .*pass --val-fraction"):
        T.tokenize(paths, str(tmp_path / "set"), val_fraction=0.001, progress=False)  # the user's: not overridden
    assert not os.path.exists(tmp_path / "set")
    with pytest.raises(D.DataError, match="is empty"):  # one file: nothing to hold out; nothing left behind
        T.tokenize(paths[:1], str(tmp_path / "one"), progress=False)
    assert not os.path.exists(tmp_path / "one")


def test_tokenize_errors_name_the_file(inputs, tmp_path, capsys):
    with pytest.raises(D.DataError, match=r"part0\.parquet.*no column 'body'"):
        T.tokenize(inputs[0][:1], str(tmp_path / "a"), text_column="body", progress=False)
    with pytest.raises(D.DataError, match="val split is empty"):
        T.tokenize(inputs[0][3:], str(tmp_path / "b"), val_fraction=1e-9, progress=False)
    assert not os.path.exists(tmp_path / "b")  # refused before writing shards; no .parts/ left behind
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(D.DataError, match=r"bad\.jsonl' line 2.*'text'"):
        T.tokenize([str(bad)], str(tmp_path / "c"), progress=False)
    assert cli_main(["tokenize", inputs[0][0], "--out", str(tmp_path / "d"), "--text-column", "body",
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edit-jax tokenize: parquet file") and "part0.parquet" in err and "'body'" in err


def test_cli_tokenize(inputs, shard_dir, tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert cli_main(["tokenize", *inputs[0], "--out", out, "--val-fraction", "0.2", "--shard-tokens", "500",
                     "--no-progress"]) == 0
    assert "train" in capsys.readouterr().out
    assert _files(out) == _files(shard_dir)


# ----------------------------------------------------------------------------- training on shards


def _cfg(path: str, **kw) -> DataConfig:
    return DataConfig(source="tokens", paths=(path,), seq_len=SEQ, **kw)


def test_corpus_is_the_shards_concatenated_without_a_scan(inputs, shard_dir, monkeypatch):
    reads = []
    real = S.ConcatTokens.__getitem__
    monkeypatch.setattr(S.ConcatTokens, "__getitem__", lambda self, k: reads.append(k) or real(self, k))
    corpus = D.load_corpus(_cfg(shard_dir))
    stream = D.make_train_stream(corpus, SEQ, 4, 2, seed=3)
    assert reads == []  # startup read index.json only: no token touched
    assert isinstance(corpus.train_tokens, S.ConcatTokens) and len(corpus.train_tokens.parts) > 1
    want = _expected(inputs[1], 0.2)
    assert np.array_equal(np.asarray(corpus.train_tokens), want["train"])
    # Each batch row is the window of the numpy reference at the id grain's shuffle chose.
    ref = want["train"][:(want["train"].size // (SEQ + 1)) * (SEQ + 1)].reshape(-1, SEQ + 1).astype(np.int32)
    for _ in range(5):
        batch = stream.next()
        for row in batch:
            assert any(np.array_equal(row, r) for r in ref)
    val = D.val_batches(corpus, SEQ, 4, 2)
    assert np.array_equal(np.concatenate(val).reshape(-1), want["val"][:2 * 4 * (SEQ + 1)])


def test_window_across_a_shard_boundary_matches_numpy(shard_dir, monkeypatch):
    monkeypatch.setattr(S.ShardFile, "MAX_OPEN", 2)  # fewer maps open than shards: reopened on demand
    monkeypatch.setattr(S.ShardFile, "_open", S.OrderedDict())
    corpus = D.load_corpus(_cfg(shard_dir))
    ref = np.concatenate([np.fromfile(p.path, dtype=p.dtype) for p in corpus.train_tokens.parts])
    assert len(corpus.train_tokens.parts) > 2 and np.array_equal(np.asarray(corpus.train_tokens), ref)
    assert len(S.ShardFile._open) <= 2
    boundary = int(corpus.train_tokens.starts[1])  # 500: not a multiple of 8, so a window straddles it
    w = boundary // (SEQ + 1)
    assert np.array_equal(D.window(corpus.train_tokens, w, SEQ), ref[w * 8:(w + 1) * 8])
    assert np.array_equal(corpus.train_tokens[3:1500:7], ref[3:1500:7])


def test_batches_identical_across_kill_and_resume(shard_dir):
    a = D.make_train_stream(D.load_corpus(_cfg(shard_dir)), SEQ, 4, 2, seed=1)
    full = [a.next() for _ in range(8)]
    b = D.make_train_stream(D.load_corpus(_cfg(shard_dir)), SEQ, 4, 2, seed=1)
    for _ in range(3):
        b.next()
    state = json.loads(json.dumps(b.get_state()))  # as a checkpoint stores it
    c = D.make_train_stream(D.load_corpus(_cfg(shard_dir)), SEQ, 4, 2, seed=1)  # a new process
    c.set_state(state)
    assert all(np.array_equal(c.next(), full[k]) for k in range(3, 8))


def test_each_replica_reads_only_its_own_windows(shard_dir, monkeypatch):
    corpus = D.load_corpus(_cfg(shard_dir))
    stream = D.make_train_stream(corpus, SEQ, 8, 2, seed=0)
    read: list[tuple[int, int]] = []
    real = S.ConcatTokens.__getitem__

    def record(self, key):
        read.append((key.start, key.stop))
        return real(self, key)

    monkeypatch.setattr(S.ConcatTokens, "__getitem__", record)
    seen = {}
    for r in range(2):  # what worker process r of mesh.processes=2 does: replica_batch(r, k) only
        read.clear()
        rows = [stream.replica_batch(r, k) for k in range(stream.steps_per_epoch)]
        seen[r] = {start // (SEQ + 1) for start, _ in read}
        assert all(stop - start == SEQ + 1 and start % (SEQ + 1) == 0 for start, stop in read)
        assert len(seen[r]) == len(read) == 4 * stream.steps_per_epoch  # each window read once, B/N per step
        got = {tuple(row) for b in rows for row in b}
        want = {tuple(D.window(np.asarray(corpus.train_tokens), w, SEQ)) for w in seen[r]}
        assert got == want
    assert not seen[0] & seen[1]


def _damaged(shard_dir, tmp_path, name="d"):
    import shutil

    out = str(tmp_path / name)
    shutil.copytree(shard_dir, out)
    return out


def test_shard_errors_name_the_file(shard_dir, tmp_path):
    with pytest.raises(D.DataError, match="give the directory itself"):
        D.load_corpus(_cfg(os.path.join(shard_dir, "*")))
    out = _damaged(shard_dir, tmp_path, "trunc")
    shard = os.path.join(out, "train-00001.bin")
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(D.DataError, match=r"train-00001\.bin.*100 bytes.*truncated or resized"):
        D.load_corpus(_cfg(out))

    out = _damaged(shard_dir, tmp_path, "missing")
    os.remove(os.path.join(out, "val-00000.bin"))
    with pytest.raises(D.DataError, match=r"val-00000\.bin.*cannot be read"):
        D.load_corpus(_cfg(out))

    out = _damaged(shard_dir, tmp_path, "tok")
    ipath = os.path.join(out, "index.json")
    index = json.load(open(ipath))
    index["tokenizer"] = {"name": "tokenizer.json", "sha256": "ab" * 32}
    json.dump(index, open(ipath, "w"))
    with pytest.raises(D.DataError, match=r"made with tokenizer 'tokenizer\.json'.*data\.tokenizer is 'byte'"):
        D.load_corpus(_cfg(out))

    out = _damaged(shard_dir, tmp_path, "empty")
    ipath = os.path.join(out, "index.json")
    index = json.load(open(ipath))
    index["splits"]["val"] = []
    json.dump(index, open(ipath, "w"))
    with pytest.raises(D.DataError, match=r"index\.json.*val split is empty"):
        D.load_corpus(_cfg(out))

    os.remove(ipath)
    with pytest.raises(D.DataError, match="has no index.json"):
        D.load_corpus(_cfg(out))
    with open(ipath, "w") as f:
        f.write("{not json")
    with pytest.raises(D.DataError, match=r"index\.json.*not readable JSON"):
        D.load_corpus(_cfg(out))


def test_loose_token_files_are_concatenated_virtually(tmp_path):
    a, b = np.arange(40, dtype=np.uint16) % 250, (np.arange(30, dtype=np.uint16) * 3) % 250
    pa, pb = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    a.tofile(pa)
    b.tofile(pb)
    c = D.load_corpus(DataConfig(source="tokens", paths=(pa, pb), seq_len=3, val_fraction=0.1))
    assert isinstance(c.train_tokens, S.ConcatTokens)
    assert np.array_equal(np.asarray(c.train_tokens), np.concatenate([a[:36], b[:27]]))
    assert np.array_equal(np.asarray(c.val_tokens), np.concatenate([a[36:], b[27:]]))


def test_resume_with_other_settings_starts_over(inputs, tmp_path, monkeypatch):
    out = str(tmp_path / "changed")

    def dies_on_val(out_, parts, split, *a):
        if split == "val":
            raise KeyboardInterrupt
        return real(out_, parts, split, *a)

    real = T._assemble_split
    monkeypatch.setattr(T, "_assemble_split", dies_on_val)
    with pytest.raises(KeyboardInterrupt):  # train shards of 500 tokens left behind
        T.tokenize(inputs[0], out, val_fraction=0.2, shard_tokens=500, progress=False)
    monkeypatch.undo()
    T.tokenize(inputs[0], out, val_fraction=0.2, shard_tokens=400, progress=False)
    fresh = str(tmp_path / "fresh")
    T.tokenize(inputs[0], fresh, val_fraction=0.2, shard_tokens=400, progress=False)
    assert _files(out) == _files(fresh)
    with pytest.raises(D.DataError, match="already holds shards of other inputs or settings"):
        T.tokenize(inputs[0], out, val_fraction=0.3, shard_tokens=400, progress=False)


def test_training_on_shards_resumes_bit_exactly(shard_dir, tmp_path):
    """End to end: a run on a shard directory stopped at step 3 (checkpoint) and resumed logs the
    same losses as an uninterrupted one."""
    one_stage("3.12", "token shards' exact resume", 7)
    from tests.helpers import assert_stop_and_resume_is_exact, tiny_config

    cfg = tiny_config(2, 2, steps=6, checkpoint_every=3, eval_every=6)
    cfg.data.source, cfg.data.paths = "tokens", (shard_dir,)
    assert_stop_and_resume_is_exact(cfg, str(tmp_path))


def test_tokenize_with_a_tokenizer_json(inputs, tmp_path):
    """A tokenizer.json (a small BPE trained here): the shards are its ids per document + its EOS,
    and a run with the byte tokenizer refuses them, naming both tokenizers."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(inputs[1], trainer)
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    eos = tok.token_to_id("<|endoftext|>")
    jsonl = inputs[0][2]  # the jsonl file: 30 documents
    out = str(tmp_path / "bpe")
    T.tokenize([jsonl], out, tokenizer=path, val_fraction=0.2, shard_tokens=100, progress=False)
    docs = [json.loads(line)["text"] for line in open(jsonl)]
    want = {"train": [], "val": []}
    for t in docs:
        h = int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")
        want["val" if h < 0.2 * 2.0**64 else "train"] += tok.encode(t, add_special_tokens=False).ids + [eos]
    for split in ("train", "val"):
        assert _read_split(out, split).tolist() == want[split]
    corpus = D.load_corpus(DataConfig(source="tokens", paths=(out,), tokenizer=path, seq_len=3))
    assert corpus.vocab_size == tok.get_vocab_size() and corpus.eos_id == eos
    with pytest.raises(D.DataError, match=r"made with tokenizer 'tokenizer\.json'.*data\.tokenizer is 'byte'"):
        D.load_corpus(DataConfig(source="tokens", paths=(out,), seq_len=3))
