"""``bench_faults.py --part kill``: a kill loop in the style of torchft's (issue 31, item 4).

1. Calibration (unless ``--checkpoint-every`` is given): a short run of the same config measures
   the step time; ``checkpoint_every`` is set so that a save is due about every ``--save-every-s``
   seconds (default 10).
2. Fault-free: ``edit-jax train`` with ``mesh.processes=--workers`` on a new run dir, stopped by a
   SIGINT after ``--duration`` seconds (it stops at its next meeting and checkpoints): S steps.
   ``optim.decay_steps`` is fixed so that the schedule does not depend on ``steps``.
3. Faulty: the same config with ``steps=S`` on a new run dir under the launcher with
   ``--max-restarts`` large; a killer thread SIGKILLs a random worker (a child of the launcher,
   found in /proc) every ``--mtbf`` seconds (``--exponential``: exponentially distributed gaps
   with that mean) while the run lasts, at most for ``--duration`` seconds.

Reported: goodput = (tokens/s of the faulty run) / (tokens/s of the fault-free run) over the same
S steps, wall time from the launcher's start to its end, both runs cold (a new run dir each);
per fault the time from the kill to the next new training record in metrics.jsonl after the
launcher's restart line, and the steps lost (from that line); the final loss of both runs and
whether every step's loss is equal (lockstep methods resume exactly on CPU).

``--smoke`` (CI): the same path at its smallest: 2 workers of one device, ``method=baseline`` (one
training program; ``--method`` picks another), one layer, 6 steps, a checkpoint every 2, no
calibration; the fault-free run goes to its end, and the faulty run gets exactly one SIGKILL, once
a training record past step 2 appears (then it resumes from its checkpoint); worker 1 sleeps 4x
its step time after each step (``debug.slowdown=1:5``) so the run outlasts the poll.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

RESTART = re.compile(r"restart (\d+) of \d+.*?(?:resuming from step (\d+)|starting from step 0).*?\((\d+) steps lost\)")


def add_args(p) -> None:
    p.add_argument("--workers", type=int, default=2, help="kill: worker processes (mesh.processes = mesh.replica)")
    p.add_argument("--shard", type=int, default=2, help="kill: CPU devices per worker (mesh.shard)")
    p.add_argument("--mtbf", type=float, default=None, help="kill, live: seconds between kills (default 60; live: 30)")
    p.add_argument("--exponential", action="store_true", help="kill: exponential gaps with mean --mtbf")
    p.add_argument("--duration", type=float, default=600.0,
                   help="kill, live: seconds of the fault-free run and of kills")
    p.add_argument("--checkpoint-every", type=int, default=0, help="kill: 0 = from a calibration run")
    p.add_argument("--save-every-s", type=float, default=10.0, help="kill: aim of the calibration")
    p.add_argument("--seed", type=int, default=0, help="kill, live: which worker is killed (stopped) when")


SMOKE_STEPS, SMOKE_EVERY = 6, 2
# (smoke: worker 1 sleeps 4x its step time after each step, so that on a fast machine the run is
# still going when the kill comes; sleeping costs no CPU)
SMOKE_OVERRIDES = ["model.n_layers=1", "eval_batches=1", "debug.slowdown=1:5"]


def _overrides(args, steps: int, every: int) -> list[str]:
    w = args.workers
    return ["--config", args.kill_config, "--no-progress", f"method={args.kill_method}", f"mesh.replica={w}",
            f"mesh.processes={w}", f"mesh.shard={args.shard}", f"batch_size={4 * w}", "data.seq_len=32",
            "log_every=1", "eval_every=0", "optim.decay_steps=100000", f"steps={steps}", f"checkpoint_every={every}",
            "mesh.heartbeat_seconds=5", *(SMOKE_OVERRIDES if args.smoke else [])]


def _records(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [r for r in (json.loads(x) for x in f if x.endswith("\n")) if "loss" in r]
    except OSError:
        return []


class Run:
    """One launcher process and what happens to it, timed from here: its output lines and the
    training records appearing in its metrics.jsonl (polled every 50 ms)."""

    def __init__(self, run_dir: str, argv: list[str], extra: list[str] = ()):
        shutil.rmtree(run_dir, ignore_errors=True)
        self.run_dir, self.lines, self.seen = run_dir, [], []  # (time, line); (time, step) of new records
        self.t0 = time.monotonic()
        env = common.child_env()
        self.proc = subprocess.Popen([sys.executable, "-m", "edit_jax", "train", "--run-dir", run_dir, *argv, *extra],
                                     cwd=common.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._poll, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            print(f"  [{time.monotonic() - self.t0:7.1f}s] {line.rstrip()}", flush=True)

    def _poll(self):
        count = 0
        path = os.path.join(self.run_dir, "metrics.jsonl")
        while self.proc.poll() is None:
            try:
                with open(path) as f:
                    lines = [x for x in f if x.endswith("\n") and '"loss"' in x]
            except OSError:
                lines = []
            if len(lines) < count:  # a resume dropped the records past its checkpoint
                count = len(lines)
            for x in lines[count:]:
                self.seen.append((time.monotonic(), json.loads(x)["step"]))
            count = len(lines)
            time.sleep(0.05)

    def wait(self) -> float:
        self.proc.wait()
        time.sleep(0.3)  # the reader's last lines
        return time.monotonic() - self.t0

    def workers(self) -> list[int]:
        return common.child_pids(self.proc.pid)


def _calibrate(args) -> int:
    run = Run(os.path.join(args.run_root, "kill", "calibrate"), _overrides(args, 30, 0), ["--max-restarts", "0"])
    if run.wait() and run.proc.returncode != 0:
        raise SystemExit(f"bench_faults kill: the calibration run failed (exit {run.proc.returncode})")
    times = [r["step_time"] for r in _records(run.run_dir)[5:]]
    step = statistics.median(times)
    return max(1, round(args.save_every_s / step))


def part_kill(args) -> dict:
    root = os.path.join(args.run_root, "kill")
    mtbf = 60.0 if args.mtbf is None else args.mtbf
    if args.smoke:  # the smallest real run: no calibration, a fixed length, one kill
        args.workers, args.shard, args.duration = 2, 1, 300.0
    every = SMOKE_EVERY if args.smoke else args.checkpoint_every or _calibrate(args)
    print(f"kill: checkpoint_every={every}", flush=True)
    # Fault-free: stopped after --duration (SIGINT: the launcher forwards it, the workers checkpoint)
    free = Run(os.path.join(root, "fault_free"), _overrides(args, SMOKE_STEPS if args.smoke else 10**6, every),
               ["--max-restarts", "0"])
    while free.proc.poll() is None and time.monotonic() - free.t0 < args.duration:
        time.sleep(0.2)
    if free.proc.poll() is None:  # (a smoke run ends by itself; its pid may be gone)
        os.kill(free.proc.pid, signal.SIGINT)
    free_wall = free.wait()
    free_losses = {r["step"]: r["loss"] for r in _records(free.run_dir)}
    steps = max(free_losses)
    # Faulty: the same steps, a random worker SIGKILLed every --mtbf s
    rng = random.Random(args.seed)
    faulty = Run(os.path.join(root, "faulty"), _overrides(args, steps, every), ["--max-restarts", "100000"])
    kills = []
    while faulty.proc.poll() is None and not (args.smoke and kills):
        gap = rng.expovariate(1 / mtbf) if args.exponential else mtbf
        target = time.monotonic() + gap
        while faulty.proc.poll() is None and (time.monotonic() < target if not args.smoke else
                                              not any(step > every for _, step in faulty.seen)):
            time.sleep(0.05)
        if faulty.proc.poll() is not None or time.monotonic() - faulty.t0 > args.duration:
            break
        pids = faulty.workers()
        if pids:
            pid = rng.choice(pids)
            os.kill(pid, signal.SIGKILL)
            kills.append((time.monotonic(), pid))
            print(f"  [{time.monotonic() - faulty.t0:7.1f}s] bench: SIGKILL worker pid {pid}", flush=True)
    faulty_wall = faulty.wait()
    faulty_losses = {r["step"]: r["loss"] for r in _records(faulty.run_dir)}
    faults = []
    restarts = [(t, m) for t, line in faulty.lines if (m := RESTART.search(line))]
    for t_kill, pid in kills:
        line = next(((t, m) for t, m in restarts if t >= t_kill), None)
        if line is None:
            faults.append({"pid": pid, "restart": None})
            continue
        nxt = next((t for t, _ in faulty.seen if t >= line[0]), None)
        faults.append({"pid": pid, "restart": int(line[1][1]), "resumed_from": int(line[1][2] or 0),
                       "steps_lost": int(line[1][3]), "kill_to_next_step_s": None if nxt is None else nxt - t_kill})
    goodput = free_wall / faulty_wall if faulty.proc.returncode == 0 else 0.0
    equal = faulty_losses == free_losses
    next_s = [f["kill_to_next_step_s"] for f in faults if f.get("kill_to_next_step_s") is not None]
    lost = [f["steps_lost"] for f in faults if f.get("steps_lost") is not None]
    common.print_table(f"kill: {args.workers} workers, {steps} steps, checkpoint_every={every}, a SIGKILL every "
                       f"{'~' if args.exponential else ''}{mtbf:g} s for {args.duration:g} s",
                       ["run", "exit", "wall s", "tokens/s", "final loss", "faults", "kill -> next step s (max)",
                        "steps lost / fault (mean)"],
                       [["fault-free", free.proc.returncode, free_wall, steps * 4 * args.workers * 32 / free_wall,
                         free_losses[steps], 0, "-", "-"],
                        ["faulty", faulty.proc.returncode, faulty_wall, steps * 4 * args.workers * 32 / faulty_wall,
                         faulty_losses.get(steps, float("nan")), len(kills),
                         max(next_s) if next_s else float("nan"), statistics.fmean(lost) if lost else float("nan")]],
                       note=f"goodput {goodput:.3f} (target >= 0.80); kill -> next step median "
                            f"{statistics.median(next_s) if next_s else float('nan'):.2f} s (target <= 15 s); "
                            f"every step's loss equal to the fault-free run's: {equal}")
    return {"workers": args.workers, "steps": steps, "checkpoint_every": every, "mtbf_s": mtbf,
            "duration_s": args.duration, "exponential": args.exponential,
            "fault_free": {"exit": free.proc.returncode, "wall_s": free_wall, "final_loss": free_losses[steps]},
            "faulty": {"exit": faulty.proc.returncode, "wall_s": faulty_wall, "final_loss": faulty_losses.get(steps)},
            "goodput": goodput, "faults": faults, "kill_to_next_step_s": next_s, "steps_lost": lost,
            "losses_equal": equal, "targets": {"goodput": 0.8, "kill_to_next_step_s": 15}}
