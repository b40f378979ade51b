"""Preset configs: the paper's settings at each model size, and small CPU ones for every method.

Paper (EDIT.md, "The paper's setup"): context 4096, global batch 1024 sequences, 100k steps, cosine
decay, tau = 128, phi = 10, inner lr 1.5e-4 (Baseline lr 3e-4), outer lr 0.8, outer momentum 0.85,
8 x 8 mesh, FineWeb-Edu with the Llama tokenizer, read as the token shards that
``edit-jax tokenize data/fineweb-edu/*.parquet --tokenizer tokenizer.json --out
data/fineweb-edu-tokens`` writes (docs/guides/data.md). Our choices where the paper is silent:
2000 synchronous warmup steps W (2% of the run) and 2000 lr warmup steps; bf16 compute and
rematerialised layers for GPU memory.
"""

from __future__ import annotations

from edit_jax.config import CO2Config, Config, DataConfig, MeshConfig, OptimConfig, OuterConfig, PenaltyConfig, \
    SyncConfig, with_fields
from edit_jax.localsgd.methods import sync_fields_for
from edit_jax.models.llama import preset

PAPER_SIZES = ("350m", "1b", "3b", "7b")


def sync_for(method: str, **kw) -> SyncConfig:
    """The sync settings of a method: ``kw``, then what the method table fixes (methods.py)."""
    return with_fields(SyncConfig(**{**kw, "method": method}), sync_fields_for(method))


# CO2's outer settings where the EDiT paper does not give them (CO2.md section 3): the fairseq
# default beta 0.5 for up to 64 GPUs, alpha 1.0, Lambda 1 (the released constant), and the GPT-2
# script's momentum clip phi = 1.0.
PAPER_OUTER = {"co2": dict(outer=OuterConfig(lr=1.0, momentum=0.5), co2=CO2Config(momentum_clip=1.0))}


def paper(size: str, method: str = "edit") -> Config:
    if size not in PAPER_SIZES:
        raise ValueError(f"unknown paper size {size!r}; known: {', '.join(PAPER_SIZES)}")
    steps = 100_000
    return Config(
        model=preset(size, compute_dtype="bfloat16", remat=True),
        mesh=MeshConfig(replica=8, shard=8, fused_gather=False),  # GPU: XLA combines the per-leaf gathers itself
        data=DataConfig(source="tokens", paths=("data/fineweb-edu-tokens",), tokenizer="tokenizer.json",
                        seq_len=4096),
        optim=OptimConfig(lr=3e-4 if method == "baseline" else 1.5e-4, warmup_steps=2000, min_lr_ratio=0.1,
                          weight_decay=0.1, grad_clip=1.0),
        sync=sync_for(method, **{**dict(warmup_steps=2000, tau=128, outer=OuterConfig(lr=0.8, momentum=0.85),
                                        penalty=PenaltyConfig(clip_threshold=10.0, anomaly_alpha=0.02,
                                                              anomaly_warmup=120, anomaly_threshold=3.0,
                                                              temperature=1.0)),
                                 **PAPER_OUTER.get(method, {})}),
        steps=steps, batch_size=1024, seed=0, log_every=10, eval_every=1000, eval_batches=16,
        checkpoint_every=1000, keep_checkpoints=3,
    )


def cpu(method: str = "edit", steps: int = 300) -> Config:
    """The demo model on a 2 x 4 CPU-emulated mesh and the stdlib corpus: minutes per method.

    Outer lr 0.5 / momentum 0.5: the best setting of `benchmarks/compare_methods.py`'s sweep for each of
    DiLoCo, EDiT and CO2 (grid lr {0.5, 1.0} x momentum {0.5, 0.85}; docs/benchmarks/methods.md). The
    paper's 0.8 / 0.85 is tuned for 100k-step runs; over a few hundred steps it overshoots."""
    return Config(
        model=preset("demo"),
        mesh=MeshConfig(replica=2, shard=4),
        data=DataConfig(seq_len=128),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        sync=sync_for(method, warmup_steps=20, tau=10, outer=OuterConfig(lr=0.5, momentum=0.5),
                      penalty=PenaltyConfig(anomaly_warmup=3, clip_threshold=10.0)),
        steps=steps, batch_size=16, log_every=10, eval_every=50, eval_batches=8, checkpoint_every=100,
    )
