"""Sampling from a trained model: ``edit-jax sample``.

    edit-jax sample --run-dir runs/demo --prompt "def " --max-tokens 200 --temperature 0.8 --top-k 40 --top-p 0.95

The params (θ̄, see trained.py) go to one device (the default one; no mesh). Generation uses a KV
cache (decode.py; another model family than Llama: its token window, run through the family's own
forward at every step, which gives the same tokens as a cache for a causal model) under ``jax.jit``:
one compiled prefill over a fixed-length window and one compiled single-token decode step, each
choosing the next token on the device (temperature, top-k, top-p, a key derived from the seed and
the token's index, so a seed gives the same text).

The prompt is read as the start of a document: an EOS token goes first, as in the packed training
stream, and generation stops at the next EOS (the end of that document) or after max_tokens.
The context is the training ``data.seq_len`` (W): when the cache is full, generation continues
from the last W/2 tokens (re-prefilled at positions 0.., as the model saw windows in training).
Ids past the tokenizer's vocabulary (the padding up to ``model.vocab_size``) are never sampled.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from edit_jax.config import FamilyConfig
from edit_jax.models import decode
from edit_jax.models.family import identity_hook, model_family
from edit_jax.rundir.trained import TrainedModelError, load_tokenizer, load_trained
from edit_jax.exit_codes import EXIT_BAD_INPUT


def choose(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, vocab_limit: int,
           top_p: float = 1.0) -> jax.Array:
    """Next token ids [batch] from logits [batch, vocab]: greedy at temperature 0, else a draw
    from softmax(logits / temperature) over the top_k largest (top_k 0: all), then over the
    smallest set of the most likely whose probability (after temperature and top-k) reaches
    top_p (nucleus sampling; 1: all). The most likely token is always kept; a token tied with
    the set's least likely one is kept too."""
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k and top_k < vocab_limit:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    logits = logits / temperature
    if top_p < 1.0:
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]
        before = jnp.cumsum(jax.nn.softmax(ranked, axis=-1), axis=-1) - jax.nn.softmax(ranked, axis=-1)
        kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: `before` is 0 for the first
        last = jnp.take_along_axis(ranked, kept - 1, axis=-1)
        logits = jnp.where(logits < last, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class WindowDecoder:
    """``decode``'s two calls for a family without a KV cache: the "cache" is the token window
    [batch, context]; a call writes its tokens at ``pos`` and runs the family's whole forward over
    the window (causal: the empty slots after ``pos`` change no logit before them)."""

    def __init__(self, family: str):
        self.model = model_family(family)

    @staticmethod
    def init_cache(cfg, batch: int, length: int) -> jax.Array:
        del cfg
        return jnp.zeros((batch, length), jnp.int32)

    def forward_cached(self, cfg, params, tokens: jax.Array, window: jax.Array, pos) -> tuple[jax.Array, jax.Array]:
        window = jax.lax.dynamic_update_slice_in_dim(window, tokens.astype(jnp.int32), pos, axis=1)
        logits, _ = self.model.forward(cfg, params, window, identity_hook)
        return jax.lax.dynamic_slice_in_dim(logits, pos, tokens.shape[1], axis=1), window


@dataclass
class Generation:
    tokens: np.ndarray  # [batch, n] generated ids (with stop_at_eos: EOS-padded after each row's first EOS)
    lengths: np.ndarray  # [batch] tokens generated per row (its EOS included)
    prefill_s: float  # the first prefill (compiled on first use)
    decode_s: float  # everything after it
    steps: int  # decode steps and re-prefills run after the first prefill


class Sampler:
    """Compiled prefill and decode step for one model on one device."""

    def __init__(self, cfg: FamilyConfig, params, context: int, eos_id: int, vocab_limit: int, device=None):
        self.cfg, self.context, self.eos_id, self.vocab_limit = cfg, int(context), int(eos_id), int(vocab_limit)
        self.decoder = decode if cfg.family == "llama" else WindowDecoder(cfg.family)
        if self.context < 2:
            raise ValueError(f"context must be >= 2, got {context}")
        self.device = device or jax.devices()[0]
        self.params = jax.device_put(params, self.device)
        # Compiled once per sampler (and per temperature / top_k / top_p, which are static).
        self._prefill = jax.jit(self._prefill_fn, static_argnums=(5, 6, 7))
        self._decode = jax.jit(self._decode_fn, static_argnums=(6, 7, 8), donate_argnums=(1,))

    def _prefill_fn(self, params, window, n, key, t, temperature, top_k, top_p):
        """window [batch, context] (tokens in the first n slots) -> (next ids, cache); the draw
        for generated token t uses fold_in(key, t)."""
        cache = self.decoder.init_cache(self.cfg, window.shape[0], self.context)
        logits, cache = self.decoder.forward_cached(self.cfg, params, window, cache, 0)
        last = jax.lax.dynamic_index_in_dim(logits, n - 1, axis=1, keepdims=False)
        return choose(last, jax.random.fold_in(key, t), temperature, top_k, self.vocab_limit, top_p), cache

    def _decode_fn(self, params, cache, tokens, pos, key, t, temperature, top_k, top_p):
        """One token per row at position pos -> (next ids, cache)."""
        logits, cache = self.decoder.forward_cached(self.cfg, params, tokens[:, None], cache, pos)
        return choose(logits[:, 0], jax.random.fold_in(key, t), temperature, top_k, self.vocab_limit, top_p), cache

    def generate(self, prompt: np.ndarray, max_tokens: int, *, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 1.0, seed: int = 0, num_samples: int = 1, stop_at_eos: bool = True) -> Generation:
        """Continues ``prompt`` (1-D ids, EOS not added here) ``num_samples`` times."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        temperature, top_k, top_p = float(temperature), int(top_k), float(top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        base = jax.random.key(seed)
        seq = np.tile(np.asarray(prompt, np.int32)[None, :], (num_samples, 1))
        if seq.shape[1] < 1:
            raise ValueError("the prompt needs at least one token (e.g. EOS)")
        w = self.context

        def prefill(keep: int, t: int):
            window = np.zeros((num_samples, w), np.int32)
            window[:, :keep] = seq[:, seq.shape[1] - keep:]
            return self._prefill(self.params, jax.device_put(window, self.device), keep, base, t,
                                 temperature, top_k, top_p)

        t0 = time.perf_counter()
        pos = min(seq.shape[1], w)  # a prompt longer than the context keeps its last w tokens
        tok, cache = prefill(pos, 0)
        tok.block_until_ready()
        t1 = time.perf_counter()
        out, done, steps = [], np.zeros(num_samples, bool), 0
        lengths = np.zeros(num_samples, np.int64)
        for t in range(max_tokens):
            host = np.asarray(tok)
            out.append(np.where(done, self.eos_id, host) if stop_at_eos else host)
            lengths += ~done
            done |= host == self.eos_id
            seq = np.concatenate([seq, host[:, None]], axis=1)
            if t == max_tokens - 1 or (stop_at_eos and done.all()):
                break
            steps += 1
            if pos == w:  # the cache is full: continue from the last w/2 tokens
                pos = w // 2
                tok, cache = prefill(pos, t + 1)
            else:
                tok, cache = self._decode(self.params, cache, tok, pos, base, t + 1, temperature, top_k, top_p)
                pos += 1
        t2 = time.perf_counter()
        tokens = np.stack(out, axis=1)
        if not stop_at_eos:
            lengths[:] = tokens.shape[1]
        return Generation(tokens, lengths, t1 - t0, t2 - t1, steps)


def flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the sampling flags, or None. A NaN or infinite temperature passes a
    ``< 0`` test but turns every logit into NaN (or the draw uniform): refused like a negative one."""
    for name, val, low in [("--max-tokens", args.max_tokens, 1), ("--num-samples", args.num_samples, 1),
                           ("--top-k", args.top_k, 0)]:
        if val < low:
            return f"{name} must be >= {low}, got {val}"
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}"
    if not 0.0 < args.top_p <= 1.0:  # (False for NaN too)
        return f"--top-p must be in (0, 1] (1: all tokens), got {args.top_p}"
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edit-jax sample", description="Generate text from a trained run.")
    parser.add_argument("--run-dir", required=True, help="the run dir of `edit-jax train`")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--prompt", default="", help="text to continue (default: empty, a new document)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k most likely (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens whose probability reaches p (1: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json to use instead of the run's data.tokenizer")
    parser.add_argument("--no-eos-stop", action="store_true", help="do not stop at the end-of-document token")
    args = parser.parse_args(argv)

    problem = flag_problem(args)  # before reading anything
    if problem:
        print(f"edit-jax: sample error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        model = load_trained(args.run_dir, args.step)
        tok = load_tokenizer(model.cfg, args.tokenizer, model.run_dir)
    except TrainedModelError as e:
        print(f"edit-jax: sample error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sampler = Sampler(model.cfg.model, model.params, model.cfg.data.seq_len, tok.eos_id, tok.vocab_size)
    prompt = np.concatenate([[tok.eos_id], tok.encode(args.prompt)]).astype(np.int32)
    gen = sampler.generate(prompt, args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, num_samples=args.num_samples,
                           stop_at_eos=not args.no_eos_stop)
    what = "θ̄ (outer params)" if model.source == "outer" else "the replicas' params"
    print(f"edit-jax: {model.checkpoint}: {what}, {model.cfg.sync.method}, step {model.step}; "
          f"device {sampler.device.platform}", file=sys.stderr)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i}")
        ids = gen.tokens[i, : gen.lengths[i]]
        print(args.prompt + tok.decode(ids), flush=True)
    new = int(gen.lengths.sum())
    rate = f"{gen.steps * args.num_samples / gen.decode_s:.0f} tokens/s" if gen.steps and gen.decode_s > 0 else "n/a"
    print(f"edit-jax: {new} tokens; prefill {gen.prefill_s * 1e3:.0f} ms (with compile), decode {rate} "
          f"(with the decode step's compile)", file=sys.stderr)
    return 0


__all__ = ["Sampler", "Generation", "choose", "main"]
