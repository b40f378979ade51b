"""Every exit code of the ``edit-jax`` commands, defined once (a leaf: it imports nothing). What
each means to a user or a wrapper script, and what is kept on disk: docs/guides/restarts.md."""

EXIT_OK = 0  # done (the run's steps, or a command's work)
EXIT_FAILED = 1  # an error with no code of its own (a traceback, or storage an exchange worker cannot use)
EXIT_BAD_INPUT = 2  # a config, file or argument refused before any work: one line naming it (argparse's too)
EXIT_DIVERGED = 3  # the loss went non-finite or spiked past its rollbacks; the good checkpoints are kept
EXIT_LOCKED = 4  # the run dir is another live run's (its lock)
EXIT_WORKER_LOST = 5  # a worker process was lost and no restart is left (mesh.processes > 1)
EXIT_RETRY = 75  # as sysexits.h EX_TEMPFAIL: a peer or the exchange's storage was lost; run it again
EXIT_SHRINK = 76  # --distributed: this host's accelerators did not start; run again without it
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped by a signal, a checkpoint written where one could be

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_DIVERGED", "EXIT_LOCKED", "EXIT_WORKER_LOST", "EXIT_RETRY",
           "EXIT_SHRINK", "EXIT_INTERRUPTED"]
