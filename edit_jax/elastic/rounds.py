"""The meeting protocol of workers that share only an exchange (``exchange.py``): posts, round
manifests and the published round state, as whole objects under fixed keys.

Round r (r >= 1) turns the round state r - 1 (θ̄, the outer optimizer's state, every worker slot's
anomaly detectors, the step tally) into round state r:

1. each worker that applied round r - 1 trains for ``sync.tau_time`` seconds, then **posts**
   ``posts/rXXXXXXXX/wYYYY.npz``: its pseudo gradient Δ = θ̄_{r-1} − θ_i (every leaf, float32; with
   a sparse ``sync.compress`` its packed rows and true norms, ``packed.py``), its steps since its
   last round (A-EDiT's step share), its data cursor, its loss;
2. the round **closes** when every expected worker posted (those whose newest announcement,
   ``members/wYYYY.json``, names round r: a worker announces the round it will post at whenever it
   joins or applies a round) or ``sync.grace`` seconds after the first post that a
   waiting worker saw (each waiter measures from its own post: the earliest poster closes first, so
   the others wait at most ``grace``). Any waiter may close it: it lists the posts and *creates*
   ``rounds/rXXXXXXXX.json`` (the manifest: participants, sorted; the hash of θ̄_{r-1} as the closer
   holds it) create-exclusively: of several closers exactly one wins, and everybody follows the
   manifest that exists;
3. every participant (and anyone catching up) reads exactly the posts the manifest names and runs
   the same penalised, weighted outer step (``outer_round.py``: ``api.stacked_sync`` on the host
   CPU, so hardware never changes the bits); each compares the manifest's hash with its own θ̄_{r-1}
   first, so θ̄ is checked identical on every worker after every round;
4. the closer publishes ``state/rXXXXXXXX.npz`` (the round state: what a joiner and a whole-run
   restart start from) and removes posts and states older than ``KEEP_ROUNDS`` rounds.

A post that arrives after its round closed is late: its worker catches up (applies the rounds it
missed) and, with ``sync.late_posts=carry``, re-bases its progress onto the new θ̄ (its Δ is part
of its next post), or with ``drop`` restarts from θ̄ (a record says which).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from edit_jax.elastic.exchange import Exchange
from edit_jax.elastic.packed import PACKED, check_post
from edit_jax.rundir.integrity import leaves_hash, pack_arrays, unpack_arrays

KEEP_ROUNDS = 8  # posts and published states kept behind the newest round (catch-up by replay)


def post_key(r: int, worker: int) -> str:
    return f"posts/r{r:08d}/w{worker:04d}.npz"


def manifest_key(r: int) -> str:
    return f"rounds/r{r:08d}.json"


def state_key(r: int) -> str:
    return f"state/r{r:08d}.npz"


def hello_key(worker: int) -> str:
    return f"members/w{worker:04d}.json"


def _round_of(key: str) -> int:
    return int(key.rsplit("/", 1)[-1].split(".")[0].lstrip("r"))


# ----------------------------------------------------------------------------- payloads


pack = pack_arrays


def unpack(data: bytes, what: str) -> tuple[list[np.ndarray], dict]:
    return unpack_arrays(data, f"exchange object {what}")


def tree_hash(tree: Any) -> str:
    return leaves_hash(jax.tree.leaves(tree))


@dataclass
class Post:
    worker: int
    round: int
    delta: list[np.ndarray]  # Δ's leaves in θ̄'s tree order, float32; or, packed, each unit's rows (packed.py)
    steps_since: int  # inner steps in Δ (A-EDiT's step share)
    cursor: int  # the worker's inner steps done: its position in its own data stream
    loss: float
    base_hash: str  # θ̄_{r-1} as the poster held it
    carried: int = 0  # steps of a late post carried into this one
    wire: str = "none"  # "none": float32 Δ (format 1); a sparse wire name: packed rows (format 2)
    norms: np.ndarray | None = None  # packed: the true per-unit norms of Δ [U], before compression

    def encode(self) -> bytes:
        meta = {"worker": self.worker, "round": self.round, "steps_since": self.steps_since, "cursor": self.cursor,
                "loss": self.loss, "base_hash": self.base_hash, "carried": self.carried}
        if self.wire == "none":
            return pack(self.delta, meta)
        return pack([*self.delta, np.asarray(self.norms, np.float32)], {**meta, "format": PACKED, "wire": self.wire})

    @staticmethod
    def decode(data: bytes, what: str, wire: str = "none") -> "Post":
        """The post at ``what``; ValueError if it is not of this reader's ``wire`` (``packed.check_post``)."""
        leaves, m = unpack(data, what)
        packed = check_post(m, wire, what) == PACKED
        norms = leaves.pop() if packed else None
        return Post(int(m["worker"]), int(m["round"]), leaves, int(m["steps_since"]), int(m["cursor"]),
                    float(m["loss"]), str(m["base_hash"]), int(m.get("carried", 0)), wire, norms)


@dataclass
class Manifest:
    round: int
    members: list[int]  # sorted worker ids whose posts the round uses
    base_hash: str  # θ̄_{r-1} (and the outer state) as the closer held them
    closer: int
    closed_by: str  # "all posted" | "grace"
    expected: list[int] = field(default_factory=list)
    closed_at: float = 0.0  # the closer's wall clock: the next round's posts are due tau_time later

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @staticmethod
    def decode(data: bytes) -> "Manifest":
        return Manifest(**json.loads(data.decode()))


@dataclass
class RoundState:
    """The run's state after round ``round``: identical on every worker that applied it."""

    round: int
    theta: Any  # θ̄ (float32 pytree)
    outer_opt: Any  # the outer optimizer's state, per unit
    detectors: Any  # Detector with leaves [slots, U]: every worker slot's anomaly detectors
    tally: int  # inner steps of every worker, summed over the rounds' posts (the token budget's count)
    cursors: list[int]  # each slot's data cursor as of its newest post in a round
    members: list[int] = field(default_factory=list)  # the round's participants
    finished: bool = False

    @property
    def global_step(self) -> int:
        """The run's step as one program's: inner steps of every slot over the slots (tokens / batch)."""
        return self.tally // len(self.cursors)

    def digest(self) -> str:
        return tree_hash((self.theta, self.outer_opt, self.detectors))

    def encode(self) -> bytes:
        meta = {"round": self.round, "tally": self.tally, "cursors": self.cursors, "members": self.members,
                "finished": self.finished, "hash": self.digest()}
        return pack([np.asarray(x) for x in jax.tree.leaves((self.theta, self.outer_opt, self.detectors))], meta)

    @staticmethod
    def decode(data: bytes, template: "RoundState", what: str) -> "RoundState":
        leaves, m = unpack(data, what)
        want = jax.tree.leaves((template.theta, template.outer_opt, template.detectors))
        if len(leaves) != len(want) or any(a.shape != np.shape(b) for a, b in zip(leaves, want)):
            raise ValueError(f"exchange object {what}: the round state does not fit this config's model "
                             f"({len(leaves)} arrays, expected {len(want)} of the config's shapes)")
        tree = jax.tree.unflatten(jax.tree.structure((template.theta, template.outer_opt, template.detectors)),
                                  leaves)
        out = RoundState(int(m["round"]), *tree, int(m["tally"]), [int(c) for c in m["cursors"]],
                         [int(w) for w in m["members"]], bool(m["finished"]))
        if out.digest() != m["hash"]:
            raise ValueError(f"exchange object {what}: its arrays do not match the hash written with them")
        return out


# ----------------------------------------------------------------------------- the store's view


def newest_round(ex: Exchange) -> int:
    """The newest round with a manifest (0: none yet)."""
    keys = ex.list("rounds/r")
    return _round_of(keys[-1]) if keys else 0


def newest_state(ex: Exchange) -> int | None:
    keys = ex.list("state/r")
    return _round_of(keys[-1]) if keys else None


def read_manifest(ex: Exchange, r: int) -> Manifest | None:
    data = ex.get(manifest_key(r))
    return None if data is None else Manifest.decode(data)


def posted(ex: Exchange, r: int) -> list[int]:
    return sorted(int(k.rsplit("/w", 1)[-1].split(".")[0]) for k in ex.list(f"posts/r{r:08d}/"))


def posted_rounds(ex: Exchange, worker: int) -> list[int]:
    """The rounds holding a post of ``worker`` (those not yet collected)."""
    return sorted(_round_of(k.split("/")[1]) for k in ex.list("posts/r") if k.endswith(f"/w{worker:04d}.npz"))


def live_owner(ex: Exchange, worker: int, me: str, stale_s: float) -> str | None:
    """The process (host:pid) other than ``me`` that announced on slot ``worker`` and may still be
    alive (on this host: its PID exists; on another: it announced within ``stale_s`` seconds)."""
    data = ex.get(hello_key(worker))
    info = json.loads(data.decode()) if data else {}
    host, _, pid = str(info.get("owner", "")).rpartition(":")
    if not host or info["owner"] == me:
        return None
    if host != socket.gethostname():
        return info["owner"] if time.time() - float(info.get("time", 0)) < stale_s else None
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return None
    except PermissionError:
        pass  # exists, another user's
    return info["owner"]


def announced(ex: Exchange) -> dict[int, int]:
    """Workers that said they (re)joined: slot -> the round they will post at first."""
    out = {}
    for key in ex.list("members/w"):
        data = ex.get(key)
        if data:
            info = json.loads(data.decode())
            out[int(info["worker"])] = int(info["round"])
    return out


def expected(ex: Exchange, r: int) -> list[int]:
    """Who round r waits for: the workers whose newest announcement names round r (each worker
    announces the round it will post at next whenever it joins or applies a round, so a worker
    that died is awaited by one round at most, for ``sync.grace`` seconds)."""
    return sorted(w for w, at in announced(ex).items() if at == r)


def collect(ex: Exchange, r: int, closer: int, by_grace: bool, base_hash: str) -> Manifest | None:
    """Close round r if it may close now (everyone expected posted, or ``by_grace``): create the
    manifest; returns the manifest that exists (ours or another closer's), or None (still open)."""
    have, want = posted(ex, r), expected(ex, r)
    everyone = set(want) <= set(have)
    if not have or not (by_grace or everyone):
        return None
    ex.create(manifest_key(r), Manifest(r, have, base_hash, closer, "all posted" if everyone else "grace",
                                        want, time.time()).encode())
    return read_manifest(ex, r)


def retract(ex: Exchange, worker: int) -> None:
    """``worker`` is gone (its launcher saw it die): no round waits for it any more."""
    ex.put(hello_key(worker), json.dumps({"worker": worker, "round": -1, "owner": ""}).encode())


def collect_garbage(ex: Exchange, r: int) -> None:
    """After round r's state is published: posts and states of rounds <= r - KEEP_ROUNDS go."""
    for key in ex.list("posts/r") + ex.list("state/r"):
        if _round_of(key.split("/")[1] if key.startswith("posts/") else key) <= r - KEEP_ROUNDS:
            ex.delete(key)


__all__ = ["Post", "Manifest", "RoundState", "KEEP_ROUNDS", "post_key", "manifest_key", "state_key", "hello_key",
           "newest_round", "newest_state", "read_manifest", "posted", "posted_rounds", "expected", "collect", "collect_garbage",
           "announced", "live_owner", "retract", "tree_hash", "pack", "unpack"]
