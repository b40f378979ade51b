"""The compressed variant of any sync rule (``Compressed(rule)``; ``sync.wire.kind``,
``sync.wire.error_feedback``): the pseudo gradients cross ``replica`` as bf16 or int8 (``quantize.py``)
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


# The residual's stored dtype (sync.wire.residual_dtype). bfloat16 halves error feedback's memory (at 7B a
# float32 residual is one more fp32 copy of a worker's params per device: +6.2% of the H100 peak,
# docs/benchmarks/sparse.md); the sync reads it into float32 and rounds the new residual once on store.
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
        """The ``sync.wire`` section (whatever the method)."""
        w, ef = s.wire, "sync.wire.error_feedback"
        require(not w.error_feedback or w.kind != "none", ef,
                "needs a lossy sync.wire.kind (bf16, int8, topk2, topk4); with kind none there is no residual")
        require(0.0 < w.decay <= 1.0, "sync.wire.decay", f"must be in (0, 1], got {w.decay}")
        require(w.decay == 1.0 or w.error_feedback, "sync.wire.decay", f"decays the residual: needs {ef}=true")
        require(w.residual_dtype in EF_DTYPES, "sync.wire.residual_dtype",
                f"must be one of {', '.join(EF_DTYPES)}, got {w.residual_dtype!r}")
        require(w.residual_dtype == "float32" or w.error_feedback, "sync.wire.residual_dtype",
                f"stores the residual: needs {ef}=true")
        require(w.residual_dtype == "float32" or not s.exchange.url, "sync.wire.residual_dtype",
                "bfloat16 halves the device-resident residual of the in-program sync; exchange workers "
                "(sync.exchange.url) "
                "keep theirs in host memory as float32, bit for bit the in-program float32 sync: leave it float32")
        require(w.kind not in BITS or w.error_feedback, ef,
                f"sync.wire.kind={w.kind} sends {w.k} of every {w.chunk} values: without the "
                f"residual the rest is lost for good; set {ef}=true")
        require(0 < w.chunk <= CHUNK, "sync.wire.chunk", f"must be in [1, {CHUNK}] (12-bit indices), got {w.chunk}")
        require(0 < w.k <= w.chunk and w.k % 4 == 0, "sync.wire.k",
                f"must be a positive multiple of 4 (whole bytes of 2-bit codes and 12-bit index pairs) "
                f"<= sync.wire.chunk={w.chunk}, got {w.k}")

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
        # residuals are per worker: every worker starts at 0
        return {**(inner or {}), "residual": worker_zeros(extra["residual"], n)}

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
