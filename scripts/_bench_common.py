"""Shared helpers of the benchmark scripts (bench_step.py, bench_edit.py).

Importing this module does NOT import jax: call ``ensure_cpu_devices`` first, then import jax.
The HLO collective parser lives in the library (``edit_jax.tools.hlo``), shared with the tests.
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
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON_DIR = os.path.join(REPO, "runs", "bench")


# ----------------------------------------------------------------------------- environment


def ensure_cpu_devices(count: int) -> None:
    """Asks XLA for ``count`` CPU devices unless XLA_FLAGS already sets a count (then that count
    must be >= ``count``; the scripts use the first ``count`` devices). Call before jax creates its
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


def env_info() -> dict:
    import jax

    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = ""
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "platform": dev.platform, "device_kind": dev.device_kind,
            "num_devices": jax.device_count(), "host_cpus": os.cpu_count(), "python": platform.python_version(),
            "machine": platform.machine(), "git_commit": commit, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "command": " ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv else ""] + sys.argv[1:]),
            "loadavg_at_start": loadavg()}


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc), sorted: a launcher's worker processes."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass  # ended meanwhile
    return sorted(out)


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the host skew CPU timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default)
        f.write("\n")


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


# ----------------------------------------------------------------------------- formatting


def print_table(title: str, headers: list[str], rows: list[list[Any]], note: str = "") -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n## {title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)) + " |")
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


def summary(times: list[float]) -> dict:
    return {"n": len(times), "median_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0, "min_s": min(times), "max_s": max(times)}
