"""Data pipeline: corpus loading, tokenization, packing, per-replica training streams, validation.

The path from config to batches:

1. ``load_corpus(cfg.data)`` reads documents from one source, tokenizes them and packs each split
   into a single token stream (documents concatenated, an EOS id after each one):

   - ``stdlib``  (the default, needs no files): the running interpreter's own standard-library
     ``.py`` sources (``sysconfig.get_paths()["stdlib"]``, recursively, skipping ``site-packages``
     and ``__pycache__``, sorted). Split at FILE level: a file is validation iff the hash of its
     relative POSIX path falls below ``val_fraction`` (stable across machines and listing order).
   - ``text``: text files or globs. Split at file level the same way (hash of the path as given);
     if that leaves a split empty (too few files), the packed stream is split at token level
     instead: the last ``val_fraction`` of the tokens is validation.
   - ``tokens``: pre-tokenized ``.npy`` arrays (any integer dtype, flattened) or raw ``.bin``
     memmaps of ``data.token_dtype``. Arrays are used as they are (no EOS is added: they are
     expected to carry their own separators). Split at ARRAY level: the last ``val_fraction`` of
     each array's tokens is validation. Every id must be < the tokenizer's vocab size.
   - ``parquet``: parquet files with a string column ``data.text_column``; every non-empty row is a
     document. Split at row level by the hash of the row's text (duplicates land in the same split,
     so they cannot leak from train into validation). Needs pyarrow (``pip install edit-jax[parquet]``).

2. A split's stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (stride
   ``seq_len + 1``; the tail shorter than a window is dropped). A window ``w`` gives
   ``inputs = w[:-1]`` and ``targets = w[1:]``.

3. ``make_train_stream`` shuffles the windows per epoch with grain and hands each step one global
   batch ``[batch_size, seq_len + 1]`` whose rows ``[r*B/N, (r+1)*B/N)`` belong to replica ``r``.
   ``val_batches`` takes the validation windows in order.

Every problem with the input raises ``DataError`` (a ``ValueError``) naming the path and what was
expected.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import grain
import numpy as np

from edit_jax.config import ConfigError, DataConfig


class DataError(ValueError):
    """The data cannot be loaded or does not fit the config: bad path, empty or too small corpus."""


# ----------------------------------------------------------------------------- tokenizers

BYTE_VOCAB = 257  # 256 byte values + EOS
BYTE_EOS = 256


class ByteTokenizer:
    """token = byte value (0..255); EOS = 256. Lossless for any input, no files, no dependencies."""

    name = "byte"
    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_documents(self, docs: Sequence[tuple[str, bytes]]) -> list[np.ndarray]:
        # Bytes are the tokens: no decoding, so binary-ish or mis-encoded files cannot fail.
        return [np.frombuffer(raw, dtype=np.uint8) for _, raw in docs]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# Names under which common tokenizer.json files carry their end-of-document token.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` through the ``tokenizers`` package.

    EOS is the first of the usual end-of-text tokens the file defines; if it defines none, one id
    past the vocabulary is used as EOS (and counted in ``vocab_size``).
    """

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise DataError(f"data.tokenizer: tokenizer file {path!r} not found "
                            f"(expected 'byte' or a path to a local tokenizer.json)")
        try:
            import tokenizers  # noqa: PLC0415 - optional dependency
        except ImportError as e:
            raise DataError(f"data.tokenizer={path!r} needs the `tokenizers` package: "
                            f"pip install edit-jax[tokenizers] (or pip install tokenizers)") from e
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
            raise DataError(f"data.tokenizer: {path!r} is not a valid tokenizer.json: {e}") from e
        self.name = path
        base = self._tok.get_vocab_size(with_added_tokens=True)
        eos = next((self._tok.token_to_id(t) for t in _EOS_NAMES if self._tok.token_to_id(t) is not None), None)
        self.eos_id = base if eos is None else int(eos)
        self.vocab_size = base + 1 if eos is None else base

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_documents(self, docs: Sequence[tuple[str, bytes]]) -> list[np.ndarray]:
        texts = [_decode_utf8(name, raw) for name, raw in docs]
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eos_id])


def make_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` or a path to a local ``tokenizer.json``. ``.vocab_size`` bounds every id it emits."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


def check_model_vocab(corpus: "Corpus", model_vocab_size: int) -> None:
    """Raises ConfigError when the model's embedding table cannot hold every token id of the corpus."""
    if model_vocab_size < corpus.vocab_size:
        raise ConfigError(f"config key 'model.vocab_size': {model_vocab_size} is smaller than the data's "
                          f"vocabulary ({corpus.vocab_size} ids, tokenizer {corpus.tokenizer!r}); "
                          f"set model.vocab_size >= {corpus.vocab_size}")


def _decode_utf8(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{name!r}: expected UTF-8 text for the tokenizer, got undecodable bytes at offset "
                        f"{e.start}") from e


# ----------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """One packed token stream per split. Token arrays are 1-D unsigned ints (may be memmaps)."""

    train_tokens: np.ndarray
    val_tokens: np.ndarray
    vocab_size: int
    eos_id: int
    description: str
    tokenizer: str = "byte"
    info: dict = field(default_factory=dict)  # numbers for logs: files, bytes, tokens, load_seconds, split


def load_corpus(cfg: DataConfig) -> Corpus:
    """Reads, tokenizes, splits and packs the configured source. Checks that each split holds at
    least one window of ``cfg.seq_len + 1`` tokens."""
    start = time.perf_counter()
    tok = make_tokenizer(cfg.tokenizer)
    if not 0.0 < cfg.val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in (0, 1), got {cfg.val_fraction}")
    if cfg.source == "stdlib":
        train, val, info = _load_stdlib(tok, cfg.val_fraction)
    elif cfg.source == "text":
        train, val, info = _load_text(tok, _expand_paths(cfg.paths, "text"), cfg.val_fraction, cfg.allow_binary)
    elif cfg.source == "tokens":
        train, val, info = _load_tokens(tok, _expand_paths(cfg.paths, "tokens"), cfg.token_dtype, cfg.val_fraction)
    elif cfg.source == "parquet":
        train, val, info = _load_parquet(tok, _expand_paths(cfg.paths, "parquet"), cfg.text_column,
                                         cfg.val_fraction)
    else:
        raise DataError(f"data.source: expected one of stdlib, text, tokens, parquet; got {cfg.source!r}")
    info.update(train_tokens=int(train.size), val_tokens=int(val.size),
                load_seconds=round(time.perf_counter() - start, 3))
    what = info.pop("what")
    desc = (f"{cfg.source}: {what}, {_human(info['bytes'])}B, {_human(train.size + val.size)} tokens "
            f"({_human(train.size)} train / {_human(val.size)} val, {info['split'].split(' (')[0]} split), "
            f"tokenizer {tok.name}")
    corpus = Corpus(train, val, tok.vocab_size, tok.eos_id, desc, tok.name, info)
    window = cfg.seq_len + 1
    for split, arr in (("train", train), ("validation", val)):
        if arr.size < window:
            raise DataError(f"corpus {what} ({cfg.source}) is too small: its {split} split has {arr.size} tokens, "
                            f"fewer than one window of seq_len+1 = {window} tokens; add data, lower "
                            f"data.seq_len or change data.val_fraction")
    return corpus


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f} " if unit == "" else f"{n:.1f} {unit}"
        n /= 1000.0
    return str(n)


def _is_val(key: bytes, val_fraction: float) -> bool:
    # sha256 of a stable key (not Python's salted hash()) so the split is identical on every machine,
    # in every process and regardless of the order files are listed in.
    h = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return h < val_fraction * 2.0**64


def _pack(docs: Sequence[np.ndarray], eos_id: int, dtype) -> np.ndarray:
    """Concatenates documents with ``eos_id`` after each one into one preallocated array."""
    out = np.empty(sum(d.size for d in docs) + len(docs), dtype=dtype)
    pos = 0
    for d in docs:
        out[pos:pos + d.size] = d
        pos += d.size
        out[pos] = eos_id
        pos += 1
    return out


def _token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _read_bytes(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read {what} file {path!r}: {e.strerror or e}") from e
    if not raw:
        raise DataError(f"{what} file {path!r} is empty; expected at least one byte of text")
    return raw


def _expand_paths(paths: Sequence[str], source: str) -> list[str]:
    """Files and globs -> existing files, globs sorted, duplicates dropped, user order otherwise kept."""
    if isinstance(paths, str):  # a bare string would be iterated character by character
        paths = (paths,)
    if not paths:
        raise DataError(f"data.source={source!r} needs data.paths: at least one file or glob")
    out: list[str] = []
    seen: set[str] = set()
    for p in paths:
        if any(c in p for c in "*?["):
            matches = sorted(m for m in globlib.glob(p, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(f"data.paths: glob {p!r} matched no files (source {source!r})")
        elif os.path.isdir(p):
            raise DataError(f"data.paths: {p!r} is a directory; expected a file or a glob such as "
                            f"'{os.path.join(p, '**', '*')}'")
        elif not os.path.exists(p):
            raise DataError(f"data.paths: file {p!r} does not exist (source {source!r})")
        else:
            matches = [p]
        for m in matches:
            if m not in seen:
                seen.add(m)
                out.append(m)
    return out


def stdlib_files() -> tuple[str, list[str]]:
    """(root, sorted relative POSIX paths) of the interpreter's standard-library .py sources."""
    root = sysconfig.get_paths()["stdlib"]
    rels = []
    for d, dirs, files in os.walk(root):
        # Installed third-party packages are not the stdlib and differ per environment.
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__")]
        for f in files:
            if f.endswith(".py"):
                rels.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return root, sorted(rels)


def _load_stdlib(tok, val_fraction: float):
    root, rels = stdlib_files()
    if not rels:
        raise DataError(f"stdlib source: no .py files found under {root!r} (sysconfig stdlib path)")
    train_docs, val_docs, nbytes = [], [], 0
    for rel in rels:
        path = os.path.join(root, rel)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            continue  # an unreadable stdlib file is the environment's quirk, not the user's error
        if not raw:
            continue  # many __init__.py files are empty: nothing to learn, not an error here
        nbytes += len(raw)
        (val_docs if _is_val(rel.encode(), val_fraction) else train_docs).append((rel, raw))
    if tok.name != "byte":
        # Some stdlib test files are deliberately not UTF-8; only a text tokenizer needs decoding.
        def fix(docs):
            return [(n, r.decode("utf-8", errors="replace").encode("utf-8")) for n, r in docs]
        train_docs, val_docs = fix(train_docs), fix(val_docs)
    dtype = _token_dtype(tok.vocab_size)
    train = _pack(tok.encode_documents(train_docs), tok.eos_id, dtype)
    val = _pack(tok.encode_documents(val_docs), tok.eos_id, dtype)
    py = ".".join(map(str, sys.version_info[:3]))
    info = dict(files=len(train_docs) + len(val_docs), train_files=len(train_docs), val_files=len(val_docs),
                bytes=nbytes, root=root, split="file-level (sha256 of relative path)",
                python=py, what=f"{len(train_docs) + len(val_docs)} files of Python {py} "
                                f"({len(train_docs)} train / {len(val_docs)} val)")
    return train, val, info


def looks_binary(raw: bytes, sample: int = 8192) -> bool:
    """True if the start of a file looks like binary data, not text: a NUL byte, or more than 30%
    of bytes that are neither printable ASCII, common whitespace nor part of valid UTF-8."""
    head = raw[:sample]
    if b"\x00" in head:
        return True
    text = head.decode("utf-8", errors="replace")
    odd = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\t\n\r\f\v"))
    return odd > 0.3 * max(len(text), 1)


def _refuse_binary(docs: Sequence[tuple[str, bytes]]) -> None:
    bad = [p for p, raw in docs if looks_binary(raw)]
    if bad:
        raise DataError(f"text file(s) {', '.join(map(repr, bad[:5]))} look "
                        "binary (NUL or mostly non-text bytes); set data.allow_binary=true to train on them anyway")


def _load_text(tok, files: list[str], val_fraction: float, allow_binary: bool = False):
    docs = [(p, _read_bytes(p, "text")) for p in files]
    if not allow_binary:
        _refuse_binary(docs)
    nbytes = sum(len(r) for _, r in docs)
    dtype = _token_dtype(tok.vocab_size)
    is_val = [_is_val(p.encode(), val_fraction) for p, _ in docs]
    what = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    if any(is_val) and not all(is_val):
        enc = tok.encode_documents(docs)
        train = _pack([e for e, v in zip(enc, is_val) if not v], tok.eos_id, dtype)
        val = _pack([e for e, v in zip(enc, is_val) if v], tok.eos_id, dtype)
        split = "file-level (sha256 of path)"
        extra = dict(train_files=is_val.count(False), val_files=is_val.count(True))
    else:
        # Too few files for a file-level split to give both splits a file: split the packed stream.
        stream = _pack(tok.encode_documents(docs), tok.eos_id, dtype)
        cut = stream.size - max(1, int(round(stream.size * val_fraction)))
        train, val = stream[:cut], stream[cut:]
        split = "token-level (last val_fraction of the stream; too few files for a file-level split)"
        extra = {}
    return train, val, dict(files=len(files), bytes=nbytes, split=split, what=what, **extra)


def _load_token_file(path: str, token_dtype: str) -> np.ndarray:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"tokens file {path!r}: not a readable .npy array ({e})") from e
        if not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"tokens file {path!r}: expected an integer token array, got dtype {arr.dtype}")
        arr = arr.reshape(-1)
    elif ext == ".bin":
        dtype = np.dtype(token_dtype)
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise DataError(f"cannot read tokens file {path!r}: {e.strerror or e}") from e
        if size % dtype.itemsize:
            raise DataError(f"tokens file {path!r}: size {size} bytes is not a multiple of {dtype.itemsize} "
                            f"(data.token_dtype={token_dtype}); wrong dtype or truncated file?")
        if size == 0:
            raise DataError(f"tokens file {path!r} is empty; expected raw {token_dtype} token ids")
        try:
            arr = np.memmap(path, dtype=dtype, mode="r")
        except OSError as e:
            raise DataError(f"cannot read tokens file {path!r}: {e.strerror or e}") from e
    else:
        raise DataError(f"tokens file {path!r}: expected a .npy array or a raw .bin file of data.token_dtype")
    if arr.size == 0:
        raise DataError(f"tokens file {path!r} is empty; expected at least one token id")
    return arr


def _load_tokens(tok, files: list[str], token_dtype: str, val_fraction: float):
    trains, vals, nbytes = [], [], 0
    for p in files:
        arr = _load_token_file(p, token_dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= tok.vocab_size:
            hint = (" ; set data.tokenizer to the tokenizer.json that produced these tokens"
                    if tok.name == "byte" else "")
            raise DataError(f"tokens file {p!r}: ids must be in [0, {tok.vocab_size}) for tokenizer {tok.name!r}, "
                            f"found min {lo}, max {hi}{hint}")
        cut = arr.size - max(1, int(round(arr.size * val_fraction)))  # the tail of each array is validation
        trains.append(arr[:cut])
        vals.append(arr[cut:])
        nbytes += arr.nbytes
    if len(files) == 1:
        train, val = trains[0], vals[0]  # views of the memmap: no copy of a possibly huge file
    else:
        dtype = np.result_type(*trains)
        train, val = np.concatenate(trains).astype(dtype, copy=False), np.concatenate(vals).astype(dtype, copy=False)
    return train, val, dict(files=len(files), bytes=nbytes, what=f"{len(files)} token file{'s' if len(files) != 1 else ''}",
                            split="array-level (last val_fraction of each array)")


def _load_parquet(tok, files: list[str], column: str, val_fraction: float):
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise DataError("data.source='parquet' needs pyarrow: pip install edit-jax[parquet] (or pip install pyarrow)") from e
    train_docs, val_docs, nbytes, rows = [], [], 0, 0
    for p in files:
        try:
            schema = pq.read_schema(p)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise DataError(f"parquet file {p!r}: cannot read it as parquet ({e})") from e
        if column not in schema.names:
            raise DataError(f"parquet file {p!r}: no column {column!r} (data.text_column); "
                            f"columns are {', '.join(schema.names)}")
        try:
            values = pq.read_table(p, columns=[column]).column(column).to_pylist()
        except Exception as e:  # noqa: BLE001
            raise DataError(f"parquet file {p!r}: cannot read column {column!r} ({e})") from e
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, str):
                raw = v.encode("utf-8")
            elif isinstance(v, (bytes, bytearray)):
                raw = bytes(v)
            else:
                raise DataError(f"parquet file {p!r}: column {column!r} must hold text, row {i} is "
                                f"{type(v).__name__}")
            if raw:
                rows += 1
                nbytes += len(raw)
                (val_docs if _is_val(raw, val_fraction) else train_docs).append((f"{p}[row {i}]", raw))
    if rows == 0:
        raise DataError(f"parquet files {files!r}: column {column!r} holds no non-empty text; expected documents")
    dtype = _token_dtype(tok.vocab_size)
    train = _pack(tok.encode_documents(train_docs), tok.eos_id, dtype)
    val = _pack(tok.encode_documents(val_docs), tok.eos_id, dtype)
    return train, val, dict(files=len(files), rows=rows, train_rows=len(train_docs), val_rows=len(val_docs),
                            bytes=nbytes, split="row-level (sha256 of row text)",
                            what=f"{len(files)} parquet file{'s' if len(files) != 1 else ''}, {rows} rows")


# ----------------------------------------------------------------------------- windows and streams


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
    return tokens.size // (seq_len + 1)


def window(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    """Window ``index`` of a packed stream: tokens ``[i*(L+1), (i+1)*(L+1))`` as int32."""
    start = index * (seq_len + 1)
    return np.asarray(tokens[start:start + seq_len + 1], dtype=np.int32)


def fingerprint(tokens: np.ndarray) -> int:
    """Cheap identity of a token stream (crc32 of its length and <= ~1M evenly spaced tokens), so a
    restored stream can tell that the corpus changed under it."""
    stride = max(1, tokens.size // (1 << 20))
    sample = np.ascontiguousarray(tokens[::stride]).astype(np.uint32)
    return zlib.crc32(sample.tobytes(), zlib.crc32(str(tokens.size).encode()))


def _shuffle_seed(seed: int) -> int:
    # grain's shuffle uses seed + epoch for epoch e, so raw seeds s and s+1 would share permutations
    # one epoch apart; mixing the user seed first avoids that and maps any int into [0, 2**32).
    return int(np.random.SeedSequence([abs(int(seed)), int(seed < 0), 0xED17]).generate_state(1, np.uint32)[0])


class _Window:
    """Picklable index -> window map (a lambda would not survive grain's multiprocessing paths)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __call__(self, index: int) -> np.ndarray:
        return window(self.tokens, int(index), self.seq_len)


def replica_dataset(tokens: np.ndarray, seq_len: int, batch_size: int, num_replicas: int, seed: int,
                    replica: int) -> grain.MapDataset:
    """Replica ``replica``'s infinite grain MapDataset of ``[batch_size/num_replicas, seq_len+1]`` batches.

    Pipeline: window ids -> shuffle (new permutation each epoch) -> keep the first
    ``steps_per_epoch * batch_size`` (every step is a full global batch) -> windows -> chunks of
    ``B/N`` -> chunk ``r::N`` -> repeat. Chunk ``k*N + r`` is rows ``[r*B/N, (r+1)*B/N)`` of global
    step ``k``, so the N replicas' element ``k`` stacked in order is the same global batch whatever
    ``N`` is, and within an epoch every window is used at most once (replicas are disjoint).
    """
    per = batch_size // num_replicas
    steps = num_windows(tokens, seq_len) // batch_size
    return (grain.MapDataset.range(num_windows(tokens, seq_len))
            .shuffle(seed=_shuffle_seed(seed))
            .slice(slice(0, steps * batch_size))
            .map(_Window(tokens, seq_len))
            .batch(per, drop_remainder=True)
            .slice(slice(replica, None, num_replicas))
            .repeat(None))


class TrainStream:
    """Infinite, deterministic, resumable stream of global training batches.

    ``next()`` returns int32 ``[batch_size, seq_len + 1]``; rows ``[r*B/N, (r+1)*B/N)`` are replica
    ``r``'s. The state is just the global step (plus identity fields checked on restore), because a
    grain MapDataset is random access: batch ``k`` is recomputed, not replayed.
    """

    STATE_VERSION = 1

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, num_replicas: int, seed: int):
        if seq_len <= 0 or batch_size <= 0 or num_replicas <= 0:
            raise DataError(f"train stream: seq_len, batch_size and num_replicas must be positive, got "
                            f"{seq_len}, {batch_size}, {num_replicas}")
        if batch_size % num_replicas:
            raise DataError(f"train stream: batch_size {batch_size} must be divisible by num_replicas {num_replicas}")
        n = num_windows(corpus.train_tokens, seq_len)
        if n < batch_size:
            raise DataError(f"train split of corpus ({corpus.description}) has {corpus.train_tokens.size} tokens = "
                            f"{n} windows of seq_len+1 = {seq_len + 1}; one batch needs batch_size = {batch_size} "
                            f"windows. Add data or lower batch_size / data.seq_len")
        self.seq_len, self.batch_size, self.num_replicas, self.seed = seq_len, batch_size, num_replicas, int(seed)
        self.num_windows = n
        self.steps_per_epoch = n // batch_size
        self.fingerprint = fingerprint(corpus.train_tokens)
        self._datasets = [replica_dataset(corpus.train_tokens, seq_len, batch_size, num_replicas, seed, r)
                          for r in range(num_replicas)]
        self.step = 0

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def replica_batch(self, replica: int, step: int | None = None) -> np.ndarray:
        """Replica ``replica``'s rows of global step ``step`` (default: the next one), without advancing."""
        return np.asarray(self._datasets[replica][self.step if step is None else step], dtype=np.int32)

    def peek(self) -> np.ndarray:
        """The batch ``next()`` would return, without advancing."""
        return np.concatenate([self.replica_batch(r) for r in range(self.num_replicas)], axis=0)

    def next(self) -> np.ndarray:
        batch = self.peek()
        self.step += 1
        return batch

    __next__ = next

    def __iter__(self):
        return self

    def get_state(self) -> dict:
        return {"version": self.STATE_VERSION, "step": self.step, "epoch": self.epoch, "seed": self.seed,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "num_replicas": self.num_replicas,
                "num_windows": self.num_windows, "fingerprint": self.fingerprint}

    def set_state(self, state: dict) -> None:
        """Resumes at ``state["step"]``. The seed, batch size, seq_len and corpus (window count and
        fingerprint) must match, else DataError names the mismatch. ``num_replicas`` may differ
        (elastic restart): the global batches are the same for any N, so the stream continues at the
        same global position with the same batches; only the row -> replica assignment changes."""
        if not isinstance(state, dict) or "step" not in state:
            raise DataError(f"train stream state: expected a dict from get_state() with a 'step', got {state!r}")
        if state.get("version", self.STATE_VERSION) != self.STATE_VERSION:
            raise DataError(f"train stream state: version {state.get('version')} is not {self.STATE_VERSION}")
        for key in ("seed", "batch_size", "seq_len", "num_windows", "fingerprint"):
            if key in state and state[key] != getattr(self, key):
                what = "the corpus changed" if key in ("num_windows", "fingerprint") else "the config changed"
                raise DataError(f"train stream state: saved {key}={state[key]} but this stream has "
                                f"{key}={getattr(self, key)} ({what}); cannot resume at the same position")
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise DataError(f"train stream state: 'step' must be a non-negative int, got {step!r}")
        self.step = step


def make_train_stream(corpus: Corpus, seq_len: int, batch_size: int, num_replicas: int, seed: int) -> TrainStream:
    """See TrainStream. ``batch_size`` is global and must be divisible by ``num_replicas``."""
    return TrainStream(corpus, seq_len, batch_size, num_replicas, seed)


def val_batches(corpus: Corpus, seq_len: int, batch_size: int, max_batches: int | None = None) -> list[np.ndarray]:
    """Validation windows in stream order, ``min(max_batches, available)`` full batches of int32
    ``[batch_size, seq_len + 1]``; the same list every call (no shuffle, no overlap)."""
    if seq_len <= 0 or batch_size <= 0:
        raise DataError(f"val batches: seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    n = num_windows(corpus.val_tokens, seq_len)
    avail = n // batch_size
    if avail == 0:
        raise DataError(f"validation split of corpus ({corpus.description}) has {corpus.val_tokens.size} tokens = "
                        f"{n} windows of seq_len+1 = {seq_len + 1}; one batch needs batch_size = {batch_size} "
                        f"windows. Raise data.val_fraction, add data or lower the batch size / data.seq_len")
    count = avail if max_batches is None else max(0, min(int(max_batches), avail))
    w = seq_len + 1
    flat = np.asarray(corpus.val_tokens[:count * batch_size * w], dtype=np.int32)
    return [b for b in flat.reshape(count, batch_size, w)]


def inputs_targets(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[B, L+1]`` windows -> (inputs ``[B, L]``, targets ``[B, L]``), targets shifted by one."""
    return batch[:, :-1], batch[:, 1:]


__all__ = ["DataError", "Corpus", "ByteTokenizer", "HFTokenizer", "make_tokenizer", "check_model_vocab",
           "load_corpus", "stdlib_files", "num_windows", "window", "fingerprint", "replica_dataset", "TrainStream",
           "make_train_stream", "val_batches", "inputs_targets", "BYTE_VOCAB", "BYTE_EOS"]
