"""XLA options the step programs are compiled with, per platform of the mesh's devices.

On GPUs: the latency-hiding scheduler (``xla_gpu_enable_latency_hiding_scheduler``), which
schedules async collectives against independent compute. Not set: the pipelined collectives
(``xla_gpu_enable_pipelined_all_gather`` and friends): on EDiT's sync step the all-gather
pipeliner moves the gather of the next layer, the sync's all-reduce before it included, into the
previous iteration and the program then all-reduces the same layer block more than once (issue 29).
A flag the user's ``XLA_FLAGS`` names is left to it (``--xla_gpu_enable_latency_hiding_scheduler=false``
turns the scheduler off). Elsewhere: nothing.
"""

from __future__ import annotations

import os

GPU_OVERLAP = {"xla_gpu_enable_latency_hiding_scheduler": True}


def compiler_options(platform: str, xla_flags: str | None = None) -> dict:
    """The options for a program on ``platform`` devices ("gpu", "cpu", ...), less the flags the
    user's ``XLA_FLAGS`` (``xla_flags``, default the environment's) sets itself."""
    if platform not in ("gpu", "cuda", "rocm"):
        return {}
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {k: v for k, v in GPU_OVERLAP.items() if f"--{k}" not in flags}


__all__ = ["GPU_OVERLAP", "compiler_options"]
