"""co2 on the demo model, 2 x 4 CPU-emulated mesh (compare methods at equal tokens)."""

from edit_jax.presets import cpu


def get_config():
    return cpu("co2")
