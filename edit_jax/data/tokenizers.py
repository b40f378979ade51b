"""Tokenizers: bytes (``ByteTokenizer``, the default) or a local Hugging Face ``tokenizer.json``
(``HFTokenizer``), chosen by ``make_tokenizer(data.tokenizer)``.

This module's name does not shadow the third-party ``tokenizers`` package: imports are absolute,
so ``import tokenizers`` below is the top-level package.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable, Sequence

import numpy as np

from edit_jax.data.errors import DataError

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
            import tokenizers  # optional dependency
        except ImportError as e:
            raise DataError(f"data.tokenizer={path!r} needs the `tokenizers` package: "
                            f"pip install edit-jax[tokenizers] (or pip install tokenizers)") from e
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # any parse failure is a bad file
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


@functools.lru_cache(maxsize=2)
def cached_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``make_tokenizer(spec)``, made once per process: tokenize workers and parquet readers
    encode unit after unit with the same one (a tokenizer.json takes a while to load)."""
    return make_tokenizer(spec)


def _decode_utf8(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{name!r}: expected UTF-8 text for the tokenizer, got undecodable bytes at offset "
                        f"{e.start}") from e
