"""Starts one worker process per replica on this machine and watches them (``mesh.processes=N``).

``edit-jax train ... mesh.processes=N`` re-runs the same command line in N child processes, each
with ``mesh.shard`` CPU devices of its own and the coordinator address in its environment
(``multihost.py``). Process 0 writes the run dir's ``config.json``, the progress bar and the
sync and evaluation records; every worker appends its own training records.

Watching: a Ctrl-C or SIGTERM here is passed on to every worker (they stop together at their next
meeting and checkpoint; after a second one the run ends at once with 130, however the workers end:
``_stopped_now``) as a line on the worker's stdin, not as a signal (``follow_launcher``): a
Ctrl-C in a terminal reaches the workers directly too (one process group), and that second
arrival of the same Ctrl-C must not count as the second Ctrl-C that ends a worker at once without
a checkpoint. In a launched worker the launcher alone counts: a signal sent to the worker
directly only asks it to stop; the launcher's second forwarded one ends it at once.

A worker that dies ends the worker set at once: the others are killed (a collective with a lost peer could
only hang or abort), the message names the lost worker, how it ended and the newest checkpoint on disk, and
the launcher restarts the worker set (up to ``--max-restarts`` times, ``restarts.py``) or exits with
``EXIT_WORKER_LOST``. Every lost worker has that message, whichever worker's end the launcher sees first: the
one killed from outside is named, not a survivor that failed because of it (``lost_worker``). A worker that
hangs (stopped, e.g. by SIGSTOP) makes the others' coordination service give up after
``mesh.heartbeat_seconds``; the message then names the hung worker, not the healthy one that aborted. A worker
that ends with a message of its own (bad input 2, diverged 3, run dir locked 4) passes its code on, and its
message is the only one. Nothing checkpointed is lost: orbax commits a checkpoint only once it is whole, and
re-running the same command resumes from the last one.

The workers' output passes through here (``relay``): a message every worker prints (they all reach the same
verdict) is shown once, and the runtime's own chatter (gloo's connection lines, also when another line cut one
in two, ``gloo_fragment``; absl log lines, the native stack dump of an aborting coordination client) and a
worker's Python traceback (a survivor's gloo error once its peer is gone; a crash) are left out unless
``EDIT_JAX_DEBUG=1``: the launcher's own line names the cause, and counts what it left out.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from edit_jax.runtime.cluster import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from edit_jax.runtime.restarts import ENV_DEBUG, EXIT_WORKER_LOST, supervise, survivors_note

from edit_jax.exit_codes import EXIT_INTERRUPTED
NORMAL_EXITS = (0, EXIT_INTERRUPTED)  # done; stopped by a signal with a checkpoint
STOP_NOW_GRACE_S = 5.0  # after a second signal: how long the workers have to leave by themselves
PASSED_ON_EXITS = (2, 3, 4)  # cli.py: bad input, diverged, run dir locked
FINISH_GRACE_S = 60.0
PASS_ON_GRACE_S = 10.0  # the others usually end with the same message within moments
ENV_FORWARDS = "EDIT_JAX_SIGNALS_ON_STDIN"  # "1": this worker's stdin carries the launcher's signals
# A worker's end and the others' reaction to it (a collective with a lost peer fails) come within
# moments: the launcher waits this long after seeing one end before it names the cause, so that
# it sees the whole picture (the survivor's failure can show first).
SETTLE_S = 1.0

# Output of the runtime, not of edit-jax: gloo's connection lines and absl log lines (I/W/E/F +
# date). A fatal line or a native crash report starts a dump whose rest is dropped too.
_CHATTER = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d")
_FATAL = re.compile(r"^(F\d{4} \d\d:\d\d:\d\d|\*\*\* |Fatal Python error|Check failure stack trace|"
                    r"Terminating process because)")
# gloo writes its connection line in pieces ("[Gloo] Rank ", "1", " is connected to ", ...): a line
# the worker's Python printed meanwhile lands inside it, which cuts it in two. The head ends up
# before that line ("[Gloo] Rank edit-jax: ..."), the rest is a line of its own ("1 is connected
# to 1 peer ranks. Expected number ..."; 4 of ~45 launcher logs showed one). Both are recognised.
GLOO_LINE = "[Gloo] Rank N is connected to N peer ranks. Expected number of connected peer ranks is : N"
_GLOO_HEAD = re.compile(r"\[Gloo\] Rank (?:\d+(?: is connected to (?:\d+(?: peer ranks\. ?(?:Expected number of "
                        r"connected peer ranks is : ?(?:\d+)?)?)?)?)?)?")


def gloo_fragment(line: str) -> bool:
    """Whether ``line`` is the rest of a gloo connection line cut in the middle (a non-empty tail of
    ``GLOO_LINE``, its numbers any)."""
    tail = re.sub(r"\d+", "N", line.strip())
    return bool(tail) and GLOO_LINE.endswith(tail)


def without_gloo_head(line: str) -> str | None:
    """``line`` less a gloo connection line's head that another line cut off (None: nothing of it
    left to show)."""
    m = _GLOO_HEAD.match(line)
    rest = line[m.end():] if m else ""
    return rest if rest.strip() else None


class Relay:
    """Copies the workers' output to ours, one segment (a line, or a progress bar's ``\r`` update)
    at a time: messages already shown by another worker and the runtime's chatter are dropped
    (module docstring). Thread-safe: one thread per worker stream."""

    def __init__(self, keep_everything: bool = False):
        self.keep = keep_everything
        self.shown: set[str] = set()
        self.dumping: set[int] = set()  # workers whose output is a native dump from here on
        self.in_log: set[int] = set()  # workers inside a multi-line runtime log message
        self.in_traceback: dict[int, str] = {}  # worker -> "frames" / "tail" of a Python traceback
        self.suppressed = 0
        self.lock = threading.Lock()

    def segment(self, worker: int, text: str, out) -> None:
        line = text.rstrip("\r\n")
        with self.lock:
            if not self.keep:
                if worker in self.dumping or _FATAL.match(line):
                    self.dumping.add(worker)
                    self.suppressed += 1
                    return
                if line.startswith("[Gloo]"):  # its own line, or its head with another line after it
                    rest = without_gloo_head(line)
                    if rest is None or rest.startswith("[Gloo]"):
                        return
                    line, text = rest, rest + text[len(text.rstrip("\r\n")):]
                if gloo_fragment(line):
                    return
                if self._traceback_line(worker, line):
                    self.suppressed += 1
                    return
                if _CHATTER.match(line) or (worker in self.in_log and not line.startswith("edit-jax:")):
                    self.in_log.add(worker)  # an absl message's continuation lines carry no prefix
                    self.suppressed += 1
                    return
                self.in_log.discard(worker)
                if line.startswith("edit-jax:"):
                    if line in self.shown:
                        return
                    self.shown.add(line)
            out.write(text)
            out.flush()

    def _traceback_line(self, worker: int, line: str) -> bool:
        """Whether ``line`` belongs to a Python traceback of ``worker``: from "Traceback (most recent
        call last):" through its indented frames to the exception's own line, chained ones included.
        A worker's traceback is what a survivor prints when its peer is gone (gloo's "Connection
        reset by peer" inside a collective) or what a crash prints; the launcher's one line names
        the cause either way, and ``--debug`` shows the rest."""
        if line.startswith("Traceback (most recent call last):"):
            self.in_traceback[worker] = "frames"
            return True
        state = self.in_traceback.get(worker)
        if state is None:
            return False
        if not line.strip() or line.startswith(("The above exception", "During handling")):
            return True  # between the exception's line and a chained traceback
        if state == "frames" and line[0].isspace():
            return True
        if state == "frames" and not line.startswith("edit-jax:"):
            self.in_traceback[worker] = "tail"  # the exception's own line; a chained one may follow
            return True
        del self.in_traceback[worker]
        return False

    def pump(self, worker: int, stream, out) -> None:
        pending = ""
        for chunk in iter(lambda: stream.read1(65536), b""):
            pending += chunk.decode("utf-8", errors="replace")
            parts = re.split(r"(?<=[\r\n])", pending)
            pending = parts.pop()  # an unfinished segment waits for the rest
            for part in parts:
                self.segment(worker, part, out)
        if pending:
            self.segment(worker, pending, out)


_forwarded: dict[int, int] = {}  # signal number -> the launcher's count of it, until a handler takes it


def take_forwarded(signum: int) -> int | None:
    """For a signal handler in a launched worker: the launcher's count of signals (1: the first
    Ctrl-C, 2: the second) if this call is for a signal it forwarded, else None (sent directly)."""
    return _forwarded.pop(signum, None)


def follow_launcher(fd: int = 0) -> threading.Thread:
    """In a launched worker: a daemon thread that reads the launcher's forwarded signals from file
    descriptor ``fd`` (stdin; one line ``SIGNUM NTH`` each) and raises each in the main thread, its
    count left for the handler (``take_forwarded``). Delivered as a signal to the main thread, a
    forwarded signal is handled where and when a direct one is (between two Python steps of the
    main thread). The descriptor is read with ``os.read``, not through ``sys.stdin``: a daemon
    thread blocked inside a buffered reader stops the interpreter's shutdown with a fatal error.
    End of the stream (no launcher) ends the thread."""
    main = threading.main_thread().ident

    def read():
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                return
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                try:
                    signum, nth = (int(x) for x in line.split())
                except ValueError:
                    continue
                _forwarded[signum] = nth
                signal.pthread_kill(main, signum)

    thread = threading.Thread(target=read, name="edit-jax-launcher-signals", daemon=True)
    thread.start()
    return thread


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, D, T stopped, t traced, Z zombie), or ""."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_cpu_device_count(flags: str) -> str:
    """``XLA_FLAGS`` text less its CPU device count (a worker gets its own, from the mesh)."""
    return re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags).strip()


def worker_env(base: dict, coordinator: str, n: int, i: int, shard: int) -> dict:
    env = dict(base)
    env[ENV_FORWARDS] = "1"
    flags = without_cpu_device_count(env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={shard}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(n), ENV_PROCESS_ID: str(i)})
    return env


def die_with_parent() -> None:
    """Runs in a child between fork and exec: it dies with its launcher (no orphaned workers if the
    launcher is killed)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own cleanup still kills its workers


def _in_child(core: int | None) -> None:
    """Runs in each worker between fork and exec: ``die_with_parent``, and optionally stay on one
    CPU core (every thread the worker starts inherits it)."""
    die_with_parent()
    if core is not None:
        os.sched_setaffinity(0, {core})


def _ended_how(code: int | None) -> str:
    if code is None:
        return "did not finish with the others"
    if code < 0:
        try:
            return f"was ended by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was ended by signal {-code}"
    return f"ended with exit code {code}"


def lost_worker(codes: list[int | None], states: list[str]) -> tuple[int, str]:
    """The worker that ended the run, and how, from every worker's exit code (None: running) and
    process state (``process_state``). The cause, not the workers that failed because of it: one
    killed by a signal from outside (SIGKILL, SIGTERM, a crash) first, then one that is stopped
    (hung: the others' heartbeats time out and they abort), then one that exited with an error,
    then one that aborted (SIGABRT: the coordination service ends a worker that lost a peer), and
    last one still running after the others ended normally."""
    def rank(i: int) -> int:
        c = codes[i]
        if c is not None and c < 0 and c != -signal.SIGABRT:
            return 0
        if c is None and states[i] in ("T", "t"):
            return 1
        if c is not None and c not in NORMAL_EXITS and c > 0:
            return 2
        if c is not None and c < 0:
            return 3
        return 4 if c is None else 5  # ended normally: not a cause

    i = min(range(len(codes)), key=lambda j: (rank(j), j))
    if rank(i) == 1:
        return i, "stopped responding (its process is stopped)"
    return i, _ended_how(codes[i])


class Attempt:
    """One start of the worker set: its processes (the signal handler forwards to them) and, once
    ended, its exit code and the lost worker (index, pid, how it ended) on an exit 5."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.lost: tuple[int, int, str, int] | None = None  # + lines of diagnostics left out
        self.stop_now = False  # a second Ctrl-C / SIGTERM was passed on: the run ends now, with 130
        self.signals: list[tuple[int, int]] = []  # (signum, nth) the launcher got during this attempt
        self.told: dict[int, int] = {}  # worker index -> how many of them it was written
        self._passing = False  # a pass_on under way

    def pass_on(self) -> None:
        """Writes each running worker the signals it was not told yet, in order; also as each starts (a
        Ctrl-C while the set starts reaches them all). A handler's call inside a call leaves it the work."""
        if self._passing:
            return  # the call under way loops until nobody lacks a line
        lacking = lambda: any(self.told.get(i, 0) < len(self.signals) and p.poll() is None
                              for i, p in enumerate(self.procs))
        self._passing = True
        try:  # (no line twice, none out of order)
            while lacking():
                for i, p in enumerate(self.procs):
                    k = self.told.get(i, 0)
                    if k < len(self.signals) and p.poll() is None:
                        self.told[i] = k + 1
                        try:  # (os.write: one small write to a pipe is atomic, not a buffered writer)
                            os.write(p.stdin.fileno(), "{} {}\n".format(*self.signals[k]).encode())
                        except OSError:  # it ended meanwhile (a broken pipe): the watch sees it
                            self.told[i] = len(self.signals)
        finally:
            self._passing = False
        if lacking():  # a signal that came after the loop's last look
            self.pass_on()


def run_workers(attempt: Attempt, train_argv: list[str], n: int, shard: int, pin_cores: bool, say,
                run_dir: str | None) -> int:
    """Starts N workers running ``python -m edit_jax train <train_argv>`` and watches them until they
    end (module docstring); returns the exit code. On an exit 5 ``attempt.lost`` says which worker
    was lost and how (the caller says it: ``restarts.supervise``)."""
    coordinator = f"127.0.0.1:{free_port()}"  # a fresh port each start: the old one may linger
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    relay = Relay(keep_everything=os.environ.get(ENV_DEBUG, "") not in ("", "0"))
    procs, pumps = attempt.procs, []
    for i in range(n):
        env = worker_env(os.environ, coordinator, n, i, shard)
        core = cores[i % len(cores)] if pin_cores and cores else None
        procs.append(subprocess.Popen([sys.executable, "-m", "edit_jax", "train", *train_argv], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      preexec_fn=lambda core=core: _in_child(core)))
        attempt.pass_on()
        for stream, out in ((procs[i].stdout, sys.stdout), (procs[i].stderr, sys.stderr)):
            pumps.append(threading.Thread(target=relay.pump, args=(i, stream, out), daemon=True))
            pumps[-1].start()
    say(f"edit-jax: started {n} worker processes (pids {', '.join(str(p.pid) for p in procs)}), "
        f"{shard} CPU devices each, coordinator {coordinator}")

    def stop_all():
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for t in pumps:  # the rest of their output (the pipes close with the processes)
            t.join(timeout=5)

    finished_at = None  # when the first worker ended normally (done, or stopped by a signal)
    while True:
        codes = [p.poll() for p in procs]
        if any(c is not None and c not in NORMAL_EXITS for c in codes):
            time.sleep(SETTLE_S)  # the cause may show after its consequence (lost_worker)
            codes = [p.poll() for p in procs]
        if attempt.stop_now:
            return _stopped_now(procs, stop_all)
        if all(c is not None for c in codes) and all(c in NORMAL_EXITS for c in codes):
            for t in pumps:
                t.join(timeout=5)
            return next((c for c in codes if c), 0)
        killed = any(c is not None and c < 0 and c != -signal.SIGABRT for c in codes)
        passed_on = [c for c in codes if c in PASSED_ON_EXITS]
        if passed_on and not killed:  # its own message said what happened: the others agree soon
            deadline = time.monotonic() + PASS_ON_GRACE_S
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.1)
            stop_all()
            return passed_on[0]
        ended = [c for c in codes if c is not None]
        if ended and finished_at is None:
            finished_at = time.monotonic()
        # Workers that end normally end within moments of each other (they meet to finish).
        late = ended and time.monotonic() - finished_at > FINISH_GRACE_S
        if any(c not in NORMAL_EXITS for c in ended) or late:
            i, how = lost_worker(codes, [process_state(procs[j].pid) if c is None else "" for j, c in enumerate(codes)])
            stop_all()
            attempt.lost = (i, procs[i].pid, how, relay.suppressed)
            return EXIT_WORKER_LOST
        time.sleep(0.1)


def _stopped_now(procs: list[subprocess.Popen], stop_all) -> int:
    """A second signal was passed on (exit now, without a checkpoint): the workers leave at once
    (``train._StopFlag``), or ignore it when their run already ended (``cli._ignore_late_signals``).
    Either way the run ends with 130, however each worker ends: one that leaves first takes the
    coordination service (process 0) or a collective with it, and a worker still in JAX's shutdown
    barrier or in a compile then aborts (SIGABRT). That is the stop asked for, not a lost worker
    (before: exit 5, "worker 1 was ended by signal 6"). Those still running after
    ``STOP_NOW_GRACE_S`` are killed; a run all of whose workers had finished keeps its 0."""
    deadline = time.monotonic() + STOP_NOW_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    codes = [p.poll() for p in procs]
    stop_all()
    return 0 if all(c == 0 for c in codes) else EXIT_INTERRUPTED


def launch(train_argv: list[str], n: int, shard: int, pin_cores: bool = False,
           say=lambda m: print(m, file=sys.stderr, flush=True), run_dir: str | None = None,
           max_restarts: int = 0, shrink_check=None) -> int:
    """Runs ``python -m edit_jax train <train_argv>`` as N workers; returns the exit code. With
    ``pin_cores`` worker i (and every thread it starts) runs on core i mod (cores available).
    ``run_dir``: where the workers checkpoint (named in the message when a worker is lost).
    ``max_restarts``: how often a lost or hung worker set is started again (``restarts.py``);
    ``shrink_check(n)``: None if the run may go on with n workers (``mesh.elastic``), else why not."""
    received = [0]  # signals this launcher got: the workers' count of Ctrl-Cs (module docstring)
    current = [Attempt()]

    def forward(signum, frame):
        received[0] += 1
        current[0].stop_now = current[0].stop_now or received[0] > 1
        current[0].signals.append((signum, received[0]))
        current[0].pass_on()

    def start(argv: list[str], workers: int) -> tuple[int, tuple | None]:
        if received[0]:  # a Ctrl-C / SIGTERM came before the first start: none is started
            say("edit-jax: stopped before the workers started (a Ctrl-C or SIGTERM came); nothing written")
            return EXIT_INTERRUPTED, None
        current[0] = Attempt()
        code = run_workers(current[0], argv, workers, shard, pin_cores, say, run_dir)
        return code, current[0].lost

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return supervise(start, train_argv, n, max_restarts, run_dir, say, interrupted=lambda: received[0] > 0,
                         shrink_check=shrink_check)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        for p in current[0].procs:  # never leave a worker behind
            if p.poll() is None:
                p.kill()
                p.wait()


__all__ = ["launch", "run_workers", "die_with_parent", "Attempt", "free_port", "worker_env", "Relay", "process_state",
           "EXIT_WORKER_LOST", "take_forwarded", "follow_launcher", "lost_worker", "survivors_note", "ENV_FORWARDS"]
