"""What a run leaves on disk: ``checkpoint`` (orbax I/O, rotation), ``integrity`` (checksums),
``runlock``, ``records`` (metrics.jsonl, the one sink), ``tensorboard``, ``wandb_log`` and
``trained`` (a finished run read back for sampling and export)."""
