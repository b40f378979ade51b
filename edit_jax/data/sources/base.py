"""What every data source shares: its result type (``SourceResult``), its registry entry
(``Source``) and the helpers for a stable train/validation split, packing and reading files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from edit_jax.config import DataConfig
from edit_jax.data.documents import is_val as _is_val  # noqa: F401 - the sources' split rule
from edit_jax.data.errors import DataError


@dataclass
class SourceResult:
    """One source's packed splits and what ``load_corpus`` reports about them."""

    train: np.ndarray | None  # packed 1-D token stream of the training split (None: streamed)
    val: np.ndarray | None  # packed 1-D token stream of the validation split (None: streamed)
    what: str  # the corpus in a few words, for the description and errors ("3 files")
    split: str  # how it was split ("file-level (sha256 of path)"); the part before " (" is shown
    files: int  # input files read
    bytes: int  # bytes of text read (or of token arrays)
    info: dict = field(default_factory=dict)  # source-specific numbers for logs (per-split counts, ...)
    # The train stream's identity when the source knows it without reading the tokens (shard
    # indexes); None: streams.fingerprint samples the tokens.
    fingerprint: int | None = None
    # Also accept, on resume, the fingerprint sampled from the tokens (what loose arrays had before
    # they got an identity that reads nothing): checkpoints made then still resume.
    sampled_fingerprint_ok: bool = False
    # A streamed source (parquet) reads its documents during training instead: train / val are None.
    streamed: object | None = None


@dataclass(frozen=True)
class Source:
    """A registry entry: ``load(tokenizer, files, data_config) -> SourceResult``, where ``files``
    are ``data.paths`` expanded to existing files (empty when ``needs_paths`` is False)."""

    load: Callable[[object, list, "DataConfig"], SourceResult]
    needs_paths: bool = True


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
