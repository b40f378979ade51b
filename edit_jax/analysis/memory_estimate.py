"""An analytic estimate of one step's peak GPU memory per device beyond the state (``plan``'s
``gpu_estimate``), derived from the config's shapes alone, term by term from XLA:GPU's buffer
assignment of the paper presets (docs/developer/gpu-program.md, docs/benchmarks/gpu-program.md).

With remat, a step's memory peaks at one of two moments, both while every layer's saved input is
still alive (the backward has not freed any yet):

- **loss**: the backward of the chunked cross-entropy, before any layer's backward: three fp32
  logit-sized buffers of one chunk (the recomputed logits, their gradient, and the first chunk's
  gradient, whose product with the head XLA schedules after the layers' backward), beside the
  last layer's forward recomputation, which XLA runs alongside;
- **layer**: the backward of the last layer (the first of the backward loop): the layer's
  recomputed activations and their gradients, the attention's scores when not fused, and the
  layers' fp32 gradient accumulators, now allocated.

The estimate is the larger of the two. Names (per device; c bytes per compute value, b rows per
micro-batch, T = seq_len, d, f = ffn_dim, L layers, h heads, V vocab, S = mesh.shard):

    A  = b T d c            one d-wide activation of one layer
    F  = b T f c            one MLP intermediate
    Lg = b C V 4            one chunk's fp32 logits (C = model.loss_chunk, or T)
    P  = 4 L p / S          the layers' fp32 params shard (p: one layer's param count)
    H  = V d c              the LM head (or the tied embedding), gathered, in the compute dtype

    saved      = L A (remat: each layer's input); without remat every layer's intermediates,
                 L (b T (10 d + 3 f) c + scores); ``model.remat_saves`` adds the projections'
                 outputs, L b T (h hd + 2 kv hd + 2 f + d) c for "dots" (q, k, v, gate, up and
                 one d-wide: 5% above the 20.35 GiB XLA:GPU gave at 1B batch 8,
                 docs/benchmarks/gpu.md), and L (b T h hd c + b h T 4) more for "dots_attention" (cuDNN's output
                 and softmax statistics)
    scores     = b h T^2 (2 x 4 + 2 c) without a fused attention kernel: the fp32 scores and
                 their gradient, the probabilities and their gradient in the compute dtype (the
                 four [b, h, T, T] buffers of XLA:GPU's softmax attention backward); 0 with cuDNN's
    common     = saved + P (XLA's fp32 relayout copies of the layer params feeding the loop) + A
                 (the final hidden states, in chunks) + 2 H (the gathered head, and its copy for
                 the loss's backward) [+ P_all, fp32, with grad_accum > 1: the running sum]
    loss       = common + 3 Lg + k A
    layer      = common + P (the gradient accumulators) + 4 F + k A + scores + 2 p c (two layers'
                 gathered params) + Lg (local steps: the first chunk's gradient, still waiting)
                 + synced (sync steps: the synced units' shards kept for the backward in the
                 compute dtype, ``HOOK_SAVED``)

k, the d-wide activations of the recomputed last layer alive at either peak: 8 in a local or
hsdp step (its input, normed input, q, k and v after the GQA repeat, the attention output and the
MLP's normed input and input), 4 in a sync step, whose schedule XLA orders differently: it runs
the last layer's recomputation after the loss backward rather than beside it, and takes the
first chunk's logit gradient through the head before the layers' backward (both read from the
buffer assignments of the 350M / 1B / 7B presets' steps; the schedule is XLA's choice, which is
why this is an estimate).

What it leaves out: XLA's small buffers (under 1% at the paper sizes), fragmentation (none in
the assignments read), the cuDNN workspace, and the allocator's own reserve (keep ~10% free).
"""

from __future__ import annotations

GIB = 1024 ** 3
RECOMPUTED_ACTIVATIONS = {"local": 8, "sync": 4}  # k above


def layer_param_count(m) -> int:
    """One decoder layer's params: q, k, v, o projections, the SwiGLU MLP, two norms."""
    return m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.ffn_dim + 2 * m.d_model


def compute_bytes(m) -> int:
    """Bytes per value of the model's compute dtype."""
    return 2 if m.compute_dtype in ("bfloat16", "float16") else 4


def fused_attention(m) -> bool:
    """Whether the GPU step runs cuDNN's fused attention (``model.attention`` auto picks it there)."""
    return m.attention in ("auto", "cudnn") and m.compute_dtype in ("bfloat16", "float16") \
        and m.head_dim <= 128 and m.head_dim % 8 == 0


def gpu_estimate(cfg, params_device_bytes: float, kind: str = "local", synced_bytes: float | None = None) -> dict:
    """The estimate for a step of ``kind`` (a sync step when it starts with "sync_forward"; other
    kinds sync after the backward, if at all, when activations are gone). ``params_device_bytes``:
    the fp32 params shard per device (all of it, root included); ``synced_bytes``: a sync step's
    kept shards, default the whole model's in the compute dtype (a fragment syncs fewer)."""
    m = cfg.model
    n_dev = cfg.mesh.replica * cfg.mesh.shard
    b = cfg.batch_size // n_dev // cfg.optim.grad_accum
    t, d, f, L, h, v = cfg.data.seq_len, m.d_model, m.ffn_dim, m.n_layers, m.n_heads, m.vocab_size
    c = compute_bytes(m)
    sync_step = str(kind).startswith("sync_forward")
    k = RECOMPUTED_ACTIVATIONS["sync" if sync_step else "local"]
    fused = fused_attention(m)
    act, mlp = b * t * d * c, b * t * f * c
    chunk = m.loss_chunk if 0 < m.loss_chunk < t else t
    logits = b * chunk * v * 4
    p = layer_param_count(m)
    layer_params = 4 * L * p / cfg.mesh.shard
    head = v * d * c
    scores = 0.0 if fused else b * h * t * t * (2 * 4 + 2 * c)
    saved = L * act if m.remat else L * (b * t * (10 * d + 3 * f) * c + scores)
    if m.remat and m.remat_saves != "nothing":
        hd = m.head_dim
        saved += L * b * t * (h * hd + 2 * m.n_kv_heads * hd + 2 * f + d) * c
        if m.remat_saves == "dots_attention" and fused:
            saved += L * (b * t * h * hd * c + b * h * t * 4)
    if synced_bytes is None:
        synced_bytes = params_device_bytes * c / 4
    common = {"saved_activations": saved, "layer_param_copies": layer_params, "final_hidden": act,
              "head": 2 * head, "grad_accumulation": params_device_bytes if cfg.optim.grad_accum > 1 else 0.0}
    loss = {"loss_logits": 3 * logits, "recomputed_layer": k * act}
    layer = {"gradients": layer_params, "layer_working_set": 4 * mlp + k * act, "attention_scores": scores,
             "param_gathers": 2 * p * c, "waiting_logit_gradient": 0.0 if sync_step else logits,
             "synced_shards": synced_bytes if sync_step else 0.0}
    base = sum(common.values())
    phases = {"loss": base + sum(loss.values()), "layer": base + sum(layer.values())}
    peak = max(phases, key=phases.get)
    return {"kind": str(kind), "parts": {**common, **(loss if peak == "loss" else layer)}, "phases": phases,
            "peak_phase": peak, "total_bytes": phases[peak], "rows_per_micro_batch": b, "fused_attention": fused}


__all__ = ["gpu_estimate", "layer_param_count", "compute_bytes", "fused_attention", "RECOMPUTED_ACTIVATIONS"]
