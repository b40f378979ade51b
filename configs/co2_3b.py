"""The paper's setup with CO2 (one-round-stale outer momentum; CO2.md) for the 3b Llama model on an
8 x 8 mesh (see edit_jax/presets.py)."""

from edit_jax.presets import paper


def get_config():
    return paper("3b", "co2")
