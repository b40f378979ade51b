"""``log.wandb=true`` in W&B's offline mode: every record of ``metrics.jsonl`` reaches W&B's own run
file at its step, read back here from that file (W&B's record log: a 7-byte header, then
LevelDB-style records of its protobuf ``Record``s), a resume continues the same W&B run, a W&B
turned on at a resume first logs the history, and a W&B that cannot start is one line."""

import dataclasses
import glob
import json
import os
import subprocess
import sys

import jax
import pytest

pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # the Record message's schema

from edit_jax.config import ConfigError, LogConfig, apply_overrides, Config
from edit_jax.rundir.wandb_log import ID_FILE
from edit_jax.training.train import train
from edit_jax.validate import validate
from tests.helpers import REPO, child_xla_flags, tiny_config
from tests.stages import one_stage

BLOCK = 32768


def wandb_records(path):
    """The protobuf Records of a W&B run file (``run-<id>.wandb``)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(run_dir):
    """{step: {tag: value}} over every offline W&B run file under run_dir, and the run records."""
    steps, runs = {}, []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                steps.setdefault(items["_step"], {}).update({k: v for k, v in items.items() if not k.startswith("_")})
            elif kind == "run":
                runs.append(r.run)
    return steps, runs


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_offline_run_logs_every_record_and_a_resume_continues_the_same_run(tmp_path, offline):
    one_stage("default", "the offline wandb run", 12, other="test_wandb_turned_on_at_a_resume_logs_the_history_first")
    run_dir = str(tmp_path / "run")
    cfg = tiny_config(2, 1, method="edit", steps=2, checkpoint_every=2, eval_every=2, log=LogConfig(wandb=True))
    train(cfg, run_dir, progress=False, devices=jax.devices()[:2])
    with open(os.path.join(run_dir, ID_FILE)) as f:
        rid = f.read().strip()
    steps, runs = history(run_dir)
    assert [r.run_id for r in runs] == [rid] and runs[0].display_name == "run" and runs[0].project == "edit-jax"
    config = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
    assert config["sync"]["method"] == "edit" and config["steps"] == 2
    records = _records(run_dir)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(steps) == [1, 2]
    assert {s: steps[s]["train/loss"] for s in losses} == losses  # the very numbers (JSON both ways)
    assert steps[2]["eval/val_loss"] == next(r["val_loss"] for r in records if "val_loss" in r)

    train(dataclasses.replace(cfg, steps=3), run_dir, progress=False, devices=jax.devices()[:2])
    with open(os.path.join(run_dir, ID_FILE)) as f:
        assert f.read().strip() == rid  # the same W&B run
    steps, runs = history(run_dir)
    assert [r.run_id for r in runs] == [rid, rid] and sorted(steps) == [1, 2, 3]
    records = _records(run_dir)
    assert steps[3]["train/loss"] == next(r["loss"] for r in records if r["step"] == 3 and "loss" in r)
    sync = [r for r in records if r.get("sync")]  # EDiT's first sync runs in step 3's forward
    assert sync and all(steps[r["step"]]["sync/weight/1"] == r["weight"][1] for r in sync)


def test_wandb_turned_on_at_a_resume_logs_the_history_first(tmp_path, offline):
    one_stage("3.12", "wandb turned on at a resume", 10,
              other="test_offline_run_logs_every_record_and_a_resume_continues_the_same_run")
    run_dir = str(tmp_path / "run")
    cfg = tiny_config(1, 2, steps=2, checkpoint_every=2)
    train(cfg, run_dir, progress=False, devices=jax.devices()[:2])
    assert not os.path.exists(os.path.join(run_dir, "wandb"))
    train(dataclasses.replace(cfg, steps=3, log=LogConfig(wandb=True)), run_dir, progress=False,
          devices=jax.devices()[:2])
    steps, _ = history(run_dir)
    losses = {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}
    assert sorted(steps) == [1, 2, 3] and {s: steps[s]["train/loss"] for s in losses} == losses


def test_wandb_needs_its_package_and_a_way_to_start(tmp_path, monkeypatch):
    import importlib.util

    cfg = apply_overrides(Config(), ["log.wandb=true"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb.*pip install edit-jax\[wandb\]"):
        validate(cfg)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="log.wandb_project"):
        validate(apply_overrides(Config(), ["log.wandb=true", "log.wandb_project= "]))
    # Online, with no API key anywhere: one line naming log.wandb, exit 2, before any step.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["XLA_FLAGS"] = child_xla_flags()
    env.update(HOME=str(tmp_path), WANDB_MODE="online", WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
               PYTHONPATH=REPO)
    run_dir = str(tmp_path / "run")
    p = subprocess.run([sys.executable, "-m", "edit_jax", "train", "--config", "configs/tiny.py", "--run-dir", run_dir,
                        "steps=2", "log.wandb=true", "mesh.replica=1", "mesh.shard=1"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "edit-jax: bad config error: config key 'log.wandb': W&B could not start" in p.stderr
    assert "WANDB_MODE=offline" in p.stderr and "Traceback" not in p.stderr
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl")) or not _records(run_dir)
