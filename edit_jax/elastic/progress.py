"""A worker's steps not yet in any round, on disk: a killed worker loses at most
``sync.exchange.progress_every`` seconds of them instead of everything since its last post.

Between two posts a worker's progress lives only in its process; a SIGKILL used to lose all of it
(on the live bench, half a ``tau_time`` of the worker's share per kill: the largest cost of a
fault, docs/benchmarks/elastic-runs.md). With ``sync.exchange.progress_every`` > 0 the worker writes, that often,
``RUN/progress/wI.npz`` (aside, then renamed over: whole or the previous one):

- ``delta`` = θ̄_round − θ_i (float32, every leaf; θ̄ of the round it last applied),
- the inner optimizer state, the packed wire's error-feedback residual,
- ``done`` (its data cursor), ``since`` (steps no round has counted yet), ``counted`` (this
  slot's cursor in that round state: the cursor of its last post a round used) and the run's start
  time (the exchange's ``run/start.json``); each array with the .npz (zip) format's CRC-32, checked
  when read (a save every second makes a stronger hash cost more than the check is worth).

A restarted worker (``ElasticWorker.resume_progress``) re-bases it onto the newest θ̄ exactly as a
late post is carried (θ_i = θ̄_new − Δ, its steps counted in its next post) **only if no round
has counted or may still count any of those steps**: this slot's cursor in the newest round state
is still ``counted`` (a post a round used always moves it), and the exchange holds no post of this
slot for a round after ``round`` (one made after the snapshot, which a round not yet closed may
still use). Otherwise, or if the file is unreadable or from another run or model, the worker starts
from θ̄ as before and a record says why. Snapshots are taken only while training, never between a
post and its round's close (the worker waits for that round first), so no post is pending at one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from edit_jax.rundir.integrity import pack_arrays, unpack_arrays
from edit_jax.rundir.records import replace_file


@dataclass
class Progress:
    run_start: float  # the exchange's run/start.json time: a snapshot of another run never resumes
    round: int  # the round state whose θ̄ ``delta`` is measured from
    counted: int  # this slot's cursor in that state
    done: int  # data cursor: steps this slot ever took
    since: int  # steps no round has counted
    delta: list  # θ̄_round − θ_i per leaf, float32
    opt: list  # inner optimizer state leaves
    residual: list  # the packed wire's error-feedback residual per unit ([] without one)

    def encode(self) -> bytes:
        meta = {"run_start": self.run_start, "round": self.round, "counted": self.counted, "done": self.done,
                "since": self.since, "sizes": [len(self.delta), len(self.opt), len(self.residual)]}
        return pack_arrays([*self.delta, *self.opt, *self.residual], meta)

    @staticmethod
    def decode(data: bytes, what: str) -> "Progress":
        arrays, meta = unpack_arrays(data, what)  # (zipfile checks each array's CRC-32)
        try:
            n_delta, n_opt, n_res = meta["sizes"]
            head = (float(meta["run_start"]), int(meta["round"]), int(meta["counted"]), int(meta["done"]),
                    int(meta["since"]))
        except (KeyError, TypeError, ValueError) as e:  # an .npz of another kind
            raise ValueError(f"{what}: not a progress file (its header lacks {e})") from e
        if n_delta + n_opt + n_res != len(arrays):
            raise ValueError(f"{what}: {len(arrays)} arrays, its header says {n_delta + n_opt + n_res}")
        return Progress(*head, arrays[:n_delta], arrays[n_delta:n_delta + n_opt], arrays[n_delta + n_opt:])


def progress_path(run_dir: str, worker: int) -> str:
    return os.path.join(run_dir, "progress", f"w{worker}.npz")


def save(path: str, p: Progress) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    replace_file(path, p.encode())


def load(path: str) -> Progress | None:
    """The snapshot at ``path``, None if there is none; ValueError naming the file if unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return Progress.decode(data, path)


def _shapes(arrays) -> list:
    return [(tuple(a.shape), np.dtype(a.dtype).str) for a in arrays]


def resumable(path: str, *, run_start: float, cursor: int, posted_rounds: list[int], delta_like: list,
              opt_like: list, residual_like: list) -> tuple[Progress | None, str | None]:
    """The snapshot at ``path`` if it may resume (and None), else None and why (None: no file).
    ``posted_rounds``: the rounds holding a post of this slot (``rounds.posted_rounds``)."""
    try:
        p = load(path)
    except (ValueError, OSError) as e:
        return None, f"unreadable: {e}"
    if p is None:
        return None, None
    why = why_not(p, run_start=run_start, cursor=cursor, later_posts=[r for r in posted_rounds if r > p.round],
                  delta_like=delta_like, opt_like=opt_like, residual_like=residual_like)
    return (None, why) if why else (p, None)


def why_not(p: Progress, *, run_start: float, cursor: int, later_posts: list[int], delta_like: list,
            opt_like: list, residual_like: list) -> str | None:
    """Why snapshot ``p`` may not resume (None: it may). ``cursor``: this slot's cursor in the
    newest round state; ``later_posts``: the rounds after ``p.round`` with a post of this slot;
    the ``*_like`` lists: this worker's arrays the snapshot's must match in shape and dtype."""
    if p.run_start != run_start:
        return f"written by another run (started at {p.run_start}, this run {run_start})"
    if later_posts:
        return f"this slot posted to round {later_posts[0]} after it (those steps are in that post)"
    if cursor != p.counted:
        return f"a round counted this slot's steps to cursor {cursor} since it (it expected {p.counted})"
    if p.since <= 0:
        return "no steps to carry"
    for name, got, like in (("delta", p.delta, delta_like), ("optimizer state", p.opt, opt_like),
                            ("residual", p.residual, residual_like)):
        if _shapes(got) != _shapes(like):
            return f"its {name} does not fit this run's model and wire ({len(got)} arrays vs {len(like)})"
    return None


__all__ = ["Progress", "progress_path", "save", "load", "why_not", "resumable"]
