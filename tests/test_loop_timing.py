"""The loop's own timings (``train(..., on_timing=...)``: what benchmarks read instead of patching
the loop) and a ``time`` that goes on across resumes."""

import json

import jax

from edit_jax.training.result import TIMING_KINDS
from edit_jax.training.train import train
from tests.helpers import tiny_config


def test_timings_and_time_across_a_resume(tmp_path):
    cfg = tiny_config(2, 2, steps=4, eval_every=2, checkpoint_every=2)
    devices = jax.devices()[:4]
    first, got = [], []
    train(cfg, str(tmp_path), progress=False, devices=devices, stop_after=2, on_timing=first.append)
    t2 = [json.loads(line)["time"] for line in open(tmp_path / "metrics.jsonl") if "val_loss" in line][-1]
    train(cfg, str(tmp_path), progress=False, devices=devices, on_timing=got.append)
    # (compile_ahead: the suite runs without it, tests/test_compile_ahead.py with it)
    assert {r["timing"] for r in first + got} == set(TIMING_KINDS) - {"compile_ahead"}
    adv = [r for r in got if r["timing"] == "advance"]
    assert [r["step"] for r in adv] == [3, 4] and adv[0]["includes_compile"]
    assert all(0 <= r["data_s"] <= r["advance_s"] for r in adv)
    assert all({"records", "progress", "spike", "stop checks"} <= set(r["hooks_s"]) for r in adv)
    for run, step in ((first, 2), (got, 4)):  # the stop's save, the final save: each found written after it
        kinds = [(r["timing"], r["step"]) for r in run if r["timing"] != "advance"]
        assert kinds == [("save", step), ("written", step)], kinds
        assert [r["save_s"] > 0 for r in run if r["timing"] == "save"] == [True]
    # time goes on: the eval at step 4 is stamped after the kept records' newest (step 2's)
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    t4 = [r["time"] for r in recs if "val_loss" in r and r["step"] == 4][-1]
    assert t4 >= t2 + adv[1]["at"]
