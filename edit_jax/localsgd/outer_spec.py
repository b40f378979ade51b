"""The static facts of a sync's outer step: the outer optimizer (``OuterSpec``) and EDiT's penalty
(``Penalty``). Plain values without JAX: the method table (``methods.py``) builds them from the
config, every rule's sync and the exchange's round read them (``outer.py`` builds the machinery)."""

from __future__ import annotations

from dataclasses import dataclass

from edit_jax.config import SyncConfig

OUTER_OPTIMIZERS = ("nesterov", "adam")


@dataclass(frozen=True)
class OuterSpec:
    """The outer optimizer (outer.make_outer_optimizer builds it)."""

    name: str = "nesterov"  # "nesterov": SGD with momentum (Nesterov iff `nesterov`); "adam"
    lr: float = 0.8
    momentum: float = 0.85  # SGD momentum, or Adam's b1
    nesterov: bool = True
    b2: float = 0.95  # Adam only
    momentum_clip: float = 0.0  # > 0 (CO2): the stored momentum is clamped to [-phi, phi] element-wise


@dataclass(frozen=True)
class Penalty:
    """Which parts of the pseudo-gradient penalty are on, and their constants (static; outer.py
    applies them)."""

    anomaly: bool = True
    alpha: float = 0.02
    warmup: int = 10  # K
    threshold: float = 3.0  # delta
    weighting: bool = True
    temperature: float = 1.0
    clip: bool = True
    clip_threshold: float = 10.0  # phi
    step_weight_ratio: float = 0.0  # rho (A-EDiT): mixes each worker's share of the steps into its weight

    @staticmethod
    def off() -> "Penalty":
        return Penalty(anomaly=False, weighting=False, clip=False)

    @staticmethod
    def from_config(s: SyncConfig) -> "Penalty":
        p = s.penalty
        return Penalty(p.anomaly, p.anomaly_alpha, p.anomaly_warmup, p.anomaly_threshold, p.weighting,
                       p.temperature, p.clip, p.clip_threshold, s.time.step_weight_ratio)


__all__ = ["OuterSpec", "Penalty", "OUTER_OPTIMIZERS"]
