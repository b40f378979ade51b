"""TensorBoard scalars: the event files are read back here with a reader of our own (the TFRecord
framing with its masked CRC-32C checked, then the Event protobuf) and compared with the records
of metrics.jsonl; plus the `log` config section (absent from older configs)."""

import glob
import json
import math
import os
import struct

import pytest

from edit_jax.config import Config, ConfigError, apply_overrides, from_dict, to_dict
from edit_jax.validate import validate
from tests.trained_runs import edit_run

pytest.importorskip("tensorboardX")
from tensorboardX.proto import event_pb2  # the Event message's schema

from edit_jax.rundir.tensorboard import TeeLog, TensorBoardWriter, record_scalars
from tests.stages import one_stage


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path):
    """Every Event of a TFRecord file: u64 length, u32 masked crc(length), data, u32 masked crc(data)."""
    events = []
    with open(path, "rb") as f:
        raw = f.read()
    pos = 0
    while pos < len(raw):
        header = raw[pos:pos + 8]
        (length,), (len_crc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[pos + 8:pos + 12])
        assert len_crc == _masked(header), f"{path}: bad length crc at byte {pos}"
        data = raw[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack("<I", raw[pos + 12 + length:pos + 16 + length])
        assert data_crc == _masked(data), f"{path}: bad data crc at byte {pos}"
        events.append(event_pb2.Event.FromString(data))
        pos += 16 + length
    return events


def read_scalars(log_dir):
    """{(tag, step): value} over every event file in log_dir."""
    out = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        events = read_events(path)
        assert events[0].file_version.startswith("brain.Event:")
        for ev in events:
            for v in ev.summary.value:
                out[(v.tag, ev.step)] = v.simple_value
    return out


TRAIN = {"step": 10, "loss": 2.5, "grad_norm": 0.75, "tokens_per_s": 1234.0, "step_time": 0.125, "kind": "local",
         "replica_loss": [2.25, 2.75], "includes_compile": True}
SYNC = {"step": 10, "sync": True, "pseudo_grad_norm": [0.5, 1.5], "weight": [0.25, 0.75], "flagged": [0, 1],
        "clip_factor": [1.0, 0.5], "outer_update_norm": 0.0625, "unit_weight": [[0.5, 0.5], [0.25, 0.75]]}
EVAL = {"step": 20, "val_loss": 2.0, "val_ppl": math.exp(2.0)}


def test_record_tags():
    assert dict(record_scalars(TRAIN)) == {"train/loss": 2.5, "train/grad_norm": 0.75, "train/tokens_per_s": 1234.0,
                                           "train/step_time": 0.125, "train/replica_loss/0": 2.25,
                                           "train/replica_loss/1": 2.75}
    tags = dict(record_scalars(SYNC))
    assert tags["sync/pseudo_grad_norm/1"] == 1.5 and tags["sync/flagged/1"] == 1.0
    assert tags["sync/outer_update_norm"] == 0.0625 and tags["sync/unit_weight/1/0"] == 0.25
    assert len(tags) == 2 * 4 + 1 + 4
    assert dict(record_scalars(EVAL)) == {"eval/val_loss": 2.0, "eval/val_ppl": math.exp(2.0)}


def test_writer_event_files_read_back(tmp_path):
    w = TensorBoardWriter(str(tmp_path))
    for rec in (TRAIN, SYNC, EVAL, {**TRAIN, "step": 20, "loss": float("nan")}):
        w.write(rec)
    w.close()
    got = read_scalars(str(tmp_path))
    assert got[("train/loss", 10)] == 2.5 and math.isnan(got[("train/loss", 20)])
    assert got[("train/replica_loss/1", 10)] == 2.75
    assert got[("sync/weight/0", 10)] == 0.25 and got[("sync/unit_weight/1/1", 10)] == 0.75
    assert got[("eval/val_ppl", 20)] == pytest.approx(math.exp(2.0), rel=1e-6)  # float32 in the event
    assert len(got) == 6 + 13 + 2 + 6


def test_resume_purges_later_steps(tmp_path):
    class Plain:
        def __init__(self):
            self.records = []

        def write(self, record):
            self.records.append(record)

    log = TeeLog(Plain(), str(tmp_path), resumed_from=40)
    log.write(EVAL)
    log.close()
    assert log.log.records == [EVAL]
    (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    starts = [ev.step for ev in read_events(path) if ev.HasField("session_log")]
    assert starts == [41]  # TensorBoard drops earlier files' events from step 41 on


def test_training_run_writes_every_record(tmp_path_factory):
    _, run_dir = edit_run(tmp_path_factory)  # log.tensorboard=true
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    got = read_scalars(os.path.join(run_dir, "tb"))
    kinds = {"sync" if r.get("sync") else "eval" if "val_loss" in r else "train" for r in records}
    assert kinds == {"train", "sync", "eval"}
    expected = {(tag, r["step"]): v for r in records for tag, v in record_scalars(r)}
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    # the sync inside step 5
    assert ("train/loss", 6) in got and ("eval/val_loss", 6) in got and ("sync/pseudo_grad_norm/1", 5) in got


def test_log_section_config(monkeypatch):
    old = to_dict(Config())
    del old["log"]  # a config written before the section existed
    assert from_dict(old).log.tensorboard is False
    cfg = apply_overrides(Config(), ["log.tensorboard=true"])
    assert cfg.log.tensorboard is True
    validate(cfg)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.tensorboard.*pip install"):
        validate(cfg)


def test_turned_on_at_a_resume_shows_the_whole_history(tmp_path):
    """Steps 1-2 trained without TensorBoard, 3-4 with it: the event files hold all four steps
    (before: only 3-4), with the values of metrics.jsonl; a second resume adds no duplicate."""
    one_stage("default", "TensorBoard turned on at a resume", 8, other="wandb turned on at a resume")
    import jax

    from edit_jax.config import LogConfig
    from edit_jax.training.train import train
    from tests.helpers import tiny_config

    cfg = tiny_config(2, 2, steps=2, checkpoint_every=2)
    train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4])
    assert not os.path.exists(tmp_path / "tb")
    cfg.steps, cfg.log = 4, LogConfig(tensorboard=True)
    train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4])
    with open(tmp_path / "metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    got = read_scalars(str(tmp_path / "tb"))
    assert sorted(losses) == [1, 2, 3, 4]
    assert {step: got[("train/loss", step)] for step in losses} == pytest.approx(losses, rel=1e-6)
    files = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    cfg.steps = 6
    train(cfg, str(tmp_path), progress=False, devices=jax.devices()[:4])
    new = set(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))) - set(files)
    assert len(new) == 1 and min(ev.step for ev in read_events(new.pop()) if ev.summary.value) == 5
