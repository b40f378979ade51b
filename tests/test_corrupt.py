"""The testing knob ``debug.corrupt`` (edit_jax/data/corrupt.py): parsing and validation, which rows
it replaces and when, where those rows land on the mesh, and an EDiT run that flags the worker."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from edit_jax.config import ConfigError, apply_overrides
from edit_jax.data.corrupt import CorruptSpec, corrupt_batch, corrupt_rows, garbage_rows, parse_corrupt
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.runtime.mesh import make_mesh
from edit_jax.training.train import train
from edit_jax.validate import load_config, validate
from tests.helpers import REPO, tiny_config
from tests.stages import one_stage


def _with(cfg, *overrides):
    cfg = apply_overrides(cfg, list(overrides))
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- parsing and validation


@pytest.mark.parametrize("text,spec", [
    ("", None),
    ("worker=1,steps=3-5", CorruptSpec(1, 3, 5)),
    (" steps = 7 , worker = 0 ", CorruptSpec(0, 7, 7)),  # any order, spaces, a single step
    ("worker=1,steps=0-0", CorruptSpec(1, 0, 0)),
])
def test_parse(text, spec):
    assert parse_corrupt(text) == spec


@pytest.mark.parametrize("value,match", [
    ("worker=1", "missing steps"),
    ("steps=3-5", "missing worker"),
    ("worker=one,steps=3-5", "must be integers"),
    ("worker=1,steps=3-x", "must be integers"),
    ("worker=1,steps=5-3", r"empty step window 5-3"),
    ("worker=-1,steps=3-5", ">= 0"),
    ("worker=1,steps=-3-5", "must be integers"),  # "-3-5" has no A before its dash
    ("worker=1,steps=3-5,seed=2", "unknown item 'seed=2'"),
    ("worker=1,worker=0,steps=3-5", "worker given twice"),
    ("1:3-5", "unknown item"),
    ("worker=2,steps=3-5", r"worker 2 does not exist \(workers 0..1, mesh.replica=2\)"),
])
def test_bad_spec_names_the_key(value, match):
    with pytest.raises(ConfigError, match=r"config key 'debug.corrupt'.*" + match):
        _with(tiny_config(replica=2, shard=4), f"debug.corrupt={value}")


def test_good_spec_on_every_worker_of_a_4x2_mesh():
    for w in range(4):
        _with(tiny_config(replica=4, shard=2), f"debug.corrupt=worker={w},steps=0-3")


# ----------------------------------------------------------------------------- which rows, when


def test_corrupt_batch_changes_only_worker_rows_in_the_window():
    n, b, t1, vocab, seed = 4, 16, 9, 320, 7
    spec = CorruptSpec(worker=2, first=3, last=5)
    per = b // n
    rng = np.random.default_rng(0)
    for step in range(0, 8):
        batch = rng.integers(0, 257, (b, t1)).astype(np.int32)
        keep = batch.copy()
        out = corrupt_batch(batch, spec, step, n, vocab, seed)
        np.testing.assert_array_equal(batch, keep)  # the caller's (the stream's) array is never written
        if not 3 <= step <= 5:
            assert out is batch
            continue
        rows = slice(2 * per, 3 * per)  # hand check: worker 2 of 4 owns rows 8..11
        assert (rows.start, rows.stop) == (8, 12)
        others = np.ones(b, bool)
        others[rows] = False
        np.testing.assert_array_equal(out[others], batch[others])
        assert out.dtype == np.int32 and out.shape == batch.shape
        assert out[rows].min() >= 0 and out[rows].max() < vocab
        assert out[rows].max() >= 257  # drawn from the model's vocab, not the data's
        assert (out[rows] != batch[rows]).mean() > 0.9
        # Deterministic in (seed, step, worker): the same call agrees, another step or seed does not.
        np.testing.assert_array_equal(out, corrupt_batch(batch, spec, step, n, vocab, seed))
        np.testing.assert_array_equal(out[rows], garbage_rows((per, t1), vocab, seed, step, 2))
        assert not np.array_equal(out[rows], corrupt_batch(batch, spec, step, n, vocab, seed + 1)[rows])
        if step > 3:
            assert not np.array_equal(out[rows], corrupt_batch(batch, spec, step - 1, n, vocab, seed)[rows])


def test_corrupt_rows_matches_the_global_batch():
    """The multi-process path (one worker's rows) gives the rows the single-process path writes."""
    n, b, t1, vocab, seed = 2, 8, 5, 320, 3
    spec = CorruptSpec(worker=1, first=2, last=2)
    batch = np.arange(b * t1, dtype=np.int32).reshape(b, t1)
    full = corrupt_batch(batch, spec, 2, n, vocab, seed)
    for w in range(n):
        mine = batch[w * b // n:(w + 1) * b // n]
        np.testing.assert_array_equal(corrupt_rows(mine, spec, 2, w, vocab, seed), full[w * b // n:(w + 1) * b // n])
    np.testing.assert_array_equal(corrupt_rows(batch[4:], spec, 1, 1, vocab, seed), batch[4:])  # outside the window


@pytest.mark.parametrize("replica,shard", [(2, 4), (4, 2)])
def test_put_batch_puts_replica_rows_on_replica_devices(replica, shard):
    """The layout corrupt_batch relies on: rows [r*B/N, (r+1)*B/N) of the global batch live on
    replica r's devices (mesh row r), on a permuted device order so ids and positions differ."""
    cfg = tiny_config(replica=replica, shard=shard)
    devices = [jax.devices()[i] for i in np.random.default_rng(1).permutation(8)]
    mesh = make_mesh(cfg.mesh, devices)
    batch = np.repeat(np.arange(cfg.batch_size, dtype=np.int32)[:, None], cfg.data.seq_len + 1, axis=1)
    arr = StepPrograms.for_config(cfg, mesh).put_batch(batch)
    per = cfg.batch_size // replica
    row_of = {d: r for r in range(replica) for d in mesh.devices[r]}
    for piece in arr.addressable_shards:
        r = row_of[piece.device]
        rows = np.asarray(piece.data)[:, 0]
        assert r * per <= rows.min() and rows.max() < (r + 1) * per


# ----------------------------------------------------------------------------- end to end


def _syncs(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("sync")]


def test_edit_flags_the_corrupted_worker(tmp_path):
    """Worker 1 trains on garbage for steps 70..89, long after its detectors warmed up: EDiT flags
    it at both syncs of the window, and flags nothing else (worker 0 never, worker 1 not before).

    Why these settings (see docs/spike_notes.md for what garbage does): AdamW normalises each
    coordinate's step, so garbage does not make one inner step much larger; the pseudo gradient
    grows because the garbage gradient points the same way step after step (towards a uniform
    next-token distribution) and the steps add up, while a trained model's clean steps partly
    cancel. So the clean norms must have settled first and the sync interval must not be tiny:
    tau = 10, a constant learning rate (min_lr_ratio = 1: no decay trend in the norms) and 70 clean
    steps (the tiny model's norms are flat from about step 50), seq_len 128 (the demo's). The
    detector is the CPU preset's (K = 3, alpha = 0.02, delta = 3). Measured on this config: at the
    window's two syncs worker 1's norm is 2.1x and 3.2x worker 0's, its z-scores reach 1.35x and
    1.95x the threshold; outside the window no unit of either worker exceeds 0.76x it.
    """
    one_stage("3.12", "EDiT flags a worker fed corrupted rows", 55, other="test_two_processes_corrupt_the_same_rows")
    window = (70, 89)
    cfg = _with(tiny_config(method="edit", steps=92, seq_len=128, log_every=10, optim={"min_lr_ratio": 1.0},
                            sync={"tau": 10, "penalty": {"anomaly_warmup": 3}}),
                f"debug.corrupt=worker=1,steps={window[0]}-{window[1]}")
    train(cfg, run_dir=str(tmp_path / "run"), progress=False, devices=jax.devices()[:8])
    syncs = {s["step"]: s for s in _syncs(str(tmp_path / "run"))}
    # EDiT's sync in step k's forward covers steps k - tau .. k - 1; its record says step k + 1.
    in_window = [k + 1 for k in (80, 90)]
    assert all(syncs[s]["flagged"][1] > 0 for s in in_window), {s: syncs[s]["flagged"] for s in syncs}
    assert all(syncs[s]["weight"][1] < 0.5 for s in in_window)
    assert all(s["flagged"] == [0, 0] for step, s in syncs.items() if step not in in_window)


@pytest.mark.slow  # two worker processes and a single-process run: about 1-2 minutes on 2 cores
def test_two_processes_corrupt_the_same_rows(tmp_path):
    """With one process per worker (each building only its own rows of the batch) the corrupted
    worker draws the same garbage: the 2-process run's per-worker losses equal the single-process
    run's (steps 3..5 corrupted)."""
    one_stage("default", "the 2-process corrupted run", 49,
              other="test_multiprocess.py::test_two_processes_equal_one_program's 3.12 cases")
    from tests.test_multiprocess import TINY, _records, _run_cli  # its launcher helpers

    over = ["method=edit", "steps=8", "sync.warmup_steps=2", "sync.tau=3", "eval_every=0",
            "debug.corrupt=worker=1,steps=3-5"]
    code, out = _run_cli(tmp_path / "mp", *over)
    assert code == 0, out[-3000:]
    cfg = load_config(os.path.join(REPO, "configs/tiny.py"), [o for o in TINY if "processes" not in o] + over)
    single = train(cfg, str(tmp_path / "sp"), progress=False, devices=jax.devices()[:4])
    want = {r["step"]: r["replica_loss"] for r in single.history}
    got = {r["step"]: r["replica_loss"] for r in _records(tmp_path / "mp") if "loss" in r}
    assert sorted(got) == sorted(want) == list(range(1, 9))
    np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=2e-5)
    # Against the same run without garbage: records 1-3 (steps 0-2) are identical; record 4 (step
    # 3, the first corrupted one) starts from the same params, so worker 0 (clean rows) has the
    # clean run's loss and worker 1 (garbage) does not. (A margin between the two workers' losses
    # depends on the corpus, which differs between Python versions.)
    clean_cfg = load_config(os.path.join(REPO, "configs/tiny.py"),
                            [o for o in TINY if "processes" not in o] + over[:-1])
    clean = {r["step"]: r["replica_loss"] for r in train(clean_cfg, str(tmp_path / "clean"), progress=False,
                                                         devices=jax.devices()[:4]).history}
    np.testing.assert_array_equal([want[k] for k in (1, 2, 3)], [clean[k] for k in (1, 2, 3)])
    assert want[4][0] == clean[4][0] and abs(want[4][1] - clean[4][1]) > 1e-3, (want[4], clean[4])
