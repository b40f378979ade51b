"""A worker's heartbeat and the closer's watch on it (``elastic/heartbeat.py``): a round stops
waiting for an expected worker whose process stopped (its beat unchanged for ``quiet_s`` on the
closer's clock), closes on the others' posts ("live posted"), and still waits for a worker that
beats, or one whose announcement has no beat (an older version)."""

from __future__ import annotations

import json
import time

import numpy as np

from edit_jax.elastic import rounds as R
from edit_jax.elastic.exchange import DirExchange
from edit_jax.elastic.heartbeat import BeatWatch, Heartbeat, beat_interval


def test_a_beat_unchanged_for_quiet_s_is_a_stalled_worker():
    now = [0.0]
    watch = BeatWatch(5.0, clock=lambda: now[0])
    assert watch.stalled({0: 1, 1: 1}) == set()
    now[0] = 4.0
    assert watch.stalled({0: 2, 1: 1}) == set()  # 1: unchanged for 4 s < 5 s
    now[0] = 5.0
    assert watch.stalled({0: 3, 1: 1}) == {1}  # 1 stopped beating; 0 beats on
    now[0] = 9.0
    assert watch.stalled({0: 3, 1: 2}) == set()  # 1 resumed; 0's beat of t=5 is 4 s old
    now[0] = 10.0
    assert watch.stalled({0: 3, 1: 2}) == {0}
    assert beat_interval(3.0) == (0.75, 5.0) and beat_interval(40.0) == (5.0, 20.0)
    assert beat_interval(0.05) == (0.5, 5.0)


def test_a_round_closes_on_the_live_workers_posts(tmp_path):
    ex = DirExchange(str(tmp_path / "ex"))
    for w in (0, 1, 2):  # 2 announced without a beat: a worker of an older version
        info = {"worker": w, "round": 1, **({"beat": 7} if w < 2 else {})}
        ex.put(R.hello_key(w), json.dumps(info).encode())
    for w in (0, 2):
        ex.put(R.post_key(1, w), R.Post(w, 1, [np.zeros(2, np.float32)], 1, 1, 0.0, "h").encode())
    assert R.beats(ex) == {0: 7, 1: 7}
    assert R.collect(ex, 1, closer=0, by_grace=False, base_hash="h") is None  # 1 awaited
    assert R.collect(ex, 1, closer=0, by_grace=False, base_hash="h", stalled=lambda beats: {2}) is None  # (2 posted)
    m = R.collect(ex, 1, closer=0, by_grace=False, base_hash="h", stalled=lambda beats: {1} & set(beats))
    assert m.members == [0, 2] and m.closed_by == "live posted" and m.expected == [0, 1, 2]


def test_the_heartbeat_beats_until_closed(tmp_path):
    ex = DirExchange(str(tmp_path / "ex"))
    hb = Heartbeat(ex, 3, "host:1", every_s=0.05)
    hb.announce(4)
    deadline = time.monotonic() + 20
    while R.beats(ex).get(3, 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert R.beats(ex)[3] >= 3 and R.announced(ex) == {3: 4}
    hb.announce(5)  # a new round keeps the count
    assert R.announced(ex) == {3: 5} and R.beats(ex)[3] >= 3
    hb.close()
    after = R.beats(ex)[3]
    time.sleep(0.3)
    assert R.beats(ex)[3] == after  # a closed (or stopped) worker's beat stays where it was
