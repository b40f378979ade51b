"""The speed figures of a training record: learning rate, tokens/s per device and MFU.

MFU (model FLOPs utilisation) = the model's training FLOPs per token (the model family's ``flops_per_token``, for Llama
6 x matmul params + attention scores, remat's recomputation not counted) x tokens/s, over the
devices' dense bf16 peak. The peak is ``log.peak_tflops`` when set, else read from the device's
kind in ``PEAK_BF16_TFLOPS``; on other devices (the CPU) records carry no ``mfu``.
"""

from __future__ import annotations

from functools import partial

from edit_jax.config import Config
from edit_jax.localsgd.optim import host_lr
from edit_jax.models.family import model_family

# Dense bf16 TFLOP/s of one device (vendor data sheets, without sparsity), by a substring of
# ``jax.Device.device_kind``; the first match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    ("H200", 989.0),
    ("A100", 312.0),
)


def device_peak_tflops(device_kind: str) -> float | None:
    """A device kind's dense bf16 peak (TFLOP/s) from ``PEAK_BF16_TFLOPS``, or None when unknown."""
    for name, tflops in PEAK_BF16_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops
    return None


def peak_tflops(cfg: Config, device_kind: str) -> float | None:
    """One device's peak (TFLOP/s) for MFU, or None when unknown (no ``mfu`` in the records)."""
    if cfg.log.peak_tflops > 0:
        return cfg.log.peak_tflops
    return device_peak_tflops(device_kind)


class StepFigures:
    """Adds ``lr``, ``tokens_per_s_per_device`` and (with a known peak) ``mfu`` to a training
    record of ``devices`` devices that ran at ``tokens_per_s``."""

    def __init__(self, cfg: Config, devices: int, device_kind: str):
        self.lr = partial(host_lr, cfg.optim, cfg.steps)  # on the host: no JAX op inside the loop
        self.devices = devices
        family = model_family(cfg.model.family)
        self.flops_per_token = family.flops_per_token(cfg.model, cfg.data.seq_len)
        causal = getattr(family, "causal_flops_per_token", None)  # (optional in the family contract)
        self.causal_flops_per_token = causal(cfg.model, cfg.data.seq_len) if causal is not None else None
        self.peak = peak_tflops(cfg, device_kind)

    def __call__(self, step: int, tokens_per_s: float) -> dict:
        # optax counts updates from 0: the update that made step k used the schedule at k - 1.
        fig = {"lr": float(self.lr(max(step - 1, 0))), "tokens_per_s_per_device": tokens_per_s / self.devices}
        if self.peak is not None:
            fig["mfu"] = self.flops_per_token * tokens_per_s / (self.peak * 1e12 * self.devices)
            if self.causal_flops_per_token is not None:
                fig["mfu_causal"] = self.causal_flops_per_token * tokens_per_s / (self.peak * 1e12 * self.devices)
        return fig


__all__ = ["PEAK_BF16_TFLOPS", "device_peak_tflops", "peak_tflops", "StepFigures"]
