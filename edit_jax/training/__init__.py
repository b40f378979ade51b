"""The training loop and its policies: ``train`` (the entry: signals, lock), ``loop`` (set up,
then one loop with hooks), ``hooks`` (evaluation, checkpoints, records, progress, stop checks on
a cadence), ``drivers`` (lock-step and A-EDiT stepping), ``resume``, ``evaluate``, ``throughput``."""
