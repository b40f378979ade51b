"""The compressed variant of any sync rule (``Compressed(rule)``; ``sync.compress``,
``sync.error_feedback``): the pseudo gradients cross ``replica`` as bf16 or int8 (``compress.py``)
or sparse and 2/4-bit (``sparse.py``); everything before and after the exchange stays float32.

The wrapper owns what compression adds and nothing else: the wire (its ``codec.Codec``, handed to
the rule in the ``SyncSpec``) and, with error feedback, each worker's quantization residual
(``OuterState.extra["residual"]``, laid out like the params, [N, ...]), which it passes into the
rule's sync and stores back. Every worker's residual starts at zero, also after an elastic resume
with another worker count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from edit_jax.config import SyncConfig, require
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.rule import RuleWrapper, Span, SyncRule, SyncSpec, worker_zeros
from edit_jax.localsgd.sparse import BITS, CHUNK


# The residual's stored dtype (sync.ef_dtype). bfloat16 halves error feedback's memory (at 7B a
# float32 residual is one more fp32 copy of a worker's params per device: +6.2% of the H100 peak,
# BUILD_NOTES 18); the sync reads it into float32 and rounds the new residual once on store.
EF_DTYPES = ("float32", "bfloat16")


class Compressed(RuleWrapper):
    """``rule`` with its pseudo gradients crossing ``replica`` as ``codec`` says ("bf16" | "int8" |
    "topk2" | "topk4" with their options), and with its error feedback each worker's residual
    carried to its next sync."""

    def __init__(self, rule: SyncRule, codec: Codec):
        super().__init__(rule)
        self.codec = codec
        self.name = f"compressed({rule.name})"

    @staticmethod
    def of(rule: SyncRule, s: SyncConfig) -> Compressed:
        return Compressed(rule, Codec.from_sync(s))

    @staticmethod
    def validate_fields(s: SyncConfig) -> None:
        """The compression fields (whatever the method)."""
        require(not s.error_feedback or s.compress != "none", "sync.error_feedback",
                "needs a lossy sync.compress (bf16, int8, topk2, topk4); with compress=none there is no residual")
        require(0.0 < s.ef_decay <= 1.0, "sync.ef_decay", f"must be in (0, 1], got {s.ef_decay}")
        require(s.ef_decay == 1.0 or s.error_feedback, "sync.ef_decay", "decays the residual: needs sync.error_feedback=true")
        require(s.ef_dtype in EF_DTYPES, "sync.ef_dtype", f"must be one of {', '.join(EF_DTYPES)}, got {s.ef_dtype!r}")
        require(s.ef_dtype == "float32" or s.error_feedback, "sync.ef_dtype", "stores the residual: needs sync.error_feedback=true")
        require(s.ef_dtype == "float32" or not s.exchange, "sync.ef_dtype",
                "bfloat16 halves the device-resident residual of the in-program sync; exchange workers (sync.exchange) "
                "keep theirs in host memory as float32, bit for bit the in-program float32 sync: leave it float32")
        require(s.compress not in BITS or s.error_feedback, "sync.error_feedback",
                f"sync.compress={s.compress} sends {s.sparse_k} of every {s.sparse_chunk} values: without the "
                "residual the rest is lost for good; set sync.error_feedback=true")
        require(0 < s.sparse_chunk <= CHUNK, "sync.sparse_chunk", f"must be in [1, {CHUNK}] (12-bit indices), got {s.sparse_chunk}")
        require(0 < s.sparse_k <= s.sparse_chunk and s.sparse_k % 4 == 0, "sync.sparse_k",
                f"must be a positive multiple of 4 (whole bytes of 2-bit codes and 12-bit index pairs) "
                f"<= sync.sparse_chunk={s.sparse_chunk}, got {s.sparse_k}")

    def _spec(self, spec: SyncSpec) -> SyncSpec:
        return dataclasses.replace(spec, codec=self.codec)

    # -- the residuals ---------------------------------------------------------------------------

    @staticmethod
    def _inner(extra):
        """The wrapped rule's part of ``extra`` (all but the residuals), None when empty."""
        return {k: v for k, v in extra.items() if k != "residual"} or None

    def _split(self, outer):
        """(the outer state as the wrapped rule sees it, this wrapper's residual or None)."""
        if not self.codec.carries_residual:
            return outer, None
        return outer.replace(extra=self._inner(outer.extra)), outer.extra["residual"]

    def _join(self, outer, residual):
        if not self.codec.carries_residual:
            return outer
        return outer.replace(extra={**(outer.extra or {}), "residual": residual})

    def init_extra(self, rep_params):
        inner = self.rule.init_extra(rep_params)
        if not self.codec.carries_residual:
            return inner
        dtype = self.codec.residual_dtype
        return {**(inner or {}), "residual": jax.tree.map(lambda x: jnp.zeros(x.shape, dtype), rep_params)}

    def extra_specs(self, param_specs):
        inner = self.rule.extra_specs(param_specs)
        return {**(inner or {}), "residual": param_specs} if self.codec.carries_residual else inner

    def reset_extra(self, extra):
        if not self.codec.carries_residual:
            return self.rule.reset_extra(extra)
        inner = self.rule.reset_extra(self._inner(extra))
        return {**(inner or {}), "residual": extra["residual"]}  # residuals survive the initialising sync

    def remap_extra(self, extra, n: int):
        if not self.codec.carries_residual:
            return self.rule.remap_extra(extra, n)
        inner = self.rule.remap_extra(self._inner(extra), n)
        return {**(inner or {}), "residual": worker_zeros(extra["residual"], n)}  # residuals are per worker: every worker starts at 0

    def extra_from_format2(self, residual, pending):
        inner = self.rule.extra_from_format2(None, pending)
        return {**(inner or {}), "residual": residual} if self.codec.carries_residual else inner

    def extra_as_format2(self, extra):
        if not self.codec.carries_residual:
            return self.rule.extra_as_format2(extra)
        inner = self.rule.extra_as_format2(self._inner(extra))
        return {**inner, "residual": extra["residual"]}

    # -- the sync, delegated ---------------------------------------------------------------------

    def after_step(self, params, outer, opt_state, spec: SyncSpec, shares=None, span: Span | None = None,
                   residual=None):
        outer, res = self._split(outer)
        params, outer, opt_state, metrics, res = self.rule.after_step(params, outer, opt_state, self._spec(spec),
                                                                      shares, span, res)
        return params, self._join(outer, res), opt_state, metrics, None

    def forward_inputs(self, outer, spec: SyncSpec, span: Span | None = None, residual=None):
        outer, res = self._split(outer)
        return self.rule.forward_inputs(outer, self._spec(spec), span, res)

    def in_forward_sync(self, unit, xs, which: str, spec: SyncSpec, shares=None):
        return self.rule.in_forward_sync(unit, xs, which, self._spec(spec), shares)

    def assemble(self, params, outer, opt_state, ys, spec: SyncSpec, span: Span | None = None, residual=None):
        outer, res = self._split(outer)
        params, outer, opt_state, metrics, res = self.rule.assemble(params, outer, opt_state, ys, self._spec(spec),
                                                                    span, res)
        return params, self._join(outer, res), opt_state, metrics, None

    def flush(self, params, outer, spec: SyncSpec, residual=None):
        outer, res = self._split(outer)
        params, outer, metrics, res = self.rule.flush(params, outer, self._spec(spec), res)
        return params, self._join(outer, res), metrics, None


__all__ = ["Compressed"]
