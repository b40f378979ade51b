"""Source ``tokens``: token shards written by ``edit-jax tokenize`` (a directory with an
``index.json``, or the index itself), or pre-tokenized ``.npy`` arrays (any integer dtype,
flattened) / raw ``.bin`` memmaps of ``data.token_dtype``.

Shard directories: each split is its shard set (document-level split made at tokenize time),
memory-mapped and used as one virtual concatenation (``shards.ConcatTokens``); nothing but the
index is read at start (the tokenizer, vocabulary and fingerprint come from it). Several
directories are concatenated split by split.

Loose arrays are used as they are (no EOS is added: they are expected to carry their own
separators). Split at ARRAY level: the last ``val_fraction`` of each array's tokens is validation.
Every id must be < the tokenizer's vocab size (checked by a scan: loose arrays have no index).
Several arrays are memory-mapped and concatenated virtually, never copied."""

from __future__ import annotations

import os

import numpy as np

from edit_jax.data.errors import DataError
from edit_jax.data.shards import ConcatTokens, index_path, open_shards
from edit_jax.data.sources.base import SourceResult

TOKEN_DTYPES = ("uint16", "uint32", "int32")  # the data.token_dtype values a raw .bin file may hold


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
        train, val = ConcatTokens(trains, "train"), ConcatTokens(vals, "val")  # virtual: the files stay memory-mapped
    return SourceResult(train, val, what=f"{len(files)} token file{'s' if len(files) != 1 else ''}",
                        split="array-level (last val_fraction of each array)", files=len(files), bytes=nbytes)
