"""``bench_faults.py --part live``: exchange-mode A-EDiT that never stops (issue 38, item 7), or a
lock-step method through the exchange (``--method diloco --tau 300``: each worker posts every ``--tau``
of its steps; issue 56).

    python benchmarks/bench_faults.py --part live --duration 600 --mtbf 30      # the issue's run
    python benchmarks/bench_faults.py --part live --method diloco --tau 300     # DiLoCo, the same faults
    python benchmarks/bench_faults.py --part live --smoke                        # CI: the same path, tiny

``--config`` (default tiny), one CPU device per worker, ``--live-workers`` + 1 worker slots
(``mesh.replica``), the launcher (``edit-jax train``, ``sync.exchange.url``) starting ``--live-workers``
of them; a token budget no run reaches: each run ends by SIGTERM at ``--duration`` (exit 130).
1. Fault-free: the launcher's workers, and the last slot's worker started by hand (``edit-jax
   worker``) at ``--duration`` / 2.
2. Live: the same, plus a random one of the launcher's workers SIGKILLed every ``--mtbf`` s from
   ``--mtbf`` / 2 on (the launcher restarts it alone), one SIGSTOPped at ``--duration`` / 3 for ``--stop-s`` s (never
   killed), then SIGCONTed.

Measured from the exchange (manifests: members, expected, the file's mtime = the close; posts'
mtimes, polled every 0.2 s), the round records (each member's steps) and the processes' lines, in
s since the launcher started: tokens/s (steps x rows x seq_len) and live / fault-free; every worker
a round left out (expected, or posting to it too late), by cause: killed, stopped, (re)starting,
or live (a survivor's work set aside, carried to its next post); per fault the first round closed
without the worker, the survivors' wait in it (their last post to the close) and the worker's
first round as a member again; the joiner's time to its first round beside the time to read the
round state (here, in process); val loss at the last ``eval_every`` multiple both runs crossed, and
of each run's published θ̄ nearest to equal tokens, evaluated here. A figure: tokens/s, members.

``--smoke``: 2 launcher workers + a joiner, one layer, 32 tokens, ``tau_time`` and grace 1 s, one
compile cache for both runs; after the first round closes: a kill, a 1.5 s stop and the joiner;
a run ends once the joiner (and the killed worker) were members of a round (at most 60 s).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

JOINED = re.compile(r"edit-jax worker (\d+): joined at round (\d+)")
RESTARTED = re.compile(r"edit-jax: worker (\d+) ended \((.*?)\); starting it again")
SMOKE_SIZES = ["model.n_layers=1", "data.seq_len=32", "eval_batches=1"]
MTBF_S = 30.0  # the default --mtbf of this part
FIT_ROUNDS = 20  # the val loss at equal tokens, also from a line through a run's this many rounds nearest them


def add_args(p) -> None:
    p.add_argument("--live-workers", type=int, default=4, help="live: the launcher's workers (a joiner makes +1)")
    p.add_argument("--tau-time", type=float, default=5.0, help="live: sync.time.tau (s of local steps per round)")
    p.add_argument("--tau", type=int, default=300,
                   help="live, with a lock-step --method (diloco, edit, post_local_sgd): sync.tau, the steps each "
                        "worker posts after (300: about tau_time's 5 s of tiny steps on these cores)")
    p.add_argument("--grace", type=float, default=3.0,
                   help="live: sync.exchange.grace (s a round waits for late posts)")
    p.add_argument("--progress-every", type=float, default=1.0,
                   help="live: sync.exchange.progress_every (s between saves of a worker's unposted steps; 0: off)")
    p.add_argument("--carried-weight", type=float, default=0.5,
                   help="live: sync.exchange.carried_weight (a carried, one-round-stale Δ re-based at this fraction; "
                        "1: as fresh steps, the library's default)")
    p.add_argument("--stop-s", type=float, default=60.0, help="live: how long one worker stays SIGSTOPped")
    p.add_argument("--eval-every", type=int, default=2000, help="live: eval_every (global steps) of both runs")
    p.add_argument("--eval-batches", type=int, default=16, help="live: batches of this bench's own evaluations")
    p.add_argument("--figure", default=None, help="live: the figure (default: beside --json, bench_live.png)")
    p.add_argument("--abba", action="store_true", help="live: four runs, fault-free, live, live, fault-free, and the "
                   "ratio of the two runs of each kind (a machine whose speed drifts linearly cancels out)")


def overrides(args, ex: str) -> list[str]:
    w = args.live_workers
    slots = w + 1
    method = getattr(args, "live_method", "a_edit")
    timing = [] if method == "a_edit" else [f"sync.tau={args.tau}"]
    return [f"sync.exchange.url={ex}", f"sync.method={method}", *timing, "sync.warmup_steps=0", f"mesh.replica={slots}",
            "mesh.shard=1", f"mesh.processes={w}", f"batch_size={4 * slots}", f"sync.time.tau={args.tau_time}",
            f"sync.exchange.grace={args.grace}", f"sync.exchange.progress_every={args.progress_every}",
            f"sync.exchange.carried_weight={args.carried_weight}", "steps=100000000", "optim.decay_steps=100000",
            "log_every=20", f"eval_every={args.eval_every}", *(SMOKE_SIZES if args.smoke else [])] + \
        ([f"train.compile_cache={os.path.join(args.run_root, 'live', 'compile_cache')}"] if args.smoke else [])


def _env() -> dict:
    env = common.child_env()
    env["PYTHONUNBUFFERED"] = "1"  # the processes' lines arrive when printed: their times are ours
    return env


class LiveRun:
    """One run: the launcher (and later a hand-started worker), their timed output lines, and the
    exchange's posts as they appear. Times are time.time(); ``t0`` is the launcher's start."""

    def __init__(self, root: str, args):
        self.run_dir, self.ex = os.path.join(root, "run"), os.path.join(root, "exchange")
        self.saved = os.path.join(root, "states")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(self.saved)
        self.args, self.lines, self.posts = args, [], {}  # (time, source, line); (round, worker) -> mtime
        self.argv = ["--config", args.kill_config, *overrides(args, self.ex)]
        self.t0 = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "edit_jax", "train", "--run-dir", self.run_dir,
                                      "--no-progress", "--max-restarts", "100000", *self.argv], cwd=common.REPO,
                                     env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.hand = None
        self.done = False
        self.cpu: dict[int, list] = {}  # worker pid -> [(time, its CPU s so far)], sampled with the posts
        self.slot_of: dict[int, int] = {}
        threading.Thread(target=self._read, args=(self.proc, "launcher"), daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self, proc, source: str) -> None:
        for line in proc.stdout:
            now = time.time()
            self.lines.append((now, source, line.rstrip("\n")))
            print(f"  [{now - self.t0:7.1f}s] {line.rstrip()}", flush=True)

    def _watch(self) -> None:
        """Posts' mtimes; and every published round state kept (a hard link: the exchange collects
        them), so that the runs can be compared at any token count."""
        base, states = os.path.join(self.ex, "posts"), os.path.join(self.ex, "state")
        while not self.done:
            try:
                for d in os.scandir(base):
                    for f in os.scandir(d.path):
                        if f.name.endswith(".npz") and not f.name.startswith(".tmp"):
                            key = (int(d.name[1:]), int(f.name[1:5]))
                            if key not in self.posts:
                                self.posts[key] = f.stat().st_mtime
                for f in os.scandir(states):
                    keep = os.path.join(self.saved, f.name)
                    if f.name.endswith(".npz") and not f.name.startswith(".tmp") and not os.path.exists(keep):
                        os.link(f.path, keep)
            except OSError:
                pass  # not made yet, or collected while we looked
            self._sample_cpu()
            time.sleep(0.2)

    def _sample_cpu(self) -> None:
        """Every worker process's CPU seconds (user + system, from /proc), with the time: where a
        run's CPU goes (training, starting, work lost at a kill), ``cpu_ledger``."""
        now = time.time()
        pids = dict(self.slots())
        if self.hand is not None and self.hand.poll() is None:
            pids[self.args.live_workers] = self.hand.pid
        for slot, pid in pids.items():
            c = common.cpu_seconds(pid)
            if c is not None:
                self.slot_of[pid] = slot
                self.cpu.setdefault(pid, []).append((now, c))

    def start_hand_worker(self) -> float:
        slot = self.args.live_workers
        env = _env()
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1".strip()
        env["JAX_PLATFORMS"] = "cpu"
        t = time.time()
        self.hand = subprocess.Popen([sys.executable, "-m", "edit_jax", "worker", "--worker", str(slot),
                                      "--run-dir", self.run_dir, *self.argv], cwd=common.REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, args=(self.hand, "hand"), daemon=True).start()
        return t

    def slots(self) -> dict[int, int]:
        """The launcher's live workers: slot -> pid (from /proc: the child's ``--worker I``)."""
        out = {}
        for pid in common.child_pids(self.proc.pid):
            try:  # forked by the launcher: named "edit-jax wI"; else its command line's --worker I
                with open(f"/proc/{pid}/comm") as f:
                    name = f.read().strip()
                if name.startswith("edit-jax w"):
                    out[int(name[len("edit-jax w"):])] = pid
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode().split("\0")
                out[int(argv[argv.index("--worker") + 1])] = pid
            except (OSError, ValueError, IndexError):
                pass
        return out

    def manifests(self) -> list[dict]:
        base, out = os.path.join(self.ex, "rounds"), []
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            if name.endswith(".json") and not name.startswith(".tmp"):
                with open(os.path.join(base, name)) as f:
                    m = json.load(f)
                out.append({**m, "close": os.stat(os.path.join(base, name)).st_mtime})
        return out

    def closed_rounds(self) -> int:
        base = os.path.join(self.ex, "rounds")
        return len(os.listdir(base)) if os.path.isdir(base) else 0

    def records(self) -> list[dict]:
        with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
            recs = [json.loads(x) for x in f if x.endswith("\n")]
        with open(os.path.join(self.ex, "run", "start.json")) as f:
            start = json.load(f)["time"]
        return [{**r, "at": start + r["time"]} for r in recs if "time" in r]

    def stop(self) -> dict:
        """SIGTERM to the launcher and the hand-started worker; their exit codes (killed after 60 s)."""
        t = time.time()
        procs = {"launcher": self.proc, **({"hand": self.hand} if self.hand else {})}
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        codes = {}
        for name, p in procs.items():
            try:
                codes[name] = p.wait(timeout=max(1.0, 60 - (time.time() - t)))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes[name] = p.wait()
        time.sleep(0.5)  # the readers' last lines, the watcher's last look
        self.done = True
        return {"at": t, "exit": codes}


def _member_since(run: LiveRun, slot: int, t: float) -> bool:
    return any(slot in m["members"] and m["close"] > t for m in run.manifests())


def drive(run: LiveRun, args, faults: bool, rng: random.Random) -> list[dict]:
    """Runs the schedule (times since the first round closed) and ends the run; returns the events."""
    d, events = args.duration, []
    while run.closed_rounds() == 0 and time.time() - run.t0 < 600 and run.proc.poll() is None:
        time.sleep(0.1)  # the clock starts at the first round: start-up (imports, compiles) is no fault
    origin = time.time()
    events.append({"event": "origin", "at": origin})
    plan = [(d / 2, "join")]
    if faults:
        # (kills at 0.5, 1.5, ... x mtbf: none at the same time as the stop, the continue or the joiner)
        kills = [0.5] if args.smoke else [(k + 0.5) * args.mtbf_live for k in range(int(d / args.mtbf_live))]
        plan += [(t, "kill") for t in kills] + [(d / 3, "stop"), (d / 3 + args.stop_s, "cont")]
    plan.sort(key=lambda e: (e[0], e[1] != "stop"))  # a stop before a kill due at the same time
    stopped = None
    for at, what in plan:
        while time.time() < origin + at and run.proc.poll() is None:
            time.sleep(0.05)
        if run.proc.poll() is not None:
            break
        live = run.slots()
        if what == "join":
            events.append({"event": "join", "at": run.start_hand_worker(), "slot": args.live_workers})
        elif what == "kill":
            choice = sorted(s for s in live if s != (stopped or {}).get("slot"))
            if choice:
                s = rng.choice(choice)
                os.kill(live[s], signal.SIGKILL)
                events.append({"event": "kill", "at": time.time(), "slot": s, "pid": live[s]})
        elif what == "stop" and live:  # a worker of the newest round, not one restarting
            recent = {e["slot"] for e in events if e["event"] == "kill" and time.time() - e["at"] < 60}
            members = set((run.manifests() or [{"members": []}])[-1]["members"])
            fresh = sorted(x for x in live if x not in recent)  # (a just-killed slot's pid may be the dead one)
            pick = sorted(x for x in fresh if x in members) or fresh
            if pick:
                s = rng.choice(pick)
                os.kill(live[s], signal.SIGSTOP)
                stopped = {"event": "stop", "at": time.time(), "slot": s, "pid": live[s]}
                events.append(stopped)
        elif what == "cont" and stopped:
            try:
                os.kill(stopped["pid"], signal.SIGCONT)
            except ProcessLookupError:  # it died while stopped (the smoke under load: a pid the launcher had lost)
                pass
            events.append({"event": "cont", "at": time.time(), "slot": stopped["slot"], "pid": stopped["pid"]})
        print(f"  [{time.time() - run.t0:7.1f}s] bench: {events[-1]['event'] if events else what} "
              f"{events[-1].get('slot', '') if events else ''}", flush=True)
    if args.smoke:  # until the joiner (and the killed worker) were members again, at most 60 s more
        back = [e for e in events if e["event"] in ("join", "kill")]
        while time.time() < origin + 60 and not all(_member_since(run, e["slot"], e["at"]) for e in back):
            time.sleep(0.2)
    else:
        while time.time() < origin + d and run.proc.poll() is None:
            time.sleep(0.1)
    events.append({"event": "end", **run.stop()})
    return events


def _rel(t, t0):
    return None if t is None else round(t - t0, 2)


def _first(xs):
    return next(iter(xs), None)


def _cause(m, w, events, starts, posts) -> str:
    """Why round m left out worker w (expected by the round, or posting to it too late): killed,
    stopped, (re)starting (its first post), or "live": it was up and training, only late (a slow
    apply of the previous round, an outer-step compile, an evaluation): its work was set aside."""
    prev = max([t for (r, x), t in posts.items() if x == w and r < m["round"]], default=float("-inf"))
    close = m["close"]
    started = any(x == w and prev < t <= close for t, x in starts)
    if (m["round"], w) in posts and started:  # its first post since a (re)start, too late
        return "starting"
    if any(e["event"] == "kill" and e["slot"] == w and prev < e["at"] <= close for e in events):
        return "killed"
    stop, cont = _first(e for e in events if e["event"] == "stop"), _first(e for e in events if e["event"] == "cont")
    if stop and stop["slot"] == w and stop["at"] <= close and (cont is None or cont["at"] > prev):
        return "stopped"
    return "starting" if started else "live"


def analyse(t0, events, manifests, records, posts, lines, tokens_per_step, bin_s) -> dict:
    end = _first(e for e in events if e["event"] == "end")
    recs = {r["round"]: r for r in records if r.get("sync")}
    starts = [(t, int(m[1])) for t, _, x in lines if (m := RESTARTED.search(x))] + \
        [(e["at"], e["slot"]) for e in events if e["event"] == "join"]
    joins = [(t, int(m[1]), src) for t, src, x in lines if (m := JOINED.search(x))]
    rounds, short, causes = [], [], {}
    for m in manifests:
        rec = recs.get(m["round"])
        tokens = sum(rec["steps"]) * tokens_per_step if rec else None
        rounds.append({"round": m["round"], "t": _rel(m["close"], t0), "members": m["members"],
                       "closed_by": m["closed_by"], "tokens": tokens})
        seen = {x for (r, x) in posts if r == m["round"]}  # (a late post is written to its round all the same)
        for w in sorted((set(m["expected"]) | seen) - set(m["members"])):
            causes[(m["round"], w)] = c = _cause(m, w, events, starts, posts)
            short.append({"round": m["round"], "worker": w, "cause": c, "t": _rel(m["close"], t0)})
    tokens = sum(r["tokens"] or 0 for r in rounds)
    late = [{"round": r["late_post"], "worker": r["worker"], "steps": r["late_steps"], "how": r["late_posts"],
             "cause": causes.get((r["late_post"], r["worker"]), "live")} for r in records if "late_post" in r]
    by = lambda rows: {c: sum(1 for x in rows if x["cause"] == c) for c in
                       ("killed", "stopped", "starting", "live")}
    span, origin = end["at"] - t0, _first(e["at"] for e in events if e["event"] == "origin") - t0
    window = sum(r["tokens"] or 0 for r in rounds if r["t"] > origin) / (span - origin)
    bins = [0.0] * (int(span // bin_s) + 1)
    # a round's tokens spread over the time since the last close
    for prev, r in zip([None] + rounds, rounds, strict=False):
        a, b = (prev["t"] if prev else r["t"] - 1.0), r["t"]
        for i in range(max(0, int(a // bin_s)), min(len(bins), int(b // bin_s) + 1)):
            bins[i] += (r["tokens"] or 0) * (min(b, (i + 1) * bin_s) - max(a, i * bin_s)) / (b - a) / bin_s

    def without(w, after, before):  # the first round closed between the fault and w's return that left w out
        m = _first(m for m in manifests if after < m["close"] < before and w not in m["members"])
        if m is None:  # it missed no round (posted before the kill, back in time for the next): say so
            return {"round_without": None}
        last = max((posts[(m["round"], x)] for x in m["members"] if (m["round"], x) in posts), default=None)
        return {"round_without": m["round"], "to_round_without_s": _rel(m["close"], after), "closed_by": m["closed_by"],
                "survivors_wait_s": None if last is None else round(m["close"] - last, 2)}

    def back_round(w, after):  # the first round holding a post w made after ``after`` (None: never); a round
        # that closed after a kill with the dead worker's earlier post in it is not its return
        return _first(m for m in manifests if m["close"] > after and w in m["members"]
                      and posts.get((m["round"], w), float("-inf")) >= after)

    faults = []
    for e in events:
        if e["event"] not in ("kill", "stop", "join"):
            continue
        w, at = e["slot"], e["at"]
        row = {"event": e["event"], "slot": w, "t": _rel(at, t0)}
        after = at
        if e["event"] == "stop":
            cont = _first(x for x in events if x["event"] == "cont")
            row["cont_t"], after = _rel(cont["at"], t0) if cont else None, cont["at"] if cont else at
        returned = back_round(w, after)
        if returned:
            row.update({"round_back": returned["round"], "to_member_s": _rel(returned["close"], after)})
        if e["event"] != "join":  # a round it missed must close before the round it is back in
            row.update(without(w, at, returned["close"] if returned else float("inf")))
        row["restart_s"] = _rel(_first(t for t, x in starts if x == w and t >= at and e["event"] == "kill"), at)
        joined = _first(r for r in records if r.get("worker") == w and "joined" in r and r["at"] > at)
        if joined and e["event"] != "stop":  # its catch-up: the newest state read, later rounds replayed
            row.update({k: joined.get(k) for k in ("read_s", "catch_up_s", "replayed")})
        row["joined_line_s"] = _rel(_first(t for t, x, _ in joins if x == w and t >= at), at)
        row["first_post_s"] = _rel(min((t for (r, x), t in posts.items() if x == w and t >= after), default=None),
                                   after)
        if e["event"] == "kill":  # its local steps since its last round: a lower bound (records every log_every)
            mine = [r for r in records if r.get("worker") == w and "loss" in r and r["at"] < at]
            cur = _first(r["cursors"][r["members"].index(w)] for r in sorted(recs.values(), key=lambda r: -r["at"])
                         if r["at"] < at and w in r["members"])
            nxt = _first(x["at"] for x in events if x["event"] == "kill" and x["slot"] == w and x["at"] > at) or 1e18
            res = _first(r for r in records if r.get("worker") == w and "progress_resumed" in r and at < r["at"] < nxt)
            row["steps_restored"] = res["progress_resumed"] if res else 0  # saved steps its restart carried on
            cur = max(cur, res["cursor"]) if res and cur is not None else cur
            row["steps_lost"] = max(0, mine[-1]["step"] - cur) if mine and cur is not None else None
        faults.append(row)
    evals = [{"step": r["step"], "val_loss": r["val_loss"], "round": r.get("round")} for r in records
             if "val_loss" in r]
    saving, last = 0.0, {}  # seconds the workers spent saving progress (per process; a restart starts at 0)
    for r in records:
        if "progress_s" in r:
            w, v = r["worker"], r["progress_s"]
            saving += v - last.get(w, 0.0) if v >= last.get(w, 0.0) else v
            last[w] = v
    return {"exit": end["exit"], "wall_s": round(span, 2), "rounds": len(rounds), "tokens": tokens,
            "tokens_per_s": tokens / span, "tokens_per_s_window": window,
            "window_s": [round(origin, 2), round(span, 2)],
            "rounds_without_record": [r["round"] for r in rounds if r["tokens"] is None],
            # Every worker compares its θ̄ with the hash in each round's manifest (the closer's) before it applies
            # the round; one that differs takes the closer's published state and records it (a worker.py resync).
            "theta_resyncs": sum(1 for r in records if "theta_resync" in r),
            "left_out": short, "left_out_by_cause": by(short), "late_posts": late, "late_by_cause": by(late),
            "rounds_leaving_out_a_live_worker": len({x["round"] for x in short if x["cause"] == "live"}),
            "live_steps_dropped": sum(x["steps"] for x in late if x["cause"] == "live" and x["how"] == "drop"),
            "faults": faults, "evals": evals, "progress_save_s": round(saving, 3), "timeline": rounds, "bin_s": bin_s,
            "tokens_per_s_bins": bins,
            "events": [{**e, "at": _rel(e["at"], t0)} for e in events],
            "posts": sorted([r, w, _rel(t, t0)] for (r, w), t in posts.items()),
            "lines": [[_rel(t, t0), x] for t, _, x in lines if JOINED.search(x) or RESTARTED.search(x)]}


def cpu_ledger(run: LiveRun, events: list[dict], window_tokens: float) -> dict:
    """Where the worker processes' CPU went (from /proc, sampled every 0.2 s): in the window from the
    first round to the end, all of it and per token; each (re)started or joining process's CPU until
    its "joined" line and its first post (its start-up, paid from the machine's cores); each killed
    process's CPU since its last post (work lost)."""
    def used(samples, t):  # CPU s by time t: the last sample at or before it (0 before the first)
        return max((c for ts, c in samples if ts <= t), default=0.0)

    origin = _first(e["at"] for e in events if e["event"] == "origin")
    end = _first(e["at"] for e in events if e["event"] == "end")
    core_s = sum(used(s, end) - used(s, origin) for s in run.cpu.values())
    joins = [(t, int(m[1])) for t, _, x in run.lines if (m := JOINED.search(x))]
    starts = []
    for pid, samples in run.cpu.items():
        born, slot = samples[0][0], run.slot_of[pid]
        if born < origin + 1.0:
            continue  # a worker of the run's start
        joined = _first(t for t, w in joins if w == slot and t >= born - 0.5)
        post = min((t for (r, w), t in run.posts.items() if w == slot and t >= born), default=None)
        starts.append({"slot": slot, "t": _rel(born, run.t0),
                       "cpu_to_joined_s": None if joined is None else round(used(samples, joined), 2),
                       "cpu_to_first_post_s": None if post is None else round(used(samples, post), 2)})
    kills = []
    for e in events:
        if e["event"] == "kill" and e.get("pid") in run.cpu:
            last = max((t for (r, w), t in run.posts.items() if w == e["slot"] and t < e["at"]), default=None)
            s = run.cpu[e["pid"]]
            kills.append({"slot": e["slot"], "t": _rel(e["at"], run.t0),
                          "cpu_since_last_post_s": (None if last is None
                                                    else round(used(s, e["at"]) - used(s, last), 2))})
    return {"cores": os.cpu_count(), "window_s": round(end - origin, 2), "workers_core_s": round(core_s, 1),
            "machine_core_s": round((os.cpu_count() or 1) * (end - origin), 1),
            "tokens_per_core_s": window_tokens / core_s if core_s else None, "starts": starts, "kills": kills}


def evaluate_states(args, runs: dict) -> dict:
    """In this process (public classes only): a joiner's ``ElasticWorker.join()`` on the live run's
    exchange, timed (it compiles the init program), and the read of the newest round state alone
    (get + decode: θ̄ and the outer state); then of each run the published state (the newest rounds
    are kept) nearest to the smaller of the two runs' token tallies, and each run's newest, evaluated."""
    from edit_jax.elastic import rounds as R
    from edit_jax.elastic.exchange import open_exchange
    from edit_jax.elastic.worker import ElasticWorker
    from edit_jax.validate import load_config

    run = runs["live"]
    cfg = load_config(args.kill_config, overrides(args, run.ex) + [f"eval_batches={args.eval_batches}"])
    w = ElasticWorker(cfg, args.live_workers, os.path.join(os.path.dirname(run.run_dir), "reader"),
                      say=lambda m: None)
    t = time.perf_counter()
    w.join()
    out = {"join_s": time.perf_counter() - t, "eval_batches": args.eval_batches}
    for name, r in runs.items():
        ex = open_exchange(r.ex)
        t = time.perf_counter()
        key = R.state_key(R.newest_state(ex))
        R.RoundState.decode(ex.get(key), w.template, key)
        out[name] = {"read_state_s": time.perf_counter() - t, "state_bytes": len(ex.get(key))}
        # every state the run published (kept by the watcher), else those the exchange still holds;
        # round 0 left out (join() creates it again wherever it was collected)
        saved = getattr(r, "saved", "")
        names = sorted(f for f in os.listdir(saved) if f.endswith(".npz")) if os.path.isdir(saved) else []
        blobs = [(f, open(os.path.join(saved, f), "rb").read()) for f in names] or \
            [(k, ex.get(k)) for k in ex.list("state/r")]
        kept = [R.RoundState.decode(b, w.template, k) for k, b in blobs]
        out[name]["kept"] = [[s.round, s.tally, w.evaluate(s.theta)] for s in kept if s.round]  # round, tally, val
    target = min(out[n]["kept"][-1][1] for n in runs)
    for name in runs:
        kept = out[name]["kept"]
        near = min(kept, key=lambda k: (abs(k[1] - target), k[0]))
        inside = kept[0][1] <= target <= kept[-1][1]  # (else no equal-token value: np.interp would clamp)
        out[name].update({"equal_round": near[0], "equal_tally": near[1], "equal_val_loss": near[2],
                          "interp_val_loss": float(np.interp(target, [k[1] for k in kept], [k[2] for k in kept]))
                          if inside else None})
    a, b = out["live"]["equal_val_loss"], out["fault_free"]["equal_val_loss"]
    out["target_tally"], out["rel_diff"] = target, (a - b) / b
    a, b = out["live"]["interp_val_loss"], out["fault_free"]["interp_val_loss"]
    out["rel_diff_interp"] = None if a is None or b is None else (a - b) / b  # both at the target tally
    for name in runs:
        out[name]["fit_val_loss"] = fitted_val_loss(out[name]["kept"], target)
    a, b = out["live"]["fit_val_loss"], out["fault_free"]["fit_val_loss"]
    out["rel_diff_fit"] = None if a is None or b is None else (a - b) / b
    return out


def fitted_val_loss(kept: list, tally: float) -> float | None:
    """The val loss at ``tally`` read off a line fitted to the FIT_ROUNDS rounds of ``kept`` ([round,
    tally, val loss] per published θ̄, by round) whose tallies lie nearest to it (a run's last
    FIT_ROUNDS when it ends there): one θ̄ against another carries θ̄'s round-to-round noise (+-2%
    late in a 600 s run). None under 3 rounds."""
    near = sorted(sorted(kept, key=lambda k: (abs(k[1] - tally), k[0]))[:FIT_ROUNDS])
    k = np.array([[t, v] for _, t, v in near], dtype=float)
    return float(np.polyval(np.polyfit(k[:, 0], k[:, 1], 1), tally)) if len(k) >= 3 else None


def plot(out: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for name in ("fault_free", "live"):  # x: s since the run's first round closed (when its schedule starts)
        r = out[name]
        o = r["window_s"][0]
        xs = [(i + 0.5) * r["bin_s"] - o for i in range(len(r["tokens_per_s_bins"]))]
        ax.plot(xs, r["tokens_per_s_bins"], marker=".", label=f"{name} ({r['tokens_per_s_window']:,.0f} tokens/s)")
        bx.step([t["t"] - o for t in r["timeline"]], [len(t["members"]) for t in r["timeline"]], where="post",
                label=name)
    o = out["live"]["window_s"][0]
    for e in out["live"]["events"]:
        for a in (ax, bx):
            if e["event"] == "kill":
                a.axvline(e["at"] - o, color="red", linestyle=":", linewidth=1)
            elif e["event"] == "join":
                a.axvline(e["at"] - o, color="green", linestyle="--", linewidth=1)
            elif e["event"] == "stop":
                cont = _first(x["at"] for x in out["live"]["events"] if x["event"] == "cont") or e["at"]
                a.axvspan(e["at"] - o, cont - o, color="grey", alpha=0.2)
    ax.set_ylabel(f"tokens/s ({out['live']['bin_s']:g} s bins)")
    bx.set_ylabel("round members")
    bx.set_xlabel("s since the run's first round (red: SIGKILL, grey: SIGSTOP, green: a worker started by hand)")
    ax.set_title(f"exchange-mode {out.get('method', 'a_edit')}, {out['config']}: {out['workers']} workers + a joiner, "
                 f"{'tau_time' if out.get('tau') is None else 'tau ' + str(out['tau']) + ' steps, tau_time'} "
                 f"{out['tau_time']:g} s, grace {out['grace']:g} s; live / fault-free = {out['ratio']:.3f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def common_eval(runs: dict, every: int) -> dict:
    """Both runs' evaluation at the last multiple of eval_every both crossed (its first round past it)."""
    ks = [max((e["step"] // every for e in r["evals"]), default=0) for r in runs.values()]
    out = {"multiple": min(ks) * every}
    for name, r in runs.items():
        out[name] = _first(e for e in r["evals"] if e["step"] // every == min(ks))
    if all(out[n] for n in runs) and min(ks):
        out["rel_diff"] = (out["live"]["val_loss"] - out["fault_free"]["val_loss"]) / out["fault_free"]["val_loss"]
    return out


def abba(out: dict) -> dict:
    """Four runs in the order fault-free, live, live, fault-free: tokens/s from round 1 of each, the
    ratio of the means (a drift of the machine's speed that is linear in time cancels: each kind's
    mean sits at the same mid-time) and each adjacent pair's own ratio."""
    tps = {n: out[n]["tokens_per_s_window"] for n in ("fault_free", "live", "live_b", "fault_free_b")}
    ff, lv = (tps["fault_free"] + tps["fault_free_b"]) / 2, (tps["live"] + tps["live_b"]) / 2
    return {"tokens_per_s_window": tps, "ratio": lv / ff, "ratio_first_pair": tps["live"] / tps["fault_free"],
            "ratio_second_pair": tps["live_b"] / tps["fault_free_b"],
            "fault_free_drift": tps["fault_free_b"] / tps["fault_free"]}


def abba_kept(states: dict, states_b: dict) -> dict:
    """The four ABBA runs' evaluated θ̄ ([round, tally, val loss] each), by run name in run order."""
    return {"fault_free": states["fault_free"]["kept"], "live": states["live"]["kept"],
            "live_b": states_b["live"]["kept"], "fault_free_b": states_b["fault_free"]["kept"]}


def abba_val_loss(states: dict, states_b: dict, tally: float | None = None) -> dict | None:
    """The val loss of the four ABBA runs, each read off its fitted line (``fitted_val_loss``) at one
    tally (default: the smallest of the four runs' last): the live runs' mean against the fault-free
    runs' mean, as ``abba`` compares tokens/s, and the two fault-free runs against each other (the
    bench's own noise floor: the same command twice). None if a run has too few rounds."""
    kept = abba_kept(states, states_b)
    tally = min(k[-1][1] for k in kept.values()) if tally is None else tally
    fit = {n: fitted_val_loss(k, tally) for n, k in kept.items()}
    if None in fit.values():
        return None
    ff, lv = fit["fault_free"] + fit["fault_free_b"], fit["live"] + fit["live_b"]
    return {"tally": tally, "fit": fit, "rel_diff_of_means": lv / ff - 1,
            "fault_free_apart": fit["fault_free_b"] / fit["fault_free"] - 1,
            "live_apart": fit["live_b"] / fit["live"] - 1}


def part_live(args) -> dict:
    from edit_jax.validate import load_config

    args.mtbf_live = MTBF_S if args.mtbf is None else args.mtbf
    if args.smoke:  # (after the first round: a kill at 0.5 s, the stop at 1 s for 1.5 s, the joiner at 1.5 s)
        args.live_workers, args.tau_time, args.grace, args.stop_s, args.eval_every = 2, 1.0, 1.0, 1.5, 50
        args.eval_batches = 1
        args.duration = 3.0
        args.tau = min(args.tau, 10)  # (a lock-step method: rounds of about a second of one-layer steps)
    cfg = load_config(args.kill_config, overrides(args, "x"))
    per_step = cfg.batch_size // cfg.mesh.replica * cfg.data.seq_len
    out = {"config": args.kill_config, "method": args.live_method,
           "tau": None if args.live_method == "a_edit" else args.tau, "workers": args.live_workers,
           "slots": args.live_workers + 1,
           "tau_time": args.tau_time, "grace": args.grace, "mtbf_s": args.mtbf_live, "duration_s": args.duration,
           "stop_s": args.stop_s, "eval_every": args.eval_every, "tokens_per_step": per_step,
           "progress_every": args.progress_every, "carried_weight": args.carried_weight}
    runs = {}
    order = [("fault_free", False), ("live", True)] + ([("live_b", True), ("fault_free_b", False)] if args.abba else [])
    for name, faults in order:
        print(f"live: the {name} run", flush=True)
        runs[name] = run = LiveRun(os.path.join(args.run_root, "live", name), args)
        try:
            events = drive(run, args, faults, random.Random(args.seed))
        except BaseException:
            run.stop()  # a failed drive leaves no launcher or worker running (they outlived a test once)
            raise
        out[name] = analyse(run.t0, events, run.manifests(), run.records(), run.posts, run.lines, per_step,
                            2.0 if args.smoke else 15.0)
        o = out[name]
        out[name]["cpu"] = cpu_ledger(run, events, o["tokens_per_s_window"] * (o["wall_s"] - o["window_s"][0]))
    out["ratio"] = out["live"]["tokens_per_s_window"] / out["fault_free"]["tokens_per_s_window"]
    out["ratio_whole_run"] = out["live"]["tokens_per_s"] / out["fault_free"]["tokens_per_s"]
    first = {k: runs[k] for k in ("fault_free", "live")}
    out["common_eval"] = common_eval({k: out[k] for k in first}, args.eval_every)
    if args.abba:
        out["abba"] = abba(out)
    common.write_json(args.json, out)  # (what was measured, should the rest fail)
    out["states"] = evaluate_states(args, first)
    if args.abba:  # the second pair's val loss at equal tokens too
        out["states_b"] = evaluate_states(args, {"fault_free": runs["fault_free_b"], "live": runs["live_b"]})
        out["abba_val_loss"] = abba_val_loss(out["states"], out["states_b"])
    out["figure"] = plot(out, args.figure or os.path.join(os.path.dirname(os.path.abspath(args.json)),
                                                          "bench_live.png"))
    _print(out)
    return out


def _num(x) -> float:
    return float("nan") if x is None else x


def _print(out: dict) -> None:
    ff, lv, st = out["fault_free"], out["live"], out["states"]
    rows = [[n, "{launcher}/{hand}".format(**r["exit"]), r["wall_s"], r["rounds"], r["tokens"], r["tokens_per_s"],
             r["tokens_per_s_window"], " ".join(f"{c} {v}" for c, v in r["left_out_by_cause"].items()),
             len(r["late_posts"]), st[n]["equal_tally"], st[n]["equal_val_loss"]] for n, r in (("fault_free", ff),
                                                                                                ("live", lv))]
    ce, interp = out["common_eval"], st["rel_diff_interp"]
    common.print_table(f"live: {out['workers']} workers + a joiner, kill every {out['mtbf_s']:g} s, stop "
                       f"{out['stop_s']:g} s, for {out['duration_s']:g} s",
                       ["run", "exit (launcher/hand)", "wall s", "rounds", "tokens", "tokens/s", "from round 1",
                        "workers left out of a round, by cause", "late posts", "tally (eval)", "val loss"], rows,
                       note=f"tokens/s from round 1 live / fault-free = {out['ratio']:.3f} (target >= 0.95; whole run "
                            f"{out['ratio_whole_run']:.3f}; restart-everything "
                            "mode, --part kill: goodput 0.833 at MTBF 60 s, 2 workers, BUILD_NOTES); val loss at equal "
                            f"tokens: {st['rel_diff']:+.4f} (target within 1%), both at tally "
                            f"{st['target_tally']} {_num(interp):+.4f}, a line "
                            f"through each run's last {FIT_ROUNDS} rounds {_num(st['rel_diff_fit']):+.4f}; at "
                            "the last common multiple of "
                            f"eval_every ({ce['multiple']}): {ce.get('rel_diff', float('nan')):+.4f}; rounds "
                            f"without a record {len(lv['rounds_without_record'])}, θ̄ resyncs (a worker's θ̄ not "
                            f"the closer's) {lv.get('theta_resyncs', 0)}")
    if "abba" in out:
        a, sb = out["abba"], out["states_b"]
        print("live, ABBA (fault-free, live, live, fault-free): tokens/s from round 1 " +
              ", ".join(f"{n} {v:,.0f}" for n, v in a["tokens_per_s_window"].items()) +
              f"; live / fault-free of the means {a['ratio']:.3f} (pairs {a['ratio_first_pair']:.3f}, "
              f"{a['ratio_second_pair']:.3f}; fault-free second / first {a['fault_free_drift']:.3f}); the second "
              f"pair's val loss at equal tokens {sb['rel_diff']:+.4f} (a line through the last {FIT_ROUNDS} rounds "
              f"{_num(sb['rel_diff_fit']):+.4f})", flush=True)
        v = out.get("abba_val_loss")
        if v:
            print(f"live, ABBA val loss (each run's line at tally {v['tally']}): live / fault-free of the means "
                  f"{v['rel_diff_of_means']:+.4f} (target within 1%); the two fault-free runs apart "
                  f"{v['fault_free_apart']:+.4f}, the two live runs {v['live_apart']:+.4f} (the bench's noise)",
                  flush=True)
    keys = ["t", "round_without", "to_round_without_s", "closed_by", "survivors_wait_s", "restart_s",
            "joined_line_s", "read_s", "catch_up_s", "replayed", "first_post_s", "round_back", "to_member_s",
            "steps_restored", "steps_lost"]
    common.print_table("live: per fault (s; for the stop, 'first post' and 'back' count from the SIGCONT)",
                       ["event", "slot", *keys], [[f["event"], f["slot"], *(f.get(k, "-") for k in keys)]
                                                  for f in lv["faults"]],
                       note=f"reading the newest round state (get + decode, {st['live']['state_bytes']:,} bytes): "
                            f"{st['live']['read_state_s']:.4f} s; ElasticWorker.join() in process: {st['join_s']:.2f} "
                            f"s (with its init program's compile); figure {out['figure']}")
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
    known = lambda rows, key: [x[key] for x in rows if x[key] is not None]
    rows = []
    for n in ("fault_free", "live"):
        c = out[n]["cpu"]
        rows.append([n, c["window_s"], c["workers_core_s"], c["machine_core_s"], c["tokens_per_core_s"],
                     len(c["starts"]), mean(known(c["starts"], "cpu_to_joined_s")),
                     mean(known(c["starts"], "cpu_to_first_post_s")), mean(known(c["kills"], "cpu_since_last_post_s"))])
    common.print_table("live: the workers' CPU from round 1 (/proc, every 0.2 s)",
                       ["run", "window s", "workers core-s", "machine core-s", "tokens / worker core-s",
                        "starts after round 1", "core-s to joined", "core-s to first post",
                        "core-s since last post, per kill"], rows,
                       note=f"saving unposted steps (sync.exchange.progress_every {out['progress_every']:g} s): "
                            + ", ".join(f"{n} {out[n]['progress_save_s']:.2f} s" for n in ("fault_free", "live"))
                            + " of the workers' time (seen in records every log_every steps)")


__all__ = ["add_args", "part_live", "overrides", "LiveRun", "drive", "abba", "abba_kept", "abba_val_loss",
           "fitted_val_loss"]
