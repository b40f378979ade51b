"""Shared helpers of the benchmark scripts (bench_step.py, bench_edit.py).

Importing this module does NOT import jax: call ``ensure_cpu_devices`` first, then import jax.
The HLO parser (``hlo_collectives``) reads collectives out of a compiled program's text
(``jax.stages.Compiled.as_text()``) and counts the bytes each device moves.
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
from dataclasses import dataclass, field
from functools import lru_cache
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


# ----------------------------------------------------------------------------- HLO collectives

DTYPE_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
               "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
               "c128": 16, "token": 0}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "ragged-all-to-all", "collective-broadcast")
_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_CALL_RE = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_LIST_RE = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_IOTA_RE = re.compile(r"^\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def dtype_bytes(dtype: str) -> float:
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return {"f8": 1, "f6": 0.75, "f4": 0.5}[dtype[:2]]
    raise ValueError(f"unknown HLO element type {dtype!r}")


def parse_shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array shape in an HLO type string (a tuple type gives several)."""
    out = []
    for dt, dims in _SHAPE_RE.findall(type_str):
        try:
            dtype_bytes(dt)
        except ValueError:
            continue
        out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def shape_bytes(shape: tuple[str, tuple[int, ...]]) -> float:
    return dtype_bytes(shape[0]) * math.prod(shape[1])


def _matching(s: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket matching s[start] (== open_)."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] == open_:
            depth += 1
        elif s[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_}{close} in {s[:200]!r}")


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


def _strip_comments(s: str) -> str:
    return re.sub(r"/\*.*?\*/", "", s)


def parse_replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """``replica_groups`` of an instruction: explicit ``{{0,1},{2,3}}``, iota ``[G,S]<=[dims]T(perm)``,
    or ``{}`` (one group of every device). None when the attribute is absent."""
    key = "replica_groups="
    i = attrs.find(key)
    if i < 0:
        return None
    rest = attrs[i + len(key):]
    if rest.startswith("["):
        return iota_groups(rest)
    if rest.startswith("{"):
        body = rest[:_matching(rest, 0, "{", "}")]
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
        groups = [g for g in groups if g]
        return groups or [list(range(num_devices))]
    raise ValueError(f"cannot parse replica_groups in {attrs[:200]!r}")


def iota_groups(text: str) -> list[list[int]]:
    """Expands the iota form: arange(prod(dims)).reshape(dims).transpose(perm).reshape(G, S)."""
    import numpy as np

    m = _IOTA_RE.match(text)
    if m is None:
        raise ValueError(f"cannot parse iota replica_groups {text[:80]!r}")
    out_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(out_shape).tolist()


def parse_pairs(attrs: str) -> list[list[int]] | None:
    i = attrs.find("source_target_pairs=")
    if i < 0:
        return None
    rest = attrs[i + len("source_target_pairs="):]
    body = rest[:_matching(rest, 0, "{", "}")]
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]


@dataclass
class Instr:
    name: str
    type_str: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str


@dataclass
class HloModule:
    computations: dict[str, list[Instr]]
    entry: str
    types: dict[str, str]  # instruction name -> result type string
    calls: dict[str, list[tuple[str, str, Instr]]] = field(default_factory=dict)  # caller -> (kind, callee, instr)


def parse_hlo(text: str) -> HloModule:
    comps: dict[str, list[Instr]] = {}
    types: dict[str, str] = {}
    entry, cur = None, None
    for raw in text.splitlines():
        line = _strip_comments(raw).rstrip()
        if not line or line.startswith("HloModule") or line.lstrip().startswith("//"):
            continue
        if cur is None:
            if line.endswith("{") and not line.startswith(" "):
                head = line[len("ENTRY "):] if line.startswith("ENTRY ") else line
                name = re.match(r"%?([^\s(]+)", head).group(1)
                cur = name
                comps[name] = []
                if line.startswith("ENTRY "):
                    entry = name
            continue
        if line.strip() == "}":
            cur = None
            continue
        ins = _parse_instr(line, cur)
        if ins is not None:
            comps[cur].append(ins)
            types[ins.name] = ins.type_str
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    mod = HloModule(comps, entry, types)
    for cname, instrs in comps.items():
        edges = []
        for ins in instrs:
            for kind, callee in _CALL_RE.findall(ins.attrs):
                edges.append((kind, callee, ins))
            for kind, lst in _CALL_LIST_RE.findall(ins.attrs):
                for callee in re.findall(r"%?([\w.\-]+)", lst):
                    edges.append(("branch" if kind == "branch_computations" else kind, callee, ins))
        mod.calls[cname] = [e for e in edges if e[1] in comps]
    return mod


def _parse_instr(line: str, comp: str) -> Instr | None:
    m = re.match(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$", line)
    if m is None:
        return None
    name, rest = m.group(1), m.group(2).lstrip()
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
        type_str, rest = rest[:end], rest[end:].lstrip()
    else:
        sp = rest.find(" ")
        if sp < 0:
            return None
        type_str, rest = rest[:sp], rest[sp:].lstrip()
    m2 = re.match(r"([\w\-]+)\(", rest)
    if m2 is None:
        return None
    opcode = m2.group(1)
    start = m2.end() - 1
    end = _matching(rest, start, "(", ")")
    operands = _split_top(rest[start + 1:end - 1])
    return Instr(name, type_str, opcode, operands, rest[end:], comp)


def multiplicities(mod: HloModule, default_trip: int | None = None) -> tuple[dict[str, float], list[dict]]:
    """How many times each computation runs per execution of the entry. A while body runs its
    trip count times per execution of its caller: ``known_trip_count`` from the while's backend
    config, else ``default_trip`` (flagged). Conditional branches count as always taken (an upper
    bound, flagged)."""
    callers: dict[str, list[tuple[str, float]]] = {}
    loops = []
    for caller, edges in mod.calls.items():
        for kind, callee, ins in edges:
            factor = 1.0
            if ins.opcode == "while" and kind in ("body", "condition"):
                m = _TRIP_RE.search(ins.attrs)
                trip, source = (int(m.group(1)), "known_trip_count") if m else (default_trip, "assumed (n_layers)")
                if trip is None:
                    raise ValueError(f"while loop {ins.name} has no known_trip_count; pass default_trip")
                factor = trip if kind == "body" else trip + 1
                if kind == "body":
                    loops.append({"while": ins.name, "in": caller, "body": callee, "trip_count": trip,
                                  "trip_count_source": source})
            elif kind == "branch" or kind in ("true_computation", "false_computation"):
                loops.append({"conditional": ins.name, "branch": callee, "note": "counted as always taken"})
            callers.setdefault(callee, []).append((caller, factor))

    @lru_cache(maxsize=None)
    def count(c: str) -> float:
        if c == mod.entry:
            return 1.0
        return sum(count(p) * f for p, f in callers.get(c, []))

    return {c: count(c) for c in mod.computations}, loops


def _ring_bytes(op: str, operand_bytes: float, n: int) -> float:
    """Bytes one device sends in a ring implementation (``operand_bytes``: this device's input)."""
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2.0 * (n - 1) / n * operand_bytes
    if op == "all-gather":  # full result = n x operand; each device sends (n-1)/n of it
        return (n - 1) * operand_bytes
    if op in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):  # operand is the full buffer
        return (n - 1) / n * operand_bytes
    if op in ("collective-permute", "collective-broadcast"):
        return operand_bytes
    raise ValueError(op)


RING_FORMULAS = {
    "all-reduce": "2(n-1)/n x B (B = per-device buffer = operand bytes)",
    "all-gather": "(n-1)/n x n x B = (n-1) x B (B = per-device operand; n x B = the gathered result)",
    "reduce-scatter": "(n-1)/n x B (B = the full per-device operand before scattering)",
    "all-to-all": "(n-1)/n x B",
    "collective-permute": "B (each device sends its whole operand once)",
}


def hlo_collectives(text: str, mesh_shape: tuple[int, int], default_trip: int | None = None,
                    small_elems: int | None = None) -> dict:
    """Every collective of a compiled SPMD program (mesh (replica, shard) = ``mesh_shape``).

    Device ids in replica_groups are taken as positions in ``mesh.devices.flat`` (row-major over
    (replica, shard)), so position p is on replica p // S. A collective crosses ``replica`` when a
    group (or a source/target pair) holds positions of two replicas. Bytes are per device and per
    step: ring bytes (formulas in RING_FORMULAS) and plain operand bytes, times the number of times
    the instruction runs per step (product of enclosing while trip counts). Operands with at most
    ``small_elems`` elements (rank-0 included) are also totalled apart as "small" (norms, weights,
    flags, metrics): they cost latency, not bandwidth.
    """
    n_rep, n_shard = mesh_shape
    num_devices = n_rep * n_shard
    small_elems = n_rep if small_elems is None else small_elems
    mod = parse_hlo(text)
    mult, loops = multiplicities(mod, default_trip)
    records = []
    for cname, instrs in mod.computations.items():
        for ins in instrs:
            op = ins.opcode
            if op.endswith("-done") or op.endswith("-update"):
                continue
            base = op[:-len("-start")] if op.endswith("-start") else op
            if base not in COLLECTIVES:
                continue
            shapes = []
            for operand in ins.operands:
                inline = parse_shapes(operand.split("%")[0]) if "[" in operand.split("%")[0] else []
                if inline:
                    shapes.extend(inline)
                    continue
                ref = re.search(r"%?([\w.\-]+)\s*$", operand)
                t = mod.types.get(ref.group(1)) if ref else None
                if t is None:
                    raise ValueError(f"{ins.name}: cannot resolve operand {operand!r}")
                shapes.extend(parse_shapes(t))
            if base == "collective-permute":
                pairs = parse_pairs(ins.attrs) or []
                groups = pairs
                n = 2
                crosses = any(len({p // n_shard for p in pr}) > 1 for pr in pairs)
            else:
                groups = parse_replica_groups(ins.attrs, num_devices)
                if groups is None:
                    groups = [list(range(num_devices))]
                n = max(len(g) for g in groups)
                crosses = any(len({p // n_shard for p in g}) > 1 for g in groups)
            within = all(len({p % n_shard for p in g}) == 1 for g in groups) if base != "collective-permute" else None
            times = mult.get(cname, 0.0)
            op_bytes = sum(shape_bytes(s) for s in shapes)
            small = sum(shape_bytes(s) for s in shapes if math.prod(s[1]) <= small_elems)
            records.append({
                "name": ins.name, "op": base, "async": op.endswith("-start"), "computation": cname,
                "runs_per_step": times, "group_size": n, "num_groups": len(groups),
                "groups": groups if len(groups) <= 16 else groups[:16] + [["..."]],
                "crosses_replica": crosses, "replica_only": bool(crosses and within),
                "operands": [f"{dt}[{','.join(map(str, d))}]" for dt, d in shapes],
                "operand_bytes": op_bytes, "small_operand_bytes": small,
                "ring_bytes": _ring_bytes(base, op_bytes, n),
                "small_ring_bytes": _ring_bytes(base, small, n),
            })
    return {"collectives": records, "loops": loops, "entry": mod.entry}


def collective_totals(parsed: dict, crossing: bool = True) -> dict:
    """Per-step per-device totals over the collectives that do (or do not) cross ``replica``."""
    recs = [r for r in parsed["collectives"] if r["crosses_replica"] == crossing]
    tot = {"ring_bytes": 0.0, "operand_bytes": 0.0, "small_ring_bytes": 0.0, "small_operand_bytes": 0.0,
           "executions": 0.0, "ops_in_hlo": len(recs), "by_op": {}}
    for r in recs:
        k = r["runs_per_step"]
        tot["ring_bytes"] += k * r["ring_bytes"]
        tot["operand_bytes"] += k * r["operand_bytes"]
        tot["small_ring_bytes"] += k * r["small_ring_bytes"]
        tot["small_operand_bytes"] += k * r["small_operand_bytes"]
        tot["executions"] += k
        b = tot["by_op"].setdefault(r["op"], {"executions": 0.0, "ring_bytes": 0.0, "operand_bytes": 0.0})
        b["executions"] += k
        b["ring_bytes"] += k * r["ring_bytes"]
        b["operand_bytes"] += k * r["operand_bytes"]
    tot["tensor_ring_bytes"] = tot["ring_bytes"] - tot["small_ring_bytes"]
    tot["tensor_operand_bytes"] = tot["operand_bytes"] - tot["small_operand_bytes"]
    return tot


def self_test_parser() -> None:
    """Quick checks of the parser on hand-written HLO (run by bench_edit.py before section a)."""
    assert iota_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert iota_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    text = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x.1 = f32[8]{0} parameter(0)
  %ag = f32[32]{0} all-gather(%x.1), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %ars = (f32[], bf16[16]{0}) all-reduce-start(f32[] %x.2, bf16[16]{0} %y), replica_groups={}, to_apply=%add
  %z = s32[] constant(0)
  %tup = (s32[], f32[8]{0}) tuple(%z, %x.1)
  %w = (s32[], f32[8]{0}) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    p = hlo_collectives(text, (2, 4))
    by = {r["name"]: r for r in p["collectives"]}
    assert by["ar"]["runs_per_step"] == 3 and by["ar"]["crosses_replica"] and by["ar"]["replica_only"]
    assert by["ar"]["ring_bytes"] == 32.0  # 2(2-1)/2 x 32 B
    assert not by["ag"]["crosses_replica"] and by["ag"]["ring_bytes"] == 3 * 32.0
    assert by["ars"]["group_size"] == 8 and by["ars"]["operand_bytes"] == 4 + 32 and by["ars"]["crosses_replica"]
    tot = collective_totals(p)
    assert tot["ring_bytes"] == 3 * 32.0 + 2 * 7 / 8 * 36 and tot["executions"] == 4
