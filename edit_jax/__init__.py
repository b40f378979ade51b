"""edit-jax: EDiT / A-EDiT Local-SGD training of Llama-style models on a (replica, shard) mesh."""

__version__ = "0.1.0"
