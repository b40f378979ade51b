"""The paper's post_local_sgd setting for the 1b Llama model on an 8 x 8 mesh (see edit_jax/presets.py)."""

from edit_jax.presets import paper


def get_config():
    return paper("1b", "post_local_sgd")
