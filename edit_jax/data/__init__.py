"""Data pipeline: corpus loading, tokenization, packing, per-replica training streams, validation.

The path from config to batches:

1. ``load_corpus(cfg.data)`` reads documents from one source, tokenizes them and packs each split
   into a single token stream (documents concatenated, an EOS id after each one). The sources are
   ``stdlib`` (the default, needs no files: the interpreter's standard-library ``.py`` files),
   ``text`` (text files or globs), ``tokens`` (pre-tokenized ``.npy`` / ``.bin`` arrays, used as
   they are) and ``parquet`` (a text column of parquet files, streamed: ``parquet_stream``); each
   module in ``sources/`` says how it reads and splits its input.

2. A split's stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (stride
   ``seq_len + 1``; the tail shorter than a window is dropped). A window ``w`` gives
   ``inputs = w[:-1]`` and ``targets = w[1:]``.

3. ``make_train_stream`` shuffles the windows per epoch with grain and hands each step one global
   batch ``[batch_size, seq_len + 1]`` whose rows ``[r*B/N, (r+1)*B/N)`` belong to replica ``r``.
   ``val_batches`` takes the validation windows in order.

Every problem with the input raises ``DataError`` (a ``ValueError``) naming the path and what was
expected.

Corpora larger than memory: ``edit-jax tokenize`` (``tokenize``) writes token shards plus an
``index.json`` (``shards``); ``data.source=tokens`` with ``data.paths=DIR`` memory-maps them as one
virtual stream per split (``shards.ConcatTokens``) after reading only the index, so step 1 and
memory do not depend on the corpus size. Loose ``.bin`` / ``.npy`` arrays are not scanned at start
either (their ids are checked as they are read), and streamed parquet reads units of at most about
``data.unit_bytes`` of text, whatever the size of the files' row groups.

Modules: ``errors`` (DataError), ``tokenizers`` (byte and tokenizer.json tokenizers), ``sources/``
(one module per source plus the ``SOURCES`` registry; to add a source: one file there and one
registry line), ``corpus`` (``Corpus``, ``load_corpus``), ``batches`` (``ReplicaStreams``: the
interface of both training streams), ``streams`` (windows, ``TrainStream``,
validation batches), ``shards`` (the shard directory: index, ``ConcatTokens``, checks),
``tokenize`` (``edit-jax tokenize``), ``parquet_stream`` (``data.source=parquet``: row groups, or
slices of them, read and tokenized in the background, per-replica streams with O(1) cursors).
This module is the public API: it re-exports the first ones.
"""

from __future__ import annotations

from edit_jax.data.corpus import Corpus, check_model_vocab, load_corpus
from edit_jax.data.errors import DataError
from edit_jax.data.sources.base import _is_val, _pack  # noqa: F401 - used by tests/test_data.py
from edit_jax.data.sources.stdlib import stdlib_files
from edit_jax.data.sources.text import looks_binary
from edit_jax.data.streams import (
    TrainStream,
    fingerprint,
    inputs_targets,
    make_train_stream,
    num_windows,
    replica_dataset,
    val_batches,
    window,
)
from edit_jax.data.tokenizers import BYTE_EOS, BYTE_VOCAB, ByteTokenizer, HFTokenizer, make_tokenizer

__all__ = ["DataError", "Corpus", "ByteTokenizer", "HFTokenizer", "make_tokenizer", "check_model_vocab",
           "load_corpus", "stdlib_files", "num_windows", "window", "fingerprint", "replica_dataset", "TrainStream",
           "make_train_stream", "val_batches", "inputs_targets", "BYTE_VOCAB", "BYTE_EOS", "looks_binary"]
