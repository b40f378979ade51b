"""Reading compiled HLO text: element types, device groups, instructions and the call graph.

* ``DTYPE_BYTES`` / ``parse_shapes`` / ``shape_bytes``: element sizes and the array shapes of a type string.
* ``COLLECTIVES``: the opcodes of the collectives (their ``-start`` / ``-done`` forms are the same ops).
* ``parse_replica_groups`` / ``iota_groups`` / ``mesh_groups`` / ``parse_pairs``: who talks to whom.
* ``Instr`` / ``HloModule`` / ``parse_hlo``: computations, their instructions and who calls whom.
* ``upstream`` / ``entry_parameters``: what an instruction depends on; the entry's parameters.

The text is ``jax.stages.Compiled.as_text()``; ``hlo.py`` totals the collectives' bytes from it.
Device groups come in every form jax 0.10 to 0.12 prints:
- explicit lists ``replica_groups={{0,1},{2,3}}`` (``{}``: one group of every device);
- the iota form ``replica_groups=[G,S]<=[dims]T(perm)``;
- jax 0.12's mesh form ``replica_groups=mesh['replica'=4,'shard'=2] {'shard'}``: one group per
  combination of the unnamed axes, over the named axes in the order given;
- collective-permute's ``source_target_pairs={{0,1},...}``.
Ids are positions in ``mesh.devices.flat`` (row-major over (replica, shard)), not device ids
(``tests/test_hlo.py`` shows it on a permuted mesh), so position p is on replica p // S.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
               "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
               "c128": 16, "token": 0}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "ragged-all-to-all", "collective-broadcast")
_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_CALL_RE = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_LIST_RE = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")
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
    jax 0.12's ``mesh['a'=N,'b'=S] {'b'}``, or ``{}`` (one group of every device). None when the
    attribute is absent."""
    key = "replica_groups="
    i = attrs.find(key)
    if i < 0:
        return None
    rest = attrs[i + len(key):]
    if rest.startswith("mesh["):
        return mesh_groups(rest)
    if rest.startswith("["):
        return iota_groups(rest)
    if rest.startswith("{"):
        body = rest[:_matching(rest, 0, "{", "}")]
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
        groups = [g for g in groups if g]
        return groups or [list(range(num_devices))]
    raise ValueError(f"cannot parse replica_groups in {attrs[:200]!r}")


def _iota(dims: str, perm: str | None):
    """arange(prod(dims)).reshape(dims).transpose(perm), from the texts ``"2,4"`` and ``"1,0"``."""
    import numpy as np

    shape = [int(x) for x in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def iota_groups(text: str) -> list[list[int]]:
    """Expands the iota form: arange(prod(dims)).reshape(dims).transpose(perm).reshape(G, S)."""
    m = _IOTA_RE.match(text)
    if m is None:
        raise ValueError(f"cannot parse iota replica_groups {text[:80]!r}")
    return _iota(m.group(2), m.group(3)).reshape([int(x) for x in m.group(1).split(",")]).tolist()


_MESH_RE = re.compile(r"^mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}")
_DEVICE_IOTA_RE = re.compile(r"^\[([\d,]+)\](?:T\(([\d,]+)\))?$")


def mesh_groups(text: str) -> list[list[int]]:
    """Expands jax 0.12's mesh form ``mesh['replica'=4,'shard'=2] {'shard'}``: one group for each
    combination of the axes not named in braces, holding the positions (row-major over the mesh's
    axes) that vary over the named axes, in the order they are named. ``{}`` names no axis: every
    device is a group of its own. ``, device_ids=([dims]T(perm))`` after the axes (a mesh whose
    devices are not in order) maps each position to its device: arange(prod(dims)) reshaped to
    dims, transposed by perm, flattened; an explicit ``device_ids=(0,2,1,3)`` likewise."""
    m = _MESH_RE.match(text)
    if m is None:
        raise ValueError(f"cannot parse mesh replica_groups {text[:80]!r}")
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))]
    if not axes:
        raise ValueError(f"mesh replica_groups without axes: {text[:80]!r}")
    names = [n for n, _ in axes]
    chosen = re.findall(r"'([^']+)'", m.group(3))
    unknown = [c for c in chosen if c not in names]
    if unknown:
        raise ValueError(f"mesh replica_groups name axes {unknown} not in the mesh {names}: {text[:80]!r}")
    sizes = dict(axes)
    strides = {n: math.prod(s for _, s in axes[i + 1:]) for i, (n, _) in enumerate(axes)}
    rest = [n for n in names if n not in chosen]
    groups = []
    for fixed in itertools.product(*(range(sizes[n]) for n in rest)):
        base = sum(i * strides[n] for n, i in zip(rest, fixed, strict=True))
        groups.append([base + sum(i * strides[n] for n, i in zip(chosen, idx, strict=True))
                       for idx in itertools.product(*(range(sizes[n]) for n in chosen))])
    if m.group(2):
        ids = _device_ids(m.group(2).strip(), math.prod(sizes.values()), text)
        groups = [[ids[p] for p in g] for g in groups]
    return groups


def _device_ids(spec: str, count: int, text: str) -> list[int]:
    """The devices of a mesh's positions, from its ``device_ids=(...)``: ``[dims]T(perm)`` or a list."""
    m = _DEVICE_IOTA_RE.match(spec)
    if m:
        ids = _iota(m.group(1), m.group(2)).reshape(-1).tolist()
    elif re.fullmatch(r"[\d,\s]+", spec):
        ids = [int(x) for x in spec.split(",") if x.strip()]
    else:
        raise ValueError(f"cannot parse the mesh's device_ids {spec!r} in {text[:120]!r}")
    if len(ids) != count:
        raise ValueError(f"mesh device_ids name {len(ids)} devices for {count} positions: {text[:120]!r}")
    return ids


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


def upstream(text: str, name: str) -> set[str]:
    """Names of every instruction whose value instruction ``name`` depends on, transitively: its
    operands, theirs, and so on; a parameter of a called computation (a while body, say) depends
    on every operand of each instruction that calls it (a conservative reading: a loop's whole
    carry). For checks like "this all-reduce does not wait for the step's compute"."""
    mod = parse_hlo(text)
    where = {i.name: (c, i) for c, instrs in mod.computations.items() for i in instrs}
    callers: dict[str, list[Instr]] = {}
    for edges in mod.calls.values():
        for _, callee, ins in edges:
            callers.setdefault(callee, []).append(ins)
    seen: set[str] = set()
    stack = [name]
    while stack:
        n = stack.pop()
        if n in seen or n not in where:
            continue
        seen.add(n)
        comp, ins = where[n]
        if ins.opcode == "parameter" and comp != mod.entry:
            stack.extend(c.name for c in callers.get(comp, []))
            continue
        for operand in ins.operands:
            ref = re.search(r"%?([\w.\-]+)\s*$", operand)
            if ref:
                stack.append(ref.group(1))
    seen.discard(name)
    return seen


def entry_parameters(text: str) -> list[tuple[str, str]]:
    """(name, type string) of the entry computation's parameters, in order."""
    mod = parse_hlo(text)
    return [(i.name, i.type_str) for i in mod.computations[mod.entry] if i.opcode == "parameter"]


__all__ = ["COLLECTIVES", "DTYPE_BYTES", "HloModule", "Instr", "parse_hlo", "upstream", "entry_parameters",
           "parse_replica_groups", "iota_groups", "mesh_groups", "parse_pairs", "dtype_bytes", "parse_shapes",
           "shape_bytes"]
