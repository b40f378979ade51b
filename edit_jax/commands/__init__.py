"""The ``edit-jax`` subcommands around training, one module each: ``plan`` (does a config fit its
devices), ``plot`` (loss curves and sync statistics of run dirs), ``sample`` (text from a
checkpoint), ``placement`` (the placement scheduler's search). ``train`` is the loop's
(``edit_jax/cli.py``); ``worker`` the exchange's (``elastic/command.py``)."""
