"""Test hooks for launched worker processes (tests put this directory on PYTHONPATH; Python
imports ``sitecustomize`` at start-up). Inactive unless ``EDIT_JAX_TEST_LOG`` is set, and only in a
worker of ``launch.py`` (``EDIT_JAX_PROCESS_ID``). They pause a worker at an exact point, so that a
race is reproduced by construction, not by timing:

- SIGUSR1 holds the worker's main thread (inside that handler) until the file ``EDIT_JAX_TEST_GO``
  exists; signals that arrive meanwhile are handled one by one inside the hold;
- every call of a SIGINT handler is logged (``<pid> handled <signum>``) after it returns;
- ``EDIT_JAX_TEST_HANG_SAVE=STEP``: worker 0 hangs just before orbax renames the finished
  temporary dir of checkpoint STEP to its final name (the save's commit), logging ``<pid> hanging``;
- ``EDIT_JAX_TEST_KILL_AT=W:STEP`` (with ``EDIT_JAX_TEST_RUN_DIR``): on the first launch only, worker W
  SIGKILLs itself once a training record of step STEP or later is in metrics.jsonl;
  ``EDIT_JAX_TEST_FAIL_AGAIN=1``: worker W SIGKILLs itself at start on every later launch (a
  restart); ``EDIT_JAX_TEST_HOLD_RESTART=1``: on a restart every worker waits at start for GO.
"""

import os

if os.environ.get("EDIT_JAX_TEST_LOG") and "EDIT_JAX_PROCESS_ID" in os.environ:
    import signal
    import time

    _LOG = os.environ["EDIT_JAX_TEST_LOG"]

    def _note(text):
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {text}\n")

    _real_signal = signal.signal

    def _logging_signal(sig, handler):
        if sig == signal.SIGINT and callable(handler):
            inner = handler

            def handler(signum, frame):
                inner(signum, frame)
                _note(f"handled {signum}")

        return _real_signal(sig, handler)

    signal.signal = _logging_signal

    def _hold(signum, frame):
        _note("held")
        while not os.path.exists(os.environ["EDIT_JAX_TEST_GO"]):
            time.sleep(0.02)

    _real_signal(signal.SIGUSR1, _hold)

    _hang_step = os.environ.get("EDIT_JAX_TEST_HANG_SAVE")
    if _hang_step and os.environ["EDIT_JAX_PROCESS_ID"] == "0":
        _real_rename = os.rename

        def _rename(src, dst, *args, **kwargs):
            if "orbax-checkpoint-tmp" in os.fspath(src) and os.path.basename(os.fspath(dst)) == _hang_step:
                _note("hanging")
                while True:
                    time.sleep(60)
            return _real_rename(src, dst, *args, **kwargs)

        os.rename = _rename

    # Restarts (tests/test_restarts.py). The file "<EDIT_JAX_TEST_LOG>.first-kill" marks that the
    # first launch's kill happened: later launches are restarts.
    _restarted = os.path.exists(_LOG + ".first-kill")
    _kill_at = os.environ.get("EDIT_JAX_TEST_KILL_AT")  # "W:STEP": worker W SIGKILLs itself once STEP is logged
    if _kill_at and not _restarted and os.environ["EDIT_JAX_PROCESS_ID"] == _kill_at.split(":")[0]:
        import json
        import threading

        def _watch(metrics=os.path.join(os.environ["EDIT_JAX_TEST_RUN_DIR"],  # noqa: B008 - read at import
                                        "metrics.jsonl"),
                   step=int(_kill_at.split(":")[1])):  # noqa: B008 - read once, as the hook is imported
            while True:
                try:
                    with open(metrics) as f:
                        steps = [json.loads(x).get("step", 0) for x in f if x.endswith("\n") and '"loss"' in x]
                except OSError:
                    steps = []
                if steps and max(steps) >= step:
                    with open(_LOG + ".first-kill", "w") as f:
                        f.write(f"{max(steps)}\n")
                    _note(f"killing at {max(steps)}")
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.02)

        threading.Thread(target=_watch, daemon=True).start()
    # EDIT_JAX_TEST_FAIL_AGAIN=1: on every restart, worker W (of KILL_AT) SIGKILLs itself at start.
    if (_restarted and os.environ.get("EDIT_JAX_TEST_FAIL_AGAIN") and _kill_at
            and os.environ["EDIT_JAX_PROCESS_ID"] == _kill_at.split(":")[0]):
        _note("failing at start")
        os.kill(os.getpid(), signal.SIGKILL)
    # EDIT_JAX_TEST_HOLD_RESTART=1: on a restart every worker waits at start for EDIT_JAX_TEST_GO.
    if _restarted and os.environ.get("EDIT_JAX_TEST_HOLD_RESTART"):
        _note("restart held")
        while not os.path.exists(os.environ["EDIT_JAX_TEST_GO"]):
            time.sleep(0.02)
