"""An exchange worker's unposted steps on disk (``elastic/progress.py``, ``sync.exchange.progress_every``):
a restarted worker carries them onto θ̄ exactly, and only when no round counted or can still count
them; anything else is refused with a record saying why."""

from __future__ import annotations

import os

import jax
import numpy as np

from edit_jax.config import with_fields
from edit_jax.elastic import progress as PG
from edit_jax.elastic import rounds as R
from edit_jax.rundir.records import read_records
from tests.stages import one_stage
from tests.test_elastic import _config


def _started(cfg, run):
    """A worker of slot 0 that joined, as ``ElasticWorker.run`` starts one."""
    from edit_jax.elastic.worker import ElasticWorker, Local

    w = ElasticWorker(cfg, 0, run, say=lambda m: None)
    shared = w.join()
    local = Local(w.initial_state, done=shared.cursors[0])
    local.state = w.restart_from(shared, local.state, count=local.done)
    return w, shared, local


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _ignored(run):
    return [r["progress_ignored"] for r in read_records(os.path.join(run, "metrics.jsonl")) if "progress_ignored" in r]


def test_saved_progress_resumes_exactly_and_only_when_uncounted(tmp_path):
    one_stage("default", "saved exchange progress on resume", 23)
    from edit_jax.runtime.compile_cache import compile_cache

    ex, run = str(tmp_path / "ex"), str(tmp_path / "run")
    cfg = _config(ex, "sync.exchange.progress_every=0.05", "steps=12")
    with compile_cache(os.environ.get("EDIT_JAX_COMPILE_CACHE")):  # the suite's shared cache (conftest.py)
        w, shared, local = _started(cfg, run)
        for _ in range(5):
            w.train_for(local, 0.0)  # one step each
        assert (local.done, local.since) == (5, 5)
        w.save_progress(shared, local)  # then the process is "killed": w is never used again
        p = PG.load(PG.progress_path(run, 0))
        assert (p.round, p.counted, p.done, p.since) == (0, 0, 5, 5)

        # A restart on the same round: params, inner optimizer state and position exactly as saved.
        w2, shared2, local2 = _started(cfg, run)
        w2.resume_progress(shared2, local2)
        assert (local2.done, local2.since, local2.carried) == (5, 5, 0)  # from the same θ̄: not stale, not carried
        for a, b, t in zip(_host(local2.state.params), _host(local.state.params), jax.tree.leaves(shared.theta),
                           strict=True):
            # θ̄ − (θ̄ − θ_i): two float32 roundings, as a carried late post's; 5 steps moved θ_i ~1e-3 from θ̄
            assert np.abs(a - b).max() <= 2.0 ** -22 * np.abs(t).max(), np.abs(a - b).max()
            assert np.abs(b[0] - t).max() > 1e-5
        for a, b in zip(_host(local2.state.opt_state), _host(local.state.opt_state), strict=True):
            np.testing.assert_array_equal(a, b)

        # Restored after a round closed without it: its steps are a round stale, carried, their Δ
        # damped to sync.exchange.carried_weight (θ̄_new − w Δ, as NumPy computes it in float32).
        w2.cfg = with_fields(w2.cfg, {"sync.exchange.carried_weight": 0.25})
        later = R.RoundState(1, jax.tree.map(lambda t: t + np.float32(0.5), shared2.theta), shared2.outer_opt,
                             shared2.detectors, shared2.tally, list(shared2.cursors))
        assert w2.resume_progress(later, local2) and (local2.since, local2.carried) == (5, 5)
        for a, t, d in zip(_host(local2.state.params), jax.tree.leaves(later.theta), p.delta, strict=True):
            np.testing.assert_array_equal(a[0], t - np.float32(0.25) * d)
        w2.cfg = with_fields(w2.cfg, {"sync.exchange.carried_weight": 1.0})
        w2.resume_progress(shared2, local2)  # back as it was, for the checks below

        # Refused, recorded, the worker left at θ̄ with its posted cursor:
        other_run = PG.Progress(**{**vars(p), "run_start": p.run_start + 1})
        PG.save(PG.progress_path(run, 0), other_run)
        w3, shared3, local3 = _started(cfg, run)
        w3.resume_progress(shared3, local3)
        assert local3.done == 0 and "another run" in _ignored(run)[-1]
        PG.save(PG.progress_path(run, 0), p)
        moved = R.RoundState(shared3.round, shared3.theta, shared3.outer_opt, shared3.detectors, shared3.tally,
                             [3, 0])  # a round counted this slot's steps up to cursor 3 since the snapshot
        w3.resume_progress(moved, local3)
        assert local3.done == 0 and "a round counted" in _ignored(run)[-1]
        post, fresh, _ = w2.post(shared2, local2, 3.0)  # posted after the snapshot; its round not closed yet
        assert fresh and post.round == 1
        w3.resume_progress(shared3, local3)
        assert local3.done == 0 and "posted to round 1" in _ignored(run)[-1]
        w3.ex.delete(R.post_key(1, 0))
        like = dict(delta_like=p.delta, opt_like=p.opt, residual_like=p.residual)
        assert PG.why_not(p, run_start=p.run_start, cursor=0, later_posts=[], **like) is None
        bad = dict(like, delta_like=[np.zeros((2, 2), np.float32)] + p.delta[1:])
        assert "does not fit" in PG.why_not(p, run_start=p.run_start, cursor=0, later_posts=[], **bad)

        # The whole loop: the restarted worker's first round counts the saved steps (its own, not carried).
        w4 = _started(cfg, run)[0]
        assert w4.run() == 0
        recs = read_records(os.path.join(run, "metrics.jsonl"))
        resumed = [r for r in recs if "progress_resumed" in r]
        assert [(r["progress_resumed"], r["from_round"], r["cursor"]) for r in resumed] == [(5, 0, 5)] * 4  # w2 (3), w4
        first = next(r for r in recs if r.get("sync"))
        assert first["members"] == [0] and first["carried"] == [0] and first["steps"][0] > 5
        assert first["cursors"][0] == first["steps"][0]  # 5 saved + those after the restart

        # Its snapshots since are older than its posts: a rerun never counts them twice.
        w5, shared5, local5 = _started(_config(ex, "sync.exchange.progress_every=0.05", "steps=100"), run)
        w5.resume_progress(shared5, local5)
        assert local5.done == shared5.cursors[0] and local5.since == 0
        assert "posted to round" in _ignored(run)[-1] or "a round counted" in _ignored(run)[-1]

        # A damaged file (one bit of an array flipped, or cut short) is reported and left alone;
        # the worker starts from θ̄.
        path = PG.progress_path(run, 0)
        PG.save(path, p)
        data = open(path, "rb").read()
        at = data.find(p.delta[0].tobytes()[:64])
        for broken, why in ((data[:at] + bytes([data[at] ^ 1]) + data[at + 1:], "CRC"), (data[: len(data) // 2], "")):
            with open(path, "wb") as f:
                f.write(broken)
            w5.resume_progress(shared5, local5)
            assert "unreadable" in _ignored(run)[-1] and path in _ignored(run)[-1] and why in _ignored(run)[-1]
            assert open(path, "rb").read() == broken and local5.done == shared5.cursors[0]


def test_saved_residual_of_a_packed_wire_resumes(tmp_path):
    """With sparse posts the error-feedback residual is part of the saved progress: a restart gets
    it back instead of zeros; an .npz of another kind is refused."""
    one_stage("default", "a packed wire's saved residual resumed", 8)
    from edit_jax.elastic import packed as PK
    from edit_jax.runtime.compile_cache import compile_cache

    ex, run = str(tmp_path / "ex"), str(tmp_path / "run")
    cfg = _config(ex, "sync.exchange.progress_every=0.05", "sync.wire.kind=topk2", "sync.wire.error_feedback=true")
    with compile_cache(os.environ.get("EDIT_JAX_COMPILE_CACHE")):
        w, shared, local = _started(cfg, run)
        zeros = PK.zero_residual(shared.theta, w.plan.layerwise, w.codec)
        rng = np.random.default_rng(0)
        local.residual = [rng.standard_normal(z.shape).astype(np.float32) for z in zeros]
        w.train_for(local, 0.0)
        w.save_progress(shared, local)
        w2, shared2, local2 = _started(cfg, run)
        local2.residual = [z.copy() for z in zeros]
        assert w2.resume_progress(shared2, local2)
        for a, b in zip(local2.residual, local.residual, strict=True):
            np.testing.assert_array_equal(a, b)
        from edit_jax.rundir.integrity import pack_arrays

        with open(PG.progress_path(run, 0), "wb") as f:
            f.write(pack_arrays([np.zeros(3)], {"round": 1}))  # an .npz of another kind
        assert not w2.resume_progress(shared2, local2) and "not a progress file" in _ignored(run)[-1]


def test_progress_needs_an_exchange():
    import pytest

    from edit_jax.validate import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"sync\.exchange\.progress_every.*sync\.exchange\.url"):
        load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py"),
                    ["sync.exchange.progress_every=1"])
    with pytest.raises(ConfigError, match=r"sync\.exchange\.carried_weight.*\[0, 1\].*1\.5"):
        load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py"),
                    ["sync.exchange.carried_weight=1.5"])
