"""``edit-jax tokenize INPUT... --out DIR``: documents -> token shards (layout: ``shards.py``).

Inputs are parquet files (each non-null row of ``--text-column`` is a document), ``.jsonl`` files
(each line's ``--text-field``) and anything else as plain text (one file, one document). Two phases,
both resumable after a kill:

1. Tokenize. The inputs are cut into units (one per parquet row group, one per jsonl / text file);
   ``--workers`` processes take units, split their documents train / val by the sha256 of the
   document text (the rule of the parquet source) and write ``DIR/.parts/uNNNNNN.{train,val}.bin``
   and, last, a ``uNNNNNN.json`` saying the unit is done. Memory holds one row group (or a batch
   of jsonl lines), never a whole file. A re-run skips the units whose ``.json`` exists.
2. Assemble. The parts, in unit order, are cut into fixed-size shards ``{train,val}-NNNNN.bin``
   (each written under a temporary name, then renamed: a shard that exists is complete and is
   skipped on a re-run); then ``index.json`` is written and ``.parts/`` removed.

The output depends only on the inputs (their order), the tokenizer, ``--val-fraction`` and
``--shard-tokens``, not on ``--workers`` or on where a run was killed: the same input gives the
same shards byte for byte.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob as globlib
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np

from edit_jax.data.documents import (BATCH_TEXT_BYTES, parquet_row_groups, row_range_documents, split_and_pack,
                                     val_key)
from edit_jax.data.errors import DataError
from edit_jax.data.shards import (INDEX_FORMAT, INDEX_NAME, INDEX_VERSION, SPLITS, dtype_for_vocab, shard_name,
                                  tokenizer_identity)
from edit_jax.data.tokenizers import cached_tokenizer, make_tokenizer
from edit_jax.exit_codes import EXIT_BAD_INPUT

PARTS = ".parts"
DEFAULT_VAL_FRACTION = 0.005  # --val-fraction left out: this, but at least one document (a handful of files)
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
JSONL_BATCH_BYTES = 64 << 20  # a jsonl unit is tokenized in batches of about this much text
COPY_TOKENS = 1 << 24  # tokens copied at a time while assembling shards


@dataclass(frozen=True)
class Unit:
    """One piece of input a worker tokenizes on its own."""

    index: int
    path: str
    kind: str  # "parquet" | "jsonl" | "text"
    row_group: int = -1  # parquet only


@dataclass(frozen=True)
class Job:
    tokenizer: str
    text_column: str
    text_field: str
    val_fraction: float
    parts_dir: str
    dtype: str


def _kind(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    return "parquet" if ext == ".parquet" else "jsonl" if ext in (".jsonl", ".ndjson") else "text"


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files and globs -> existing files (globs sorted, duplicates dropped, order otherwise kept)."""
    out: list[str] = []
    for p in inputs:
        if any(c in p for c in "*?["):
            matches = sorted(m for m in globlib.glob(p, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(f"tokenize: glob {p!r} matched no files")
        elif os.path.isfile(p):
            matches = [p]
        else:
            raise DataError(f"tokenize: input {p!r} does not exist or is not a file")
        out.extend(m for m in matches if m not in out)
    return out


def plan_units(files: list[str], text_column: str) -> list[Unit]:
    """The units, in output order; parquet files are checked for the column here, before any work."""
    units: list[Unit] = []
    for p in files:
        kind = _kind(p)
        if kind != "parquet":
            if os.path.getsize(p) == 0:
                raise DataError(f"tokenize: input {p!r} is empty; expected {kind} documents")
            units.append(Unit(len(units), p, kind))
            continue
        for g, *_ in parquet_row_groups(p, text_column, "tokenize: ", "--text-column"):
            units.append(Unit(len(units), p, "parquet", g))
    return units


def _documents(unit: Unit, job: Job):
    """Yields batches of (name, raw UTF-8 bytes) documents of one unit; a batch is about
    JSONL_BATCH_BYTES of text (a parquet row group, which pandas' and pyarrow's defaults make as
    large as a million rows, is read in slices of consecutive rows of about that size)."""
    if unit.kind == "parquet":
        _, rows, _, text = parquet_row_groups(unit.path, job.text_column, "tokenize: ", "--text-column")[unit.row_group]
        n = max(1, min(max(rows, 1), -(-text // JSONL_BATCH_BYTES)))
        batch_rows = max(1, int(rows * BATCH_TEXT_BYTES / max(1, text)))
        for j in range(n):
            yield row_range_documents(unit.path, unit.row_group, job.text_column, j * rows // n,
                                      (j + 1) * rows // n, batch_rows, "tokenize", "tokenize: ")
    elif unit.kind == "jsonl":
        batch, size = [], 0
        with open(unit.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise DataError(f"tokenize: {unit.path!r} line {lineno}: not JSON ({e})") from e
                text = rec.get(job.text_field) if isinstance(rec, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"tokenize: {unit.path!r} line {lineno}: expected an object with a string "
                                    f"field {job.text_field!r} (--text-field)")
                raw = text.encode("utf-8")
                if raw:
                    batch.append((f"{unit.path}:{lineno}", raw))
                    size += len(raw)
                if size >= JSONL_BATCH_BYTES:
                    yield batch
                    batch, size = [], 0
        yield batch
    else:
        with open(unit.path, "rb") as f:
            yield [(unit.path, f.read())]


def _atomic_write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def tokenize_unit(unit: Unit, job: Job) -> dict:
    """Tokenizes one unit into its part files; returns (and writes, last) its summary."""
    tok = cached_tokenizer(job.tokenizer)
    stem = os.path.join(job.parts_dir, f"u{unit.index:06d}")
    dtype = np.dtype(job.dtype)
    counts = {s: 0 for s in SPLITS}
    docs = {s: 0 for s in SPLITS}
    text_hash = hashlib.sha256()
    key_min = 2**64  # the smallest split key of its documents: what --val-fraction holds one out (auto)
    files = {s: open(f"{stem}.{s}.bin.tmp", "wb") for s in SPLITS}
    try:
        for batch in _documents(unit, job):
            if not batch:
                continue
            for _, raw in batch:
                text_hash.update(len(raw).to_bytes(8, "little"))
                text_hash.update(raw)
                key_min = min(key_min, val_key(raw))
            for split, (packed, ndocs) in split_and_pack(tok, batch, job.val_fraction, dtype).items():
                if ndocs:
                    files[split].write(packed.tobytes())
                    counts[split] += packed.size
                    docs[split] += ndocs
    finally:
        for f in files.values():
            f.close()
    for split in SPLITS:
        os.replace(f"{stem}.{split}.bin.tmp", f"{stem}.{split}.bin")
    summary = {"unit": unit.index, "path": unit.path, "row_group": unit.row_group, "tokens": counts,
               "documents": docs, "text_sha256": text_hash.hexdigest(), "bytes": os.path.getsize(unit.path),
               "val_key_min": key_min}
    _atomic_write_json(f"{stem}.json", summary)  # last: its presence says the unit is done
    return summary


def _run_unit(args) -> dict:
    return tokenize_unit(*args)


def _done_summary(parts_dir: str, unit: Unit) -> dict | None:
    path = os.path.join(parts_dir, f"u{unit.index:06d}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        s = json.load(f)
    return s if s.get("path") == unit.path and s.get("row_group") == unit.row_group else None


def _assemble_split(out: str, parts_dir: str, split: str, summaries: list[dict], dtype: np.dtype,
                    shard_tokens: int) -> list[dict]:
    """Cuts the split's parts (in unit order) into shards of ``shard_tokens``; returns index entries."""
    counts = [s["tokens"][split] for s in summaries]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(starts[-1])
    entries = []
    for k in range(max(1, -(-total // shard_tokens)) if total else 0):
        lo, hi = k * shard_tokens, min(total, (k + 1) * shard_tokens)
        name = shard_name(split, k)
        path = os.path.join(out, name)
        digest = hashlib.sha256()
        if os.path.isfile(path) and os.path.getsize(path) == (hi - lo) * dtype.itemsize:
            with open(path, "rb") as f:  # done by an earlier (killed) run: hash it, do not rewrite it
                for chunk in iter(lambda: f.read(COPY_TOKENS * dtype.itemsize), b""):
                    digest.update(chunk)
        else:
            with open(path + ".tmp", "wb") as f:
                pos = lo
                while pos < hi:
                    u = int(np.searchsorted(starts, pos, side="right")) - 1
                    part = np.memmap(os.path.join(parts_dir, f"u{summaries[u]['unit']:06d}.{split}.bin"),
                                     dtype=dtype, mode="r")
                    take = min(hi, int(starts[u + 1]), pos + COPY_TOKENS) - pos
                    chunk = np.asarray(part[pos - starts[u]:pos - starts[u] + take]).tobytes()
                    del part
                    f.write(chunk)
                    digest.update(chunk)
                    pos += take
            os.replace(path + ".tmp", path)
        entries.append({"file": name, "tokens": hi - lo, "sha256": digest.hexdigest()})
    return entries


def tokenize(inputs: list[str], out: str, tokenizer: str = "byte", text_column: str = "text",
             text_field: str = "text", val_fraction: float | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
             workers: int = 1, progress: bool = True, stop_after_units: int | None = None) -> dict:
    """Writes the shards and index.json of ``inputs`` into ``out``; returns the index.
    ``val_fraction`` None (the default, "auto"): ``DEFAULT_VAL_FRACTION``, but at least one
    document held out when that leaves the val split empty (a handful of files). A bad input or an
    empty split leaves nothing behind (``.parts/``, an ``out`` this call made); a kill leaves the
    parts for the re-run to resume. ``stop_after_units`` (tests: a kill) returns None after
    tokenizing that many new units."""
    if val_fraction is not None and not 0.0 < val_fraction < 1.0:
        raise DataError(f"tokenize: --val-fraction must be in (0, 1), got {val_fraction}")
    if shard_tokens <= 0 or workers <= 0:
        raise DataError(f"tokenize: --shard-tokens and --workers must be positive, got {shard_tokens}, {workers}")
    made_out = not os.path.isdir(out)
    try:
        return _tokenize(inputs, out, tokenizer, text_column, text_field, val_fraction, shard_tokens, workers,
                         progress, stop_after_units)
    except DataError:
        shutil.rmtree(os.path.join(out, PARTS), ignore_errors=True)
        if made_out and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)
        raise


def _tokenize(inputs, out, tokenizer, text_column, text_field, val_fraction, shard_tokens, workers, progress,
              stop_after_units) -> dict | None:
    tok = make_tokenizer(tokenizer)
    files = expand_inputs(inputs)
    units = plan_units(files, text_column)
    ident = tokenizer_identity(tok)
    dtype = np.dtype(dtype_for_vocab(tok.vocab_size))
    settings = {"tokenizer_sha256": ident["sha256"], "val_fraction": val_fraction, "shard_tokens": shard_tokens,
                "text_column": text_column, "text_field": text_field,
                "inputs": [[u.path, u.row_group, os.path.getsize(u.path)] for u in units]}
    index_file = os.path.join(out, INDEX_NAME)
    if os.path.isfile(index_file):
        with open(index_file) as f:
            old = json.load(f)
        if old.get("settings") == settings:
            return old  # finished before with the same inputs and settings: nothing to do
        raise DataError(f"tokenize: {out!r} already holds shards of other inputs or settings ({index_file}); "
                        f"use another --out or remove it")
    os.makedirs(out, exist_ok=True)
    parts_dir = os.path.join(out, PARTS)
    fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    job = Job(tokenizer, text_column, text_field, fraction, parts_dir, dtype.name)
    summaries, seconds = _tokenize_units(out, units, job, settings, workers, progress, stop_after_units)
    if summaries is None:
        return None
    ordered = [summaries[u.index] for u in units]
    docs = {split: sum(s["documents"][split] for s in ordered) for split in SPLITS}
    key_min = min((s.get("val_key_min", 2**64) for s in ordered), default=2**64)
    if not docs["val"] and docs["train"] >= 2 and key_min < 2**64:
        # Hold out the document of the smallest key: the same hash rule, at the smallest fraction
        # that takes one (float spacing at 2^64 scale is finer than any gap worth caring about).
        fit = math.nextafter(key_min / 2.0**64, 1.0)
        if val_fraction is None:
            job = dataclasses.replace(job, val_fraction=fit)
            summaries, more = _tokenize_units(out, units, job, settings, workers, progress, None)
            seconds += more
            ordered = [summaries[u.index] for u in units]
            docs = {split: sum(s["documents"][split] for s in ordered) for split in SPLITS}
        else:
            raise DataError(f"tokenize: --val-fraction {val_fraction:g} holds out none of the {docs['train']} "
                            f"documents; pass --val-fraction {fit:.3g} (holds out one) or leave it out (auto)")
    for split in SPLITS:
        if not docs[split]:  # before any shard is written
            raise DataError(f"tokenize: the {split} split is empty ({docs['train']} train / {docs['val']} val "
                            f"documents from {len(files)} inputs); add documents or change --val-fraction")
    splits = {split: _assemble_split(out, parts_dir, split, ordered, dtype, shard_tokens) for split in SPLITS}
    inputs_hash = hashlib.sha256("".join(s["text_sha256"] for s in ordered).encode()).hexdigest()
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "dtype": dtype.name, "vocab_size": tok.vocab_size,
             "eos_id": tok.eos_id, "tokenizer": ident, "inputs_sha256": inputs_hash, "documents": docs,
             "tokens": {split: sum(e["tokens"] for e in splits[split]) for split in SPLITS},
             "shard_tokens": shard_tokens, "val_fraction": job.val_fraction, "splits": splits, "settings": settings}
    _atomic_write_json(index_file, index)
    shutil.rmtree(parts_dir)
    index["_seconds"] = seconds  # not written: for the caller's report
    return index


def _tokenize_units(out: str, units: list[Unit], job: Job, settings: dict, workers: int, progress: bool,
                    stop_after_units: int | None) -> tuple[dict | None, float]:
    """Phase 1: each unit not done yet (by parts of these settings and ``job.val_fraction``) to
    its parts; ({unit: summary}, seconds), or (None, s) when ``stop_after_units`` stopped it."""
    parts_dir = job.parts_dir
    settings = {**settings, "effective_val_fraction": job.val_fraction}
    os.makedirs(parts_dir, exist_ok=True)
    settings_file = os.path.join(parts_dir, "settings.json")
    if os.path.isfile(settings_file):
        with open(settings_file) as f:
            stale = json.load(f) != settings
        if stale:  # an interrupted run with other settings: its parts and shards are not ours
            shutil.rmtree(parts_dir)
            os.makedirs(parts_dir)
            for name in os.listdir(out):
                if name.endswith((".bin", ".bin.tmp")) and name.startswith(SPLITS):
                    os.remove(os.path.join(out, name))
    _atomic_write_json(settings_file, settings)

    summaries: dict[int, dict] = {}
    todo = []
    for u in units:
        s = _done_summary(parts_dir, u)
        if s is None:
            todo.append(u)
        else:
            summaries[u.index] = s
    if stop_after_units is not None:
        todo = todo[:stop_after_units]
    bar = _progress(len(units), len(summaries), progress)
    start, new_tokens = time.perf_counter(), 0

    def done(s: dict) -> None:
        nonlocal new_tokens
        summaries[s["unit"]] = s
        new_tokens += sum(s["tokens"].values())
        if bar is not None:
            rate = new_tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate / 1e6:.2f} M tokens/s, {workers} worker{'s' if workers > 1 else ''}")
            bar.update(1)

    if workers == 1 or len(todo) <= 1:
        for u in todo:
            done(tokenize_unit(u, job))
    else:
        # spawn: no fork of a parent that may hold threads (the tokenizers package, JAX)
        with mp.get_context("spawn").Pool(min(workers, len(todo))) as pool:
            for s in pool.imap_unordered(_run_unit, [(u, job) for u in todo]):
                done(s)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    if stop_after_units is not None and len(summaries) < len(units):
        return None, seconds
    return summaries, seconds


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="unit", desc="tokenize", file=sys.stderr, dynamic_ncols=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edit-jax tokenize",
                                     description="Parquet / jsonl / text files -> token shards for data.source=tokens.")
    parser.add_argument("inputs", nargs="+", help="files or globs: .parquet, .jsonl (one JSON object a line), "
                        "anything else is one plain-text document")
    parser.add_argument("--out", required=True, help="output directory (shards and index.json)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' (default) or a path to a tokenizer.json")
    parser.add_argument("--text-column", default="text", help="parquet column holding the documents")
    parser.add_argument("--text-field", default="text", help="jsonl field holding the documents")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help=f"fraction of documents held out for validation (by the hash of their text); default "
                             f"{DEFAULT_VAL_FRACTION:g}, and at least one document when that holds out none")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (over files and row groups)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        index = tokenize(args.inputs, args.out, args.tokenizer, args.text_column, args.text_field,
                         args.val_fraction, args.shard_tokens, args.workers, not args.no_progress)
    except (DataError, OSError) as e:
        message = str(e)
        print(f"edit-jax tokenize: {message.removeprefix('tokenize: ')}", file=sys.stderr)
        return EXIT_BAD_INPUT
    t = index["tokens"]
    print(f"edit-jax tokenize: {t['train']} train / {t['val']} val tokens ({index['documents']['train']} / "
          f"{index['documents']['val']} documents) in {len(index['splits']['train'])} + "
          f"{len(index['splits']['val'])} shards of {index['dtype']}; {os.path.join(args.out, INDEX_NAME)}")
    return 0
