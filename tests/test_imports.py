"""The package's import graph, read from the AST of every module: no import circle, ``config/`` a
leaf, and imports of the package inside functions only in the files allowed below (a list that
only shrinks). Also what the order of ``edit-jax train`` needs: validating a config starts no JAX
backend, so the CPU device count set afterwards still takes effect."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.helpers import REPO, child_xla_flags

PACKAGE = "edit_jax"

# Circles still allowed, each exactly as it is (none: keep it so).
ALLOWED_CIRCLES: list[set[str]] = []

# Files that may import a package module inside a function, and why. Shrink it; never grow it: a
# shared name goes into a module both sides can import at the top (config/ is the leaf).
FUNCTION_LEVEL_ALLOWED = {
    "edit_jax/cli.py": "sets the CPU device count before the training modules (and JAX) load; lazy subcommands",
}


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    target: str  # the package module it loads
    path: str  # the importer's file, relative to the repo
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = " (inside a function)" if self.in_function else ""
        return f"{self.importer} -> {self.target}  [{self.path}:{self.line}]{where}"


def package_modules(package: str = PACKAGE) -> dict[str, str]:
    """Module name -> file (relative to the repo) of every module of the package (or of a folder of
    the repository whose modules import each other as ``folder.module``: tools/, benchmarks/)."""
    out = {}
    for folder, _, files in os.walk(os.path.join(REPO, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, name), REPO)
                module = path[:-3].replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_package: bool, modules: dict) -> list[str]:
    """The package modules one import statement loads. ``from pkg import name`` is the submodule
    ``pkg.name`` when there is one, and ``pkg`` itself; loading a module also runs its packages'
    ``__init__`` (except the importer's own packages: they are loaded before it runs)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            package = module if is_package else module.rpartition(".")[0]
            parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    found = []
    for name in names:
        while name and name not in modules:  # `import a.b.c` of a name inside a module: its module
            name = name.rpartition(".")[0]
        if not name:
            continue
        implicit = [p for p in _ancestors(name) if p in modules and p not in _ancestors(module)]
        found += [t for t in [name] + implicit if t != module and t not in found]
    return found


def imports_of(module: str, path: str, modules: dict) -> list[Import]:
    """Every import of a package module in ``module``, at any depth (a function's, a class body's,
    an ``if TYPE_CHECKING`` block's: each says what the module depends on)."""
    tree = ast.parse(open(os.path.join(REPO, path), encoding="utf-8").read(), path)
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, child, path.endswith("__init__.py"), modules):
                    out.append(Import(module, target, path, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def import_graph() -> tuple[dict[str, str], list[Import]]:
    modules = package_modules()
    return modules, [i for m, path in sorted(modules.items()) for i in imports_of(m, path, modules)]


def circles(edges: list[Import]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        succ.setdefault(e.importer, set()).add(e.target)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(succ):
        if v not in index:
            connect(v)
    return out


def one_cycle(component: set[str], edges: list[Import]) -> list[Import]:
    """A shortest cycle through the component's first module, as the imports that make it."""
    inside = [e for e in edges if e.importer in component and e.target in component]
    start = min(component)
    paths = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in inside:
                if e.importer == v:
                    if e.target == start:
                        return paths[v] + [e]
                    if e.target not in paths:
                        paths[e.target] = paths[v] + [e]
                        nxt.append(e.target)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _describe(component: set[str], edges: list[Import]) -> str:
    cycle = "\n".join(f"    {e}" for e in one_cycle(component, edges))
    return f"  circle of {len(component)}: {', '.join(sorted(component))}\n  one cycle in it:\n{cycle}"


def test_no_import_circle():
    _, edges = import_graph()
    found = [c for c in circles(edges) if c not in ALLOWED_CIRCLES]
    assert not found, ("import circles in edit_jax/ (move what both sides need into a module below them, "
                       "imported at the top):\n" + "\n".join(_describe(c, edges) for c in found))


def room(module: str) -> str:
    """The room a module lives in: its sub-package (``edit_jax.localsgd``), or the module itself at
    the package's root (``edit_jax.config``; the root package's ``__init__`` is ``edit_jax``)."""
    parts = module.split(".")
    modules = package_modules()
    if len(parts) >= 2 and f"{parts[0]}.{parts[1]}" in modules and \
            modules[f"{parts[0]}.{parts[1]}"].endswith("__init__.py"):
        return f"{parts[0]}.{parts[1]}"
    return module


@pytest.mark.parametrize("folder", ["tools", "benchmarks"])
def test_no_import_circle_in_the_repositorys_own_folders(folder):
    """tools/ (the docs machinery, operator checks) and benchmarks/ hold no import circle either
    (check_docs and run_docs imported each other: what both read is tools/doc_pages.py)."""
    modules = package_modules(folder)
    edges = [i for m, path in sorted(modules.items()) for i in imports_of(m, path, modules)]
    assert any(e.target.startswith(f"{folder}.") for e in edges), f"no import between {folder}/ modules read"
    found = circles(edges)
    assert not found, f"import circles in {folder}/:\n" + "\n".join(_describe(c, edges) for c in found)


def test_no_circle_between_packages():
    """The sub-packages (and the root's modules) import each other in one direction only."""
    _, edges = import_graph()
    between = [Import(room(e.importer), room(e.target), e.path, e.line, e.in_function) for e in edges
               if room(e.importer) != room(e.target)]
    found = circles(between)
    assert not found, "import circles between packages:\n" + "\n".join(_describe(c, between) for c in found)


# What the algorithm must not lean on: it is a library of pure functions and compiled steps that
# any loop, runtime or file format can use.
ALGORITHM = f"{PACKAGE}.localsgd"
OUTER_LAYERS = ("training", "runtime", "rundir", "hf", "commands", "analysis")


def test_the_algorithm_imports_no_outer_layer():
    _, edges = import_graph()
    outward = [str(e) for e in edges if room(e.importer) == ALGORITHM
               and room(e.target) in {f"{PACKAGE}.{p}" for p in OUTER_LAYERS}]
    assert not outward, f"{ALGORITHM} imports from {', '.join(OUTER_LAYERS)}:\n" + "\n".join(outward)


# The tree's size limits (issue 28): a newcomer finds the architecture in the package list.
MAX_ROOT_MODULES, MAX_MODULE_LINES, MAX_FUNCTION_LINES = 8, 450, 120


def test_the_tree_stays_readable():
    modules = package_modules()
    root = [m for m, path in modules.items() if m.count(".") == 1 and not path.endswith("__init__.py")]
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at edit_jax/'s top (at most {MAX_ROOT_MODULES}): {root}"
    long_modules, long_functions = [], []
    for path in modules.values():
        text = open(os.path.join(REPO, path), encoding="utf-8").read()
        if len(text.splitlines()) >= MAX_MODULE_LINES:
            long_modules.append(f"{path}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    assert not long_modules, f"modules of {MAX_MODULE_LINES} lines or more:\n" + "\n".join(long_modules)
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)


def test_public_api_loads_lazily_and_resolves():
    """``import edit_jax`` imports no JAX (the device count can still be set after it); every name
    of ``edit_jax.__all__`` resolves to the object its module defines."""
    proc = _python("import sys, edit_jax\n"
                   "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n"
                   "import importlib\n"
                   "for name in edit_jax.__all__:\n"
                   "    obj = getattr(edit_jax, name)\n"
                   "    if name != '__version__':\n"
                   "        assert obj is getattr(importlib.import_module(edit_jax._API[name]), name), name\n"
                   "print('resolved', len(edit_jax.__all__))\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "[]", proc.stdout
    assert lines[1].startswith("resolved ") and int(lines[1].split()[1]) >= 10, proc.stdout


def test_config_is_a_leaf():
    modules, edges = import_graph()
    config = f"{PACKAGE}.config"
    mine = [str(e) for e in edges if room(e.importer) == config and room(e.target) != config]
    assert mine == [], "edit_jax/config/ must import nothing else of edit_jax (every module imports it):\n" + \
        "\n".join(mine)


def test_function_level_imports_only_where_allowed():
    _, edges = import_graph()
    found = [str(e) for e in edges if e.in_function and e.path.replace(os.sep, "/") not in FUNCTION_LEVEL_ALLOWED]
    assert not found, ("imports of edit_jax modules inside functions (import at the top; a circle they "
                       "avoided is broken by moving what both sides need down):\n" + "\n".join(found))


def test_allowances_are_still_needed():
    """An allowance whose reason is gone is deleted, so the lists only shrink."""
    _, edges = import_graph()
    present = circles(edges)
    gone = [sorted(c) for c in ALLOWED_CIRCLES if c not in present]
    assert not gone, f"allowed circles no longer there: delete them from ALLOWED_CIRCLES: {gone}"
    with_function_level = {e.path.replace(os.sep, "/") for e in edges if e.in_function}
    unused = sorted(set(FUNCTION_LEVEL_ALLOWED) - with_function_level)
    assert not unused, f"no function-level edit_jax import left in {unused}: delete from FUNCTION_LEVEL_ALLOWED"


def test_graph_reads_every_form_of_import():
    """The parser itself: relative imports, ``from pkg import submodule`` and packages' ``__init__``."""
    modules = {"p": "p/__init__.py", "p.a": "p/a.py", "p.q": "p/q/__init__.py", "p.q.b": "p/q/b.py", "p.c": "p/c.py"}

    def targets(module, source, is_package=False):
        return _targets(module, ast.parse(source).body[0], is_package, modules)

    assert targets("p.a", "from .q import b") == ["p.q", "p.q.b"]
    assert targets("p.q.b", "from .. import c") == ["p", "p.c"]
    assert targets("p.q", "from . import b", is_package=True) == ["p.q.b"]
    assert targets("p.a", "from p.q.b import name") == ["p.q.b", "p.q"]
    assert targets("p.a", "import p.q.b.name") == ["p.q.b", "p.q"]
    assert targets("p.q.b", "from p.c import name") == ["p.c"]
    assert targets("p.a", "import numpy") == []
    cyc = [Import("p.a", "p.c", "p/a.py", 1, False), Import("p.c", "p.a", "p/c.py", 2, True)]
    assert circles(cyc) == [{"p.a", "p.c"}] and [e.line for e in one_cycle({"p.a", "p.c"}, cyc)] == [1, 2]


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=child_xla_flags())
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_validating_starts_no_jax_backend():
    """``edit-jax train`` loads and validates the config, then sets the CPU device count: that count
    must still take effect (importing JAX is harmless; creating a backend is not)."""
    proc = _python("import os\n"
                   "from edit_jax.validate import load_config\n"
                   "load_config('configs/tiny.py', ['method=edit'])\n"
                   "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=5'\n"
                   "import jax\n"
                   "print(jax.device_count())\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["5"], proc.stdout + proc.stderr


def test_config_and_rule_modules_import_without_jax():
    """The config and the parts whose rules need no data package (families, placement,
    TensorBoard) load without JAX. (The method table names its rules, which are JAX code, and
    multihost.py loads JAX: harmless, neither creates a backend, as the test above shows for the
    whole validation.)"""
    names = ["config", "localsgd.outer_spec", "models.family", "placement", "rundir.tensorboard"]
    proc = _python("import sys\n" + "".join(f"import edit_jax.{n}\n" for n in names) +
                   "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]"], proc.stdout
