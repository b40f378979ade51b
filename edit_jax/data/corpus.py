"""The corpus: ``load_corpus`` turns ``cfg.data`` into a ``Corpus`` (one packed token stream per
split) by expanding ``data.paths``, running the configured source from the registry
(``sources.SOURCES``) and checking each split holds a window; ``check_model_vocab`` checks the
model's embedding table against it."""

from __future__ import annotations

import glob as globlib
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from edit_jax.config import ConfigError, DataConfig
from edit_jax.data.errors import DataError
from edit_jax.data.sources import SOURCES
from edit_jax.data.tokenizers import make_tokenizer


@dataclass
class Corpus:
    """One packed token stream per split. Token arrays are 1-D unsigned ints (may be memmaps); for
    a streamed source (``data.source=parquet``) they are None and ``streamed`` reads the documents
    as training needs them (``parquet_units.ParquetCorpus``)."""

    train_tokens: np.ndarray | None
    val_tokens: np.ndarray | None
    vocab_size: int
    eos_id: int
    description: str
    tokenizer: str = "byte"
    info: dict = field(default_factory=dict)  # numbers for logs: files, bytes, tokens, load_seconds, split
    train_fingerprint: int | None = None  # known without a scan (token shards' index); None: sampled
    sampled_fingerprint_ok: bool = False  # a saved sampled fingerprint is accepted too (loose arrays)
    streamed: object | None = None  # a ParquetCorpus (data.source=parquet), else None


def check_model_vocab(corpus: Corpus, model_vocab_size: int) -> None:
    """Raises ConfigError when the model's embedding table cannot hold every token id of the corpus."""
    if model_vocab_size < corpus.vocab_size:
        raise ConfigError(f"config key 'model.vocab_size': {model_vocab_size} is smaller than the data's "
                          f"vocabulary ({corpus.vocab_size} ids, tokenizer {corpus.tokenizer!r}); "
                          f"set model.vocab_size >= {corpus.vocab_size}")


def load_corpus(cfg: DataConfig) -> Corpus:
    """Reads, tokenizes, splits and packs the configured source. Checks that each split holds at
    least one window of ``cfg.seq_len + 1`` tokens."""
    start = time.perf_counter()
    tok = make_tokenizer(cfg.tokenizer)
    if not 0.0 < cfg.val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in (0, 1), got {cfg.val_fraction}")
    source = SOURCES.get(cfg.source)
    if source is None:
        raise DataError(f"data.source: expected one of {', '.join(SOURCES)}; got {cfg.source!r}")
    files = _expand_paths(cfg.paths, cfg.source) if source.needs_paths else []
    result = source.load(tok, files, cfg)
    train, val, what = result.train, result.val, result.what
    info = dict(files=result.files, bytes=result.bytes, split=result.split, **result.info)
    if result.streamed is not None:  # nothing read yet: the stream and val_batches check the splits
        info["load_seconds"] = round(time.perf_counter() - start, 3)
        desc = f"{cfg.source}: {what}, {_human(result.bytes)}B on disk, tokenizer {tok.name}"
        return Corpus(None, None, tok.vocab_size, tok.eos_id, desc, tok.name, info, streamed=result.streamed)
    info.update(train_tokens=int(train.size), val_tokens=int(val.size),
                load_seconds=round(time.perf_counter() - start, 3))
    desc = (f"{cfg.source}: {what}, {_human(result.bytes)}B, {_human(train.size + val.size)} tokens "
            f"({_human(train.size)} train / {_human(val.size)} val, {result.split.split(' (')[0]} split), "
            f"tokenizer {tok.name}")
    corpus = Corpus(train, val, tok.vocab_size, tok.eos_id, desc, tok.name, info, result.fingerprint,
                    sampled_fingerprint_ok=result.sampled_fingerprint_ok)
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
        elif os.path.isdir(p) and source == "tokens" and os.path.isfile(os.path.join(p, "index.json")):
            matches = [p]  # a shard directory from `edit-jax tokenize`: the tokens source reads its index
        elif os.path.isdir(p) and source == "tokens":
            raise DataError(f"data.paths: directory {p!r} has no index.json; expected a token shard directory "
                            f"made by `edit-jax tokenize INPUT... --out {p}`, or .npy / .bin files")
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
