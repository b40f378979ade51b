"""The README's main job: EDiT on the demo model (4 layers, d=128), 2 x 4 CPU-emulated mesh,
the Python stdlib corpus, 300 steps: synchronous warmup (20 steps), then local steps with a
layer-wise sync every 10 steps. About two minutes on 2 cores."""

from edit_jax.presets import cpu


def get_config():
    return cpu("edit")
