"""Tiny model on a 2 x 4 CPU-emulated mesh: tests and smoke runs, well under a minute."""

from edit_jax.config import Config, DataConfig, MeshConfig, OptimConfig, PenaltyConfig, SyncConfig
from edit_jax.models.llama import preset


def get_config() -> Config:
    return Config(
        model=preset("tiny"),
        mesh=MeshConfig(replica=2, shard=4),
        data=DataConfig(seq_len=64),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
        sync=SyncConfig(method="baseline", warmup_steps=4, tau=4, penalty=PenaltyConfig(anomaly_warmup=3)),
        steps=30, batch_size=16, log_every=5, eval_every=0, eval_batches=2, checkpoint_every=0,
    )
