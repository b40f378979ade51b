"""Who may write an exchange run: a worker (or a launcher) is admitted before it writes anything.

The exchange holds the run's config (``run/config.json``), created exclusively by the first worker
or launcher of the run. Every later one compares its own config with it before any write (no
run-dir file, no record, no post): a worker of another model, slot count, data, seed, method, sync
rule or wire would corrupt θ̄ or die on the first round state it reads, so it is refused with one
line naming the differing fields (exit 2: a launcher does not restart it). What each process may
set for itself (``OWN``): how it logs, caches and computes the same maths, and how it is started.

``steps`` (the run's token budget) is the exchange's. A launcher (``edit-jax train``, holding the
run dir's lock) may change it: that is how a finished run is trained further. A worker started by
hand with another ``steps`` adopts the run's, said in one line, so it never ends a run that goes on
(nor trains one past its budget).

A run dir belongs to one exchange: a ``train`` or a worker whose ``sync.exchange.url`` is not the one
the run dir's ``config.json`` names is refused before it opens the exchange (``runlock.exchange_problem``,
checked once by the launcher and by each worker as they start). ``RUN/config.json`` is written
only by an admitted worker, and only as the exchange's text (``write_run_config``).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import replace

from edit_jax.config import Config, ConfigError, dumps
from edit_jax.config.renames import quiet, upgrade
from edit_jax.localsgd.methods import normalise
from edit_jax.rundir.records import replace_file
from edit_jax.rundir.runlock import RunLock, check_writable, first_missing, remove_if_unused

CONFIG_KEY = "run/config.json"  # (run/start.json is the run's start time and id: another key)
# Fields a process may set for itself: none changes θ̄'s maths or what a post holds.
OWN = ("log.", "train.compile_cache", "train.async_checkpoint", "debug.slowdown", "debug.pin_cores",
       "mesh.processes", "mesh.heartbeat_seconds", "sync.exchange.url", "sync.exchange.progress_every", "data.workers",
       "model.attention", "model.remat", "model.remat_saves", "model.scan_unroll", "model.loss_chunk",
       "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints")


class NotAdmitted(ConfigError):
    """This config does not fit the run the exchange holds (exit 2: starting it again changes nothing)."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def run_text(cfg: Config) -> str:
    """The config as the run holds it: normalised by the method table (what the workers run)."""
    return dumps(normalise(cfg)[0]) + "\n"


def differences(run: dict, mine: dict) -> list[str]:
    """``key (the run's A, this B)`` for each field that defines the run and differs (not ``steps``)."""
    a, b = _flat(run), _flat(mine)
    keys = [k for k in sorted(set(a) | set(b)) if k != "steps" and not k.startswith(OWN) and a.get(k) != b.get(k)]
    return [f"{k} (the run's {a.get(k, '(unset)')!r}, this {b.get(k, '(unset)')!r})" for k in keys]


def _read_run(ex, url: str) -> dict | None:
    data = ex.get(CONFIG_KEY)
    if data is None:
        return None
    try:
        run = json.loads(data.decode())
        if not isinstance(run, dict) or not isinstance(run.get("steps"), int):
            raise ValueError("not a config")
    except (UnicodeDecodeError, ValueError) as e:
        raise NotAdmitted(f"sync.exchange.url: {url}/{CONFIG_KEY} (the run's config) is unreadable ({e}); "
                          "restore it or start the run on a new exchange") from None
    return upgrade(run, quiet)  # a run begun before some keys moved into sections: compared as today's


def admit(ex, cfg: Config, run_dir: str, say=print, *, owner: bool = False) -> Config:
    """``cfg`` admitted to the run ``ex`` holds (with the run's ``steps``; ``owner``: a launcher
    holding the run lock sets them), or ``NotAdmitted``. Creates the run's config when there is none.
    (The run dir's own exchange was checked by the caller, before it opened ``ex``.)"""
    url = getattr(ex, "url", cfg.sync.exchange.url)
    mine = run_text(cfg)
    run = _read_run(ex, url)
    if run is None:
        first = _older_run(ex, run_dir) or mine
        if ex.create(CONFIG_KEY, first.encode()) and first == mine:
            return cfg
        run = _read_run(ex, url)  # another created it first, or the older run's config
    diff = differences(run, json.loads(mine))
    if diff:
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        raise NotAdmitted(f"sync.exchange.url {url} holds a run this config does not fit: {shown}. Its workers must "
                          f"train the run's model, slots, data and sync rule ({url}/{CONFIG_KEY}); use its config, "
                          "or another sync.exchange.url and --run-dir")
    if cfg.steps == run["steps"]:
        return cfg
    if owner:  # the launcher: the run's budget from now on (workers started after it adopt it)
        ex.put(CONFIG_KEY, _text({**run, "steps": cfg.steps}).encode())  # the run's config with its new budget
        say(f"edit-jax: the run's budget is now steps={cfg.steps} (was {run['steps']})")
        return cfg
    say(f"edit-jax: steps={cfg.steps} is not the run's budget; this worker trains to the run's steps={run['steps']} "
        f"(set by its launcher; {url}/{CONFIG_KEY})")
    return replace(cfg, steps=run["steps"])


def _older_run(ex, run_dir: str) -> str | None:
    """The config of a run whose exchange holds round states but no run config (made before
    admission existed): its run dir's ``config.json`` (its exchange checked before ``ex`` was opened)."""
    if not ex.list("state/"):
        return None
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            text = f.read()
        return text if isinstance(json.loads(text).get("steps"), int) else None
    except (OSError, ValueError, AttributeError):
        return None


def _text(run: dict) -> str:
    return json.dumps(run, indent=2) + "\n"  # as ``run_text`` (config.dumps)


def write_run_config(ex, run_dir: str, worker: int) -> None:
    """``RUN/config.json`` as the run's config (the exchange's text), unless it already is."""
    data = ex.get(CONFIG_KEY)
    if data is None:
        return
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except OSError:
        pass
    os.makedirs(run_dir, exist_ok=True)
    replace_file(path, data.decode(), tmp=f"{path}.w{worker}.tmp")


@contextmanager
def launcher_lock(run_dir: str, cfg: Config, say=print):
    """The run dir's lock (``runlock.py``) for the launcher's life, as in-program runs hold it: a
    second ``train`` on the run dir is refused (``RunLockError``) before any work. A refused launcher
    leaves no run dir it made."""
    created = first_missing(run_dir)
    try:
        check_writable(run_dir, deepest=False)  # (no checkpoints: the closer saves exchange_state.npz)
        lock = RunLock(run_dir, say).acquire()
        try:
            yield lock
        finally:
            lock.release()
    finally:
        if created:
            remove_if_unused(run_dir, created)  # only while empty: a refusal's


__all__ = ["admit", "write_run_config", "launcher_lock", "NotAdmitted", "CONFIG_KEY", "OWN"]
