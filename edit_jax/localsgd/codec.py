"""The wire's codec: how a worker's pseudo gradient crosses to the others, as one value.

A ``Codec`` is the kind (``"none"`` float32, ``"bf16"``, ``"int8"``: ``quantize.py``; ``"topk2"``,
``"topk4"``: ``sparse.py``), the sparse kinds' chunk and k, and error feedback: on or off, the
residual's decay β and its stored dtype. It is built once from the config (``from_sync``) and
handed to everything that sends, reads or stores the wire: the ``Compressed`` wrapper (through
``SyncSpec.codec``, jit-static: the value is frozen and hashable), the exchange's posts
(``elastic/packed.py``), ``plan``'s bits per parameter, and the checkpoint's resume check.

Its ``name`` is the form that travels and is recorded (a post's meta, the records, ``plan``): the
kind with the options that differ from the defaults, ``"topk2"`` at the defaults, else e.g.
``"topk2;chunk=1024;k=32;decay=0.9"``; int8 / bf16 take ``decay`` the same way. ``from_name``
reads it back. Error feedback and the residual's dtype are the worker's own business and not in
the name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax.numpy as jnp

from edit_jax.config import SyncConfig, WireConfig
from edit_jax.config.renames import quiet, upgrade
from edit_jax.localsgd import quantize as dense
from edit_jax.localsgd import sparse

KINDS = ("none", "bf16", "int8", "topk2", "topk4")
DEFAULTS = {"chunk": sparse.CHUNK, "k": sparse.TOPK, "decay": 1.0}
OPTIONS = {kind: ("chunk", "k", "decay") if kind in sparse.BITS else ("decay",) for kind in KINDS}
# Bytes per value sent by the dense kinds (int8: one float32 scale per BLOCK values).
DENSE_BYTES = {"none": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / dense.BLOCK}
# The field of the config's ``sync.wire`` section each part is read from.
FIELDS = {"kind": "kind", "chunk": "chunk", "k": "k", "decay": "decay", "error_feedback": "error_feedback",
          "ef_dtype": "residual_dtype"}
_WIRE_DEFAULTS = WireConfig()


@dataclass(frozen=True)
class Codec:
    kind: str = "none"
    chunk: int = sparse.CHUNK  # topk*: values per chunk (the defaults for the dense kinds: unused)
    k: int = sparse.TOPK  # topk*: values sent per chunk
    decay: float = 1.0  # β: the residual enters the next sync as β·e
    error_feedback: bool = False  # each worker carries what its last encoding dropped to its next sync
    ef_dtype: str = "float32"  # the stored residual's dtype (the math is float32)

    # -- built once ------------------------------------------------------------------------------

    @staticmethod
    def from_sync(s: SyncConfig | Mapping) -> Codec:
        """The codec of a sync config: a ``SyncConfig``, or a saved config's ``"sync"`` dict (its
        ``wire`` section, or the flat keys written before the section existed; a field it lacks,
        written before the field existed, is the default)."""
        if isinstance(s, Mapping):
            wire = upgrade({"sync": dict(s)}, quiet)["sync"].get("wire") or {}
            get = lambda f: wire.get(f, getattr(_WIRE_DEFAULTS, f))
        else:
            get = lambda f: getattr(s.wire, f)
        o = {part: get(field) for part, field in FIELDS.items()}
        if o["kind"] not in sparse.BITS:  # chunk and k mean nothing to the dense kinds: one value per wire
            o["chunk"], o["k"] = DEFAULTS["chunk"], DEFAULTS["k"]
        return Codec(str(o["kind"]), int(o["chunk"]), int(o["k"]), float(o["decay"]), bool(o["error_feedback"]),
                     str(o["ef_dtype"]))

    @staticmethod
    def from_name(name: str, error_feedback: bool = False, ef_dtype: str = "float32") -> Codec:
        """The codec of a wire name (``name``'s inverse); ValueError naming the part that is not one."""
        kind, *items = str(name).split(";")
        if kind not in KINDS:
            raise ValueError(f"wire {name!r}: unknown kind {kind!r}, expected one of {', '.join(KINDS)}")
        opts: dict = {}
        for item in items:
            key, eq, value = item.partition("=")
            if key not in OPTIONS[kind]:
                raise ValueError(f"wire {name!r}: unknown option {key!r} for {kind}, expected "
                                 f"{' / '.join(OPTIONS[kind])}")
            if not eq or key in opts:
                raise ValueError(f"wire {name!r}: option {key} must be given once, as {key}=VALUE")
            try:
                opts[key] = float(value) if key == "decay" else int(value)
            except ValueError:
                raise ValueError(f"wire {name!r}: option {key}={value!r} must be "
                                 f"{'a number' if key == 'decay' else 'an integer'}") from None
        return Codec(kind, **opts, error_feedback=error_feedback, ef_dtype=ef_dtype)

    # -- what it is ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The wire name: the kind with the options that differ from the defaults."""
        opts = {o: getattr(self, o) for o in OPTIONS[self.kind]}
        extra = [f"{key}={v:g}" if key == "decay" else f"{key}={v}" for key, v in opts.items() if v != DEFAULTS[key]]
        return ";".join([self.kind, *extra])

    @property
    def is_sparse(self) -> bool:
        return self.kind in sparse.BITS

    @property
    def bits(self) -> int:
        """Bits per value sent: a sparse kind's code (sign + level), else the dtype's width."""
        return sparse.BITS[self.kind] if self.is_sparse else {"none": 32, "bf16": 16, "int8": 8}[self.kind]

    @property
    def block(self) -> int:
        """Values per encoded row: the chunk of a sparse kind, ``compress.BLOCK`` else."""
        return self.chunk if self.is_sparse else dense.BLOCK

    @property
    def layout(self) -> tuple:
        """What a reader of this wire must agree on with its sender (β is the sender's own)."""
        return (self.kind, self.chunk, self.k) if self.is_sparse else (self.kind,)

    @property
    def row_bytes(self) -> int:
        """Bytes of one packed chunk of a sparse kind: codes, indices, scale."""
        return sparse.payload_bytes(self.bits, self.k)

    @property
    def carries_residual(self) -> bool:
        """Each worker's state holds an error-feedback residual (laid out like the params)."""
        return self.error_feedback and self.kind != "none"

    @property
    def residual_dtype(self):
        """The dtype the residual is stored in, when there is one."""
        return jnp.dtype(self.ef_dtype)

    def bits_per_param(self, sizes: list[int] | None = None) -> float:
        """Wire bits per parameter of one worker's payload; with ``sizes`` (the flattened vectors,
        e.g. per unit and device) including their padding to whole rows. Sparse: (k·(bits + 12) +
        32) / chunk (``sparse.py``); int8 8 + 32/BLOCK; bf16 16; none 32."""
        if not self.is_sparse:
            per = 8.0 * DENSE_BYTES[self.kind]
            if not sizes or self.kind != "int8":
                return per
            return per * sum(-(-m // dense.BLOCK) * dense.BLOCK for m in sizes) / sum(sizes)
        per_chunk = 8.0 * self.row_bytes
        if not sizes:
            return per_chunk / self.chunk
        return per_chunk * sum(-(-m // self.chunk) for m in sizes) / sum(sizes)

    # -- the kernels -----------------------------------------------------------------------------

    def encode(self, x):
        """Rows of ``block`` float32 values [..., block] -> the payload: packed uint8 rows [...,
        row_bytes] (sparse), a tuple of arrays (int8: codes and scales; bf16: the bits), x (none)."""
        if self.is_sparse:
            return sparse.encode(x, self.bits, self.k)
        return x if self.kind == "none" else dense.encode(x, self.kind)

    def decode(self, payload):
        """``encode``'s payload -> float32 rows [..., block] (the sparse kinds: zeros but the k sent)."""
        if self.is_sparse:
            return sparse.decode(payload, self.bits, self.k, self.chunk)
        return payload if self.kind == "none" else dense.decode(payload, self.kind)

    # -- resuming a checkpoint written with another codec ----------------------------------------

    def resume_refusal(self, saved: Codec) -> list[str]:
        """Why a checkpoint written with ``saved`` cannot resume under this codec ([] when it can):
        turning error feedback on or off adds or drops the residual in the state."""
        if saved.error_feedback == self.error_feedback:
            return []
        field = f"sync.wire.{FIELDS['error_feedback']}"
        return [f"{field}: checkpoint {saved.error_feedback}, config {self.error_feedback}"]

    def resume_change(self, saved: Codec, residual_kept: bool = True) -> str | None:
        """One line on what changed on the wire since a checkpoint written with ``saved`` (None when
        nothing did), for one that may resume (``resume_refusal`` is empty). The residual is what
        the old wire left unsent, laid out like the params whatever the wire: it carries over."""
        diffs = [f"sync.wire.{FIELDS['kind']} with its options: checkpoint {saved.name!r}, config {self.name!r}"] \
            if saved.name != self.name else []
        if self.carries_residual and saved.ef_dtype != self.ef_dtype:
            diffs.append(f"sync.wire.{FIELDS['ef_dtype']}: checkpoint {saved.ef_dtype}, config {self.ef_dtype}")
        if not diffs:
            return None
        if not self.carries_residual:
            fate = "no residual is carried"
        elif residual_kept:
            fate = f"the saved error-feedback residual carries over (stored as {self.ef_dtype})"
        else:
            fate = "every worker's error-feedback residual starts at zero (another worker count)"
        return f"the wire changed ({'; '.join(diffs)}): {fate}"


NONE = Codec()

__all__ = ["Codec", "DEFAULTS", "KINDS", "NONE"]
