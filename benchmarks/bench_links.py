"""Tokens per second against the bandwidth between workers (issue 32): the figure of Local SGD.

    sudo python benchmarks/bench_links.py                          # every method, rates none..10 Mbit/s (~20 min)
    sudo python benchmarks/bench_links.py --methods hsdp,edit_t32 --rates none,100,10 --processes 2

Each method runs once as ``edit-jax train --config configs/demo.py mesh.processes=N`` (one worker
process per replica, gloo over 127.0.0.1) and the link between the worker processes is throttled
step by step, in phases: unthrottled, then each rate of ``--rates`` in turn (Mbit/s). A phase
sets the rate, lets ``--settle`` steps pass (the step under way when the rate changed), then
measures whole periods of the method (τ steps; HSDP: 8 steps; A-EDiT: ``--aedit-syncs`` syncs):
tokens/s over the window, the bytes that crossed the throttled link, and the same window
predicted. After the last phase the link is unthrottled again and the run finishes at ``--steps``,
so every method ends at the same tokens (its validation loss there is the "loss at equal
tokens"; the lock-step methods' losses do not depend on the link, A-EDiT's can).

The link. The Linux token bucket on ``lo`` is the only shaper (no netem here), and lo carries more
than the link between workers: XLA:CPU's gloo collectives run between *devices*, so the FSDP
collectives among one worker's own devices go over TCP loopback too, as do the coordination
service's heartbeats. A qdisc on all of ``lo`` throttles those (the first try of issue 32 did: 7x
off the prediction at 100 Mbit/s). So this script shapes only the worker-to-worker connections:
an HTB root (``handle ed17:``) whose one class carries the rate, and u32 filters that steer into
it each TCP connection whose two ends belong to two different worker processes (found from
/proc: the sockets each worker owns; re-scanned during the run, gloo opens pairs when a
collective first needs them). Everything else on lo bypasses the class (HTB's direct queue).
Burst 256 KiB: lo's MTU is 64 KiB, and a token bucket smaller than one packet never sends it (the
first try's 10 Mbit/s stall: ``tbf burst 64kb`` < 65,536 + headers).

The prediction, per window (whole periods of the method): t = t_none + bytes / rate, with t_none
the unthrottled window's time in the same run (scaled by tokens for A-EDiT's windows) and bytes
what ``plan`` counts across ``replica`` per step kind (ring bytes per device, from the compiled
program) x devices per process x processes: every direction of every worker pair goes through the
one class. The measured bytes through the class are reported beside it.

Root only (tc); refuses in one line when not root, or when lo has a qdisc this script did not
make. The qdisc is removed on every way out (the end, an error, Ctrl-C, SIGTERM); a leftover of
a bench_links run killed with -9 (handle ed17:) is removed at the next start, with a line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common

HANDLE, CLASS, LEAF = "ed17:", "ed17:10", "ed18:"
BURST = "256k"
TOKENS = {"batch": 16, "seq": 128}  # configs/demo.py (checked against the config at start)
# name -> (overrides, label)
METHODS = {
    "hsdp": (["method=baseline"], "HSDP (sync every step)"),
    "diloco_t32": (["method=diloco", "sync.tau=32"], "DiLoCo τ=32"),
    "edit_t8": (["method=edit", "sync.tau=8"], "EDiT τ=8"),
    "edit_t32": (["method=edit", "sync.tau=32"], "EDiT τ=32"),
    "edit_t8_int8": (["method=edit", "sync.tau=8", "sync.wire.kind=int8"], "EDiT τ=8 int8"),
    "edit_t8_topk4": (["method=edit", "sync.tau=8", "sync.wire.kind=topk4", "sync.wire.error_feedback=true"],
                      "EDiT τ=8 top-64/4096 4-bit"),
    "edit_t8_topk2": (["method=edit", "sync.tau=8", "sync.wire.kind=topk2", "sync.wire.error_feedback=true"],
                      "EDiT τ=8 top-64/4096 2-bit"),
    "edit_t32_f4": (["method=edit", "sync.tau=32", "sync.fragments=4"], "EDiT τ=32, 4 streamed fragments"),
    "a_edit": (["method=a_edit", "sync.time.tau=2"], "A-EDiT τ_time=2 s"),
}


class Refused(SystemExit):
    pass


def tc(*args: str, check: bool = True) -> str:
    r = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


class Link:
    """The throttled link between worker processes: an HTB class on lo, and filters steering the
    worker-to-worker TCP connections into it (module docstring). Use as a context manager."""

    def __init__(self, say):
        self.say = say
        self.steered: set[tuple[int, int]] = set()
        self.rate: float | None = None

    def __enter__(self):
        if os.geteuid() != 0:
            raise Refused("bench_links: needs root (it shapes lo with tc); run it with sudo, or as root")
        if subprocess.run(["which", "tc"], capture_output=True).returncode != 0:
            raise Refused("bench_links: needs tc (iproute2)")
        root = (tc("qdisc", "show", "dev", "lo").splitlines() or [""])[0]
        if f"qdisc htb {HANDLE} root" in root:
            self.say(f"bench_links: removing a qdisc left on lo by an earlier bench_links run ({root.strip()})")
            tc("qdisc", "del", "dev", "lo", "root")
        elif root and not root.startswith("qdisc noqueue 0: root"):
            raise Refused(f"bench_links: lo already has a qdisc that is not ours ({root.strip()}); not touching it. "
                          "Remove it yourself (tc qdisc del dev lo root) if it is yours")
        tc("qdisc", "add", "dev", "lo", "root", "handle", HANDLE, "htb", "default", "0")
        tc("class", "add", "dev", "lo", "parent", HANDLE, "classid", CLASS, *self._rate_args(None))
        tc("qdisc", "add", "dev", "lo", "parent", CLASS, "handle", LEAF, "pfifo", "limit", "100000")
        return self

    def __exit__(self, *exc):
        tc("qdisc", "del", "dev", "lo", "root", check=False)
        left = tc("qdisc", "show", "dev", "lo", check=False)
        if HANDLE in left:
            self.say(f"bench_links: could not remove the qdisc on lo: run `tc qdisc del dev lo root` ({left.strip()})")
        return False

    @staticmethod
    def _rate_args(mbit: float | None) -> list[str]:
        rate = "100gbit" if mbit is None else f"{mbit:g}mbit"
        burst = "8m" if mbit is None else BURST
        return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst, "quantum", "200000"]

    def set_rate(self, mbit: float | None) -> None:
        tc("class", "change", "dev", "lo", "parent", HANDLE, "classid", CLASS, *self._rate_args(mbit))
        self.rate = mbit

    def bytes_sent(self) -> int:
        m = re.search(r"Sent (\d+) bytes", tc("-s", "class", "show", "dev", "lo", "classid", CLASS))
        return int(m.group(1)) if m else 0

    def steer(self, workers: list[int], skip_ports: set[int]) -> int:
        """Adds a filter for each new connection between two worker processes; returns how many."""
        added = 0
        for sport, dport in cross_process_connections(workers):
            if (sport, dport) in self.steered or sport in skip_ports or dport in skip_ports:
                continue
            tc("filter", "add", "dev", "lo", "parent", HANDLE, "protocol", "ip", "prio", "1", "u32",
               "match", "ip", "sport", str(sport), "0xffff", "match", "ip", "dport", str(dport), "0xffff",
               "flowid", CLASS)
            self.steered.add((sport, dport))
            added += 1
        return added


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    except OSError:
        pass
    return out


def cross_process_connections(workers: list[int]) -> list[tuple[int, int]]:
    """(local port, remote port) of each established TCP connection on 127.0.0.1 owned by one
    worker whose other end another worker owns: one per direction of each such connection."""
    owner = {inode: pid for pid in workers for inode in _socket_inodes(pid)}
    ends: dict[tuple[int, int], int] = {}  # (local port, remote port) -> owning pid
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # gRPC's sockets are IPv6 (v4-mapped)
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "01" or int(f[9]) not in owner:  # ESTABLISHED, a worker's
                continue
            (laddr, lport), (raddr, rport) = (x.rsplit(":", 1) for x in f[1:3])
            if laddr.endswith("0100007F") and raddr.endswith("0100007F"):
                # (a listener's accepted connections all share its port: an end is a port pair)
                ends[(int(lport, 16), int(rport, 16))] = owner[int(f[9])]
    return [(lp, rp) for (lp, rp), pid in ends.items() if ends.get((rp, lp), pid) != pid]


def connection_bytes(workers: list[int]) -> dict[tuple[int, int], tuple[int, int]]:
    """Bytes sent so far on each TCP end a worker owns: (local port, remote port) -> (owning pid,
    bytes_sent), from the kernel's tcp_info (``ss -ti``)."""
    owner = {inode: pid for pid in workers for inode in _socket_inodes(pid)}
    out = {}
    r = subprocess.run(["ss", "-tinpeH", "state", "established"], capture_output=True, text=True).stdout
    end = None
    for line in r.splitlines():
        if not line.startswith(("\t", " ")) or re.match(r"^\S", line):
            f = line.split()
            m = re.search(r"ino:(\d+)", line)
            end = None
            if len(f) >= 4 and m and int(m.group(1)) in owner:
                end = (int(f[2].rsplit(":", 1)[1]), int(f[3].rsplit(":", 1)[1]), owner[int(m.group(1))])
        elif end is not None:
            m = re.search(r"bytes_sent:(\d+)", line)
            out[end[:2]] = (end[2], int(m.group(1)) if m else 0)
            end = None
    return out


def census(args, say) -> dict:
    """``--census METHOD``: where the bytes on lo go in an unthrottled run: per step, the bytes sent
    between two worker processes, within one worker process (gloo connects every device with every
    other, the FSDP collectives of one worker included) and to / from the coordinator."""
    overrides, label = METHODS[args.census]
    run_dir = os.path.join(args.run_root, f"census_{args.census}")
    subprocess.run(["rm", "-rf", run_dir])
    argv = [sys.executable, "-m", "edit_jax", "train", "--config", args.config, "--run-dir", run_dir, "--no-progress",
            *overrides, f"mesh.processes={args.processes}", f"mesh.replica={args.processes}",
            f"mesh.shard={args.shard}", "steps=80", f"log_every={args.census_log_every}", "eval_every=0",
            "checkpoint_every=0", "train.spike.enabled=false", *args.census_set,
            f"train.compile_cache={os.path.join(args.run_root, 'compile_cache')}"]
    log = open(os.path.join(args.run_root, f"census_{args.census}.log"), "w")
    proc = subprocess.Popen(argv, cwd=common.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    recs = Records(os.path.join(run_dir, "metrics.jsonl"))
    marks = {}
    try:
        while proc.poll() is None and len(marks) < 2:
            time.sleep(0.02)
            recs.poll()
            for k in (40, 72):  # after warmup and compiles; whole periods of τ = 8 and 32 apart
                if recs.last_step() >= k and k not in marks:
                    marks[k] = connection_bytes(common.child_pids(proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    if len(marks) < 2:
        raise RuntimeError(f"census: the run ended early; see {log.name}")
    coordinator = int(re.search(r"coordinator 127\.0\.0\.1:(\d+)", open(log.name).read()).group(1))
    a, b = marks[40], marks[72]
    steps = 72 - 40
    sums = {"between_workers": 0, "within_a_worker": 0, "coordinator": 0}
    for end, (pid, sent) in b.items():
        peer = b.get((end[1], end[0]))
        delta = sent - a.get(end, (pid, 0))[1]
        if coordinator in end:
            sums["coordinator"] += delta
        elif peer is not None:
            sums["between_workers" if peer[0] != pid else "within_a_worker"] += delta
    per_step = {k: v / steps for k, v in sums.items()}
    say(f"census, {label}, steps 41..72 unthrottled, bytes sent per step: " +
        ", ".join(f"{k.replace('_', ' ')} {v / 1e6:.2f} MB" for k, v in per_step.items()))
    return {"method": args.census, "steps": [41, 72], "bytes_per_step": per_step}


# ----------------------------------------------------------------------------- one method's run


def replica_bytes_per_kind(config: str, overrides: list[str]) -> dict[str, float]:
    """``plan``'s ring bytes across ``replica`` per device, per step kind (an A-EDiT sync moves
    what an EDiT sync moves: its kinds are taken from ``method=edit``)."""
    from edit_jax.commands.plan import plan
    from edit_jax.validate import load_config

    overrides = ["method=edit" if o == "method=a_edit" else o for o in overrides if not o.startswith("sync.time.tau")]
    p = plan(load_config(config, overrides))
    return {k: v["replica_ring_bytes"] for k, v in p["steps"].items()}


class Records:
    """metrics.jsonl read as it grows (a partial last line waits for the rest)."""

    def __init__(self, path: str):
        self.path, self.offset, self.pending = path, 0, ""
        self.train: list[dict] = []
        self.syncs: list[dict] = []
        self.evals: list[dict] = []

    def poll(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        *lines, self.pending = (self.pending + chunk).split("\n")
        for line in lines:
            if not line.strip():
                continue
            r = json.loads(line)
            if "loss" in r:
                self.train.append(r)
            elif r.get("sync"):
                self.syncs.append(r)
            elif "val_loss" in r:
                self.evals.append(r)

    def last_step(self) -> int:
        return self.train[-1]["step"] if self.train else 0


def run_method(name: str, args, link: Link, bytes_per_kind: dict[str, float], say) -> dict:
    overrides, label = METHODS[name]
    run_dir = os.path.join(args.run_root, name)
    subprocess.run(["rm", "-rf", run_dir])
    argv = [sys.executable, "-m", "edit_jax", "train", "--config", args.config, "--run-dir", run_dir, "--no-progress",
            *overrides, f"mesh.processes={args.processes}", f"mesh.replica={args.processes}",
            f"mesh.shard={args.shard}", f"steps={args.steps}", "log_every=1", "eval_every=0", "checkpoint_every=0",
            "train.spike.enabled=false",
            f"train.compile_cache={os.path.join(args.run_root, 'compile_cache')}"]
    asynchronous = name == "a_edit"
    tau = next((int(o.split("=")[1]) for o in overrides if o.startswith("sync.tau=")), 1)
    period = tau if tau > 1 else 8  # steps in one measured window (whole sync periods)
    warmup = 20  # configs/demo.py's sync.warmup_steps (synchronous steps, unthrottled)
    log = open(os.path.join(args.run_root, f"{name}.log"), "w")
    proc = subprocess.Popen(argv, cwd=common.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    recs = Records(os.path.join(run_dir, "metrics.jsonl"))
    phases, rates = [], [None] + args.rates
    link.set_rate(None)
    coordinator_ports: set[int] = set()
    state = {"phase": -1, "start": None}
    first_local = None
    try:
        while proc.poll() is None:
            time.sleep(0.05)
            if not coordinator_ports:
                try:
                    m = re.search(r"coordinator 127\.0\.0\.1:(\d+)", open(log.name).read())
                    coordinator_ports = {int(m.group(1))} if m else set()
                except OSError:
                    pass
            workers = common.child_pids(proc.pid)
            if workers and coordinator_ports:
                link.steer(workers, coordinator_ports)
            recs.poll()
            if not recs.train:
                continue
            if first_local is None and recs.last_step() >= warmup + period + 1:
                first_local = recs.last_step()  # every program compiled (a whole period ran)
            if first_local is None or state["phase"] >= len(rates):
                continue
            done = _phase_step(recs, state, rates, phases, asynchronous, period, args, link)
            if done:
                say(f"  {name}: {_fmt_phase(phases[-1])}")
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        link.set_rate(None)
    recs.poll()
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: the run exited {proc.returncode}; see {log.name}")
    if len(phases) < len(rates):
        raise RuntimeError(f"{name}: the run ended before its phases did ({len(phases)} of {len(rates)}); "
                           f"raise --steps (now {args.steps})")
    _predict(phases, recs, bytes_per_kind, args, asynchronous)
    final = recs.evals[-1]["val_loss"] if recs.evals else float("nan")
    return {"method": name, "label": label, "overrides": overrides, "phases": phases, "final_val_loss": final,
            "final_step": recs.last_step(), "steered_connections": len(link.steered), "command": " ".join(argv[1:])}


def _phase_step(recs: Records, state: dict, rates: list, phases: list, asynchronous: bool, period: int, args,
                link: Link) -> bool:
    """Advances the phase machine; True when a phase's window just closed."""
    if state["phase"] == -1 or state.get("closed"):
        state["phase"] += 1
        state["closed"] = False
        if state["phase"] >= len(rates):
            link.set_rate(None)
            return False
        link.set_rate(rates[state["phase"]])
        state["changed_at"] = (recs.last_step(), len(recs.syncs))
        state["start"] = None
        return False
    step0, syncs0 = state["changed_at"]
    if asynchronous:
        if state["start"] is None and len(recs.syncs) >= syncs0 + 1 + args.settle_syncs:
            state["start"] = (len(recs.syncs) - 1, link.bytes_sent())
        if state["start"] is not None and len(recs.syncs) >= state["start"][0] + 1 + args.aedit_syncs:
            i, b0 = state["start"]
            j = i + args.aedit_syncs
            a, z = recs.syncs[i], recs.syncs[j]
            worker_steps = sum(sum(s["worker_steps_since"]) for s in recs.syncs[i + 1:j + 1])
            phases.append({"rate_mbit": rates[state["phase"]], "window": [a["step"], z["step"]],
                           "syncs": args.aedit_syncs, "seconds": z["time"] - a["time"],
                           "tokens": worker_steps * TOKENS["batch"] * TOKENS["seq"] // args.processes,
                           "link_bytes": link.bytes_sent() - b0})
            state["closed"] = True
            return True
        return False
    if state["start"] is None and recs.last_step() >= step0 + args.settle:
        state["start"] = (recs.last_step(), link.bytes_sent())
    if state["start"] is not None and recs.last_step() >= state["start"][0] + period:
        k0, b0 = state["start"]
        by_step = {r["step"]: r for r in recs.train}
        window = [by_step[k] for k in range(k0 + 1, k0 + period + 1)]
        phases.append({"rate_mbit": rates[state["phase"]], "window": [k0, k0 + period],
                       "seconds": by_step[k0 + period]["time"] - by_step[k0]["time"],
                       "tokens": period * TOKENS["batch"] * TOKENS["seq"],
                       "kinds": [r["kind"] for r in window], "step_times": [r["step_time"] for r in window],
                       "link_bytes": link.bytes_sent() - b0})
        state["closed"] = True
        return True
    return False


def _predict(phases: list[dict], recs: Records, bytes_per_kind: dict[str, float], args, asynchronous: bool) -> None:
    """Adds each phase's prediction (module docstring) and the ratios."""
    none = phases[0]
    per_step_link = {k: b * args.shard * args.processes for k, b in bytes_per_kind.items()}
    sync_bytes = per_step_link.get("sync_forward", max(per_step_link.values()))
    for ph in phases:
        ph["predicted_link_bytes"] = (sync_bytes * ph["syncs"] if asynchronous
                                      else sum(per_step_link.get(k, 0.0) for k in ph["kinds"]))
        # Every window holds whole periods of the method, so its compute is the unthrottled
        # window's, scaled by its tokens (A-EDiT: its windows' syncs are τ_time apart).
        base = none["seconds"] * ph["tokens"] / none["tokens"]
        rate = ph["rate_mbit"]
        ph["predicted_seconds"] = base + (0.0 if rate is None else ph["predicted_link_bytes"] * 8 / (rate * 1e6))
        ph["tokens_per_s"] = ph["tokens"] / ph["seconds"]
        ph["predicted_tokens_per_s"] = ph["tokens"] / ph["predicted_seconds"]
        ph["measured_over_predicted"] = ph["tokens_per_s"] / ph["predicted_tokens_per_s"]
        ph["fraction_of_unthrottled"] = ph["tokens_per_s"] / none["tokens"] * none["seconds"]


def _fmt_phase(ph: dict) -> str:
    rate = "none" if ph["rate_mbit"] is None else f"{ph['rate_mbit']:g} Mbit/s"
    return (f"{rate:>12}: {ph['tokens'] / ph['seconds']:9,.0f} tokens/s over steps "
            f"{ph['window'][0]}..{ph['window'][1]}, {ph['link_bytes'] / 1e6:.2f} MB across the link")


# ----------------------------------------------------------------------------- report


def table(results: list[dict]) -> str:
    head = (f"{'method':<34}{'link Mbit/s':>12}{'tokens/s':>10}{'fraction':>10}{'predicted':>11}{'meas/pred':>10}"
            f"{'link MB':>9}{'pred MB':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        for ph in r["phases"]:
            rate = "none" if ph["rate_mbit"] is None else f"{ph['rate_mbit']:g}"
            lines.append(f"{r['label']:<34}{rate:>12}{ph['tokens_per_s']:>10,.0f}{ph['fraction_of_unthrottled']:>10.2f}"
                         f"{ph['predicted_tokens_per_s']:>11,.0f}{ph['measured_over_predicted']:>10.2f}"
                         f"{ph['link_bytes'] / 1e6:>9.2f}{ph['predicted_link_bytes'] / 1e6:>9.2f}")
    lines.append("")
    lines.append(f"{'method':<34}{'val loss at step ' + str(results[0]['final_step']):>28}")
    for r in results:
        lines.append(f"{r['label']:<34}{r['final_val_loss']:>28.4f}")
    return "\n".join(lines)


def plot(results: list[dict], out: str, unthrottled_x: float) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for r in results:
        xs = [unthrottled_x if ph["rate_mbit"] is None else ph["rate_mbit"] for ph in r["phases"]]
        ys = [ph["fraction_of_unthrottled"] for ph in r["phases"]]
        line, = ax.plot(xs, ys, marker="o", label=r["label"])
        pred = [ph["predicted_tokens_per_s"] / r["phases"][0]["tokens_per_s"] for ph in r["phases"]]
        ax.plot(xs, pred, linestyle=":", color=line.get_color(), linewidth=1)
    ax.set_xscale("log")
    rates = sorted({ph["rate_mbit"] for r in results for ph in r["phases"] if ph["rate_mbit"] is not None})
    ax.set_xticks(rates + [unthrottled_x], [f"{x:g}" for x in rates] + ["none"])
    ax.minorticks_off()
    ax.set_xlabel("link between the worker processes, Mbit/s")
    ax.set_ylabel("tokens/s, fraction of the method's own unthrottled")
    ax.set_ylim(0, 1.15)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Demo model, 2 worker processes x 4 CPU devices (dotted: compute + bytes / rate)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    return out


SMOKE_SIZES = ["model.n_layers=1", "batch_size=4", "data.seq_len=32"]


def smoke(args, say) -> int:
    """``--smoke`` (CI): what runs without root and without training, at tiny size: ``plan``'s bytes
    across ``replica`` per step kind (the prediction's input) of each method, and the scan for
    connections between worker processes (over this process: none). The shaped runs need root
    (tc) and minutes: not here."""
    out = {}
    for name in args.methods:
        out[name] = replica_bytes_per_kind(args.config, METHODS[name][0] + [
            f"mesh.replica={args.processes}", f"mesh.shard={args.shard}", *SMOKE_SIZES])
        say(f"{name}: plan counts {', '.join(f'{k} {v:,.0f} B' for k, v in out[name].items())} across replica")
    conns = cross_process_connections([os.getpid()])
    common.write_json(args.json, {"env": common.env_info(), "args": vars(args), "smoke": True,
                                  "replica_bytes_per_kind": out, "connections_between_workers": len(conns)})
    say(f"JSON: {args.json}")
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--rates", default="1000,300,100,30,10", help="Mbit/s, fastest first (an unthrottled phase "
                   "always comes first)")
    p.add_argument("--processes", type=int, default=2, help="worker processes (= mesh.replica)")
    p.add_argument("--shard", type=int, default=4, help="CPU devices per worker process (mesh.shard)")
    p.add_argument("--config", default="configs/demo.py")
    p.add_argument("--steps", type=int, default=360, help="steps of every run (equal tokens for the loss)")
    p.add_argument("--settle", type=int, default=2, help="steps after a rate change before the window")
    p.add_argument("--settle-syncs", type=int, default=1, help="A-EDiT: syncs after a rate change before the window")
    p.add_argument("--aedit-syncs", type=int, default=3, help="A-EDiT: syncs per window")
    p.add_argument("--run-root", default=os.path.join(common.REPO, "runs", "bench_links"))
    p.add_argument("--json", default=os.path.join(common.DEFAULT_JSON_DIR, "bench_links.json"))
    p.add_argument("--png", default=os.path.join(common.DEFAULT_JSON_DIR, "bench_links.png"))
    p.add_argument("--smoke", action="store_true", help="CI, no root: the prediction's inputs (plan's bytes per "
                   "step kind: hsdp, local, sync) of edit_t8 on the tiny config, the connection scan, the JSON; "
                   "no tc, no run")
    p.add_argument("--census-log-every", type=int, default=1, help="--census: the run's log_every (a record is a "
                   "gather between the worker processes; steps 40 and 72 must be multiples of it)")
    p.add_argument("--census-set", action="append", default=[], metavar="KEY=VALUE", help="--census: an override "
                   "of the run's config (repeatable; e.g. model.d_model=512 for a payload larger than the framing)")
    p.add_argument("--census", default=None, metavar="METHOD", help="instead: where the bytes on lo go, per step, "
                   "in one unthrottled run of METHOD (no qdisc; needs no root)")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.methods, args.shard = os.path.join(common.REPO, "configs", "tiny.py"), "edit_t8", 1
    if args.census is not None and args.census not in METHODS:
        p.error(f"--census: unknown {args.census} (expected one of {', '.join(METHODS)})")
    bad = [m for m in args.methods.split(",") if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {', '.join(bad)} (expected {', '.join(METHODS)})")
    args.methods = args.methods.split(",")
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rates: expected Mbit/s numbers separated by commas, got {args.rates!r}")
    if any(r <= 0 for r in args.rates):
        p.error("--rates: every rate must be > 0 Mbit/s")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    say = lambda m: print(m, flush=True)
    common.ensure_cpu_devices(args.processes * args.shard)
    if args.smoke:
        return smoke(args, say)
    os.makedirs(args.run_root, exist_ok=True)
    if args.census is not None:
        out = census(args, say)
        common.write_json(args.json.replace(".json", f"_census_{args.census}.json"), {"env": common.env_info(), **out})
        return 0

    def stop(signum, frame):  # SIGTERM / SIGHUP: leave through the finally blocks (the qdisc goes)
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        link = Link(say).__enter__()
    except Refused as e:
        print(e.code, file=sys.stderr)
        return 2
    results = []
    env = common.env_info()
    try:
        from edit_jax.validate import load_config

        cfg = load_config(args.config, [])
        if (cfg.batch_size, cfg.data.seq_len, cfg.sync.warmup_steps) != (TOKENS["batch"], TOKENS["seq"], 20):
            raise SystemExit("bench_links: expects the demo config's batch 16 x 128 and 20 warmup steps")
        for name in args.methods:
            b = replica_bytes_per_kind(args.config, METHODS[name][0] + [f"mesh.replica={args.processes}",
                                                                        f"mesh.shard={args.shard}"])
            say(f"{name}: plan counts {', '.join(f'{k} {v:,.0f} B' for k, v in b.items())} across replica per device")
            results.append(run_method(name, args, link, b, say))
            # (after every method: a later failure or Ctrl-C keeps what was measured)
            common.write_json(args.json, {"env": env, "args": vars(args), "results": results,
                                          "complete": len(results) == len(args.methods)})
    except KeyboardInterrupt:
        say("bench_links: interrupted; the qdisc on lo is removed")
        return 130
    finally:
        link.__exit__(None, None, None)
    text = table(results)
    print(text)
    common.write_json(args.json, {"env": env, "args": vars(args), "results": results, "complete": True, "table": text})
    say(f"JSON: {args.json}\nplot: {plot(results, args.png, unthrottled_x=3000.0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
