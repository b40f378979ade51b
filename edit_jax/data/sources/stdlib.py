"""Source ``stdlib`` (the default, needs no files): the running interpreter's own standard-library
``.py`` sources (``sysconfig.get_paths()["stdlib"]``, recursively, skipping ``site-packages`` and
``__pycache__``, sorted). Split at FILE level: a file is validation iff the hash of its relative
POSIX path falls below ``val_fraction`` (stable across machines and listing order)."""

from __future__ import annotations

import os
import sys
import sysconfig

from edit_jax.data.errors import DataError
from edit_jax.data.sources.base import SourceResult, _is_val, _pack, _token_dtype


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


def load(tok, files: list[str], cfg) -> SourceResult:
    val_fraction = cfg.val_fraction
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
    return SourceResult(train, val, what=f"{len(train_docs) + len(val_docs)} files of Python {py} "
                                         f"({len(train_docs)} train / {len(val_docs)} val)",
                        split="file-level (sha256 of relative path)", files=len(train_docs) + len(val_docs),
                        bytes=nbytes, info=dict(train_files=len(train_docs), val_files=len(val_docs), root=root,
                                                python=py))
