"""Source ``text``: text files or globs. Split at file level by the hash of the path as given; if
that leaves a split empty (too few files), the packed stream is split at token level instead: the
last ``val_fraction`` of the tokens is validation."""

from __future__ import annotations

from typing import Sequence

from edit_jax.data.errors import DataError
from edit_jax.data.sources.base import SourceResult, _is_val, _pack, _read_bytes, _token_dtype


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


def load(tok, files: list[str], cfg) -> SourceResult:
    val_fraction = cfg.val_fraction
    docs = [(p, _read_bytes(p, "text")) for p in files]
    if not cfg.allow_binary:
        _refuse_binary(docs)
    nbytes = sum(len(r) for _, r in docs)
    dtype = _token_dtype(tok.vocab_size)
    is_val = [_is_val(p.encode(), val_fraction) for p, _ in docs]
    what = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    if any(is_val) and not all(is_val):
        enc = tok.encode_documents(docs)
        train = _pack([e for e, v in zip(enc, is_val, strict=True) if not v], tok.eos_id, dtype)
        val = _pack([e for e, v in zip(enc, is_val, strict=True) if v], tok.eos_id, dtype)
        split = "file-level (sha256 of path)"
        extra = dict(train_files=is_val.count(False), val_files=is_val.count(True))
    else:
        # Too few files for a file-level split to give both splits a file: split the packed stream.
        stream = _pack(tok.encode_documents(docs), tok.eos_id, dtype)
        cut = stream.size - max(1, int(round(stream.size * val_fraction)))
        train, val = stream[:cut], stream[cut:]
        split = "token-level (last val_fraction of the stream; too few files for a file-level split)"
        extra = {}
    return SourceResult(train, val, what=what, split=split, files=len(files), bytes=nbytes, info=extra)
