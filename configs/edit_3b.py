"""The paper's edit setting for the 3b Llama model on an 8 x 8 mesh (see edit_jax/presets.py)."""

from edit_jax.presets import paper


def get_config():
    return paper("3b", "edit")
