"""XLA options the step programs are compiled with, per platform of the mesh's devices.

On GPUs, what makes EDiT's sync overlap the layers' compute (docs/developer/gpu-program.md; measured in XLA:GPU's
compiled ``sync_forward`` for an H100, ``edit_jax/analysis/gpu_window.py``):

- the pipelined layer loop (llama ``_pipelined_layers``): iteration l syncs layer l+1, which
  depends on nothing layer l computes (with the plain loop the window is empty);
- ``xla_gpu_all_reduce_combine_threshold_bytes`` = a quarter of one layer's pseudo gradient per
  device (f32; ``SYNC_PIECES``): the layer's sync crosses ``replica`` in about four all-reduces.
  XLA:GPU's scheduler gives every async collective the same fixed latency and starts it only as
  far ahead of its done as that latency's worth of compute: one all-reduce per layer (a 1 GiB
  threshold) had one GEMM between start and done at 7B (22% of the layer's GEMM FLOPs, no
  attention) and three at 1B (79%, no attention); four pieces, issued one after another, spread
  over the layer: 100% of the GEMM FLOPs with the attention at 7B and at 1B (XLA's default
  threshold: 7B 83%, 1B unchanged at 79%). Per leaf (threshold 0: seven pieces) is worse (7B 78%,
  1B 21%: the small pieces go first and cover little). The bytes are the same (the same elements,
  cut differently). At 1B two of the four pieces have no compute under them (docs/benchmarks/gpu-program.md).
- ``xla_disable_hlo_passes=dynamic-slice-copy-fusion-async-wrapper``: that pass makes the layer
  loop's dynamic-update-slice copies (the scan writing each layer's sync results and saved
  residuals into their stacks) async pairs, which the scheduler costs at its fixed latency; to
  start them early it then issued the whole sync of the next layer before the layer's compute,
  with nothing between start and done. With the four pieces the window is the same without it
  (1B and 7B), but 1B's sync step then needs 67 MB more temporaries (8.69 against 8.63 GB).

Measured and left out: ``xla_gpu_enable_latency_hiding_scheduler`` (on by default in XLA:GPU:
the program is byte-identical without it); the SOL latency estimator told the link
(``xla_gpu_enable_analytical_sol_latency_estimator`` with ``nic_speed_gbps``: byte-identical
program, the estimator does not apply to these modules); the pipelined collectives
(``xla_gpu_enable_pipelined_all_gather`` and friends: on EDiT's sync step the all-gather pipeliner
moves the gather of the next layer, the sync's all-reduce before it included, into the previous
iteration and the program then all-reduces the same layer block more than once, docs/benchmarks/gpu-program.md). A flag
the user's ``XLA_FLAGS`` names is left to it (naming ``--xla_disable_hlo_passes`` replaces the
list). Elsewhere: nothing.
"""

from __future__ import annotations

import os

GPU_OVERLAP = {
    "xla_disable_hlo_passes": "dynamic-slice-copy-fusion-async-wrapper",
}
SYNC_PIECES = 4  # all-reduces per layer sync across replica (see above: 4 spread widest at 1B and 7B)
COMBINE = "xla_gpu_all_reduce_combine_threshold_bytes"


def combine_threshold(layer_sync_bytes: int) -> int:
    """The all-reduce combine threshold that cuts a layer's sync of ``layer_sync_bytes`` bytes per
    device into ``SYNC_PIECES`` all-reduces."""
    return max(1, -(-int(layer_sync_bytes) // SYNC_PIECES))


def compiler_options(platform: str, xla_flags: str | None = None, layer_sync_bytes: int | None = None) -> dict:
    """The options for a program on ``platform`` devices ("gpu", "cuda", "rocm", "cpu", ...) whose
    layer sync moves ``layer_sync_bytes`` per device (None: no combine threshold set), less the
    flags the user's ``XLA_FLAGS`` (``xla_flags``, default the environment's) sets itself."""
    if platform not in ("gpu", "cuda", "rocm"):
        return {}
    options = dict(GPU_OVERLAP)
    if layer_sync_bytes:
        options[COMBINE] = combine_threshold(layer_sync_bytes)
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {k: v for k, v in options.items() if f"--{k}" not in flags}


__all__ = ["GPU_OVERLAP", "SYNC_PIECES", "combine_threshold", "compiler_options"]
