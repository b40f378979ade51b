"""The launcher of exchange-mode A-EDiT on one machine: one ``edit-jax worker`` process per worker
slot (``mesh.processes`` of them), each restarted alone when it dies while the others keep training.

    edit-jax train --config C sync.method=a_edit sync.exchange.url=DIR ...    # -> launch_workers(...)

A worker that exits 0 is done (the run's token budget is spent); one that dies otherwise (a crash,
SIGKILL, an OOM) is started again, at most ``--max-restarts`` times *per worker*: it rejoins from
the newest round state (``worker.py``). The launcher never waits on a stopped worker: the rounds go
on without it (``sync.exchange.grace``). A signal to the launcher (Ctrl-C, SIGTERM) is passed to every
worker, which ends where it stands (exit 130). Workers can also be started and stopped by hand, or
by SLURM (one job step per worker): ``edit-jax worker --worker I`` pointing at the same run dir.

How a worker starts (``EDIT_JAX_WORKER_START``): "fork" (the default on Linux) forks it from the
launcher, which imported the worker's modules (JAX, the data pipeline, the model: ~1.4 CPU s) once
and never starts a JAX backend itself; the child sets its own XLA flags and platform, then builds
its backend and programs as ``edit-jax worker`` would. A restarted worker thus skips the imports,
which on a machine whose cores the workers share come out of the others' training
(docs/benchmarks/elastic-runs.md). Forking is safe only from a process with one thread and no JAX
backend: where that does not hold, or with "spawn", each worker is a fresh ``python -m edit_jax
worker`` process. A forked worker is named ``edit-jax wI`` (``/proc/PID/comm``, what ``ps`` and ``top`` show).

When the storage fails (``patience.py``): ``train`` asks the exchange once before it writes
anything, for ``PROBE_S`` seconds; an exchange it cannot use is a config error (exit 2, one line,
no run dir). A worker waits storage faults out for ``sync.exchange.patience`` and then exits 75
(``EXIT_RETRY``): the launcher starts it again after ``RETRY_PAUSE_S``. Such restarts count against
``--max-restarts`` once per outage: a worker's exit 75 right after its previous exit 75 is the same
outage and is not counted again (so an outage longer than the patience never uses up the
restarts; each restart waits the full patience before it exits again). The launcher's own writes
(a dead worker's ``retract``) are tried for ``RETRACT_S`` seconds and then skipped with one line:
the rounds' grace stops waiting for that worker anyway.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback

from edit_jax.elastic import command
from edit_jax.elastic.admission import NotAdmitted, admit, launcher_lock
from edit_jax.elastic.exchange import Exchange
from edit_jax.elastic.keys import ExchangeError, ExchangeUnavailable
from edit_jax.elastic.patience import PatientExchange, open_patient
from edit_jax.elastic.rounds import retract
from edit_jax.runtime.cluster_exit import EXIT_RETRY
from edit_jax.rundir.runlock import RunDirError, RunLockError, exchange_problem
from edit_jax.runtime.launch import die_with_parent, without_cpu_device_count

from edit_jax.exit_codes import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_OK, EXIT_WORKER_LOST
ENV_START = "EDIT_JAX_WORKER_START"  # "fork" (default where safe) or "spawn"
PROBE_S = 10.0  # how long `train` tries the exchange before it refuses it (exit 2)
RETRACT_S = 3.0  # how long the launcher tries a dead worker's retract before it skips it
RETRY_PAUSE_S = 5.0  # a worker that exited 75 (storage down past its patience) starts again after this


def worker_args(worker: int, config: str, run_dir: str, overrides: list[str]) -> list[str]:
    """The ``edit-jax worker`` arguments of worker ``worker``."""
    return ["--config", config, "--run-dir", run_dir, "--worker", str(worker), *overrides]


def worker_argv(worker: int, config: str, run_dir: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "edit_jax", "worker", *worker_args(worker, config, run_dir, overrides)]


def _child_env(shard: int) -> dict:
    env = dict(os.environ)
    flags = without_cpu_device_count(env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={shard}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


class Forked:
    """A worker forked from the launcher, with what the launcher uses of ``subprocess.Popen``."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # ended, not yet reaped

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def can_fork() -> str | None:
    """Why workers cannot be forked from this process (None: they can)."""
    if os.environ.get(ENV_START, "fork") == "spawn":
        return f"{ENV_START}=spawn"
    if not hasattr(os, "fork") or sys.platform != "linux":
        return "not Linux"
    if threading.active_count() > 1:  # a lock held by another thread would stay held in the child
        return f"{threading.active_count()} threads"
    try:
        from jax._src import xla_bridge
        if xla_bridge._backends:  # a backend's thread pools do not survive a fork
            return "a JAX backend is running"
    except (ImportError, AttributeError):
        return "cannot tell whether a JAX backend runs"
    return None


def fork_worker(worker: int, args: list[str], env: dict) -> Forked:
    """Worker ``worker`` (its ``edit-jax worker`` arguments ``args``) in a child of this process."""
    sys.stdout.flush()
    sys.stderr.flush()
    stops = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # none runs the launcher's handler in the child
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        return Forked(pid)
    code = 1
    try:  # the child: never returns into the launcher's code
        die_with_parent()
        for sig in stops:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        os.environ.clear()
        os.environ.update(env)
        _name_process(f"edit-jax w{worker}")
        import jax

        jax.config.update("jax_platforms", env.get("JAX_PLATFORMS") or None)  # (read at import, in the launcher)
        code = command.main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # reported, and the launcher restarts the worker
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _name_process(name: str) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: /proc/PID/comm
    except (OSError, AttributeError):
        pass


def launch_workers(config: str, run_dir: str, overrides: list[str], workers: int, shard: int, max_restarts: int,
                   say=lambda m: print(m, file=sys.stderr, flush=True), poll_s: float = 0.2,
                   exchange: Exchange | None = None) -> int:
    """Runs workers 0..workers-1 until each exits 0 or has used its restarts. Returns 0 when the run
    finished (some worker ended it), 130 when interrupted, 5 when every worker was lost. With
    ``exchange``, a worker that dies is retracted from the rounds at once (``rounds.retract``)."""
    env = _child_env(shard)
    procs: dict[int, subprocess.Popen | Forked] = {}
    restarts = {i: 0 for i in range(workers)}
    ended: dict[int, int] = {}
    interrupted = [0]
    fork = can_fork() is None  # (this module imported the worker's modules: ``command``)

    def start(i: int) -> None:
        if fork:
            procs[i] = fork_worker(i, worker_args(i, config, run_dir, overrides), env)
        else:
            procs[i] = subprocess.Popen(worker_argv(i, config, run_dir, overrides), env=env, preexec_fn=die_with_parent)

    def forward(signum, frame):
        del frame
        interrupted[0] += 1
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if interrupted[0] > 1 else signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    if exchange is not None and not isinstance(exchange, PatientExchange):
        exchange = PatientExchange(exchange, RETRACT_S, say)
    pending: dict[int, float] = {}  # worker -> when it starts again (it exited 75)
    outage = {i: False for i in range(workers)}  # its last end was an exit 75 (one outage: counted once)
    try:
        for i in range(workers):
            start(i)
        while len(ended) < workers:
            time.sleep(poll_s)
            for i, at in list(pending.items()):
                if interrupted[0]:
                    ended[i] = EXIT_INTERRUPTED
                    del pending[i]
                elif time.monotonic() >= at:
                    del pending[i]
                    start(i)
            for i, p in list(procs.items()):
                code = p.poll()
                if code is None or i in ended or i in pending:
                    continue
                if code == EXIT_OK or interrupted[0]:
                    ended[i] = code
                elif code == EXIT_BAD_INPUT:  # a bad config or a slot in use: starting it again changes nothing
                    ended[i] = code
                    say(f"edit-jax: worker {i} refused to start (exit 2, its message above); not restarting it")
                elif code == EXIT_RETRY and (outage[i] or restarts[i] < max_restarts):
                    restarts[i] += 0 if outage[i] else 1
                    outage[i] = True
                    _retract(exchange, i, say)
                    say(f"edit-jax: worker {i} could not use the exchange (exit {EXIT_RETRY}, its message above); "
                        f"starting it again in {RETRY_PAUSE_S:g} s ({restarts[i]} of {max_restarts} restarts, "
                        "one per outage)")
                    pending[i] = time.monotonic() + RETRY_PAUSE_S
                elif restarts[i] < max_restarts:
                    restarts[i] += 1
                    outage[i] = False
                    _retract(exchange, i, say)  # the rounds stop waiting for it now, not after the grace
                    say(f"edit-jax: worker {i} ended ({_how(code)}); starting it again "
                        f"({restarts[i]} of {max_restarts}); the others keep training")
                    start(i)
                else:
                    ended[i] = code
                    _retract(exchange, i, say)
                    say(f"edit-jax: worker {i} ended ({_how(code)}) with its {max_restarts} restarts used; "
                        "the others go on without it")
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    if interrupted[0]:
        return EXIT_INTERRUPTED
    if EXIT_OK in ended.values():
        return EXIT_OK
    return EXIT_BAD_INPUT if set(ended.values()) == {EXIT_BAD_INPUT} else EXIT_WORKER_LOST


def launch_run(cfg, args, run_dir: str) -> int:
    """``edit-jax train`` with ``sync.exchange.url``: checks ``--max-restarts``, takes the run dir's lock
    (exit 4 when another launcher holds it), is admitted to the run (exit 2: ``admission.py``), then
    the workers."""
    if args.max_restarts < 0:
        print(f"edit-jax: bad option: --max-restarts {args.max_restarts}: expected 0 or more", file=sys.stderr)
        return EXIT_BAD_INPUT
    say = lambda m: print(m, file=sys.stderr, flush=True)
    try:
        # (another exchange's run dir: that exchange never made)
        problem = exchange_problem(run_dir, cfg.sync.exchange.url)
        if problem:
            raise NotAdmitted(problem)
        exchange = probe_exchange(cfg.sync.exchange.url, say)  # before any write: an unusable one is a config error
        with launcher_lock(run_dir, cfg, say):  # one launcher per run dir, before any work
            admit(exchange, cfg, run_dir, say, owner=True)  # the run's config; this launcher sets its `steps`
            exchange.patience_s = RETRACT_S  # from now on only its retracts: never worth a wait
            return launch_workers(args.config, run_dir, args.overrides, cfg.mesh.processes, cfg.mesh.shard,
                                  args.max_restarts, exchange=exchange)
    except (NotAdmitted, RunDirError, ExchangeError) as e:
        print(f"edit-jax: {'run dir error' if isinstance(e, RunDirError) else 'bad config'}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunLockError as e:
        print(f"edit-jax: {e}", file=sys.stderr)
        return EXIT_LOCKED


def probe_exchange(url: str, say, patience_s: float = PROBE_S) -> PatientExchange:
    """The exchange ``url`` opened and asked once (``list("run/")``), trying for ``patience_s``
    seconds through transient faults; an ``ExchangeError`` naming ``sync.exchange.url`` when it cannot."""
    try:
        exchange = open_patient(url, patience_s, say, "edit-jax")
        exchange.list("run/")
    except ExchangeUnavailable as e:
        raise ExchangeError(f"sync.exchange.url {url}: unusable for {patience_s:g} s at the start "
                            f"({str(e).split('(sync.exchange.patience): ', 1)[-1]}); check it, or start the run "
                            f"when it answers") from None
    return exchange


def _retract(exchange, worker: int, say) -> None:
    """``rounds.retract``, tried for the exchange's (short) patience, else skipped with one line:
    the launcher never dies of its own bookkeeping (the rounds' grace covers a missed retract)."""
    if exchange is None:
        return
    try:
        retract(exchange, worker)
    except (ExchangeError, OSError) as e:
        say(f"edit-jax: could not tell the exchange that worker {worker} stopped ({e}); "
            "the rounds stop waiting for it after sync.exchange.grace")


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


__all__ = ["launch_workers", "launch_run", "probe_exchange", "worker_argv"]
