"""The README's main job: EDiT on the demo model, 2 x 4 CPU-emulated mesh, the stdlib corpus.

Synchronous warmup, then local steps with a layer-wise sync every tau steps. A few minutes on 2 cores.
"""

from edit_jax.config import Config, DataConfig, MeshConfig, OptimConfig, SyncConfig
from edit_jax.model import preset


def get_config() -> Config:
    return Config(
        model=preset("demo"),
        mesh=MeshConfig(replica=2, shard=4),
        data=DataConfig(seq_len=128),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        sync=SyncConfig(method="edit", warmup_steps=20, tau=10, outer_lr=0.8, outer_momentum=0.85,
                        anomaly_warmup=3, clip_threshold=10.0),
        steps=300, batch_size=16, log_every=10, eval_every=50, eval_batches=8, checkpoint_every=100,
    )
