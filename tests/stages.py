"""CI runs the suite twice (.ci/run): under the default Python (jax as pinned there), then under
Python 3.12 (the newest jax). The costliest multi-process scenarios come in pairs of the same kind
(two ways a worker is lost, two orders of one Ctrl-C, two methods' 2-process equivalence, ...):
each stage runs one of each pair, so both stages still run that kind of scenario under their own
jax, every scenario runs once per CI run, and each stage pays about half. ``one_stage`` skips a
test outside its stage, saying where it runs; ``EDIT_JAX_BOTH_STAGES=1`` (or the benches' older
``EDIT_JAX_ALL_SMOKES=1``) runs every one of them under any Python."""

import os
import sys

import pytest

STAGES = ("default", "3.12")


def runs_here(stage: str) -> bool:
    """Whether a test of ``stage`` ("default": not Python 3.12; "3.12") runs in this process."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
    if os.environ.get("EDIT_JAX_BOTH_STAGES") == "1" or os.environ.get("EDIT_JAX_ALL_SMOKES") == "1":
        return True
    return (stage == "3.12") == (sys.version_info[:2] == (3, 12))


def one_stage(stage: str, what: str, cpu_s: float, other: str = "") -> None:
    """Skips the calling test unless this is ``stage``'s Python; ``other`` names its pair's test,
    which runs in the other stage."""
    if runs_here(stage):
        return
    where = "Python 3.12" if stage == "3.12" else "the default Python (not 3.12)"
    pair = f"; its pair, {other}, runs here" if other else ""
    pytest.skip(f"{what} (~{cpu_s:g} s) runs under {where} only: CI runs both stages, so it runs once per CI "
                f"run{pair}; EDIT_JAX_BOTH_STAGES=1 runs it here")
