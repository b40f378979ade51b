"""Test hooks for launched worker processes (tests put this directory on PYTHONPATH; Python
imports ``sitecustomize`` at start-up). Inactive unless ``EDIT_JAX_TEST_LOG`` is set, and only in a
worker of ``launch.py`` (``EDIT_JAX_PROCESS_ID``). They pause a worker at an exact point, so that a
race is reproduced by construction, not by timing:

- SIGUSR1 holds the worker's main thread (inside that handler) until the file ``EDIT_JAX_TEST_GO``
  exists; signals that arrive meanwhile are handled one by one inside the hold;
- every call of a SIGINT handler is logged (``<pid> handled <signum>``) after it returns;
- ``EDIT_JAX_TEST_HANG_SAVE=STEP``: worker 0 hangs just before orbax renames the finished
  temporary dir of checkpoint STEP to its final name (the save's commit), logging ``<pid> hanging``.
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
