"""``python -m edit_jax``: the command line (``cli.py``)."""

from edit_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
