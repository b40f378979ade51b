"""One worker as its own program, meeting the others only through the exchange (A-EDiT's rounds by
wall clock; DiLoCo's, EDiT's and Post Local SGD's after ``sync.tau`` steps of each worker).

    edit-jax worker CONFIG --worker I --run-dir RUN [key=value ...]     # what the launcher starts

Set up: the method plan, this worker's mesh (its own devices, ``mesh.shard`` of them), the local
step program, the data (its slot's rows of the global batch), the exchange. Then one plain loop:

    join: the newest round state (published, then replayed up to the newest manifest)
    until the token budget is spent:
        local steps for sync.time.tau seconds (a lock-step rule: sync.tau steps)
        post Δ = θ̄ − θ_i to round r; wait for round r's manifest (closing it when due)
        apply round r (and any it missed); restart from θ̄ (a late post: carried or dropped)

No JAX collective spans two workers: a worker that dies, stops or joins changes only the rounds'
membership (``rounds.py``). Records (``RUN/metrics.jsonl``): each worker's training, each round's
(by its closer: members, who was late, the sync's figures), θ̄'s evaluations. Exit: 0 (budget spent), 130 (signal).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import replace

import jax
import numpy as np

from edit_jax.config import Config, WireConfig, dumps
from edit_jax.data import check_model_vocab, load_corpus, make_train_stream, val_batches
from edit_jax.elastic import packed as PK
from edit_jax.elastic import progress as PG
from edit_jax.elastic import rounds as R
from edit_jax.elastic import trust as T
from edit_jax.elastic.admission import NotAdmitted, admit, write_run_config
from edit_jax.elastic.exchange import Exchange
from edit_jax.elastic.keys import ExchangeError, ExchangeUnavailable
from edit_jax.elastic.local_training import Local, LocalTraining
from edit_jax.elastic.recovery import RoundRecovery, Published
from edit_jax.elastic.outer_round import OuterRound
from edit_jax.elastic.heartbeat import BeatWatch, Heartbeat, beat_interval
from edit_jax.elastic.patience import open_patient
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.methods import LOCAL, plan_for
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.rundir.records import replace_file, worker_log
from edit_jax.rundir.runlock import exchange_problem
from edit_jax.runtime import multihost
from edit_jax.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_RETRY
from edit_jax.runtime.executables import ExecutableStore
from edit_jax.runtime.mesh import make_mesh
from edit_jax.runtime.multihost import parse_slowdown

POLL_S = 0.05  # how often a waiting worker looks at the exchange
EXCHANGE_STATE = "exchange_state.npz"  # the newest saved round state in the run dir (rundir/trained.py)


class SlotInUse(RuntimeError):
    """Another live worker holds this worker slot."""


class RoundMismatch(RuntimeError):
    """This worker's θ̄ differs from the one the round's closer held, and no published state has
    the closer's (``ElasticWorker.adopt_published``)."""


class ElasticWorker(LocalTraining, RoundRecovery):
    def __init__(self, cfg: Config, worker: int, run_dir: str, say=print, exchange: Exchange | None = None):
        self.cfg = cfg
        if not cfg.sync.exchange.url and exchange is None:
            raise ValueError("sync.exchange.url: required for an elastic worker (a directory or s3://bucket/prefix)")
        if not 0 <= worker < cfg.mesh.replica:
            raise ValueError(f"--worker: expected a worker slot 0..{cfg.mesh.replica - 1} (mesh.replica slots), "
                             f"got {worker}")
        self.me, self.run_dir, self.say = worker, run_dir, say
        # before the exchange is opened (which makes it)
        if problem := exchange_problem(run_dir, cfg.sync.exchange.url):
            raise NotAdmitted(problem)
        # Storage faults waited out for sync.exchange.patience (patience.py), the open included.
        self.ex = exchange or open_patient(cfg.sync.exchange.url, cfg.sync.exchange.patience, say,
                                           f"edit-jax worker {worker}")
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        every_s, quiet_s = beat_interval(cfg.sync.exchange.grace)
        self.heartbeat, self.watch = Heartbeat(self.ex, worker, self.owner, every_s), BeatWatch(quiet_s)
        # Admitted before anything is written (no run-dir file, record or post): the run's config,
        # with the run's `steps`, or NotAdmitted (admission.py); then its slot, before any work.
        method_plan = plan_for(admit(self.ex, cfg, run_dir, say))
        self.cfg = cfg = method_plan.cfg
        self.check_slot_free()
        self.plan = method_plan.plan
        lcfg = multihost.local_config(cfg)
        # Its own program only steps (the posts are encoded on the host): no residual buffer on its devices.
        lcfg = replace(lcfg, sync=replace(lcfg.sync, wire=WireConfig()))
        self.mesh = make_mesh(lcfg.mesh, jax.local_devices()[:cfg.mesh.shard])
        self.loc = StepPrograms.for_config(lcfg, self.mesh)
        self.exe = ExecutableStore.in_compile_cache(dumps(cfg))  # a restart loads its programs whole (no trace)
        self.local_step = self.exe.lazy("local_step", self.loc.step_fn(LOCAL), list(self.mesh.devices.flat))
        corpus = load_corpus(cfg.data)
        check_model_vocab(corpus, cfg.model.vocab_size)
        self.stream = make_train_stream(corpus, cfg.data.seq_len, cfg.batch_size, cfg.mesh.replica, cfg.data.seed)
        self.val = (val_batches(corpus, cfg.data.seq_len, cfg.batch_size // cfg.mesh.replica, cfg.eval_batches)
                    if cfg.eval_batches else [])
        self.codec = Codec.from_sync(cfg.sync)
        self.wire = self.codec.name  # what the posts and records carry
        self.outer = OuterRound(self.plan, self.codec, cfg.sync.exchange.carried_weight, self.exe)
        self._encode = jax.jit(lambda d, e: PK.encode_post(d, e, self.codec, self.outer.layerwise))
        self.my_flags: dict[int, list] = {}  # round -> this worker's per-unit flags (packed posts' residual)
        self.applied: tuple | None = None  # the last round applied here: (manifest, posts without Δ, figures)
        self.target = cfg.steps * cfg.mesh.replica  # the token budget in inner steps of one worker's rows
        self.slow = parse_slowdown(cfg.debug.slowdown).get(worker, 1.0)
        self.stop, self.compiled = False, False
        self.last_posted_at: float | None = None  # (monotonic) this worker's previous post: a round's length
        self._eval_fn = None  # compiled at the first evaluation
        self.t0 = self._start_time()
        self.log = worker_log(run_dir)  # whole lines, shared with the other workers
        self.progress_file, self.progress_s = PG.progress_path(run_dir, worker), 0.0

    # -- records -----------------------------------------------------------------------------------

    def _start_time(self) -> float:
        key = T.exchange_key()
        start, run = T.run_start(self.ex, self.say, key)  # the run's id: what its objects are sealed with
        self.check = R.PostCheck(run, self.wire, None, key)
        os.makedirs(self.run_dir, exist_ok=True)
        write_run_config(self.ex, self.run_dir, self.me)  # the run's config, never this worker's own
        return start

    def record(self, rec: dict) -> None:
        self.log.write({**rec, "time": round(time.time() - self.t0, 3)})

    # -- the round state ---------------------------------------------------------------------------

    def _template(self) -> R.RoundState:
        key = jax.random.key(self.cfg.seed)  # the same initial params on every worker (the seed)
        state = self.exe.compile("init_state", self.loc.layout.init_fn(), (key,), list(self.mesh.devices.flat))(key)
        theta = jax.tree.map(lambda x: np.asarray(x)[0], jax.device_get(state.params))
        units = 1 + self.cfg.model.n_layers if self.outer.layerwise else 1
        self.initial_state = state
        return self.outer.initial(theta, self.cfg.mesh.replica, units, max(2, self.plan.penalty.warmup))

    def join(self) -> R.RoundState:
        """The newest round state: round 0 created if nobody did yet; the newest published state,
        then every later round replayed from its posts (``self.caught_up``: how long each took)."""
        self.template = template = self._template()
        if R.newest_state(self.ex) is None:  # a new run (not again once round 0 was collected)
            self.ex.create(R.state_key(0), template.encode(self.check.run, self.check.key))
        if self.wire == "none":  # (packed rows: their shapes from this worker's first post)
            self.check.shapes = [np.shape(t) for t in jax.tree.leaves(template.theta)]
        t = time.perf_counter()
        shared = self._newest_good_state(0)
        r = shared.round
        read_s, shared = time.perf_counter() - t, self.catch_up(shared)
        self.caught_up = {"read_s": read_s, "catch_up_s": time.perf_counter() - t, "replayed": shared.round - r}
        shared.finished = shared.tally >= self.target  # this config's budget (a restart may raise `steps`)
        return shared

    def catch_up(self, shared: R.RoundState) -> R.RoundState:
        while True:
            try:
                m = self.manifest(shared, shared.round + 1)
            except Published as p:
                return self._published_at_least(p.round)
            if m is None:
                return shared
            shared = self.apply(shared, m)

    def apply(self, shared: R.RoundState, m: R.Manifest) -> R.RoundState:
        """Round ``m.round`` applied to ``shared`` (round m.round - 1): the posts the manifest names
        (each checked again: one damaged or removed since the round closed redoes the round)."""
        if m.base_hash != shared.digest():
            shared = self.adopt_published(shared, m)
        posts = []
        try:
            for w in m.members:
                post, why = self.check.problem(self.ex.get(R.post_key(m.round, w)), m.round, w, m.base_hash)
                if why == "gone" and self._newest_good_state(m.round, required=False) is not None:
                    raise Published(m.round)  # collected: too far behind to replay; the published state
                if why:
                    return self.apply(shared, self.redo(shared, m.round, f"worker {w}'s post is {why}", m.members))
                posts.append(post)
        except Published as p:
            return self._published_at_least(p.round)
        new, figures = self.outer.apply(shared, posts)
        if self.me in m.members and "unit_flagged" in figures:
            self.my_flags[m.round] = [u[m.members.index(self.me)] for u in figures["unit_flagged"]]
        new.finished = new.tally >= self.target
        if m.closer == self.me:
            last = self.applied  # the round before, if this process applied it (its closer's to publish)
            if last and last[0].round == shared.round and last[0].closer != self.me:
                # Its closer died between its manifest and its state:
                # this round's closer publishes that state and writes its record, else it has neither.
                self._publish(shared, *last, published_for=last[0].closer)
            self._publish(new, m, posts, figures)
        # What this round's record needs, without Δ (the state it made is the next round's `shared`)
        self.applied = (m, [replace(p, delta=[], norms=None) for p in posts], figures)
        return new

    def adopt_published(self, shared: R.RoundState, m: R.Manifest) -> R.RoundState:
        """This worker's θ̄ differs from the closer's (hosts whose CPUs round differently, say): take
        the published round state the closer holds, recorded; with none, stop with the hashes."""
        theirs = self._state(shared.round)
        if theirs is None or theirs.digest() != m.base_hash:
            raise RoundMismatch(f"round {m.round}: worker {self.me}'s θ̄ (hash {shared.digest()}) differs from the "
                                f"closer's (worker {m.closer}, hash {m.base_hash}) and no published state matches")
        self.record({"step": shared.global_step, "worker": self.me, "theta_resync": shared.round,
                     "mine": shared.digest(), "closers": m.base_hash})
        theirs.finished = shared.finished
        return theirs

    def _published_at_least(self, r: int) -> R.RoundState:
        return self.catch_up(self._newest_good_state(r))

    def _publish(self, new: R.RoundState, m: R.Manifest, posts: list[R.Post], figures: dict,
                 published_for: int | None = None) -> None:
        """Round ``new.round``'s state into the exchange and its record into the run dir, once: the
        state is created exclusively, and only the process that created it records the round (a
        restarted closer replaying its round, or two publishers of a dead closer's, write nothing)."""
        key = R.state_key(new.round)
        if self.ex.list(key) or not self.ex.create(key, new.encode(self.check.run, self.check.key, self.owner)):
            return
        R.collect_garbage(self.ex, new.round)
        slots = self.cfg.mesh.replica
        per_slot = lambda v: [v[m.members.index(w)] if w in m.members else None for w in range(slots)]
        step = new.global_step
        self.record({"step": step, "global_step": step, "sync": True, "round": new.round, "members": m.members,
                     "expected": m.expected, "closed_by": m.closed_by, "theta_hash": new.digest(),
                     "pseudo_grad_norm": per_slot(figures["pseudo_grad_norm"]), "weight": per_slot(figures["weight"]),
                     "flagged": per_slot(figures["flagged"]), "clip_factor": figures["clip_factor"],
                     "outer_update_norm": figures["outer_update_norm"],
                     "steps": [p.steps_since for p in posts], "carried": [p.carried for p in posts],
                     "cursors": [p.cursor for p in posts], "finished": new.finished,
                     **({"rejected": m.rejected} if m.rejected else {}),
                     **({"version": m.version} if m.version else {}),
                     **({"published_for": published_for} if published_for is not None else {})})
        before = (new.tally - sum(p.steps_since for p in posts)) // slots
        crossed = lambda every: new.finished or (every > 0 and step // every > before // every)
        save, evaluate = crossed(self.cfg.checkpoint_every), self.val and crossed(self.cfg.eval_every)
        model = self.outer.flushed(new) if save or evaluate else new  # (CO2: its last round applied)
        if save:  # what `edit-jax sample / export` read (rundir/trained.py)
            self.save_model(model)
        if evaluate:
            self.record({"step": step, "val_loss": self.evaluate(model.theta), "round": new.round})

    def save_model(self, state: R.RoundState) -> None:
        """The round state as ``RUN/exchange_state.npz`` (written aside, then renamed over): the run's
        model, what its rule had in flight applied (``OuterRound.flushed``: CO2's last round)."""
        path = os.path.join(self.run_dir, EXCHANGE_STATE)
        replace_file(path, state.encode(), tmp=f"{path}.w{self.me}.tmp")

    # -- local training ----------------------------------------------------------------------------

    def due_in(self, shared: R.RoundState) -> float:
        """Seconds of training before this worker's next post: the next round's posts are due
        ``tau_time`` after the last round closed, so a worker that joined or caught up mid-round
        posts with the others instead of a round late (clocks on different hosts: NTP-close)."""
        try:
            m = R.read_manifest(self.ex, shared.round, self.check) if shared.round else None
        except R.BadObject:
            m = None
        if m is None or not m.closed_at:
            return self.cfg.sync.time.tau
        return min(self.cfg.sync.time.tau, max(0.0, self.cfg.sync.time.tau - (time.time() - m.closed_at)))

    def announce(self, r: int) -> None:
        """Round r will wait for this worker (``rounds.expected``); the announcement names this
        process, so a second worker started on the same slot is refused (``check_slot_free``), and
        carries its heartbeat (``heartbeat.py``: a closer stops waiting for a stopped process)."""
        self.heartbeat.announce(r)

    def check_slot_free(self) -> None:
        """Refuses to start on a slot another live process announced on (``rounds.live_owner``)."""
        other = R.live_owner(self.ex, self.me, self.owner, 2 * (self.cfg.sync.time.tau + self.cfg.sync.exchange.grace))
        if other:
            raise SlotInUse(f"--worker {self.me}: slot {self.me} of exchange {self.ex.url} is in use by "
                            f"{other} (host:pid); pick another slot (0..{self.cfg.mesh.replica - 1}) or stop it")

    def post(self, shared: R.RoundState, local: Local, loss: float) -> tuple[R.Post, bool, list]:
        """This worker's post to the next round; False if a post of this slot is already there (this
        worker's, from before a restart): posts are immutable, so every reader of the round reads
        the same one, and this worker's newer progress is carried as a late post's would be. Also
        Δ's leaves (float32: what a late post carries). Packed posts: ``packed.encode_post`` on the
        host CPU, the new residual pending in ``local`` until the round says it was used."""
        delta = self.delta_of(shared, jax.device_get(local.state.params))
        post = R.Post(self.me, shared.round + 1, delta, local.since, local.done, loss, shared.digest(), local.carried)
        if self.wire != "none":
            cpu = jax.devices("cpu")[0]
            tree = jax.tree.unflatten(jax.tree.structure(shared.theta), delta)
            rows, norms, pending = jax.device_get(self._encode(jax.device_put(tree, cpu),
                                                               jax.device_put(local.residual, cpu)))
            post.delta, post.norms, post.wire = [np.asarray(r) for r in rows], np.asarray(norms), self.wire
            local.pending = [np.asarray(e) for e in pending]
            if self.check.shapes is None:  # every worker's rows have these shapes (one config: admission.py)
                self.check.shapes = [np.shape(x) for x in post.delta]
        data, key = post.encode(self.check.run, self.check.key), R.post_key(post.round, self.me)
        fresh = self.ex.create(key, data)
        if not fresh and self.check.problem(self.ex.get(key), post.round, self.me, post.base_hash)[1] is not None:
            # Junk in this worker's own slot (not its own post from before a restart): no manifest
            # can name it (the closer checks), so it goes, and this post takes its place.
            self.ex.delete(key)
            fresh = self.ex.create(key, data)
        return post, fresh, delta

    def patience(self, posted_at: float) -> float:
        """How long after its post this worker waits for the others before it closes the round
        without them: ``sync.exchange.grace``; for a lock-step rule, plus this worker's last round (post to
        post). Lock-step rounds close on posts: with the grace alone, a worker whose tau steps take
        more than a grace longer (a restart compiling beside it, one resumed after a stop) posts to
        a round already closed, carries its steps, and is late again at the next round: the fastest
        worker ran alone for minutes under the kill loop (docs/benchmarks/elastic.md). Awaiting a
        round's length more keeps a worker up to one round slower in every round."""
        grace = self.cfg.sync.exchange.grace
        if self.plan.rule.asynchronous or self.last_posted_at is None:
            return grace
        return grace + max(posted_at - self.last_posted_at, 0.0)

    def await_round(self, shared: R.RoundState) -> R.Manifest | None:
        """Round shared.round + 1's manifest: read, or written by this worker when the round is due
        (everyone expected posted, or ``patience`` seconds since this worker posted)."""
        r, posted_at = shared.round + 1, time.monotonic()
        patience, self.last_posted_at = self.patience(posted_at), posted_at
        poll = getattr(self.ex, "poll_s", POLL_S)  # object stores: fewer requests
        while not self.stop:
            try:
                m = self.manifest(shared, r)
            except Published:  # redone elsewhere and published: catch_up takes the state (this post: late)
                return R.Manifest(r, [], "", -1, "published")
            if m is not None:
                return m
            m = R.collect(self.ex, r, self.me, time.monotonic() - posted_at >= patience, shared.digest(),
                          self.check, behind=0 if self.plan.rule.asynchronous else 1,
                          stalled=self.watch.stalled)
            if m is not None:
                return m
            time.sleep(poll)
        return None

    def counts_to_compile(self, shared: R.RoundState) -> list[int]:
        """The participant counts whose outer step this worker compiles ahead (the rest when a round
        needs them): at the run's first start (round 0) every count 1..slots, nearest to all slots
        first (a round whose membership changed would wait seconds on a compile); a restarted or
        joining worker, from the cache, only its first round's count (the last round's members with
        itself: loading all cost ~1.3 CPU s of a ~3.5 s restart, docs/benchmarks/elastic-runs.md).
        Without a cache, all."""
        slots = self.cfg.mesh.replica
        if shared.round == 0 or self.cfg.train.compile_cache in ("", "off"):
            return sorted(range(1, slots + 1), key=lambda c: (abs(c - slots), -c))
        return [min(slots, len(set(shared.members) | {self.me}))]

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Trains, posts and applies rounds until the run ends (0) or a signal stops it (130)."""
        try:
            return self._run()
        finally:
            self.heartbeat.close()  # (a worker that returns is no longer alive to the closers)

    def _run(self) -> int:
        shared = self.join()
        local = Local(self.initial_state, done=shared.cursors[self.me])
        local.state = self.restart_from(shared, local.state, count=local.done)
        if self.wire != "none":  # the residual lives in this process: zeros, unless its saved progress resumes
            local.residual = PK.zero_residual(shared.theta, self.outer.layerwise, self.codec)
        resumed = self.cfg.sync.exchange.progress_every > 0 and self.resume_progress(shared, local)
        wire = {"wire": self.wire, "residual": "saved" if resumed else "zeros"} if self.wire != "none" else {}
        self.record({"step": shared.global_step, "worker": self.me, "joined": shared.round, **self.caught_up, **wire})
        self.say(f"edit-jax worker {self.me}: joined at round {shared.round} (data cursor {local.done})")
        self.outer.precompile(shared, self.counts_to_compile(shared))  # in the background
        while not shared.finished:
            loss = self.train_for(local, self.due_in(shared), lambda r=shared.round + 1: self.announce(r),
                                  aligned=shared.round > 0, save=lambda s=shared: self.save_progress(s, local),
                                  steps=None if self.plan.rule.asynchronous else self.cfg.sync.tau)
            if self.stop:
                return EXIT_INTERRUPTED
            post, fresh, delta = self.post(shared, local, loss)
            self.announce(post.round + 1)  # expected next round even while this one is still being applied
            m = self.await_round(shared)
            if m is None:
                return EXIT_INTERRUPTED
            shared = self.catch_up(shared)
            if fresh and self.me in m.members:
                if self.wire != "none":  # the round used the post: its residual, zeroed where flagged
                    flags = self.my_flags.pop(post.round, None)
                    self.my_flags.clear()  # older rounds' (a replay's): no post of this process pends on them
                    local.residual = PK.settle_residual(local.pending, flags, self.outer.layerwise)
                local.state = self.restart_from(shared, local.state)
                local.since, local.carried = 0, 0
                continue
            # Late: the round closed without this worker's post (it was stopped, or slow).
            carry = self.cfg.sync.exchange.late_posts == "carry"
            # (a packed post not used sent nothing: the residual stays what it was before it)
            delta = jax.tree.unflatten(jax.tree.structure(shared.theta), delta) if carry else None
            local.state = self.restart_from(shared, local.state, delta=delta, stale=True)
            if carry:
                local.carried = local.since
            else:
                local.since = 0
            self.record({"step": shared.global_step, "worker": self.me, "late_post": post.round,
                         "late_steps": post.steps_since, "late_posts": self.cfg.sync.exchange.late_posts,
                         "caught_up_to": shared.round})
        self.hand_over_last(shared)
        self.record({"step": shared.global_step, "worker": self.me, "finished_round": shared.round,
                     "theta_hash": shared.digest()})
        self.say(f"edit-jax worker {self.me}: the run's token budget is spent (round {shared.round}); exiting")
        return 0


def run_worker(cfg: Config, worker: int, run_dir: str, say=print) -> int:
    """Runs worker ``worker`` until the run ends (0) or a signal stops it (130)."""
    try:
        w = ElasticWorker(cfg, worker, run_dir, say)
    except ExchangeUnavailable as e:  # storage down past the patience: exit 75, started again later
        say(f"edit-jax worker {worker}: {e}; exit {EXIT_RETRY} (retry)")
        return EXIT_RETRY
    except (SlotInUse, NotAdmitted, ExchangeError) as e:  # exit 2: the launcher does not start it again
        say(f"edit-jax: {'' if isinstance(e, SlotInUse) else 'bad config: '}{e}")
        return EXIT_BAD_INPUT

    def on_signal(signum, frame):
        del signum, frame
        w.stop = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    w.ex.stopped = lambda: w.stop
    try:
        return w.run()
    except ExchangeUnavailable as e:
        if w.stop:  # a signal ended its wait for the storage
            return EXIT_INTERRUPTED
        say(f"edit-jax worker {worker}: {e}; exit {EXIT_RETRY} (retry)")
        return EXIT_RETRY
    except ExchangeError as e:  # (e.g. the bucket deleted or the credentials revoked under the run)
        say(f"edit-jax worker {worker}: {e}")
        return EXIT_FAILED
    finally:
        w.outer.close()  # no compile thread left running into the interpreter's exit
        w.heartbeat.close()


__all__ = ["ElasticWorker", "run_worker", "RoundMismatch", "SlotInUse"]
