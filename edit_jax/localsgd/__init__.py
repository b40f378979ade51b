"""The algorithm: EDiT's Local SGD and the paper's baselines as one compiled machinery.

``methods`` (the method table, plans, schedules), ``sync`` (the syncs as pure functions),
``outer`` (one unit's penalty and outer step), ``codec`` (the wire as one value), ``compress``
(quantized exchange), ``fragments`` (streaming groups), ``state`` (the train state and its
layout), ``sharding`` (specs, FSDP hook), ``optim`` (the inner optimizer) and ``programs`` (the
compiled step programs). Imports nothing from training, runtime, rundir, hf or tools.
"""
