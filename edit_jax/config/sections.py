"""The config's sections: one dataclass per concern (the model, the mesh, the data, the inner
optimizer, the sync and its own sections: penalty, outer optimizer, wire, CO2, time, exchange; the
loop's), each field with its default and a comment saying what it does. ``parse.py`` reads them
from ``key=value`` overrides and JSON dicts; ``checks.py`` checks what the fields say on their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar


class ConfigError(ValueError):
    """A config is malformed: unknown key, wrong type or impossible value."""


@dataclass
class FamilyConfig:
    """What every model family's config holds: the fields the training machinery itself reads (the
    data's vocabulary check, the layer-wise sync's units, the step's dtype, the Hugging Face start).
    A family with fields of its own subclasses it and registers the class with the family
    (``models.family.register``); the ``model`` section then parses as that class, chosen by
    ``model.family``. ``STRUCTURAL``: the fields that shape the params (a checkpoint of another value
    cannot be restored)."""

    STRUCTURAL: ClassVar[tuple[str, ...]] = ("family", "vocab_size", "n_layers")

    family: str = "llama"  # a name in edit_jax.models.family.FAMILIES (the model's module)
    vocab_size: int = 320  # byte tokenizer (256 bytes + EOS) padded to a multiple of 64
    n_layers: int = 4  # the stacked blocks (the layer-wise sync's units: the root and each layer)
    compute_dtype: str = "float32"  # "bfloat16" on GPU; params are always float32
    # A Hugging Face Llama directory (config.json + *.safetensors) to start from: its architecture
    # replaces the llama family's sizes, its weights the random init, for every method (hf/load.py).
    init_from: str = ""


@dataclass
class ModelConfig(FamilyConfig):
    """The "llama" family's config (also ``LlamaConfig``): a Llama decoder's sizes and kernels."""

    STRUCTURAL: ClassVar[tuple[str, ...]] = (*FamilyConfig.STRUCTURAL, "d_model", "n_heads", "n_kv_heads", "ffn_dim",
                                             "tie_embeddings")

    d_model: int = 128  # the residual stream's width
    n_heads: int = 4  # query heads (head dim = d_model / n_heads, even for the rotary embedding)
    n_kv_heads: int = 4  # < n_heads gives grouped-query attention
    ffn_dim: int = 384  # the SwiGLU MLP's hidden width
    rope_theta: float = 10000.0  # the rotary embedding's base
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = False  # the output head is the embedding's transpose
    remat: bool = False  # recompute each layer in the backward pass (saves activation memory)
    # What a remat layer keeps beside its input: "nothing" (least memory), "dots" (the projections'
    # outputs: no matmul rerun), "dots_attention" (also cuDNN attention's output and statistics).
    remat_saves: str = "nothing"
    # Layers per iteration of the layer scan (lax.scan's unroll): 1 keeps one loop body; >= n_layers
    # unrolls the stack completely (no per-layer slicing/stacking copies; longer compiles).
    scan_unroll: int = 1
    init_std: float = 0.02  # the random init's standard deviation
    # Attention kernel for jax.nn.dot_product_attention: "xla" (any backend), "cudnn" (cuDNN flash
    # attention: GPU, bf16/fp16; never materialises the [seq, seq] scores), "auto" (cudnn where
    # it applies, else xla; CPU runs xla).
    attention: str = "auto"
    # Tokens per sequence chunk of the cross-entropy (0: the whole sequence at once). Each chunk's
    # fp32 logits are made, used and dropped (recomputed in the backward), so the step never
    # holds [batch, seq, vocab] fp32 logits: 16 x 4096 x 32000 of them are 8.4 GB per device.
    loss_chunk: int = 1024

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class MeshConfig:
    replica: int = 2  # N workers (replicas); sync groups span this axis
    shard: int = 4  # S devices per worker; FSDP shards span this axis
    placement: str = ""  # optional JSON file with a "device_order" list (from `edit-jax placement`)
    # Controller processes. 1: one SPMD program drives every replica. mesh.replica: one process
    # per worker (multi-controller JAX), each owning its replica's `shard` devices (multihost.py).
    processes: int = 1
    heartbeat_seconds: int = 10  # a lost process ends the others after about this long
    elastic: bool = False  # launcher restarts may drop a worker that fails again at once (docs/guides/restarts.md)
    # One all-gather (and in the backward one reduce-scatter) per unit, not per parameter (gather_unit):
    # pays on XLA:CPU (every collective a rendezvous of threads); GPU presets leave it to XLA's combiner.
    fused_gather: bool = True


@dataclass
class DataConfig:
    source: str = "stdlib"  # "stdlib" | "text" | "tokens" | "parquet"
    paths: tuple[str, ...] = ()  # files or globs for "text" / "tokens" / "parquet"
    text_column: str = "text"  # parquet column holding the documents
    tokenizer: str = "byte"  # "byte", or a path to a local tokenizer.json (needs `tokenizers`)
    token_dtype: str = "uint16"  # dtype of raw .bin token files
    seq_len: int = 128  # context length; sequences are packed to it
    val_fraction: float = 0.05  # fraction of documents (files) held out for validation
    seed: int = 0  # shuffling seed (separate from the model seed)
    allow_binary: bool = False  # "text": accept files that look binary (NUL bytes, mostly non-text bytes)
    # "parquet": background processes that read and tokenize row groups ahead of training (each
    # training process has its own); 0: one thread of the training process.
    workers: int = 1
    # "parquet": text bytes per unit (a row group, or a slice of one) a reader reads at a time.
    unit_bytes: int = 8 * 2**20


@dataclass
class OptimConfig:
    """Inner optimizer: clip by global norm -> AdamW, linear warmup then cosine decay."""

    lr: float = 3e-3
    warmup_steps: int = 20
    decay_steps: int = 0  # 0: decay over the whole run (`steps`)
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    # Micro-batches per step: each device's rows are split into grad_accum parts, whose gradients
    # are summed (one part's activations alive at a time) before the one optimizer update.
    grad_accum: int = 1


@dataclass
class WireConfig:
    """How the pseudo gradients cross ``replica`` (``sync.wire``): one ``codec.Codec`` is built from it."""

    kind: str = "none"  # "none" (float32) | "bf16" | "int8" | "topk2" | "topk4" (quantize.py, sparse.py)
    error_feedback: bool = False  # carry each worker's compression residual to its next sync
    decay: float = 1.0  # beta in (0, 1]: the residual enters the next sync as beta * e
    residual_dtype: str = "float32"  # the stored residual: float32 | bfloat16 (half the memory; math in float32)
    chunk: int = 4096  # topk*: values per chunk (<= 4096: 12-bit indices)
    k: int = 64  # topk*: values sent per chunk (a multiple of 4)


@dataclass
class PenaltyConfig:
    """EDiT's penalty of the pseudo gradients (``sync.penalty``; ``localsgd/outer.py``): methods
    without it (DiLoCo, CO2, ...) fix anomaly, weighting and clip off."""

    anomaly: bool = True  # anomaly elimination (EWMA z-test per worker and unit)
    anomaly_alpha: float = 0.02
    anomaly_warmup: int = 10  # K: syncs seen before the z-test applies; also the z-score window
    anomaly_threshold: float = 3.0  # delta
    weighting: bool = True  # softmax(-g / T) weights over workers
    temperature: float = 1.0
    clip: bool = True  # per-unit pseudo-gradient clipping
    clip_threshold: float = 10.0  # phi


@dataclass
class OuterConfig:
    """The outer optimizer θ̄ steps with on the averaged pseudo gradient (``sync.outer``)."""

    optimizer: str = "nesterov"  # "nesterov" (SGD + momentum) | "adam"
    lr: float = 0.8  # the outer step size on the averaged pseudo gradient
    momentum: float = 0.85  # SGD momentum, or Adam's b1
    nesterov: bool = True  # with optimizer=nesterov: false gives heavy-ball momentum
    b2: float = 0.95  # Adam's b2 (optimizer=adam)


@dataclass
class CO2Config:
    """CO2's own hyperparameters (``sync.co2``; the stale rule, ``localsgd/stale.py``, reads them)."""

    gap_penalty: float = 1.0  # Lambda: the staleness-gap penalty (a constant, as in the released code)
    momentum_clip: float = 0.0  # phi > 0 clamps the stored outer momentum to [-phi, phi] element-wise (0: off)


@dataclass
class TimeConfig:
    """A-EDiT's timing (method a_edit: one process per worker, or workers through an exchange): a
    sync is due ``tau`` seconds after the last, and workers that stepped at their own pace are
    weighted by their share of the steps."""

    tau: float = 600.0  # tau_time: seconds of local training between syncs
    min_total_steps: int = 1  # a due sync is put off until the workers took this many steps in all
    step_weight_ratio: float = 0.5  # rho: w <- (1 - rho) w + rho * (worker's share of the steps)


@dataclass
class ExchangeConfig:
    """Workers as separate programs meeting through storage (elastic/): A-EDiT by wall clock, or
    DiLoCo / EDiT / Post Local SGD posting every ``sync.tau`` steps. A round closes ``grace`` s
    after a post (clusters: ~60 s)."""

    url: str = ""  # a directory, file://PATH or s3://BUCKET/PREFIX[?endpoint=URL]; "": in-program syncs
    grace: float = 10.0  # s a round waits for the other posts after the first
    late_posts: str = "carry"  # a post that missed its round: "carry" (into the next post) | "drop"
    progress_every: float = 0.0  # s between saves of a worker's unposted steps (0: off)
    patience: float = 300.0  # s an operation retries through storage faults (backoff; 0: none), then exit 75
    carried_weight: float = 1.0  # w: a carried (stale) Δ re-based as θ̄ − w Δ, its steps at w in the step shares


@dataclass
class SyncConfig:
    """How replicas meet. ``method`` picks a row of the method table (``methods.py``), which may
    fix some of these fields; the run's ``config.json`` records them as they took effect. A rule
    from outside the library brings its own section, ``sync.NAME``, registered with its method
    (``localsgd.methods.register``)."""

    # a name in edit_jax.localsgd.methods.METHODS: baseline | post_local_sgd | diloco | edit | a_edit | co2
    method: str = "baseline"
    warmup_steps: int = 0  # W: synchronous (HSDP) steps before local training starts
    tau: int = 16  # sync interval in inner steps
    layerwise: bool = True  # sync unit by unit inside the forward (EDiT) vs whole model after the step
    outer_sharding: str = "shard"  # "shard" | "replica_shard" (also shard outer state over replica)
    cpu_offload: bool = False  # keep outer state in host memory
    per_unit_metrics: bool = False  # log per-unit pseudo-gradient norms at each sync
    fragments: int = 1  # F: units split into F contiguous groups, synced on staggered steps (streaming)
    penalty: PenaltyConfig = field(default_factory=PenaltyConfig)  # anomaly elimination, weighting, clipping
    outer: OuterConfig = field(default_factory=OuterConfig)  # θ̄'s optimizer (localsgd/outer.py)
    wire: WireConfig = field(default_factory=WireConfig)  # the form Δ crosses `replica` in (localsgd/codec.py)
    co2: CO2Config = field(default_factory=CO2Config)  # CO2's own (method co2 only)
    time: TimeConfig = field(default_factory=TimeConfig)  # A-EDiT's wall-clock syncs (localsgd/timed.py)
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)  # workers as separate programs (elastic/)
    # The sections of rules registered from outside the library (RULE_SECTIONS) that this config
    # sets, by name; each reads as ``sync.NAME`` like a field (on a command line, in config.json).
    rule_sections: dict = field(default_factory=dict, metadata={"registered": True})

    def __getattr__(self, name: str):
        # Reached only when no field has the name: a registered rule's section, its values as set,
        # else its defaults (reading it stores nothing, so the config compares as before).
        if name in RULE_SECTIONS:
            section = self.__dict__.get("rule_sections", {}).get(name)
            return RULE_SECTIONS[name]() if section is None else section
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclass
class DebugConfig:
    """Testing knobs; never for real runs."""

    # "WORKER:FACTOR[,WORKER:FACTOR]": that worker's steps take FACTOR x as long (it sleeps
    # (FACTOR - 1) x its measured step time after each step). Multi-process runs only.
    slowdown: str = ""
    pin_cores: bool = False  # each worker process runs on one CPU core of its own (worker i: core i mod cores)
    # "worker=W,steps=A-B": for inner steps A..B (0-based, both included; the step's training
    # record says step k + 1) worker W's rows of the global batch are uniform random token ids in
    # [0, model.vocab_size), fixed by (seed, step). For loss-spike tests (edit_jax/data/corrupt.py).
    corrupt: str = ""
    # "A-B:FACTOR": updates of steps on data batches A..B (0-based, inclusive; rollbacks' skips counted;
    # A-EDiT: each worker's own steps) x FACTOR: an injected loss spike (training/spike.py, docs/guides/restarts.md).
    lr_spike: str = ""


@dataclass
class SpikeConfig:
    """Loss-spike rollback (training/spike.py): the rule, its defaults and why are in docs/developer/restarts.md."""

    enabled: bool = True  # false: a finite spike is not noticed, a non-finite record exits 3 at once
    window: int = 64  # records of healthy training loss the running median and MAD are taken over
    mads: float = 8.0  # a spike is above the median by this many median absolute deviations ...
    margin: float = 0.2  # ... and by this fraction of the median (both must hold)
    patience: int = 3  # records a spike may last and still settle; the next one rolls back
    max_rollbacks: int = 3  # rollbacks in one invocation before the run exits 3


@dataclass
class LogConfig:
    """Where records go besides RUN_DIR/metrics.jsonl (absent from older configs: defaults apply)."""

    tensorboard: bool = False  # also as TensorBoard scalars in RUN_DIR/tb/ (needs tensorboardX)
    wandb: bool = False  # also to Weights & Biases (needs wandb; WANDB_MODE=offline works without an account)
    wandb_project: str = "edit-jax"
    # One device's peak TFLOP/s for the records' ``mfu``; 0: known A100 / H100 / H200 from the
    # device's kind (dense bf16), none on other devices (training/throughput.py).
    peak_tflops: float = 0.0


@dataclass
class TrainConfig:
    """How a run survives spikes and restarts (absent from older configs: defaults apply)."""

    spike: SpikeConfig = field(default_factory=SpikeConfig)

    # JAX's persistent compilation cache, so a restarted run loads its compiled programs instead of
    # compiling them again: "auto" ($EDIT_JAX_COMPILE_CACHE, else RUN_DIR/compile_cache), "off" or ""
    # (none), or a directory of your own (e.g. one shared by several run dirs).
    compile_cache: str = "auto"
    # Checkpoints written in the background (orbax async, one process only): a save returns once
    # the arrays are copied to host memory. Off by default: on CPU it was slower (docs/benchmarks/restarts.md).
    async_checkpoint: bool = False
    # Compile every program the run will use before step 1, side by side in threads (the steps of
    # each kind, the evaluation, the checkpoint's checks), so no step pays a compile (the first sync
    # would). $EDIT_JAX_COMPILE_AHEAD=0 turns it off too (the test suite: its short runs use few).
    compile_ahead: bool = True


@dataclass
class Config:
    model: FamilyConfig = field(default_factory=ModelConfig)  # the class model.family registered (Llama's)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    log: LogConfig = field(default_factory=LogConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    steps: int = 200
    max_seconds: float = 0.0  # > 0: also stop after this much training wall time (then evaluate and save as at the end)
    batch_size: int = 16  # global batch in sequences, split over replica x shard
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8
    checkpoint_every: int = 100  # 0: only at the end (and on SIGTERM / SIGINT)
    keep_checkpoints: int = 2

    @property
    def method(self) -> str:
        return self.sync.method


COMPRESS = ("none", "bf16", "int8", "topk2", "topk4")
LlamaConfig = ModelConfig
# model.family -> the class its ``model`` section parses as (``models.family.register`` adds a
# family's; a family registered without one reads Llama's fields, as every family did before).
MODEL_CONFIGS: dict[str, type] = {"llama": ModelConfig}


# sync.NAME -> the dataclass of a rule's own hyperparameters, for a rule from outside the library
# (``localsgd.methods.register`` adds it from the rule's ``owned_section`` / ``section_type``; the
# library's own rules' sections are SyncConfig's fields, as Llama's is the default model section).
RULE_SECTIONS: dict[str, type] = {}


def register_rule_section(name: str, cls: type) -> None:
    """``sync.<name>`` reads as the dataclass ``cls`` (its fields with their defaults)."""
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"rule section {name!r}: expected a dataclass of the rule's fields, got {cls!r}")
    if name in {f.name for f in dataclasses.fields(SyncConfig)}:
        raise ConfigError(f"rule section {name!r}: sync.{name} is already a field of SyncConfig")
    was = RULE_SECTIONS.get(name, cls)
    if (was.__module__, was.__qualname__) != (cls.__module__, cls.__qualname__):  # (a file run again: its class anew)
        raise ConfigError(f"rule section {name!r}: sync.{name} is already registered as "
                          f"{was.__module__}.{was.__qualname__}")
    RULE_SECTIONS[name] = cls


def model_config_class(family: str) -> type:
    """The class of the ``model`` section of a config whose ``model.family`` is ``family``."""
    return MODEL_CONFIGS.get(family, ModelConfig)


__all__ = ["Config", "FamilyConfig", "ModelConfig", "LlamaConfig", "MODEL_CONFIGS", "model_config_class", "MeshConfig",
           "DataConfig", "OptimConfig", "SyncConfig", "PenaltyConfig", "OuterConfig", "WireConfig", "CO2Config",
           "TimeConfig", "ExchangeConfig", "DebugConfig", "LogConfig", "TrainConfig", "SpikeConfig", "ConfigError",
           "COMPRESS", "RULE_SECTIONS", "register_rule_section"]
