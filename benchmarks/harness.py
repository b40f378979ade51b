"""What every benchmark shares: devices and XLA flags (set before JAX starts), interleaved
repeats, a table printer, and JSON stamped with the commit, the versions and the machine.

Importing this module does NOT import jax: call ``ensure_cpu_devices`` first, then import jax.
A bench is a module with ``parse_args(argv)`` (``add_common(p)`` adds ``--json`` and ``--smoke``)
and ``main(argv=None)``; ``tests/test_benchmarks.py`` calls ``main([..., "--smoke"])`` in-process.

    from benchmarks import harness as common   # (a bench run as a script puts the repo root on sys.path)
    common.ensure_cpu_devices(8)
    times = common.interleaved({"a": step_a, "b": step_b}, reps=6, steps=3)
    common.print_table("title", ["case", "median s"], rows)
    common.write_json(path, {"env": common.env_info(), ...})
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from importlib import metadata
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON_DIR = os.path.join(REPO, "runs", "bench")


# ----------------------------------------------------------------------------- arguments


def add_common(p, name: str) -> None:
    """``--json`` (default runs/bench/NAME.json) and ``--smoke`` (tiny sizes, seconds: the CI run)."""
    p.add_argument("--json", default=os.path.join(DEFAULT_JSON_DIR, f"{name}.json"), help="where the results go")
    p.add_argument("--smoke", action="store_true", help="tiny sizes in seconds (CI); the numbers mean nothing")


# ----------------------------------------------------------------------------- environment


def ensure_cpu_devices(count: int) -> None:
    """Asks XLA for ``count`` CPU devices unless XLA_FLAGS already sets a count (then that count
    must be >= ``count``; the benches use the first ``count`` devices). Call before jax creates its
    first backend (importing jax alone is fine: XLA_FLAGS is read when the CPU client is made)."""
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if m is None:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def pick_devices(count: int):
    import jax

    devices = jax.devices()
    if len(devices) < count:
        raise SystemExit(f"need {count} devices, found {len(devices)} {devices[0].platform} device(s); on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={count} (or leave it unset)")
    return devices[:count]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def git_commit() -> str:
    """The checkout's commit (with ``+dirty`` when the tree has changes), or "" outside git."""
    try:
        run = lambda *a: subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True, timeout=10)
        commit = run("rev-parse", "HEAD").stdout.strip()
        dirty = bool(run("status", "--porcelain", "--untracked-files=no").stdout.strip())
    except Exception:  # no git: the stamp says so by its empty commit
        return ""
    return commit + ("+dirty" if commit and dirty else "")


def env_info() -> dict:
    """The stamp of every results file: commit, versions, machine, devices, load, command."""
    import jax

    dev = jax.devices()[0]
    return {"git_commit": git_commit(), "jax": jax.__version__, "jaxlib": _version("jaxlib"),
            "flax": _version("flax"), "optax": _version("optax"), "numpy": _version("numpy"),
            "python": platform.python_version(), "platform": dev.platform, "device_kind": dev.device_kind,
            "num_devices": jax.device_count(), "host_cpus": os.cpu_count(), "cpu_model": _cpu_model(),
            "machine": platform.machine(), "system": platform.system(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""),
            "command": " ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv else ""] + sys.argv[1:]),
            "loadavg_at_start": loadavg(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name: [state, ppid, ...]; field n of proc(5) is [n - 3]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc), sorted: a launcher's worker processes."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(_stat_fields(int(d))[1]) == pid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass  # ended meanwhile
    return sorted(out)


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far, from /proc (None: it ended)."""
    try:
        fields = _stat_fields(pid)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def child_env() -> dict:
    """The environment for an ``edit-jax`` process a bench starts: this one's, the repo on
    PYTHONPATH, and XLA_FLAGS less the CPU device count (the CLI sets its own from the mesh; other
    flags, e.g. the test suite's backend optimisation level, carry over)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.pop("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the host skew CPU timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def write_json(path: str, obj: Any) -> None:
    """``obj`` as JSON at ``path``, with every path inside the repository written relative to it
    (a result committed under docs/ holds no path of the machine it ran on)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(repo_relative(obj), f, indent=2, default=_json_default)
        f.write("\n")


def repo_relative(obj: Any) -> Any:
    """``obj`` with the repository's absolute path dropped from every string in it."""
    if isinstance(obj, str):
        return obj.replace(REPO + os.sep, "")
    if isinstance(obj, dict):
        return {k: repo_relative(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [repo_relative(v) for v in obj]
    return obj


def _json_default(x):
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    return str(x)


# ----------------------------------------------------------------------------- repeats


def interleaved(cases: dict[str, Callable[[], float]], reps: int, steps: int = 1) -> dict[str, list[float]]:
    """Each case's ``steps`` timings per repetition, the cases taking turns (a, b, a, b, ...), so a
    slow spell of the machine falls on all of them alike. A case returns its own time (s)."""
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            out[name] += [fn() for _ in range(steps)]
    return out


def summary(times: list[float]) -> dict:
    return {"n": len(times), "median_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0, "min_s": min(times), "max_s": max(times)}


# ----------------------------------------------------------------------------- formatting


def print_table(title: str, headers: list[str], rows: list[list[Any]], note: str = "") -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n## {title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.rjust(w) if _numeric(c) else c.ljust(w)
                                for c, w in zip(r, widths, strict=False)) + " |")
    if note:
        print(note)
    sys.stdout.flush()


def _numeric(s: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d.,]+(e[-+]?\d+)?\s*[%x]?|nan|inf|-", s))


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if math.isnan(c) or math.isinf(c):
            return str(c)
        if c == 0:
            return "0"
        if abs(c) >= 1e5 or abs(c) < 1e-3:
            return f"{c:.3e}"
        if abs(c) >= 100:
            return f"{c:,.1f}"
        return f"{c:.4g}"
    if isinstance(c, int) and not isinstance(c, bool):
        return f"{c:,}"
    return str(c)


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"
