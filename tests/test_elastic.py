"""A-EDiT's workers as separate programs meeting through an exchange (edit_jax/elastic, issue 38).

- a round's outer step from posts equals the collective meeting (``sync_unit`` with ``ReplicaPsum``
  over a real ``replica`` mesh axis) on the same pseudo gradients, and a NumPy hand case;
- the protocol on a directory: who a round waits for, closing by everyone or by grace, one
  manifest among racing closers, garbage collection, objects complete or reported;
- two workers in threads of this process train to the token budget with θ̄ identical on both
  after every round, a late worker and a finished run's restart;
- real processes (``edit-jax train`` with sync.exchange.url): a worker SIGKILLed is restarted alone, a
  SIGSTOPped one is left out of rounds within grace and comes back, a worker started by hand joins.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from edit_jax.elastic import rounds as R
from edit_jax.elastic.exchange import DirExchange
from edit_jax.elastic.outer_round import OuterRound
from edit_jax.localsgd.layerwise import LayerwiseSync
from edit_jax.localsgd.methods import OuterSpec, Penalty, Plan
from edit_jax.localsgd.outer import Detector, make_outer_optimizer, sync_unit
from edit_jax.localsgd.reduction import ReplicaPsum
from edit_jax.localsgd.sharding import REPLICA
from edit_jax.localsgd.timed import Timed
from edit_jax.rundir.records import read_records
from tests.stages import one_stage

A_EDIT_RULE = Timed(LayerwiseSync())  # A-EDiT's rule, as plan_for builds it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _theta(rng, layers=2):
    return {"root": {"embed": rng.normal(size=(6, 4)).astype(np.float32)},
            "layers": {"w": rng.normal(size=(layers, 4, 4)).astype(np.float32),
                       "b": rng.normal(size=(layers, 4)).astype(np.float32)}}


def _posts(rng, theta, n, scale=0.05):
    posts = []
    for w in range(n):
        leaves = [(scale * (1 + 3 * (w == 1)) * rng.normal(size=x.shape)).astype(np.float32)
                  for x in jax.tree.leaves(theta)]
        posts.append(R.Post(w, 1, leaves, steps_since=5 + 3 * w, cursor=10 * w, loss=1.0, base_hash=""))
    return posts


def test_round_equals_the_collective_meeting():
    """OuterRound (Stacked, host CPU) vs sync_unit with ReplicaPsum under shard_map over `replica`,
    unit by unit, with the penalty on, the step shares and a warm detector: same θ̄, momentum,
    detectors (float32 rounding)."""
    one_stage("3.12", "a round against the collective meeting", 10, other="test_round_plain_mean_against_numpy")
    n, rng = 3, np.random.default_rng(0)
    penalty = Penalty(warmup=2, step_weight_ratio=0.5, clip_threshold=0.3)
    plan = Plan("a_edit", A_EDIT_RULE, True, penalty, OuterSpec("nesterov", 0.8, 0.85, True))
    rnd = OuterRound(plan)
    start = rnd.initial(_theta(rng), slots=n, n_units=3, window=2)
    start.outer_opt = jax.tree.map(lambda x: (0.01 * rng.normal(size=x.shape)).astype(np.float32), start.outer_opt)
    # Warm detectors near the workers' usual unit norms (~0.25): worker 1's 4x pseudo gradient is
    # the anomaly, the others are averaged with softmax and step-share weights.
    start.detectors = Detector(np.full((n, 3), 0.25, np.float32), np.full((n, 3), 0.01, np.float32),
                               np.full((n, 3), 5, np.int32), rng.normal(size=(n, 3, 2)).astype(np.float32))
    posts = _posts(rng, start.theta, n)
    got, figures = rnd.apply(start, posts)

    mesh = Mesh(np.array(jax.devices()[:n]), (REPLICA,))
    steps = np.array([p.steps_since for p in posts], np.float32)
    shares = jnp.asarray(steps / steps.sum())
    opt = make_outer_optimizer(plan.outer)
    deltas = jax.tree.unflatten(jax.tree.structure(start.theta),
                                [np.stack(x) for x in zip(*(p.delta for p in posts), strict=True)])

    def meet(unit, u):  # one unit over the mesh: each device one worker's θ_i and detector
        theta_u = start.theta[unit] if u == 0 else jax.tree.map(lambda x: x[u - 1], start.theta["layers"])
        opt_u = start.outer_opt[unit] if u == 0 else jax.tree.map(lambda x: x[u - 1], start.outer_opt["layers"])
        d_u = deltas[unit] if u == 0 else jax.tree.map(lambda x: x[:, u - 1], deltas["layers"])
        local = jax.tree.map(lambda o, d: o[None] - d, theta_u, d_u)
        det = jax.tree.map(lambda x: x[:, u], start.detectors)

        def body(local, det):
            r = sync_unit(jax.tree.map(lambda x: x[0], local), theta_u, opt_u, jax.tree.map(lambda x: x[0], det),
                          penalty, opt, shares=shares, reduction=ReplicaPsum(axis=REPLICA, norm_axes=()))
            return r.outer_params, r.opt_state, jax.tree.map(lambda x: x[None], r.detector)
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(REPLICA), P(REPLICA)), out_specs=(P(), P(), P(REPLICA)),
                          check_vma=False)
        return jax.jit(f)(local, det)

    for unit, u in (("root", 0), ("layers", 1), ("layers", 2)):
        theta_ref, opt_ref, det_ref = meet(unit, u)
        mine = (got.theta[unit] if u == 0
                else jax.tree.map(lambda x: x[u - 1], got.theta["layers"]))  # noqa: B023 - called at once
        opt_mine = (got.outer_opt[unit] if u == 0
                    else jax.tree.map(lambda x: x[u - 1], got.outer_opt["layers"]))  # noqa: B023 - called at once
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7), mine, theta_ref)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7), opt_mine, opt_ref)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7),
                     jax.tree.map(lambda x: x[:, u], got.detectors), det_ref)  # noqa: B023 - called at once
    assert got.round == 1 and got.tally == int(steps.sum()) and got.members == [0, 1, 2]
    assert got.cursors == [0, 10, 20] and len(figures["weight"]) == n
    assert figures["flagged"] == [0, 3, 0]  # every unit of worker 1 only: the step is not a no-op
    assert figures["weight"][1] == 0 and figures["outer_update_norm"] > 0


def test_round_plain_mean_against_numpy():
    """Penalty off, outer lr 1, momentum 0 (Post Local SGD): θ̄ - mean(Δ_i) by hand; a subset of the
    slots participating leaves the others' detectors and cursors untouched."""
    one_stage("default", "a round's plain mean", 10, other="test_round_equals_the_collective_meeting")
    rng = np.random.default_rng(1)
    plan = Plan("a_edit", A_EDIT_RULE, True, Penalty.off(), OuterSpec("nesterov", 1.0, 0.0, False))
    rnd = OuterRound(plan)
    start = rnd.initial(_theta(rng, layers=3), slots=4, n_units=4, window=2)
    posts = [p for p in _posts(rng, start.theta, 4) if p.worker in (0, 3)]
    got, _ = rnd.apply(start, posts)
    want = [t - (posts[0].delta[i] + posts[1].delta[i]) / 2 for i, t in enumerate(jax.tree.leaves(start.theta))]
    for a, b in zip(jax.tree.leaves(got.theta), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert got.members == [0, 3] and got.cursors == [0, 0, 0, 30]
    assert np.all(np.asarray(got.detectors.count)[[1, 2]] == 0)  # slots 1, 2 did not take part

    # Weights from the step shares alone (rho 1): worker 3's post carries 10 stale steps of its 14,
    # counted at sync.exchange.carried_weight 0.25: shares (5, 4 + 0.25 * 10) / 11.5.
    plan = Plan("a_edit", A_EDIT_RULE, True, Penalty(anomaly=False, weighting=False, clip=False,
                                                           step_weight_ratio=1.0), plan.outer)
    posts[1].carried = 10
    got, _ = OuterRound(plan, carried_weight=0.25).apply(start, posts)
    s = np.array([5.0, 6.5], np.float32) / np.float32(11.5)
    for i, (a, t) in enumerate(zip(jax.tree.leaves(got.theta), jax.tree.leaves(start.theta), strict=True)):
        np.testing.assert_allclose(a, t - (s[0] * posts[0].delta[i] + s[1] * posts[1].delta[i]), rtol=1e-6, atol=1e-7)
    assert got.tally == 5 + 14  # tokens are tokens: the carried steps are counted in full


def test_protocol_on_a_directory(tmp_path):
    ex = DirExchange(str(tmp_path / "ex"))
    for w in (0, 1, 2):
        ex.put(R.hello_key(w), json.dumps({"worker": w, "round": 1}).encode())
    post = lambda w, r: ex.put(R.post_key(r, w), R.Post(w, r, [np.zeros(2, np.float32)], 1, 1, 0.0, "h").encode())
    post(0, 1)
    post(2, 1)
    assert R.expected(ex, 1) == [0, 1, 2] and R.posted(ex, 1) == [0, 2]
    assert R.collect(ex, 1, closer=0, by_grace=False, base_hash="h") is None  # worker 1 is awaited
    # Racing closers after the grace: exactly one manifest, the same for all of them.
    got = []
    threads = [threading.Thread(target=lambda c=c: got.append(R.collect(ex, 1, c, True, "h"))) for c in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len({m.encode() for m in got}) == 1 and got[0].members == [0, 2] and got[0].closed_by == "grace"
    post(1, 1)  # late: the manifest stands
    assert R.read_manifest(ex, 1).members == [0, 2]
    # Round 2 waits only for who announced it: worker 1 (dead, say) still names round 1.
    for w in (0, 2):
        ex.put(R.hello_key(w), json.dumps({"worker": w, "round": 2}).encode())
    post(0, 2)
    post(2, 2)
    m = R.collect(ex, 2, closer=2, by_grace=False, base_hash="h2")
    assert m.members == [0, 2] and m.closed_by == "all posted" and m.closer == 2
    assert R.newest_round(ex) == 2
    for r in range(1, 12):
        ex.put(R.state_key(r), b"x")
        post(0, r)
    R.collect_garbage(ex, 11)
    assert R.newest_state(ex) == 11 and not ex.list(R.state_key(3)) and ex.list(R.state_key(4))
    assert not ex.list("posts/r00000003/") and ex.list("posts/r00000004/")


def test_round_state_is_whole_or_reported():
    rng = np.random.default_rng(2)
    plan = Plan("a_edit", A_EDIT_RULE, True, Penalty(), OuterSpec())
    state = OuterRound(plan).initial(_theta(rng), slots=2, n_units=3, window=3)
    data = state.encode()
    back = R.RoundState.decode(data, state, "state/r00000000.npz")
    assert back.digest() == state.digest() and back.cursors == [0, 0]
    with pytest.raises(ValueError, match="state/r00000000.npz: not a whole, readable"):
        R.RoundState.decode(data[: len(data) // 2], state, "state/r00000000.npz")
    other = OuterRound(plan).initial(_theta(rng, layers=3), slots=2, n_units=4, window=3)
    with pytest.raises(ValueError, match="does not fit this config"):
        R.RoundState.decode(data, other, "k")
    leaves, meta = R.unpack(data, "k")
    leaves[0] = leaves[0] + 1.0
    with pytest.raises(ValueError, match="do not match the hash"):
        R.RoundState.decode(R.pack(leaves, meta), state, "k")


def _config(exchange, *extra):
    from edit_jax.validate import load_config

    return load_config(os.path.join(ROOT, "configs", "tiny.py"), [
        "sync.method=a_edit", f"sync.exchange.url={exchange}", "sync.warmup_steps=0", "mesh.replica=2", "mesh.shard=1",
        "mesh.processes=2", "sync.time.tau=0.3", "sync.exchange.grace=1.0", "steps=24", "batch_size=8",
        "eval_batches=1", *extra])


def _records(run_dir):
    return read_records(os.path.join(run_dir, "metrics.jsonl"))


def test_two_workers_in_threads_finish_with_one_theta(tmp_path):
    """Two workers (threads of this process, each its own programs) train to the token budget;
    every worker checks the closer's hash of θ̄ before each round, and both end on the same θ̄.
    A worker started on the finished run exits at once; the run continues with a larger budget
    from the newest round (the whole-run restart) with each slot's data cursor."""
    one_stage("default", "two exchange workers in threads", 15, other="test_workers_leave_and_join_as_processes")
    from edit_jax.elastic.worker import ElasticWorker
    from edit_jax.runtime.compile_cache import compile_cache

    with compile_cache(os.environ.get("EDIT_JAX_COMPILE_CACHE")):  # the suite's shared cache (conftest.py)
        _two_workers(tmp_path, ElasticWorker)


def _run_in_threads(ElasticWorker, cfg, run: str, slots=(0, 1)) -> dict[int, int]:
    """Workers ``slots`` of ``cfg``'s exchange run in threads of this process: each one's exit code."""
    codes = {}
    workers = [ElasticWorker(cfg, w, run, say=lambda m: None) for w in slots]
    threads = [threading.Thread(target=lambda w=w: codes.__setitem__(w.me, w.run())) for w in workers]
    [t.start() for t in threads]
    [t.join(timeout=240) for t in threads]
    for w in workers:  # (as run_worker does: a compile thread running into the interpreter's exit aborts it)
        w.outer.close()
    return codes


def _two_workers(tmp_path, ElasticWorker):
    ex, run = str(tmp_path / "ex"), str(tmp_path / "run")
    cfg = _config(ex)
    assert _run_in_threads(ElasticWorker, cfg, run) == {0: 0, 1: 0}
    recs = _records(run)
    rounds = [r for r in recs if r.get("sync")]
    ends = [r for r in recs if "finished_round" in r]
    assert rounds and rounds[-1]["finished"] and rounds[-1]["round"] == len(rounds)
    assert {r["theta_hash"] for r in ends} == {rounds[-1]["theta_hash"]} and len(ends) == 2
    assert sum(sum(r["steps"]) for r in rounds) >= cfg.steps * 2
    assert any(r.get("val_loss") for r in recs)
    assert ElasticWorker(cfg, 1, run, say=lambda m: None).run() == 0  # finished: nothing to do
    assert [sorted({"joined", "finished_round"} & set(r)) for r in _records(run)[len(recs):]] == \
        [["joined"], ["finished_round"]]  # it joined, then found the budget spent
    # A larger budget: a worker started by hand with steps=60 adopts the run's; the launcher (holding
    # the run lock) raises it (admission.py). The run resumes from the newest round, each worker at its own cursor.
    from edit_jax.elastic.admission import admit

    assert admit(DirExchange(ex), _config(ex, "steps=60"), run, say=lambda m: None).steps == cfg.steps
    admit(DirExchange(ex), _config(ex, "steps=60"), run, say=lambda m: None, owner=True)
    more = ElasticWorker(_config(ex, "steps=60"), 0, run, say=lambda m: None)
    shared = more.join()
    assert shared.round == rounds[-1]["round"] and shared.digest() == rounds[-1]["theta_hash"]
    assert not shared.finished  # this config's budget: 60 steps per slot
    from edit_jax.rundir.trained import load_trained  # what `edit-jax sample / export` read

    model = load_trained(run)
    assert model.source == "outer" and model.step == shared.tally // 2
    jax.tree.map(np.testing.assert_array_equal, model.params, shared.theta)
    posted = {w: [c for r in rounds for m, c in zip(r["members"], r["cursors"], strict=True) if m == w] for w in (0, 1)}
    # (a worker whose first step compiled slower than the other spent the budget posted in no round: cursor 0;
    # seen when an earlier test of the same process had compiled the step already)
    assert shared.cursors == [posted[w][-1] if posted[w] else 0 for w in (0, 1)] and max(shared.cursors) > 0
    # A worker whose θ̄ differs from the closer's (a host that rounds differently) takes the
    # published state, recorded; with no published state of the closer's hash it stops.
    from edit_jax.elastic.worker import RoundMismatch

    off = R.RoundState(shared.round, jax.tree.map(lambda x: x + np.float32(1e-7), shared.theta), shared.outer_opt,
                       shared.detectors, shared.tally, shared.cursors)
    manifest = R.Manifest(shared.round + 1, [0, 1], shared.digest(), closer=1, closed_by="all posted")
    assert more.adopt_published(off, manifest).digest() == shared.digest()
    assert _records(run)[-1]["theta_resync"] == shared.round
    with pytest.raises(RoundMismatch, match="no published state matches"):
        more.adopt_published(off, R.Manifest(shared.round + 1, [0, 1], "0" * 24, closer=1, closed_by="grace"))


@pytest.mark.parametrize("method", ["diloco", "edit", "co2"])
def test_lock_step_rules_meet_through_the_exchange_every_tau_steps(tmp_path, method):
    """DiLoCo, EDiT and CO2 through the exchange (issue 56): each worker posts after exactly sync.tau
    of its own steps, the round applies the method's rule on the host (DiLoCo, CO2: the plain mean,
    no step shares; CO2 one round late, its pending kept in the round state), and both workers end
    on one θ̄."""
    if method == "edit":
        one_stage("3.12", "EDiT through the exchange", 12, other="DiLoCo through the exchange")
    else:
        one_stage("default", f"{method} through the exchange", 12, other="EDiT through the exchange")
    from edit_jax.elastic.worker import ElasticWorker
    from edit_jax.runtime.compile_cache import compile_cache

    ex, run = str(tmp_path / "ex"), str(tmp_path / "run")
    # steps=30: a budget the first worker cannot spend alone while the other still compiles (at
    # steps=12 one worker, ~0.5 s a round, sometimes ran every round alone)
    cfg = _config(ex, f"sync.method={method}", "sync.tau=3", "steps=30", "sync.exchange.grace=5.0")
    with compile_cache(os.environ.get("EDIT_JAX_COMPILE_CACHE")):
        assert _run_in_threads(ElasticWorker, cfg, run) == {0: 0, 1: 0}
    recs = _records(run)
    rounds = [r for r in recs if r.get("sync")]
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1)) and rounds[-1]["finished"]
    # Every post is tau steps (a post left out of a round, on a loaded machine, is carried into the
    # worker's next: a multiple of tau), and the rounds count the whole budget.
    assert all(s % 3 == 0 and s > 0 for r in rounds for s in r["steps"]), [r["steps"] for r in rounds]
    assert sum(sum(r["steps"]) for r in rounds) >= 60
    # A round waits for a worker a round behind (rounds close on posts, not on the clock): once both
    # were in a round, both are in every later one. (Before that, a worker still compiling its first
    # step has announced nothing, and the other's rounds go on without it, as A-EDiT's do.)
    members = [r["members"] for r in rounds]
    assert [0, 1] in members and all(m == [0, 1] for m in members[members.index([0, 1]):]), members
    both = [r for r in rounds if r["members"] == [0, 1]]
    if method in ("diloco", "co2"):  # no penalty and no step shares: the plain mean
        assert all(r["weight"] == [0.5, 0.5] for r in both), [r["weight"] for r in both]
    # (CO2's first round applies what was in flight before it: nothing, Δ_{-1} = 0)
    moved = [r for r in both if not (method == "co2" and r["round"] == 1)]
    assert all(abs(sum(r["weight"]) - 1.0) < 1e-6 and r["outer_update_norm"] > 0 for r in moved)
    if method == "co2":
        assert rounds[0]["outer_update_norm"] == 0.0 and len(moved) >= 2
    ends = [r for r in recs if "finished_round" in r]
    assert len(ends) == 2 and {r["theta_hash"] for r in ends} == {rounds[-1]["theta_hash"]}


def test_a_lock_step_round_awaits_a_worker_up_to_a_round_slower():
    """How long a closer waits for the others after its post (``ElasticWorker.patience``): the grace
    for A-EDiT (its rounds close on the clock) and for a first post; for a lock-step rule the grace
    plus the closer's last round, post to post. With the grace alone (3 s) a worker more than 3 s
    slower per round (a restart compiling beside it) posted late to every round under the kill
    loop, and the fastest worker ran alone (docs/benchmarks/elastic.md: EDiT 0.549 -> 0.888)."""
    from types import SimpleNamespace

    from edit_jax.elastic.worker import ElasticWorker
    from edit_jax.localsgd.methods import plan_for

    def worker(method, last):
        cfg = _config("/unused", f"sync.method={method}", "sync.exchange.grace=3.0")
        return SimpleNamespace(cfg=cfg, plan=plan_for(cfg).plan, last_posted_at=last)

    assert ElasticWorker.patience(worker("diloco", None), 100.0) == 3.0  # a first post: the grace
    assert ElasticWorker.patience(worker("diloco", 94.5), 100.0) == 3.0 + 5.5  # and its last round
    assert ElasticWorker.patience(worker("edit", 94.5), 100.0) == 8.5
    assert ElasticWorker.patience(worker("a_edit", 94.5), 100.0) == 3.0  # rounds by the clock


def _child_env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    return env


def _wait_for(what, pred, timeout=120.0, procs=()):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = pred()
        if out:
            return out
        for p in procs:
            assert p.poll() is None, f"{what}: a process ended early (exit {p.returncode})"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _worker_args(run: str, ex: str, slots: int) -> list[str]:
    """``edit-jax train`` / ``worker`` arguments of an exchange run of ``slots`` one-device workers
    on the tiny config, two rows each, rounds every 0.5 s, no end of its own (stopped by signals)."""
    return ["--config", os.path.join(ROOT, "configs", "tiny.py"), "--run-dir", run, "sync.method=a_edit",
            f"sync.exchange.url={ex}", "sync.warmup_steps=0", f"mesh.replica={slots}", "mesh.shard=1",
            "mesh.processes=2", "sync.time.tau=0.5", "sync.exchange.grace=1.5", "steps=1000000",
            f"batch_size={2 * slots}", "log_every=50", "eval_every=0"]


def _pid_of(launcher: subprocess.Popen, worker: int) -> int:
    """The launcher's worker ``worker``: forked (named ``edit-jax wI``) or spawned (``--worker I``)."""
    for pid in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split():
        with open(f"/proc/{pid}/comm") as f, open(f"/proc/{pid}/cmdline", "rb") as g:
            if f.read().strip() == f"edit-jax w{worker}" or f"--worker\x00{worker}\x00".encode() in g.read():
                return int(pid)
    raise AssertionError(f"worker {worker} is not running")


def test_workers_leave_and_join_as_processes(tmp_path):
    """Real processes: the launcher starts workers 0 and 1 of 3 slots. SIGKILL worker 1: only it is
    restarted, worker 0's rounds go on. SIGSTOP worker 1: a round closes without it within grace + 5
    s; continued, its late post is recorded and it is a member again. Worker 2 started by hand joins
    a round. Every worker checks θ̄'s hash at every round (a mismatch would end it with a traceback)."""
    one_stage("3.12", "exchange workers as processes, killed, stopped, joined", 40,
              other="test_two_workers_in_threads_finish_with_one_theta")
    run, ex = str(tmp_path / "run"), str(tmp_path / "ex")
    args = _worker_args(run, ex, slots=3)
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "edit_jax", "train", *args, "--max-restarts", "2"],
                                env=_child_env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path))
    joiner = None
    try:
        def rounds():
            return [r for r in _records(run) if r.get("sync")]
        with_members = lambda ids, after=0: [r for r in rounds()
                                             if set(ids) <= set(r["members"]) and r["round"] > after]
        first = _wait_for("a round of workers 0 and 1", lambda: with_members([0, 1]), procs=[launcher])[0]
        os.kill(_pid_of(launcher, 1), signal.SIGKILL)
        log_text = lambda: open(tmp_path / "launcher.log").read()
        rejoined = _wait_for("worker 1 restarted and joined",
                             lambda: re.findall(r"worker 1: joined at round (\d+)", log_text())[1:], procs=[launcher])
        back = _wait_for("worker 1 back in a round", lambda: with_members([1], int(rejoined[0])), procs=[launcher])[0]
        programs = [r["programs"] for r in _records(run) if "programs" in r and r["worker"] == 1]
        assert {"init_state", "local_step"} <= set(programs[1]["loaded"]), programs  # restarted: no trace, no compile
        text = log_text()
        assert "worker 1 ended (signal SIGKILL); starting it again (1 of 2)" in text and "worker 0 ended" not in text
        assert any(r["members"] == [0] and first["round"] < r["round"] < back["round"] for r in rounds())
        stopped = _pid_of(launcher, 1)
        with open(f"/proc/{stopped}/comm") as f:  # forked from the launcher (no imports again), named
            assert f.read().strip() == "edit-jax w1"
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.time()
        without = _wait_for("a round without the stopped worker",
                            lambda: [r for r in rounds() if r["round"] > back["round"] + 1 and r["members"] == [0]])[0]
        start = json.loads(open(os.path.join(ex, "run", "start.json")).read())["time"]
        assert start + without["time"] - t_stop <= 0.5 + 1.5 + 5.0  # tau + grace + 5 s
        time.sleep(2.0)
        os.kill(stopped, signal.SIGCONT)
        _wait_for("the late post's record",
                  lambda: [r for r in _records(run) if r.get("late_post") and r["worker"] == 1])
        again = _wait_for("worker 1 a member again", lambda: with_members([1], without["round"]), procs=[launcher])
        joiner = subprocess.Popen([sys.executable, "-m", "edit_jax", "worker", "--worker", "2", *args],
                                  env=_child_env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path))
        _wait_for("the joiner in a round", lambda: with_members([2], again[0]["round"]), procs=[launcher, joiner])
        twin = subprocess.run([sys.executable, "-m", "edit_jax", "worker", "--worker", "2", *args], env=_child_env(),
                              capture_output=True, text=True, cwd=str(tmp_path), timeout=120)
        assert twin.returncode == 2 and "slot 2 of exchange" in twin.stderr and "is in use by" in twin.stderr
    finally:
        for p in (launcher, joiner):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in (launcher, joiner) if p is not None]
        log.close()
    text = open(tmp_path / "launcher.log").read()
    assert codes == [130, 130], text[-3000:]
    assert "Traceback" not in text and "differs from the closer" not in text, text[-3000:]
    hashes = [r["theta_hash"] for r in rounds()]
    assert len(hashes) == len({r["round"] for r in rounds()})  # one record per round, by its closer


def test_launcher_forks_workers_only_where_safe():
    """The launcher forks its workers only from a process with one thread and no JAX backend (a
    fork copies neither another thread's locks nor a backend's thread pools safely), and never
    with EDIT_JAX_WORKER_START=spawn; JAX's backend check is a private name, so a JAX that
    renamed it would show here, not as a silent fallback to spawning."""
    code = ("import os, threading, jax; from edit_jax.elastic import supervisor as L; a = L.can_fork(); "
            "e = threading.Event(); t = threading.Thread(target=e.wait, daemon=True); t.start(); "
            "b = L.can_fork(); e.set(); t.join(); jax.devices(); c = L.can_fork(); os.environ[L.ENV_START] = 'spawn'; "
            "print(repr((a, b, c, L.can_fork())))")
    env = {k: v for k, v in _child_env().items() if k != "EDIT_JAX_WORKER_START"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == repr((None, "2 threads", "a JAX backend is running", "EDIT_JAX_WORKER_START=spawn"))


def test_worker_stopped_seconds_after_joining_exits_130(tmp_path):
    """SIGTERM as soon as a hand-started worker says it joined: its outer-round programs are still
    compiling in a background thread. It must exit 130, not abort (SIGABRT, "FATAL: exception not
    rethrown": a daemon thread inside XLA's compiler at interpreter exit; CI's bench_live hit it).
    Failed 3 of 3 before ``OuterRound.close``, under both Pythons."""
    one_stage("default", "a worker stopped while its outer rounds compile", 10)
    args = _worker_args(str(tmp_path / "run"), str(tmp_path / "ex"), slots=4)  # 4 programs to compile
    p = subprocess.Popen([sys.executable, "-m", "edit_jax", "worker", "--worker", "0", *args], env=_child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path))
    try:
        seen = []
        for line in p.stdout:
            seen.append(line)
            if "joined at round" in line:
                p.send_signal(signal.SIGTERM)
                break
        rest = p.stdout.read()
        code = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert any("joined at round" in line for line in seen), "".join(seen)[-2000:]
    assert code == 130 and "FATAL" not in rest and "Traceback" not in rest, (code, rest[-2000:])


def test_plot_shows_membership(tmp_path):
    """``edit-jax plot`` of an exchange run: a membership panel with a mark per (round, member)."""
    from edit_jax.commands.plot import load_run, make_figure

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"sync": {"method": "a_edit"}, "batch_size": 6, "data": {"seq_len": 8},
                                                 "mesh": {"replica": 3}}))
    members = [[0, 1], [0], [0, 1, 2], [1, 2]]
    recs = [{"step": 5 * i, "worker": w, "loss": 3.0 - 0.1 * i} for i in range(1, 5) for w in (0, 1)]
    recs += [{"step": 5 * i, "sync": True, "round": i, "members": m, "pseudo_grad_norm": [1.0] * 3, "weight": [0.5] * 3}
             for i, m in enumerate(members, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fig = make_figure([load_run(str(run))], x="step")
    ax = next(a for a in fig.axes if "membership" in a.get_title())
    marks = sorted((float(x), float(y))
                   for line in ax.lines for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True))
    assert marks == sorted((5.0 * i, float(w)) for i, m in enumerate(members, 1) for w in m)


@pytest.mark.parametrize("override, key", [
    ("sync.warmup_steps=4", "sync.warmup_steps"), ("sync.wire.kind=int8", "sync.wire.kind"),
    ("mesh.processes=3", "mesh.processes"), ("sync.exchange.grace=0", "sync.exchange.grace"),
    ("sync.exchange.late_posts=keep", "sync.exchange.late_posts"),
    ("sync.exchange.progress_every=-1", "sync.exchange.progress_every"),
    ("max_seconds=60", "max_seconds"), ("sync.method=co2 sync.co2.gap_penalty=0", "sync.co2.gap_penalty"),
    ("sync.method=baseline", "sync.exchange.url"), ("sync.method=edit sync.fragments=2", "sync.fragments"),
    ("sync.wire.kind=topk2 sync.wire.error_feedback=true sync.wire.residual_dtype=bfloat16",
     "sync.wire.residual_dtype")])
def test_exchange_config_errors_name_the_field(tmp_path, override, key):
    from edit_jax.validate import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _config(str(tmp_path / "ex"), *override.split())
