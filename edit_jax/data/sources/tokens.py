"""Source ``tokens``: token shards written by ``edit-jax tokenize`` (a directory with an
``index.json``, or the index itself), or pre-tokenized ``.npy`` arrays (any integer dtype,
flattened) / raw ``.bin`` memmaps of ``data.token_dtype``.

Shard directories: each split is its shard set (document-level split made at tokenize time),
memory-mapped and used as one virtual concatenation (``shards.ConcatTokens``); nothing but the
index is read at start (the tokenizer, vocabulary and fingerprint come from it). Several
directories are concatenated split by split.

Loose arrays are used as they are (no EOS is added: they are expected to carry their own
separators). Split at ARRAY level: the last ``val_fraction`` of each array's tokens is validation.
Nothing is scanned at start (a nanoGPT-style directory of 100 M-token shards would be read end
to end before every start): every id must be in ``[0, vocab)`` of the tokenizer, and that is
checked on each range of tokens as it is read (``CheckedTokens``: one vectorised comparison per
read; a bad id is a DataError naming the file and the offset of the first one). The stream's
fingerprint comes from the files' names, sizes and first and last tokens. Several arrays are
memory-mapped and concatenated virtually, never copied."""

from __future__ import annotations

import collections
import json
import os
import threading
import zlib

import numpy as np

from edit_jax.data.errors import DataError
from edit_jax.data.shards import ConcatTokens, index_path, open_shards
from edit_jax.data.sources.base import SourceResult

TOKEN_DTYPES = ("uint16", "uint32", "int32")  # the data.token_dtype values a raw .bin file may hold


def _load_token_file(path: str, token_dtype: str) -> tuple[np.ndarray, int, bool]:
    """(the file's tokens as a flat memmap, its header's bytes, whether the tokens lie in the file in
    that flat order, so ranges can be read with pread)."""
    ext = os.path.splitext(path)[1].lower()
    header, direct = 0, True
    if ext == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"tokens file {path!r}: not a readable .npy array ({e})") from e
        if not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"tokens file {path!r}: expected an integer token array, got dtype {arr.dtype}")
        header, direct = int(arr.offset), bool(arr.flags.c_contiguous)  # a Fortran-order array is read by the map
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
    return arr, header, direct


class _Files:
    """Open read-only descriptors of loose token files, the most recently read ``MAX_OPEN`` per
    process (a corpus may be thousands of files)."""

    MAX_OPEN = 64
    _open: "collections.OrderedDict[str, int]" = collections.OrderedDict()
    _lock = threading.Lock()

    @classmethod
    def pread(cls, path: str, nbytes: int, offset: int) -> bytes:
        with cls._lock:
            fd = cls._open.pop(path, None)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise DataError(f"cannot read tokens file {path!r}: {e.strerror or e}") from e
            cls._open[path] = fd
            while len(cls._open) > cls.MAX_OPEN:
                os.close(cls._open.popitem(last=False)[1])
            return os.pread(fd, nbytes, offset)


class CheckedTokens:
    """Tokens ``[start, stop)`` of a loose token array (a memmap), read only when sliced, each read
    checked against the vocabulary: an id outside ``[0, vocab)`` is a DataError naming the file
    and the offset of the first bad id in it. A contiguous range is read with ``pread`` (``direct``),
    not through the map: a fault on a mapped file maps the kernel's whole page-cache folio (up to
    megabytes on recent kernels) into the process, so RSS would grow with every window touched.
    Has what the streams and ``ConcatTokens`` use: ``size``, ``dtype``, ``nbytes``, ``len``,
    slicing, ``reshape(-1)`` and ``np.asarray``."""

    def __init__(self, arr: np.ndarray, path: str, start: int, stop: int, vocab_size: int, tokenizer: str,
                 header_bytes: int = 0, direct: bool = False):
        self.arr, self.path, self.start, self.stop, self.direct = arr, path, int(start), int(stop), bool(direct)
        self.vocab_size, self.tokenizer, self.header_bytes = int(vocab_size), tokenizer, int(header_bytes)
        self.dtype = arr.dtype
        self.size = self.stop - self.start
        self.nbytes = self.size * self.dtype.itemsize
        self.ndim, self.shape = 1, (self.size,)

    def __len__(self) -> int:
        return self.size

    def reshape(self, *shape):
        return self  # already 1-D

    def __getitem__(self, key):
        if not isinstance(key, slice):
            i = int(key)
            i += self.size if i < 0 else 0
            if not 0 <= i < self.size:
                raise IndexError(f"index {key} out of range for {self.size} tokens")
            key = slice(i, i + 1)
            return self[key][0]
        first, stop, step = key.indices(self.size)
        if self.direct and step == 1:
            piece = read_tokens(self.path, self.dtype, self.header_bytes, self.start + first,
                                self.start + max(first, stop))
        else:
            piece = self.arr[self.start:self.stop][key]
        if piece.size:
            self._check(piece, first, step)
        return piece

    def _check(self, piece: np.ndarray, first: int, step: int) -> None:
        bad = piece.max() >= self.vocab_size or (piece.dtype.kind == "i" and piece.min() < 0)
        if not bad:
            return
        i = int(np.flatnonzero((piece < 0) | (piece >= self.vocab_size))[0])
        token = self.start + first + i * step
        hint = ("; set data.tokenizer to the tokenizer.json that produced these tokens"
                if self.tokenizer == "byte" else "")
        raise DataError(f"tokens file {self.path!r}: id {int(piece[i])} at token {token} (byte offset "
                        f"{self.header_bytes + token * self.dtype.itemsize}) is outside [0, {self.vocab_size}) for "
                        f"tokenizer {self.tokenizer!r}{hint}")

    def __array__(self, dtype=None, copy=None):
        arr = np.asarray(self[:])
        return arr if dtype is None else arr.astype(dtype)

    def tolist(self) -> list:
        return np.asarray(self[:]).tolist()

    def astype(self, dtype, copy=True):
        return np.asarray(self[:], dtype=dtype)


def read_tokens(path: str, dtype: np.dtype, header: int, a: int, b: int) -> np.ndarray:
    """Tokens ``[a, b)`` of a flat token file (``header`` bytes before them), with one pread."""
    nbytes = (b - a) * dtype.itemsize
    buf = _Files.pread(path, nbytes, header + a * dtype.itemsize)
    if len(buf) != nbytes:
        raise DataError(f"tokens file {path!r}: ended at byte {header + a * dtype.itemsize + len(buf)} while reading "
                        f"tokens {a}-{b - 1} (the file was truncated since the run started?)")
    return np.frombuffer(buf, dtype)


def _identity(path: str, arr: np.ndarray, cut: int, header: int, direct: bool) -> list:
    """What identifies a loose array without reading it: name, dtype, size, split point and its
    first and last 1024 tokens (two preads)."""
    n = arr.size
    if direct:
        ends = [read_tokens(path, arr.dtype, header, 0, min(n, 1024)),
                read_tokens(path, arr.dtype, header, max(0, n - 1024), n)]
    else:
        ends = [np.asarray(arr[:1024]), np.asarray(arr[-1024:])]
    ends = np.concatenate(ends).astype(np.int64)
    return [os.path.basename(path), arr.dtype.str, int(arr.size), int(cut), zlib.crc32(ends.tobytes())]


def _load_shard_dirs(tok, files: list[str]) -> SourceResult:
    sets = [open_shards(p, tok) for p in files]
    trains = [part for s in sets for part in s.train.parts]
    vals = [part for s in sets for part in s.val.parts]
    train, val = ConcatTokens(trains, "train"), ConcatTokens(vals, "val")
    fp = sets[0].fingerprint
    for s in sets[1:]:
        fp = (fp * 1_000_003 + s.fingerprint) % 2**32
    shards = len(trains) + len(vals)
    docs = {k: sum(s.index.get("documents", {}).get(k, 0) for s in sets) for k in ("train", "val")}
    return SourceResult(train, val, what=f"{len(files)} shard dir{'s' if len(files) != 1 else ''}, {shards} shards",
                        split="document-level (sha256 of document text, at tokenize time)", files=shards,
                        bytes=train.nbytes + val.nbytes, info=dict(shards=shards, train_documents=docs["train"],
                                                                    val_documents=docs["val"]),
                        fingerprint=fp)


def load(tok, files: list[str], cfg) -> SourceResult:
    indexed = [p for p in files if index_path(p) is not None]
    if indexed:
        if len(indexed) != len(files):
            loose = [p for p in files if index_path(p) is None]
            raise DataError(f"data.paths mixes token shard directories ({indexed[0]!r}) with loose token files "
                            f"({loose[0]!r}); expected one kind (for a shard directory, give the directory itself, "
                            f"not a glob over its files)")
        return _load_shard_dirs(tok, files)
    token_dtype, val_fraction = cfg.token_dtype, cfg.val_fraction
    trains, vals, nbytes, identity = [], [], 0, []
    for p in files:
        arr, header, direct = _load_token_file(p, token_dtype)  # header: a .npy's, before its tokens
        cut = arr.size - max(1, int(round(arr.size * val_fraction)))  # the tail of each array is validation
        trains.append(CheckedTokens(arr, p, 0, cut, tok.vocab_size, tok.name, header, direct))
        vals.append(CheckedTokens(arr, p, cut, arr.size, tok.vocab_size, tok.name, header, direct))
        identity.append(_identity(p, arr, cut, header, direct))
        nbytes += arr.nbytes
    if len(files) == 1:
        train, val = trains[0], vals[0]  # views of the memmap: no copy of a possibly huge file
    else:
        train, val = ConcatTokens(trains, "train"), ConcatTokens(vals, "val")  # virtual: the files stay memory-mapped
    fingerprint = zlib.crc32(json.dumps(identity).encode())
    return SourceResult(train, val, what=f"{len(files)} token file{'s' if len(files) != 1 else ''}",
                        split="array-level (last val_fraction of each array)", files=len(files), bytes=nbytes,
                        fingerprint=fingerprint, sampled_fingerprint_ok=True)
