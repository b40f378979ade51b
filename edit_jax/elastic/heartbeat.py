"""A worker's heartbeat, and the closer's watch on it: a round stops waiting for a worker whose
process no longer runs (stopped by SIGSTOP, swapped out, hung), not only for one that is gone.

A round waits for the workers that announced it (``rounds.expected``) until each has posted or
its closer's patience has passed (``sync.exchange.grace``; for a lock-step rule, plus a round:
``ElasticWorker.patience``). A stopped worker never posts, so every round it is expected in
waited the whole patience: under the kill loop (a worker SIGSTOPped every ~30 s) the lock-step
methods lost ~0.11 of their goodput to it (docs/benchmarks/elastic.md). Now each worker, from a
thread of its own, writes its announcement again every ``every_s`` seconds with a counter
(``beat``): the thread runs while the worker computes or compiles (both release the interpreter
lock), and stops when the process stops. A closer that sees a worker's counter unchanged for
``quiet_s`` seconds, on its own monotonic clock (no two hosts' clocks are compared), leaves it out
of the workers it waits for; the round closes on the posts of the others (``closed_by``: "live
posted"). The stopped worker, resumed, finds its round closed and carries its steps into the
next post (``sync.exchange.late_posts``), as a late worker always did.

A worker whose announcement has no counter (an older version) is waited for as before. A missed
beat (storage faults: beats go to the backend directly, without ``PatientExchange``'s retries) is
only a missed beat; ``quiet_s`` spans several of them.
"""

from __future__ import annotations

import json
import threading
import time

from edit_jax.elastic.exchange import Exchange
from edit_jax.elastic.rounds import hello_key


def beat_interval(grace: float) -> tuple[float, float]:
    """(``every_s``, ``quiet_s``) for ``sync.exchange.grace``: a beat every quarter grace (0.5-5 s), a worker
    stalled after 4 beats or 5 s unchanged, whichever is longer (a loaded host may delay a beat by
    seconds; taking a running worker for a stopped one costs it a late post)."""
    every = min(max(grace / 4.0, 0.5), 5.0)
    return every, max(4.0 * every, 5.0)


class Heartbeat:
    """Writes worker ``worker``'s announcement (``rounds.hello_key``; ``owner`` its process) when
    it announces a round (``announce``) and again every ``every_s`` seconds with ``beat`` + 1."""

    def __init__(self, ex: Exchange, worker: int, owner: str, every_s: float):
        self.ex = getattr(ex, "inner", ex)  # (beats are best effort: no retries through an outage)
        self.announcing = ex
        self.every_s = every_s
        self.hello = {"worker": worker, "round": -1, "owner": owner, "time": time.time(), "beat": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def announce(self, r: int) -> None:
        """Round ``r`` will wait for this worker (written through the patient exchange: it must land)."""
        with self._lock:
            self.hello.update(round=r, time=time.time())
            self.announcing.put(hello_key(self.hello["worker"]), json.dumps(self.hello).encode())
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                self.hello.update(beat=self.hello["beat"] + 1, time=time.time())
                data = json.dumps(self.hello).encode()
                try:
                    self.ex.put(hello_key(self.hello["worker"]), data)
                except Exception:  # a missed beat; the main loop meets the storage's faults
                    pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class BeatWatch:
    """Which workers' beats stopped, as this reader has seen them: a worker whose ``beat`` stayed
    the same for ``quiet_s`` seconds of this process's monotonic clock."""

    def __init__(self, quiet_s: float, clock=time.monotonic):
        self.quiet_s, self.clock = quiet_s, clock
        self.seen: dict[int, tuple[int, float]] = {}  # worker -> (its beat, when this reader first saw it)

    def stalled(self, beats: dict[int, int]) -> set[int]:
        """Of ``beats`` (worker -> its announcement's counter: ``rounds.beats``; ``rounds.collect``
        asks), those stalled."""
        now, out = self.clock(), set()
        for w, b in beats.items():
            last = self.seen.get(w)
            if last is None or last[0] != b:
                self.seen[w] = (b, now)
            elif now - last[1] >= self.quiet_s:
                out.add(w)
        return out


__all__ = ["Heartbeat", "BeatWatch", "beat_interval"]
