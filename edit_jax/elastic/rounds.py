"""The meeting protocol of workers that share only an exchange (``exchange.py``): posts, round
manifests and the published round state, as whole objects under fixed keys.

Round r (r >= 1) turns the round state r - 1 (θ̄, the outer optimizer's state, every worker slot's
anomaly detectors, the step tally) into round state r:

1. each worker that applied round r - 1 trains for ``sync.time.tau`` seconds (a lock-step rule:
   ``sync.tau`` steps), then **posts**
   ``posts/rXXXXXXXX/wYYYY.npz``: its pseudo gradient Δ = θ̄_{r-1} − θ_i (every leaf, float32; with
   a sparse ``sync.wire.kind`` its packed rows and true norms, ``packed.py``), its steps since its
   last round (A-EDiT's step share), its data cursor, its loss;
2. the round **closes** when every expected worker posted (those whose newest announcement,
   ``members/wYYYY.json``, names round r: a worker announces the round it will post at whenever it
   joins or applies a round) or ``sync.exchange.grace`` seconds after the first post that a
   waiting worker saw (each waiter measures from its own post: the earliest poster closes first, so
   the others wait at most ``grace``). Any waiter may close it: it lists the posts and *creates*
   ``rounds/rXXXXXXXX.json`` (the manifest: participants, sorted; the hash of θ̄_{r-1} as the closer
   holds it) create-exclusively: of several closers exactly one wins, and everybody follows the
   manifest that exists;
3. every participant (and anyone catching up) reads exactly the posts the manifest names and runs
   the same outer step, the method's rule (``outer_round.py``: ``stacked.workers_sync`` on the host
   CPU, so hardware never changes the bits); each compares the manifest's hash with its own θ̄_{r-1}
   first, so θ̄ is checked identical on every worker after every round;
4. the closer publishes ``state/rXXXXXXXX.npz`` (the round state: what a joiner and a whole-run
   restart start from) and removes posts and states older than ``KEEP_ROUNDS`` rounds.

A post that arrives after its round closed is late: its worker catches up (applies the rounds it
missed) and, with ``sync.exchange.late_posts=carry``, re-bases its progress onto the new θ̄ (its Δ is part
of its next post), or with ``drop`` restarts from θ̄ (a record says which).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from edit_jax.elastic.exchange import Exchange
from edit_jax.elastic.packed import PACKED, check_post
from edit_jax.elastic.trust import broken_seal, seal
from edit_jax.rundir.integrity import leaves_hash, pack_arrays, unpack_arrays

KEEP_ROUNDS = 8  # posts and published states kept behind the newest round (catch-up by replay)


def post_key(r: int, worker: int) -> str:
    return f"posts/r{r:08d}/w{worker:04d}.npz"


def manifest_key(r: int, version: int = 0) -> str:
    """Round r's manifest; a later ``version`` supersedes it (the round redone without a post that
    could no longer be read, or over a garbled manifest: ``collect(..., version=)``)."""
    return f"rounds/r{r:08d}.json" if version == 0 else f"rounds/r{r:08d}.v{version}.json"


def state_key(r: int) -> str:
    return f"state/r{r:08d}.npz"


def hello_key(worker: int) -> str:
    return f"members/w{worker:04d}.json"


# The keys this protocol writes; anything else in the exchange (an operator's notes, a copy) is
# stray and ignored, never parsed into a round or a worker.
_POST = re.compile(r"^posts/r(\d{8})/w(\d{4})\.npz$")
_MANIFEST = re.compile(r"^rounds/r(\d{8})(?:\.v(\d+))?\.json$")
_STATE = re.compile(r"^state/r(\d{8})\.npz$")


class BadObject(ValueError):
    """An object of the protocol that cannot be read or is not this run's."""


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

    def encode(self, run: str = "", key: bytes | None = None) -> bytes:
        """The post's bytes, sealed with the run id ``run`` and the shared ``key`` (``trust.py``)."""
        meta = {"worker": self.worker, "round": self.round, "steps_since": self.steps_since, "cursor": self.cursor,
                "loss": self.loss, "base_hash": self.base_hash, "carried": self.carried}
        arrays = list(self.delta)
        if self.wire != "none":
            arrays, meta = [*arrays, np.asarray(self.norms, np.float32)], {**meta, "format": PACKED, "wire": self.wire}
        return pack(arrays, seal(meta, arrays, run, key))

    @staticmethod
    def decode(data: bytes, what: str, wire: str = "none") -> "Post":
        """The post at ``what``; ValueError if it is not of this reader's ``wire`` (``packed.check_post``)."""
        return Post.decode_unpacked(*unpack(data, what), what, wire)

    @staticmethod
    def decode_unpacked(leaves: list, m: dict, what: str, wire: str = "none") -> "Post":
        packed = check_post(m, wire, what) == PACKED
        leaves = list(leaves)
        norms = leaves.pop() if packed else None
        return Post(int(m["worker"]), int(m["round"]), leaves, int(m["steps_since"]), int(m["cursor"]),
                    float(m["loss"]), str(m["base_hash"]), int(m.get("carried", 0)), wire, norms)


@dataclass
class PostCheck:
    """What the closer checks of each post before a manifest names it (``problem``; ``trust.py``),
    and what every reader checks of the manifests and states it reads (``run``, ``key``)."""

    run: str = ""  # the run id (run/start.json); "" for a run started before ids: not compared
    wire: str = "none"  # the run's wire name (sync.wire.kind with its options)
    shapes: list | None = None  # the post's arrays' shapes (Δ's leaves, or the packed rows); None: unchecked
    key: bytes | None = None  # the shared secret ($EDIT_JAX_EXCHANGE_KEY)

    def problem(self, data: bytes | None, r: int, worker: int, base_hash: str) -> tuple["Post | None", str | None]:
        """(the decoded post, None), or (None, why the round leaves it out)."""
        if not data:
            return None, "gone" if data is None else "empty"
        what = post_key(r, worker)
        try:
            leaves, meta = unpack(data, what)
            post = Post.decode_unpacked(leaves, meta, what, self.wire)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return None, f"unreadable ({str(e)[:200]})"
        why = broken_seal(meta, leaves, self.run, self.key)
        if why:
            return None, why
        if post.round != r or post.worker != worker:
            return None, f"says round {post.round} worker {post.worker}; its key, round {r} worker {worker}"
        if post.base_hash != base_hash:
            return None, f"made from another θ̄ (hash {post.base_hash}; the round's {base_hash})"
        if self.shapes is not None and [np.shape(x) for x in post.delta] != [tuple(s) for s in self.shapes]:
            return None, "its arrays' shapes are not this run's"
        return post, None


@dataclass
class Manifest:
    round: int
    members: list[int]  # sorted worker ids whose posts the round uses
    base_hash: str  # θ̄_{r-1} (and the outer state) as the closer held them
    closer: int
    closed_by: str  # "all posted" | "live posted" (the rest's heartbeats stopped) | "grace"
    expected: list[int] = field(default_factory=list)
    closed_at: float = 0.0  # the closer's wall clock: the next round's posts are due tau_time later
    rejected: dict = field(default_factory=dict)  # slot -> why its post was left out (PostCheck)
    version: int = 0  # > 0: this manifest supersedes the round's earlier ones (``collect``)
    redone: str = ""  # why the round was redone (a named post that could no longer be read)

    def encode(self, run: str = "", key: bytes | None = None) -> bytes:
        return json.dumps(seal(self.__dict__, None, run, key), sort_keys=True).encode()

    @staticmethod
    def decode(data: bytes, what: str = "manifest", check: "PostCheck | None" = None) -> "Manifest":
        """The manifest; ``BadObject`` naming ``what`` if it is not a readable one of this run."""
        try:
            meta = json.loads(data.decode())
            why = broken_seal(meta, None, check.run, check.key) if check is not None else None
            if why:
                raise ValueError(why)
            known = {k: meta[k] for k in Manifest.__dataclass_fields__ if k in meta}
            m = Manifest(**known)
            m.members = sorted(int(w) for w in m.members)
            m.round, m.closer, m.version = int(m.round), int(m.closer), int(m.version)
            m.expected = [int(w) for w in m.expected]
            m.closed_at = float(m.closed_at)
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise BadObject(f"exchange object {what}: not a readable manifest of this run ({str(e)[:200]})") from None
        return m


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
    # The rule's own state kept between rounds (``SyncRule.pooled_extra``: CO2's mean pseudo gradient
    # in flight); None for the others, whose states' bytes and hashes are as before it existed.
    extra: Any = None

    @property
    def global_step(self) -> int:
        """The run's step as one program's: inner steps of every slot over the slots (tokens / batch)."""
        return self.tally // len(self.cursors)

    def arrays(self) -> tuple:
        """What the state's bytes and hash hold: θ̄, the outer state, the detectors, the rule's extra."""
        return self.theta, self.outer_opt, self.detectors, self.extra

    def digest(self) -> str:
        return tree_hash(self.arrays())

    def encode(self, run: str = "", key: bytes | None = None, publisher: str = "") -> bytes:
        """The state's bytes; ``publisher`` (host:pid) makes two processes' bytes of one state differ,
        so a create whose answer was lost can tell its own object from another publisher's."""
        meta = {"round": self.round, "tally": self.tally, "cursors": self.cursors, "members": self.members,
                "finished": self.finished, "hash": self.digest(), **({"publisher": publisher} if publisher else {})}
        leaves = [np.asarray(x) for x in jax.tree.leaves(self.arrays())]
        return pack(leaves, seal(meta, None, run, key))  # (its checksum: the hash of its arrays)

    @staticmethod
    def decode(data: bytes, template: "RoundState", what: str, check: PostCheck | None = None) -> "RoundState":
        leaves, m = unpack(data, what)
        why = broken_seal(m, None, check.run, check.key) if check is not None else None
        if why:
            raise BadObject(f"exchange object {what}: {why}")
        want = jax.tree.leaves(template.arrays())
        if len(leaves) != len(want) or any(a.shape != np.shape(b) for a, b in zip(leaves, want, strict=True)):
            raise ValueError(f"exchange object {what}: the round state does not fit this config's model "
                             f"({len(leaves)} arrays, expected {len(want)} of the config's shapes)")
        theta, outer_opt, detectors, extra = jax.tree.unflatten(jax.tree.structure(template.arrays()), leaves)
        out = RoundState(int(m["round"]), theta, outer_opt, detectors, int(m["tally"]), [int(c) for c in m["cursors"]],
                         [int(w) for w in m["members"]], bool(m["finished"]), extra)
        if out.digest() != m["hash"]:
            raise ValueError(f"exchange object {what}: its arrays do not match the hash written with them")
        return out


# ----------------------------------------------------------------------------- the store's view


def _rounds(keys: list[str], pattern: re.Pattern) -> list[int]:
    return sorted({int(m.group(1)) for m in map(pattern.match, keys) if m})


def newest_round(ex: Exchange) -> int:
    """The newest round with a manifest (0: none yet)."""
    rounds = _rounds(ex.list("rounds/r"), _MANIFEST)
    return rounds[-1] if rounds else 0


def state_rounds(ex: Exchange) -> list[int]:
    """The rounds with a published state, oldest first."""
    return _rounds(ex.list("state/r"), _STATE)


def newest_state(ex: Exchange) -> int | None:
    rounds = state_rounds(ex)
    return rounds[-1] if rounds else None


def manifest_versions(ex: Exchange, r: int) -> list[int]:
    """The versions of round r's manifest that exist, oldest first."""
    return sorted(int(m.group(2) or 0) for m in map(_MANIFEST.match, ex.list(f"rounds/r{r:08d}")) if m)


def read_manifest(ex: Exchange, r: int, check: PostCheck | None = None) -> Manifest | None:
    """Round r's newest manifest version, or None (the round is open). ``BadObject`` if that
    version cannot be read (garbled, another run's): the reader redoes the round (``collect``
    with the next version), since a manifest, created once, is never overwritten."""
    versions = manifest_versions(ex, r)
    if not versions:
        return None
    key = manifest_key(r, versions[-1])
    data = ex.get(key)
    if data is None:
        raise BadObject(f"exchange object {key}: listed but gone")
    m = Manifest.decode(data, key, check)
    if m.round != r or m.version != versions[-1]:
        raise BadObject(f"exchange object {key}: says round {m.round} version {m.version}")
    return m


def posted(ex: Exchange, r: int) -> list[int]:
    return sorted(int(m.group(2)) for m in map(_POST.match, ex.list(f"posts/r{r:08d}/")) if m)


def posted_rounds(ex: Exchange, worker: int) -> list[int]:
    """The rounds holding a post of ``worker`` (those not yet collected)."""
    return sorted(int(m.group(1)) for m in map(_POST.match, ex.list("posts/r")) if m and int(m.group(2)) == worker)


def _member(ex: Exchange, key: str) -> dict:
    """A member announcement, or {} if it is not a readable one (skipped: a worker announces again
    at its next round, and a round waits at most ``sync.exchange.grace`` for a slot it cannot read)."""
    data = ex.get(key)
    try:
        info = json.loads(data.decode()) if data else {}
        if not isinstance(info, dict):
            return {}
        int(info.get("worker", 0)), int(info.get("round", 0)), int(info.get("beat", 0))
        return info
    except (ValueError, TypeError, UnicodeDecodeError):
        return {}


def live_owner(ex: Exchange, worker: int, me: str, stale_s: float) -> str | None:
    """The process (host:pid) other than ``me`` that announced on slot ``worker`` and may still be
    alive (on this host: its PID exists; on another: it announced within ``stale_s`` seconds)."""
    info = _member(ex, hello_key(worker))
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


def members(ex: Exchange) -> dict[int, dict]:
    """Every readable member announcement, read once: slot -> its fields (``announced`` and
    ``beats`` take what they need from one such read)."""
    out = {}
    for key in ex.list("members/w"):
        info = _member(ex, key)
        if "worker" in info:
            out[int(info["worker"])] = info
    return out


def _field_of(ex: Exchange, name: str, of: dict[int, dict] | None) -> dict[int, int]:
    """Slot -> the announcement's integer ``name``, for those that carry it."""
    return {w: int(info[name]) for w, info in (members(ex) if of is None else of).items() if name in info}


def announced(ex: Exchange, of: dict[int, dict] | None = None) -> dict[int, int]:
    """Workers that said they (re)joined: slot -> the round they will post at first (``of``: a
    ``members`` read to take it from; None: read now)."""
    return _field_of(ex, "round", of)


def beats(ex: Exchange, of: dict[int, dict] | None = None) -> dict[int, int]:
    """Workers whose announcement carries a heartbeat counter (``heartbeat.py``): slot -> its count."""
    return _field_of(ex, "beat", of)


def expected(ex: Exchange, r: int, behind: int = 0, of: dict[int, dict] | None = None) -> list[int]:
    """Who round r waits for: the workers whose newest announcement names round r (each worker
    announces the round it will post at next whenever it joins or applies a round, so a worker
    that died is awaited by one round at most, for ``sync.exchange.grace`` seconds). ``behind``: also those
    whose announcement names one of the ``behind`` rounds before (a lock-step rule's rounds close
    on posts, not on the clock: a worker a round behind, catching up, would otherwise never be
    awaited by a faster one and post late to every round)."""
    return sorted(w for w, at in announced(ex, of).items() if r - behind <= at <= r)


def collect(ex: Exchange, r: int, closer: int, by_grace: bool, base_hash: str, check: PostCheck | None = None,
            version: int = 0, redone: str = "", only: list[int] | None = None, behind: int = 0,
            stalled: Callable[[dict[int, int]], set[int]] | None = None) -> Manifest | None:
    """Close round r if it may close now (everyone expected posted, or ``by_grace``): create the
    manifest naming the posts that pass ``check`` (the others listed with why, ``rejected``);
    returns the manifest that exists (ours or another closer's), or None (still open, or no post
    passed yet). ``version`` > 0: redo the round (``read_manifest``), ``redone`` saying why, from
    the posts in ``only`` (the earlier version's members: a post that came after it closed was
    late, and its worker carried its steps into its next post; None: any, the earlier unreadable).
    ``behind``: ``expected``'s (1 for a lock-step rule's rounds). ``stalled``: of the workers' beats, those
    whose heartbeat stopped (``heartbeat.BeatWatch.stalled``): not waited for ("live posted" once the
    others have). The announcements are read once for both."""
    of = members(ex)
    have, want = posted(ex, r), expected(ex, r, behind, of)
    gone = stalled(beats(ex, of)) if stalled is not None else set()
    live = [w for w in want if w not in gone]
    if only is not None:
        have = [w for w in have if w in only]
    everyone = set(want) <= set(have)  # (a slot whose post was left out cannot post again this round)
    if not have or not (by_grace or set(live) <= set(have)):
        return None
    good, rejected = have, {}
    if check is not None:
        verdicts = {w: check.problem(ex.get(post_key(r, w)), r, w, base_hash)[1] for w in have}
        good = [w for w in have if verdicts[w] is None]
        rejected = {str(w): why for w, why in verdicts.items() if why is not None}
    if not good:
        return None
    # Who the round waited for: those still announced at r, and those who posted (they announced r,
    # then moved on to r + 1 at their post; ``expected`` alone is nearly always empty by now).
    waited = sorted(set(want) | set(have))
    how = "all posted" if everyone else "live posted" if set(live) <= set(have) else "grace"
    m = Manifest(r, good, base_hash, closer, how, waited, time.time(), rejected, version, redone)
    ex.create(manifest_key(r, version), m.encode(check.run if check else "", check.key if check else None))
    return read_manifest(ex, r, check)


def retract(ex: Exchange, worker: int) -> None:
    """``worker`` is gone (its launcher saw it die): no round waits for it any more."""
    ex.put(hello_key(worker), json.dumps({"worker": worker, "round": -1, "owner": ""}).encode())


def collect_garbage(ex: Exchange, r: int) -> None:
    """After round r's state is published: posts and states of rounds <= r - KEEP_ROUNDS go."""
    for key in ex.list("posts/r") + ex.list("state/r"):
        m = _POST.match(key) or _STATE.match(key)
        if m and int(m.group(1)) <= r - KEEP_ROUNDS:
            ex.delete(key)


__all__ = ["Post", "PostCheck", "BadObject", "Manifest", "RoundState", "manifest_versions", "state_rounds",
           "KEEP_ROUNDS", "post_key", "manifest_key", "state_key", "hello_key",
           "newest_round", "newest_state", "read_manifest", "posted", "posted_rounds", "expected", "collect",
           "collect_garbage", "announced", "beats", "members", "live_owner", "retract", "tree_hash", "pack", "unpack"]
