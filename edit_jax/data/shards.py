"""Token shards on disk: the directory ``edit-jax tokenize`` writes and the ``tokens`` source reads.

Layout of a shard directory::

    DIR/index.json         what is below, the tokenizer that made it and a hash of the inputs
    DIR/train-00000.bin    raw token ids (uint16, or uint32 when the vocabulary needs it), fixed
    DIR/train-00001.bin    size ``shard_tokens`` except the last of each split; an EOS after every
    DIR/val-00000.bin      document, documents split train / val by the hash of their text

A split is used as the concatenation of its shards without ever concatenating them: ``ConcatTokens``
memory-maps each file and maps a global token range to (shard, offset) by a binary search over the
cumulative token counts. Reading ``index.json`` is all a run does at start: the vocabulary range
and the fingerprint come from the index (written at tokenize time), the only check against the
files is their size (a truncated or resized shard is refused, naming the file).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edit_jax.data.documents import SPLITS
from edit_jax.data.errors import DataError

INDEX_NAME = "index.json"
INDEX_FORMAT = "edit-jax token shards"
INDEX_VERSION = 1


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}.bin"


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def tokenizer_identity(tok) -> dict:
    """What identifies a tokenizer across machines: its name and the sha256 of what defines it
    (the tokenizer.json bytes; for the byte tokenizer, its fixed vocabulary)."""
    if tok.name == "byte":
        digest = hashlib.sha256(f"byte:{tok.vocab_size}:{tok.eos_id}".encode()).hexdigest()
    else:
        with open(tok.name, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return {"name": "byte" if tok.name == "byte" else os.path.basename(tok.name), "sha256": digest,
            "vocab_size": int(tok.vocab_size), "eos_id": int(tok.eos_id)}


class ShardFile:
    """One shard as a 1-D array that is memory-mapped only while it is read: a corpus of thousands
    of shards must not hold thousands of open maps (each keeps a file descriptor). The most
    recently read ``MAX_OPEN`` shards stay mapped (process-wide)."""

    MAX_OPEN = 64
    _open: "OrderedDict[tuple, np.memmap]" = OrderedDict()
    _lock = threading.Lock()  # batches may be built from several threads (jax's array callbacks)

    def __init__(self, path: str, dtype, size: int):
        self.path, self.dtype, self.size = path, np.dtype(dtype), int(size)

    def reshape(self, *shape):
        return self  # already 1-D

    def _map(self) -> np.memmap:
        key = (self.path, self.dtype.str, self.size)
        cache = ShardFile._open
        with ShardFile._lock:
            m = cache.get(key)
            if m is None:
                m = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.size,))
                cache[key] = m
                while len(cache) > ShardFile.MAX_OPEN:
                    cache.popitem(last=False)  # unmapped once no slice of it is alive
            else:
                cache.move_to_end(key)
            return m

    def __getitem__(self, key):
        return self._map()[key]

    def __len__(self) -> int:
        return self.size


# Tests and debugging: with this variable naming a file, every read of a token range of a shard
# split and every parquet row group a stream reads is appended to it as a JSON line (with the
# process id), so a multi-process test can see what each process read. Unset: nothing is written.
TRACE_ENV = "EDIT_JAX_DATA_TRACE"


def trace_read(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **record}) + "\n")


class ConcatTokens:
    """A read-only 1-D token array that is the concatenation of ``parts`` (arrays, memmaps or
    ``ShardFile``s),
    without copying them. Supports what the streams need: ``size``, ``dtype``, ``nbytes``,
    ``len``, slicing (any positive step) and ``np.asarray`` (which does copy everything: tests
    and small corpora only)."""

    def __init__(self, parts: list[np.ndarray], label: str = ""):
        parts = [p.reshape(-1) for p in parts if p.size]
        self.label, self.trace = label, os.environ.get(TRACE_ENV) or None  # label: the split, in the trace
        if not parts:
            raise ValueError("ConcatTokens needs at least one non-empty part")
        self.parts = parts
        self.dtype = np.result_type(*[p.dtype for p in parts])
        self.starts = np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int64)
        self.size = int(self.starts[-1])
        self.nbytes = self.size * self.dtype.itemsize
        self.ndim, self.shape = 1, (self.size,)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice):
            i = int(key)
            i += self.size if i < 0 else 0
            if not 0 <= i < self.size:
                raise IndexError(f"index {key} out of range for {self.size} tokens")
            k = int(np.searchsorted(self.starts, i, side="right")) - 1
            return self.parts[k][i - self.starts[k]]
        start, stop, step = key.indices(self.size)
        if step <= 0:
            raise ValueError("ConcatTokens supports positive slice steps only")
        if stop <= start:
            return np.empty(0, self.dtype)
        if self.trace:
            trace_read(self.trace, {"split": self.label, "start": start, "stop": stop})
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop - 1, side="right")) - 1
        out, pos = [], start  # pos: the next global index to take (on the step grid)
        for k in range(first, last + 1):
            lo, hi = int(self.starts[k]), int(self.starts[k + 1])
            if pos >= hi:
                continue
            piece = self.parts[k][pos - lo:min(stop, hi) - lo:step]
            out.append(np.asarray(piece, dtype=self.dtype))
            pos += piece.size * step
        return out[0] if len(out) == 1 else np.concatenate(out)

    def __array__(self, dtype=None, copy=None):
        arr = self[:]
        return arr if dtype is None else arr.astype(dtype)

    def tolist(self) -> list:
        return self[:].tolist()

    def astype(self, dtype, copy=True):
        return np.asarray(self[:], dtype=dtype)


@dataclass
class ShardSet:
    """One shard directory's splits as read from its index (nothing read from the shards yet)."""

    directory: str
    index: dict
    train: ConcatTokens
    val: ConcatTokens
    fingerprint: int  # crc32 of the train split's entries in the index (names, counts, hashes)


def index_path(path: str) -> str | None:
    """``path``'s index.json if it is a shard directory or the index itself, else None."""
    if os.path.isdir(path):
        return os.path.join(path, INDEX_NAME)
    return path if os.path.basename(path) == INDEX_NAME else None


def read_index(path: str) -> dict:
    """The parsed index.json at ``path``, its shape checked (DataError naming the file otherwise)."""
    if not os.path.isfile(path):
        raise DataError(f"token shard index {path!r} does not exist; expected a directory made by "
                        f"`edit-jax tokenize INPUT... --out DIR` (it writes DIR/{INDEX_NAME})")
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"token shard index {path!r}: not readable JSON ({e})") from e
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise DataError(f"token shard index {path!r}: expected format {INDEX_FORMAT!r}, got "
                        f"{index.get('format') if isinstance(index, dict) else type(index).__name__!r}")
    if index.get("version") != INDEX_VERSION:
        raise DataError(f"token shard index {path!r}: version {index.get('version')!r}, this edit-jax reads "
                        f"version {INDEX_VERSION}; re-run edit-jax tokenize")
    for key in ("dtype", "tokenizer", "splits", "vocab_size", "eos_id"):
        if key not in index:
            raise DataError(f"token shard index {path!r}: missing field {key!r}")
    if index["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"token shard index {path!r}: dtype must be uint16 or uint32, got {index['dtype']!r}")
    for split in SPLITS:
        entries = index["splits"].get(split)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("file"), str)
                                                    and isinstance(e.get("tokens"), int) for e in entries):
            raise DataError(f"token shard index {path!r}: splits.{split} must be a list of "
                            f"{{'file': NAME, 'tokens': COUNT}} entries")
    return index


def check_tokenizer(index: dict, path: str, tok) -> None:
    """The shards were made by the run's tokenizer (same sha256), else DataError naming both."""
    mine = tokenizer_identity(tok)
    theirs = index["tokenizer"]
    if theirs.get("sha256") != mine["sha256"]:
        raise DataError(f"token shards {os.path.dirname(path) or '.'!r} were made with tokenizer "
                        f"{theirs.get('name')!r} (sha256 {str(theirs.get('sha256'))[:12]}), but this run's "
                        f"data.tokenizer is {tok.name!r} (sha256 {mine['sha256'][:12]}); set data.tokenizer to the "
                        f"tokenizer the shards were made with, or re-tokenize")


def open_split(directory: str, index: dict, split: str, path: str) -> ConcatTokens:
    """The split's shards (mapped when read); each file's size must be what the index says."""
    dtype = np.dtype(index["dtype"])
    parts = []
    for e in index["splits"][split]:
        f = os.path.join(directory, e["file"])
        expected = e["tokens"] * dtype.itemsize
        try:
            size = os.path.getsize(f)
        except OSError as err:
            raise DataError(f"token shard {f!r} (listed in {path!r}) cannot be read: {err.strerror or err}") from err
        if size != expected:
            raise DataError(f"token shard {f!r}: {size} bytes, but {path!r} says {e['tokens']} tokens of "
                            f"{dtype.name} = {expected} bytes; the shard was truncated or resized, or the index "
                            f"belongs to other shards. Re-run edit-jax tokenize")
        if e["tokens"]:
            parts.append(ShardFile(f, dtype, e["tokens"]))
    if not parts:
        raise DataError(f"token shard index {path!r}: the {split} split is empty (no tokens); re-tokenize with "
                        f"more documents{' or a larger --val-fraction' if split == 'val' else ''}")
    return ConcatTokens(parts, split)


def split_fingerprint(index: dict, split: str) -> int:
    """crc32 of the split's index entries: the stream's identity, with no token read."""
    entries = json.dumps([[e["file"], e["tokens"], e.get("sha256", "")] for e in index["splits"][split]])
    return zlib.crc32(entries.encode(), zlib.crc32(index.get("inputs_sha256", "").encode()))


def open_shards(path: str, tok) -> ShardSet:
    """Opens a shard directory (or its index.json) for the run's tokenizer ``tok``."""
    ipath = index_path(path) or path
    index = read_index(ipath)
    check_tokenizer(index, ipath, tok)
    directory = os.path.dirname(ipath)
    train = open_split(directory, index, "train", ipath)
    val = open_split(directory, index, "val", ipath)
    return ShardSet(directory, index, train, val, split_fingerprint(index, "train"))
