"""XLA options the step programs are compiled with, per platform of the mesh's devices.

On GPUs, what makes EDiT's sync overlap the layers' compute (BUILD_NOTES section 14, "Overlap"):

- ``xla_gpu_enable_latency_hiding_scheduler``: the scheduler that places async collectives
  against independent compute.
- ``xla_disable_hlo_passes=dynamic-slice-copy-fusion-async-wrapper``: that pass makes the layer
  loop's dynamic-update-slice copies (the scan writing each layer's sync results and saved
  residuals into their stacks) async pairs, which the scheduler costs at its fixed 5000-unit
  latency; to start them early it then issues the whole sync of the next layer, its all-reduce
  across ``replica`` included, before the layer's compute, with nothing between start and done.
- ``xla_gpu_all_reduce_combine_threshold_bytes`` = 1 GiB: a layer's pseudo gradient crosses
  ``replica`` as one all-reduce (the default threshold cut a 7B layer's into four, and with one
  collective in flight at a time the layer's few GEMMs did not cover all four).

Not set: the pipelined collectives (``xla_gpu_enable_pipelined_all_gather`` and friends): on
EDiT's sync step the all-gather pipeliner moves the gather of the next layer, the sync's
all-reduce before it included, into the previous iteration and the program then all-reduces the
same layer block more than once (issue 29). A flag the user's ``XLA_FLAGS`` names is left to it
(``--xla_gpu_enable_latency_hiding_scheduler=false`` turns the scheduler off; naming
``--xla_disable_hlo_passes`` replaces the list). Elsewhere: nothing.
"""

from __future__ import annotations

import os

GPU_OVERLAP = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_disable_hlo_passes": "dynamic-slice-copy-fusion-async-wrapper",
    "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30,
}


def compiler_options(platform: str, xla_flags: str | None = None) -> dict:
    """The options for a program on ``platform`` devices ("gpu", "cpu", ...), less the flags the
    user's ``XLA_FLAGS`` (``xla_flags``, default the environment's) sets itself."""
    if platform not in ("gpu", "cuda", "rocm"):
        return {}
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {k: v for k, v in GPU_OVERLAP.items() if f"--{k}" not in flags}


__all__ = ["GPU_OVERLAP", "compiler_options"]
