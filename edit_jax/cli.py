"""Command line: ``edit-jax train``, ``edit-jax tokenize``, ``edit-jax placement``, ``edit-jax sample``,
``edit-jax export`` and ``edit-jax plot``.

    edit-jax train --config configs/demo.py --run-dir runs/demo steps=300 mesh.replica=4 mesh.shard=2

Overrides are dotted ``key=value`` pairs (``method=NAME`` is short for ``sync.method=NAME``).
On CPU the number of emulated devices is set from the mesh unless XLA_FLAGS already sets it.

Exit codes (docs/guides/restarts.md): 0 done (or already finished), 2 bad
input (config, data, mesh, placement, checkpoint, run dir not writable; for plot, a run dir it
cannot read), 3 diverged (non-finite state; nothing non-finite saved), 4 run dir in use by another
run, 5 a worker process was lost (mesh.processes > 1, restarts used up; launch.py, restarts.py), 130
stopped by a signal; with --distributed also 75 retry and 76 shrink (runtime/cluster_exit.py).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import logging
import math
import os
import signal
import sys

from edit_jax.exit_codes import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_OK  # noqa: F401 - (exit codes: one module)


ENV_DEBUG = "EDIT_JAX_DEBUG"


def _quiet_library_reports() -> None:
    """Errors that edit-jax reports itself as one line are also logged by the library threads that
    met them: orbax logs its failed save thread's traceback (absl ERROR), and TensorStore callbacks
    arriving after orbax closed its event loop print "Event loop is closed" tracebacks. Those go
    (``--debug`` keeps them); any other unraisable exception is still printed."""
    for name in ("absl", "asyncio"):  # asyncio: "Task exception was never retrieved" for the same error
        logging.getLogger(name).setLevel(logging.CRITICAL)
    default = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
            return
        default(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("jax._src.xla_bridge").addFilter(_PluginErrorAsOneLine())


class _PluginErrorAsOneLine(logging.Filter):
    """JAX logs a plugin that fails to start (the CUDA plugin on a machine whose GPUs or driver do
    not work) as an ERROR with its traceback, then goes on with the other platforms: said here in
    one line, so a GPU run that fell back to the CPU is still noticed (``--debug``: JAX's report)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "plugin configuration error" not in record.getMessage().lower():
            return True
        exc = record.exc_info[1] if record.exc_info else None
        why = " ".join(str(exc).split())[:200] if exc is not None else record.getMessage()
        print(f"edit-jax: a JAX plugin did not start ({why}); JAX goes on with its other platforms "
              "(--debug shows its report)", file=sys.stderr, flush=True)
        return False


def _cpu_without_gpus() -> None:
    """The CUDA plugin installed (``edit-jax[cuda]``, e.g. for ``plan --target`` on a machine
    without a GPU) where there is no NVIDIA device: JAX would try the plugin at start, log its
    failure with a traceback and fall back to the CPU. Ask for the CPU directly, which is what JAX
    ends up with, unless JAX_PLATFORMS says otherwise (or a TPU runtime is installed)."""
    if "JAX_PLATFORMS" in os.environ or glob.glob("/dev/nvidia[0-9]*") or importlib.util.find_spec("libtpu"):
        return
    try:
        cuda = any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    except ImportError:  # no jax_plugins namespace at all
        return
    if cuda:
        os.environ["JAX_PLATFORMS"] = "cpu"


_started = [False]  # the training (or the launcher, or the cluster watch) has begun: its outcome stands


def _stopped_before_start(signum, frame):
    """SIGINT / SIGTERM before ``train`` installs its own flag (while Python and JAX load): one line
    and exit 130, not a KeyboardInterrupt traceback. Nothing was written yet. After the training
    returned (its outcome decided, this handler back in place) a late signal is ignored: the run
    already stopped or finished, and ends with its own exit code."""
    if _started[0]:
        return
    print(f"\nedit-jax: stopped before training started (signal {signum}); nothing written", file=sys.stderr,
          flush=True)
    os._exit(EXIT_INTERRUPTED)


def _ignore_late_signals() -> None:
    """The run's outcome is decided and said: from here the process only exits. Python's shutdown
    puts SIGINT / SIGTERM back to the system default (die by the signal) before the process ends,
    and a JAX process spends a while there (its backend, a worker's shutdown barrier with the
    others): a second Ctrl-C landing there ended the run with -2 instead of 130 (or, in one worker
    of several, left the other aborting in the barrier: exit 5). Ignored signals stay ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _train(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped_before_start)
    if os.environ.get("EDIT_JAX_SIGNALS_ON_STDIN") == "1":  # launch.ENV_FORWARDS: a launched worker
        __import__("edit_jax.runtime.launch", fromlist=["x"]).follow_launcher()  # its Ctrl-Cs, counted once
    parser = argparse.ArgumentParser(prog="edit-jax train", description="Train a Llama model with EDiT / baselines.")
    parser.add_argument("--config", default="configs/demo.py",
                        help="a Python file with get_config(), or a preset name in configs/ (default: configs/demo.py)")
    parser.add_argument("--run-dir", default=None, help="output dir: config.json, metrics.jsonl, checkpoints/ "
                        "(re-running on it resumes); default runs/<config name>")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--distributed", action="store_true",
                        help="this process is one of mesh.processes started by a cluster launcher (srun, mpirun) "
                             "or with EDIT_JAX_COORDINATOR / EDIT_JAX_NUM_PROCESSES / EDIT_JAX_PROCESS_ID set: "
                             "join the others, owning mesh.shard devices of this host (docs/guides/cluster.md)")
    parser.add_argument("--restore-step", type=int, default=None, help="resume from this checkpoint instead of "
                        "the newest (newer ones are moved to RUN_DIR/checkpoints.aside/, not deleted)")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="K",
                        help="mesh.processes > 1 on this machine: start the workers again (resuming from the newest "
                             "checkpoint) after a lost or hung worker, at most K times; 0: exit 5 at once (default 3)")
    parser.add_argument("--debug", action="store_true",
                        help=f"show what the libraries report themselves (orbax's thread errors, the runtime's logs "
                             f"and native dumps of worker processes; also {ENV_DEBUG}=1) besides edit-jax's one-line "
                             "messages")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. steps=100 mesh.replica=4")
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the options
    if args.debug:
        os.environ[ENV_DEBUG] = "1"  # worker processes inherit it
    elif os.environ.get(ENV_DEBUG, "") in ("", "0"):
        _quiet_library_reports()

    from edit_jax.validate import ConfigError, load_config  # no JAX backend yet: devices are not set

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"edit-jax: bad config: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.distributed and cfg.mesh.processes < 2:
        print("edit-jax: bad config: --distributed runs one process per worker: set mesh.processes = mesh.replica "
              f"(the number of processes the cluster starts), got mesh.processes={cfg.mesh.processes}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.distributed and os.environ.get("EDIT_JAX_DISTRIBUTED_CHILD") != "1":  # cluster_exit.ENV_CHILD
        from edit_jax.runtime.cluster_exit import watch  # the training runs in a child: its end -> retry/shrink/stop

        _started[0] = True
        return watch(argv)
    from edit_jax.runtime import multihost
    from edit_jax.runtime.mesh import set_cpu_device_count
    run_dir = args.run_dir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])

    if cfg.sync.exchange.url:  # the workers as separate programs, each restarted alone (elastic/)
        return _launch_exchange_workers(cfg, args, run_dir)
    if cfg.mesh.processes > 1 and multihost.launched_worker() is None and not args.distributed:
        from edit_jax.runtime.launch import launch  # one process per worker on this machine, watched from here

        if args.max_restarts < 0:
            print(f"edit-jax: bad option: --max-restarts {args.max_restarts}: expected 0 or more", file=sys.stderr)
            return EXIT_BAD_INPUT

        def shrink_check(n: int) -> str | None:  # mesh.elastic: may the run go on with n workers?
            try:
                load_config(args.config, [*args.overrides, f"mesh.replica={n}", f"mesh.processes={n}"])
            except ConfigError as e:
                return str(e)
            return None

        if args.restore_step is None:  # a finished run: said once here, no worker started (they would say the same)
            from edit_jax.training.train import finished_result

            if finished_result(run_dir, cfg, lambda m: print(m, file=sys.stderr, flush=True)) is not None:
                return EXIT_OK
        _started[0] = True
        return launch(argv, cfg.mesh.processes, cfg.mesh.shard, pin_cores=cfg.debug.pin_cores, run_dir=run_dir,
                      max_restarts=args.max_restarts, shrink_check=shrink_check if cfg.mesh.elastic else None)
    stdout_filter = None
    if cfg.mesh.processes > 1:  # a worker: its own devices, then meet the others
        if args.distributed:
            from edit_jax.runtime.stdout_filter import StdoutFilter
            from edit_jax.runtime.cluster import ClusterError, from_environment

            if os.environ.get(ENV_DEBUG, "") in ("", "0"):
                stdout_filter = StdoutFilter()  # gloo's connection lines (launch.py filters its own workers')
            try:
                cluster = from_environment(cfg.mesh.processes, cfg.mesh.shard)
                set_cpu_device_count(cfg.mesh.shard)
                multihost.initialize(cfg.mesh.heartbeat_seconds, cluster)
            except ClusterError as e:
                from edit_jax.runtime.cluster_exit import EXIT_RETRY
                from edit_jax.runtime.cluster import JoinError

                retry = isinstance(e, JoinError)  # the others (or the coordinator) may be what failed
                print(f"edit-jax: cluster error: {e}" + (f" (exit {EXIT_RETRY}: retry)" if retry else ""),
                      file=sys.stderr)
                if stdout_filter is not None:
                    stdout_filter.close()
                return EXIT_RETRY if retry else 2
            if os.environ.get(ENV_DEBUG, "") not in ("", "0"):
                print(f"edit-jax: {cluster.describe()}", file=sys.stderr)
        else:
            set_cpu_device_count(cfg.mesh.shard)
            multihost.initialize(cfg.mesh.heartbeat_seconds)
    else:
        set_cpu_device_count(cfg.mesh.replica * cfg.mesh.shard)

    try:
        code = _train_and_report(cfg, run_dir, args)
    finally:
        if stdout_filter is not None:
            stdout_filter.close()  # (before os._exit below: it would drop what the pipe still holds)
    if code not in (EXIT_OK, EXIT_INTERRUPTED):
        # A failed run leaves at once, its message printed: a worker process would otherwise wait in
        # JAX's shutdown barrier for peers inside a collective it never joins (then the coordination
        # service aborts them with a native dump; the launcher passes this code on and stops them),
        # and the libraries' leftover tasks report the same error again at interpreter exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _launch_exchange_workers(cfg, args, run_dir: str) -> int:
    from edit_jax.elastic.supervisor import launch_run

    _started[0] = True
    return launch_run(cfg, args, run_dir)


def _worker(argv: list[str]) -> int:
    """``edit-jax worker``: one worker meeting the others through ``sync.exchange.url``."""
    from edit_jax.elastic.command import main

    return main(argv)


def _train_and_report(cfg, run_dir: str, args) -> int:
    """Runs ``train`` and turns its outcome into one line and an exit code (module docstring)."""
    import jax

    from edit_jax.rundir.checkpoint import CheckpointError
    from edit_jax.data import DataError
    from edit_jax.placement import PlacementError
    from edit_jax.rundir.runlock import RunDirError, RunLockError
    from edit_jax.localsgd.sharding import MeshError
    from edit_jax.training.train import DivergedError, train
    from edit_jax.validate import ConfigError

    try:
        jax.devices()  # the backend starts here: a missing one is a message, not JAX's traceback
    except Exception as e:  # JAX raises RuntimeError or (0.10, no plugin) a bare AssertionError
        platforms = os.environ.get("JAX_PLATFORMS", "")
        why = f"{(str(e).splitlines() or [type(e).__name__])[0][:300] or type(e).__name__}"
        if args.distributed:  # this node's own accelerators: the job can go on without it
            from edit_jax.runtime.cluster_exit import EXIT_SHRINK, note_shrink_host

            print(f"edit-jax: JAX could not start a backend on host {note_shrink_host(run_dir)} (JAX_PLATFORMS="
                  f"{platforms!r}): {why}; exit {EXIT_SHRINK} (shrink: run again without this host, listed in "
                  f"{os.path.join(run_dir, 'shrink_hosts')})", file=sys.stderr)
            return EXIT_SHRINK
        print(f"edit-jax: JAX could not start a backend (JAX_PLATFORMS={platforms!r}): {why}. Install the jax plugin "
              "for it (e.g. pip install edit-jax[cuda]) or unset JAX_PLATFORMS", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        try:
            result = train(cfg, run_dir, progress=not args.no_progress, verbose=True, restore_step=args.restore_step)
        finally:  # (until train holds its own flag, a signal stops the run before anything is written)
            _started[0] = True
    except RunLockError as e:
        if not getattr(e, "quiet", False):
            print(f"edit-jax: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except DivergedError as e:
        print(f"edit-jax: diverged: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except jax.errors.JaxRuntimeError as e:
        if not args.distributed or _runtime_cause(e) is None:
            raise
        return _retry_after(e)
    except (ConfigError, DataError, MeshError, CheckpointError, PlacementError, RunDirError) as e:
        # A save whose collective lost its peer (orbax all-gathers across processes) is the lost
        # peer's fault, not this checkpoint's: on a cluster, retry, as for any other collective.
        if args.distributed and isinstance(e, CheckpointError) and (runtime := _runtime_cause(e)) is not None:
            return _retry_after(runtime)
        kind = {ConfigError: "bad config", DataError: "data", MeshError: "mesh", CheckpointError: "checkpoint",
                PlacementError: "placement", RunDirError: "run dir"}
        kind = next((v for t, v in kind.items() if isinstance(e, t)), type(e).__name__)
        print(f"edit-jax: {kind} error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    if cfg.mesh.processes > 1 and jax.process_index() != 0:
        return EXIT_INTERRUPTED if result.interrupted else EXIT_OK  # the summary is process 0's to print
    if result.already_finished:  # train said so (one line)
        return EXIT_OK
    print(summary_line(result, run_dir))
    return EXIT_INTERRUPTED if result.interrupted else EXIT_OK


def _runtime_cause(e: BaseException) -> BaseException | None:
    """The first JAX runtime error, ``e`` itself or one it was raised from, that is not running
    out of memory or disk (RESOURCE_EXHAUSTED): on a cluster, most likely a lost peer."""
    import jax

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" not in str(e):
            return e
        e = e.__cause__ or e.__context__
    return None


def _retry_after(e: BaseException) -> int:
    """``--distributed``: a runtime error, most likely a collective with a lost peer: one line, exit 75."""
    from edit_jax.runtime.cluster_exit import EXIT_RETRY

    print(f"edit-jax: the runtime failed ({' '.join(str(e).split())[:200]}), most likely a lost peer: exit "
          f"{EXIT_RETRY} (retry: run the same job again, it resumes from the newest checkpoint)", file=sys.stderr)
    return EXIT_RETRY


def summary_line(result, run_dir: str) -> str:
    """The run's last line: where it stopped, the losses, the time."""
    ppl = f" (ppl {result.final_val_ppl:.2f})" if result.final_val_ppl else ""
    val = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
    # No training record in this invocation (stopped before the first one): no loss to show, which
    # is not the same as a non-finite one.
    loss = f"{result.final_loss:.4f}" if result.history or math.isfinite(result.final_loss) else "n/a (no step logged)"
    return (f"edit-jax: {'stopped' if result.interrupted else 'done'} at step {result.steps}: "
            f"train loss {loss}, val loss {val}{ppl}, {result.seconds:.1f} s; run dir {run_dir}")


def main(argv: list[str] | None = None) -> int:
    """The command line. Run as the program (``argv`` None: from ``sys.argv``), a ``train`` whose
    outcome is decided ignores late signals while the process exits (``_ignore_late_signals``)."""
    if argv is None and sys.argv[1:2] == ["train"]:
        code = _main(sys.argv[1:])
        _ignore_late_signals()
        return code
    return _main(sys.argv[1:] if argv is None else argv)


COMMANDS = {  # what each does, for `edit-jax --help`
    "train": "train a model with a method (EDiT, A-EDiT, DiLoCo, CO2, ...) from a config; resumes a run dir",
    "plan": "compile a config's steps without running them: memory per device, collectives, fits or not",
    "tokenize": "tokenize text into shards a run reads (data.paths)",
    "placement": "search a device placement for a heterogeneous network (DT-FM's cost model)",
    "sample": "generate text from a run's model",
    "export": "write a run's model as a Hugging Face Llama directory",
    "plot": "plot runs' records (loss against tokens, time or steps)",
    "worker": "one A-EDiT worker meeting the others through an exchange (sync.exchange.url)",
}


def _main(argv: list[str]) -> int:
    _cpu_without_gpus()
    commands = {"train": _train,
                "placement": lambda a: __import__("edit_jax.commands.placement", fromlist=["main"]).main(a),
                "sample": lambda a: __import__("edit_jax.commands.sample", fromlist=["main"]).main(a),
                "export": lambda a: __import__("edit_jax.hf.export", fromlist=["main"]).main(a),
                "plot": lambda a: __import__("edit_jax.commands.plot", fromlist=["main"]).main(a),
                "tokenize": lambda a: __import__("edit_jax.data.tokenize", fromlist=["main"]).main(a),
                "plan": lambda a: __import__("edit_jax.commands.plan", fromlist=["main"]).main(a),
                "worker": _worker}
    if not argv or argv[0] not in commands:
        wanted = bool(argv) and argv[0] in ("-h", "--help")
        print("usage: edit-jax COMMAND [options]  (edit-jax COMMAND --help for details)\n\ncommands:\n"
              + "\n".join(f"  {name:<10} {what}" for name, what in COMMANDS.items()),
              file=sys.stdout if wanted else sys.stderr)
        return 0 if wanted else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
