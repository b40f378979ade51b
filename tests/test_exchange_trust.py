"""What a round accepts (issue 57, classes 1, 2, 4, 7): only checked posts, only the run's objects.

- the closer checks every post before a manifest names it: a truncated, random, empty, other-wire,
  wrong-round, wrong-slot, other-run, other-θ̄ or other-shape post is left out, with why;
- with ``$EDIT_JAX_EXCHANGE_KEY`` an unsigned or wrongly signed post is left out too;
- stray keys and unreadable member files are passed over, never parsed into rounds;
- a garbled manifest is superseded by the round's next version, read by everyone;
- real processes: a run given random bytes, a misplaced post, a garbled member file and a stray
  file finishes by itself with one θ̄; restarted over a garbled newest state and a damaged post that
  a manifest names (the old wedge), it redoes that round and finishes again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from edit_jax.elastic import rounds as R
from edit_jax.elastic.exchange import DirExchange
from edit_jax.elastic.trust import ENV_KEY, START_KEY, broken_seal, run_start
from edit_jax.rundir.records import read_records
from tests.helpers import exchange_run_through
from tests.stages import one_stage
from tests.test_elastic import _config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN, BASE = "0123456789abcdef", "b" * 24


def _post(w, r, *, run=RUN, base=BASE, shape=(3,), key=None, **kw):
    return R.Post(w, r, [np.full(shape, w, np.float32)], 1, 1, 0.0, base, **kw).encode(run, key)


def _announce(ex, workers, r):
    for w in workers:
        ex.put(R.hello_key(w), json.dumps({"worker": w, "round": r}).encode())


def test_the_closer_leaves_out_every_post_that_fails_its_check(tmp_path):
    ex = DirExchange(str(tmp_path / "ex"))
    check = R.PostCheck(RUN, "none", [(3,)])
    good = _post(0, 1)
    bad = {
        1: good[: len(good) // 2],  # truncated
        2: np.random.default_rng(0).bytes(3000),  # random bytes
        3: b"",  # empty
        4: _post(4, 2),  # says round 2
        5: _post(6, 1),  # says worker 6
        6: _post(6, 1, run="fedcba9876543210"),  # another run's
        7: _post(7, 1, base="c" * 24),  # made from another θ̄
        8: _post(8, 1, shape=(4,)),  # another model's shapes
        9: R.Post(9, 1, [np.zeros(8, np.uint8)], 1, 1, 0.0, BASE, wire="topk2", norms=np.ones(2)).encode(RUN),
    }
    ex.put(R.post_key(1, 0), good)
    for w, data in bad.items():
        ex.put(R.post_key(1, w), data)
    ex.put("posts/r00000001/notes.txt", b"hello")  # stray: not a post
    _announce(ex, range(10), 1)
    m = R.collect(ex, 1, closer=0, by_grace=False, base_hash=BASE, check=check)
    assert m.members == [0] and m.closed_by == "all posted"
    why = {int(w): text for w, text in m.rejected.items()}
    assert sorted(why) == list(range(1, 10))
    for w in (1, 2):
        assert why[w].startswith("unreadable"), why[w]
    assert why[3] == "empty"
    assert "says round 2" in why[4] and "says round 1 worker 6" in why[5]
    assert why[6].startswith("another run's") and why[7].startswith("made from another θ̄")
    assert "shapes" in why[8] and "topk2" in why[9]
    assert R.read_manifest(ex, 1, check).rejected == m.rejected
    # Who the round waited for: everyone who announced round 1 (they posted, then moved on)
    _announce(ex, range(10), 2)
    assert R.expected(ex, 1) == [] and m.expected == list(range(10))


def test_a_round_with_no_good_post_stays_open(tmp_path):
    ex = DirExchange(str(tmp_path / "ex"))
    ex.put(R.post_key(1, 1), b"junk")
    _announce(ex, [1], 1)
    assert R.collect(ex, 1, 0, True, BASE, R.PostCheck(RUN, "none", [(3,)])) is None
    assert R.read_manifest(ex, 1) is None


def test_with_a_key_only_signed_posts_enter(tmp_path, monkeypatch):
    ex = DirExchange(str(tmp_path / "ex"))
    key = b"the run's secret"
    check = R.PostCheck(RUN, "none", [(3,)], key)
    ex.put(R.post_key(1, 0), _post(0, 1, key=key))
    ex.put(R.post_key(1, 1), _post(1, 1))  # unsigned
    ex.put(R.post_key(1, 2), _post(2, 1, key=b"a stranger's secret"))
    _announce(ex, [0, 1, 2], 1)
    m = R.collect(ex, 1, 0, False, BASE, check)
    assert m.members == [0]
    assert m.rejected["1"].startswith("unsigned") and m.rejected["2"].startswith("wrongly signed")
    # The manifest is signed too: read without the key it is still this run's; with another key it is not.
    assert R.read_manifest(ex, 1, R.PostCheck(RUN)).members == [0]
    with pytest.raises(R.BadObject, match="wrongly signed"):
        R.read_manifest(ex, 1, R.PostCheck(RUN, key=b"other"))
    monkeypatch.setenv(ENV_KEY, "s")
    from edit_jax.elastic.trust import exchange_key

    assert exchange_key() == b"s"


def test_a_tampered_post_fails_its_checksum():
    leaves, meta = R.unpack(_post(0, 1), "k")
    assert broken_seal(meta, leaves, RUN, None) is None
    leaves[0] = leaves[0] + 1
    assert broken_seal(meta, leaves, RUN, None) == "its arrays do not match its checksum"
    assert broken_seal({k: v for k, v in meta.items() if k != "sum"}, leaves, RUN, None) == "no checksum"


def test_stray_keys_and_bad_member_files_are_passed_over(tmp_path):
    ex = DirExchange(str(tmp_path / "ex"))
    for key in ("posts/r00000005/notes.txt", "posts/rxyz/w0001.npz", "state/junk.npz", "state/r1.npz",
                "rounds/r00000009.txt", "rounds/notes.json", "members/wxyz.json"):
        ex.put(key, b"hello")
    ex.put(R.post_key(3, 1), _post(1, 3))
    ex.put(R.state_key(2), b"x")
    ex.put(R.manifest_key(4), b"{}")
    ex.put(R.hello_key(0), b"{not json")
    ex.put(R.hello_key(1), json.dumps({"worker": 1, "round": 7}).encode())
    ex.put(R.hello_key(2), json.dumps({"worker": "two", "round": 7}).encode())
    assert R.posted(ex, 5) == [] and R.posted_rounds(ex, 1) == [3]
    assert R.newest_state(ex) == 2 and R.newest_round(ex) == 4
    assert R.announced(ex) == {1: 7} and R.expected(ex, 7) == [1]
    assert R.live_owner(ex, 0, "me:1", 10.0) is None
    R.collect_garbage(ex, 100)  # strays stay (not the protocol's to delete); old posts and states go
    assert ex.get("posts/r00000005/notes.txt") == b"hello" and R.posted_rounds(ex, 1) == []


def test_a_garbled_manifest_is_superseded_by_the_next_version(tmp_path):
    ex = DirExchange(str(tmp_path / "ex"))
    check = R.PostCheck(RUN, "none", [(3,)])
    ex.put(R.manifest_key(1), b"\x00garbled")
    for w in (0, 1):
        ex.put(R.post_key(1, w), _post(w, 1))
    with pytest.raises(R.BadObject, match="rounds/r00000001.json: not a readable manifest"):
        R.read_manifest(ex, 1, check)
    m = R.collect(ex, 1, 1, True, BASE, check, version=1, redone="garbled")
    assert (m.version, m.members, m.redone) == (1, [0, 1], "garbled")
    assert R.manifest_versions(ex, 1) == [0, 1] and R.read_manifest(ex, 1, check).version == 1
    assert R.newest_round(ex) == 1
    # A manifest of another run is not this run's either
    ex.put(R.manifest_key(2), R.Manifest(2, [0], BASE, 0, "grace").encode("fedcba9876543210"))
    with pytest.raises(R.BadObject, match="another run's"):
        R.read_manifest(ex, 2, check)


def test_run_start_makes_an_id_once_and_recovers_a_garbled_one(tmp_path):
    ex = DirExchange(str(tmp_path / "ex"))
    t, run = run_start(ex, say=lambda m: None)
    assert len(run) == 16 and run_start(ex, say=lambda m: None) == (t, run)
    ex.put(R.state_key(3), R.RoundState(3, {"a": np.zeros(2, np.float32)}, {}, {}, 0, [0]).encode(run))
    ex.put(START_KEY, b"garbage")
    said = []
    t2, again = run_start(ex, say=said.append)
    assert again == run and len(said) == 1 and "not readable" in said[0]


# ----------------------------------------------------------------------------- real processes


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=1")


def _args(run, ex, steps):
    return ["--config", os.path.join(ROOT, "configs", "tiny.py"), "--run-dir", run, f"sync.exchange.url={ex}",
            "sync.method=a_edit", "sync.warmup_steps=0", "mesh.replica=3", "mesh.shard=1", "mesh.processes=2",
            "sync.time.tau=0.3", "sync.exchange.grace=1", "batch_size=6", f"steps={steps}", "eval_batches=1",
            "eval_every=0"]


def _ends(run):
    return [r for r in read_records(os.path.join(run, "metrics.jsonl")) if "finished_round" in r]


def test_a_run_given_junk_finishes_and_restarts_over_a_damaged_round(tmp_path):
    one_stage("default", "an exchange run given junk, restarted over a damaged round", 45,
              other="test_exchange_storage's end-to-end outage")
    run, ex_dir = str(tmp_path / "run"), str(tmp_path / "run.x")

    def junk():
        ex = DirExchange(ex_dir)
        r = R.newest_round(ex)
        # Slot 2 has no worker (3 slots, 2 processes): what lands there is only ever the closer's to check.
        ex.put(R.post_key(r + 2, 2), np.random.default_rng(1).bytes(3000))
        ex.put(R.post_key(r + 3, 1), b"junk in worker 1's own slot")  # it replaces it with its post
        ex.put(f"posts/r{r + 2:08d}/notes.txt", b"hello")
        ex.put(R.hello_key(1), b"{garbled")

    exchange_run_through(tmp_path, _args(run, ex_dir, 24), ex_dir, junk)
    ex = DirExchange(ex_dir)
    ends = _ends(run)
    assert len(ends) == 2 and len({e["theta_hash"] for e in ends}) == 1
    recs = read_records(os.path.join(run, "metrics.jsonl"))
    rejected = [rec["rejected"] for rec in recs if rec.get("sync") and rec.get("rejected")]
    assert any(x.get("2", "").startswith("unreadable") for x in rejected), rejected
    # The old wedge: the newest state garbled, and a post its manifest names damaged since. A restart
    # with a larger budget passes over the state, redoes that round without the post, and goes on.
    last = R.newest_state(ex)
    m = R.read_manifest(ex, last)
    ex.put(R.state_key(last), b"garbled state")
    victim = m.members[-1]
    ex.put(R.post_key(last, victim), (ex.get(R.post_key(last, victim)) or b"")[:100])
    again = subprocess.run([sys.executable, "-m", "edit_jax", "train", *_args(run, ex_dir, 32)], env=_env(),
                           capture_output=True, text=True, cwd=str(tmp_path), timeout=180)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert f"round {last}: worker {victim}'s post is unreadable" in again.stderr
    assert R.manifest_versions(ex, last)[-1] >= 1 and victim not in R.read_manifest(ex, last).members
    ends = _ends(run)[2:]
    assert len(ends) == 2 and len({e["theta_hash"] for e in ends}) == 1


def test_a_worker_with_another_key_is_refused_before_any_work(tmp_path):
    from edit_jax.elastic.admission import NotAdmitted

    ex = DirExchange(str(tmp_path / "ex"))
    t, run = run_start(ex, key=b"k1")
    assert run_start(ex, key=b"k1") == (t, run)
    for key, said in [(b"k2", "is not this run's key"), (None, "is not set")]:
        with pytest.raises(NotAdmitted, match=said):
            run_start(ex, key=key)
    plain = DirExchange(str(tmp_path / "plain"))
    run_start(plain)
    with pytest.raises(NotAdmitted, match="was started without it"):
        run_start(plain, key=b"k1")


class _Died(Exception):
    """A worker's death at an exact point (its thread ends there, nothing more written)."""


def test_a_closer_that_dies_before_its_state_still_gets_its_round_recorded(tmp_path):
    """Item 7: the closer of round 2 dies between its manifest and its state, and the other worker
    closes round 3 before it is back: round 2's state and record are published once, by round 3's
    closer (``published_for``), and the dead slot's restart joins from round 3. Then the closer of
    the run's last round dies the same way: no round comes after it, so the worker that finishes
    on it publishes it after ``sync.exchange.grace`` s, and that slot's restart finds the run finished. Both
    slots end on one θ̄. Rounds are one step each (``due_in`` 0), so their count does not depend on
    the machine's speed. Without the hand-overs the rounds have no record and no state. Threads."""
    one_stage("3.12", "closers dying before their states (threads)", 31,
              other="test_a_run_given_junk_finishes_and_restarts_over_a_damaged_round")
    from edit_jax.elastic.worker import ElasticWorker
    from edit_jax.runtime.compile_cache import compile_cache
    dead = []  # (slot, round) of each closer that died before its state

    class OneStepRoundsDyingCloser(ElasticWorker):
        def due_in(self, shared):
            return 0.0

        def _publish(self, new, m, posts, figures, published_for=None):
            if published_for is None and ((new.round == 2 and not dead) or (new.finished and len(dead) == 1)):
                dead.append((self.me, new.round))
                raise _Died(self.me)  # after its manifest, before its state: nothing of the round published
            super()._publish(new, m, posts, figures, published_for)

    ex, run = str(tmp_path / "ex"), str(tmp_path / "run")
    cfg = _config(ex, "steps=8")
    codes = {}

    def go(w):
        try:
            codes[w.me] = w.run()
        except _Died:
            pass

    def start(w):
        threads.append(threading.Thread(target=go, args=(OneStepRoundsDyingCloser(cfg, w, run, say=lambda m: None),)))
        threads[-1].start()

    with compile_cache(os.environ.get("EDIT_JAX_COMPILE_CACHE")):  # the suite's shared cache (conftest.py)
        threads = []
        start(0), start(1)
        ex_dir, deadline = DirExchange(ex), time.monotonic() + 180
        while not (dead and ex_dir.list(R.state_key(3))):
            assert time.monotonic() < deadline and any(t.is_alive() for t in threads), (codes, dead)
            time.sleep(0.05)
        start(dead[0][0])  # its restart: from round 3's state
        [t.join(timeout=240) for t in threads]
        assert len(dead) == 2 and dead[1][1] > 3, dead
        codes.pop(dead[1][0], None)
        start(dead[1][0])  # its restart: the run is finished
        threads[-1].join(timeout=120)
    assert codes == {0: 0, 1: 0}, codes
    recs = read_records(os.path.join(run, "metrics.jsonl"))
    syncs = {r["round"]: r for r in recs if r.get("sync")}
    assert sorted(syncs) == list(range(1, dead[1][1] + 1)), sorted(syncs)  # every round recorded once...
    assert len(syncs) == sum(1 for r in recs if r.get("sync"))
    for slot, r in dead:  # ...those of the dead closers by the hand-over
        assert syncs[r]["published_for"] == slot and syncs[r]["members"], syncs[r]
    assert syncs[dead[1][1]]["finished"] and ex_dir.list(R.state_key(dead[1][1]))
    ends = [r for r in recs if "finished_round" in r]
    assert sorted(r["worker"] for r in ends) == [0, 1], ends  # the survivor, then the last dead slot's restart
    assert {r["theta_hash"] for r in ends} == {syncs[dead[1][1]]["theta_hash"]}, ends
