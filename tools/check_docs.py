"""Checks every page of the docs (README.md and docs/**/*.md) against the code, without running anything heavy.

    python tools/check_docs.py             # static checks; prints each problem, exits 1 if any
    python tools/check_docs.py --run DIR   # also runs the README's CPU commands in a git clone
                                           # (was scripts/check_readme.py)
    python tools/check_docs.py --tour DIR  # only the README's tour at tiny size, in one process (tests/test_docs.py)
    python tools/check_docs.py --tour DIR --pages   # then every page's other CPU commands (tools/run_docs.py)
    python tools/check_docs.py --tour DIR --pages --skip-tour --stage 3.12   # only the pages' 3.12 share

Static checks (tests/test_docs.py runs them, and runs a representative set of commands at tiny size):
- every path a page names in backticks (`edit_jax/...`, `configs/...`, `scripts/...`, `tests/...`,
  `docs/...`, `tools/...`, `examples/...`, a root file, or a module path inside the package such as
  `localsgd/methods.py`) exists; a `<...>` part or `*` matches as a glob;
- every dotted module name (`edit_jax.x.y`, possibly ending in a name the module defines) exists;
- every config key a page names (`sync.tau`, `model.remat=true`, `train.spike.*`) is a real field;
- every ```python block parses (the generated signatures of docs/reference/ aside), every relative
  link `[text](path)` exists;
- every `edit-jax ...` / `python -m edit_jax ...` command of a ```bash block parses against that
  command's own argparse (optional `[...]` parts left out), its `key=value` overrides apply to a
  Config, and every `python PATH.py` script it names exists.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import shlex
import subprocess
import sys

# Run as a script (python tools/check_docs.py) the repository root is not on sys.path: put it there.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.doc_pages import REPO, bash_commands, pages, prose, spans, without_optional  # noqa: E402, F401 - (re-exported)

ROOTS = ("edit_jax", "configs", "scripts", "tests", "docs", "tools", "examples", "benchmarks", ".ci")
ROOT_FILES = ("README.md", "BUILD_NOTES.md", "CHANGELOG.md", "pyproject.toml", "mkdocs.yml")
SECTIONS = ("model", "mesh", "data", "optim", "sync", "debug", "log", "train")
# Commands a CPU machine cannot parse-check meaningfully (a cluster launcher); they are still read.
NEEDS = [("--distributed", "needs a cluster"), ("srun", "needs SLURM"), ("fineweb", "needs the FineWeb-Edu files"),
         ("_1b.py", "a paper preset: needs the FineWeb-Edu shards and GPUs"), ("_7b.py", "a paper preset"),
         ("pytest", "the test suite (CI runs it)")]


# ----------------------------------------------------------------------------- checks


def _exists(path: str) -> bool:
    path = path.rstrip("/").split("::")[0]
    pattern = re.sub(r"<[^>]*>", "*", path)
    if "*" in pattern:
        return bool(glob.glob(os.path.join(REPO, pattern)))
    return os.path.exists(os.path.join(REPO, path))


def check_path(token: str) -> str | None:
    """A problem with a path named in a code span, or None (also None when it is not a repo path)."""
    token = token.strip().rstrip(".,;:")
    if " " in token or "=" in token or token.startswith(("/", "$", "RUN_DIR")):
        return None
    first = token.split("/")[0]
    if "/" in token and first in ROOTS:
        return None if _exists(token) else f"path {token} does not exist"
    if token in ROOT_FILES:
        return None if _exists(token) else f"file {token} does not exist"
    package_dirs = {d for d in os.listdir(os.path.join(REPO, "edit_jax"))
                    if os.path.isdir(os.path.join(REPO, "edit_jax", d))}
    if "/" in token and first in package_dirs and token.endswith(".py"):
        return None if _exists("edit_jax/" + token) else f"module path {token} is not under edit_jax/"
    return None


def check_module(token: str) -> str | None:
    """A problem with a dotted ``edit_jax.x.y[.name]``, or None."""
    m = re.fullmatch(r"(edit_jax(?:\.\w+)*)(?:\(.*\))?", token.strip())
    if not m:
        return None
    parts = m.group(1).split(".")
    for n in range(len(parts), 0, -1):
        base = os.path.join(REPO, *parts[:n])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(path):
                rest = parts[n:]
                if not rest:
                    return None
                source = open(path).read()
                if re.search(rf"\b{re.escape(rest[0])}\b", source):
                    return None
                return f"{token}: {'.'.join(parts[:n])} has no {rest[0]}"
    return f"module {m.group(1)} does not exist"


def config_keys() -> set[str]:
    sys.path.insert(0, REPO)
    from tools.gen_docs import config_fields

    return {key for key, *_ in config_fields()}


# Keys of the rule the conformance test writes and registers with its own section; the docs name it
# as the example of a rule from outside the library. Each is accepted while the test still declares it.
REGISTERED_IN_TESTS_FILE = "tests/test_rule_conformance.py"
REGISTERED_IN_TESTS = {"sync.trimmed_mean.trim": 'owned_section, section_type = "trimmed_mean", TrimmedMeanConfig'}


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def check_key(token: str, keys: set[str]) -> str | None:
    """A problem with a config key named in a code span (``sync.tau``, ``sync.tau=8``, ``train.spike.*``)."""
    m = re.fullmatch(r"((?:%s)\.[a-z_][a-z0-9_.]*[a-z0-9_*])(=\S*)?" % "|".join(SECTIONS), token.strip())
    if not m:
        return None
    key = m.group(1)
    if key.endswith(".*"):
        prefix = key[:-1]
        return None if any(k.startswith(prefix) for k in keys) else f"config section {key} does not exist"
    if key in keys or any(k.startswith(key + ".") for k in keys):
        return None
    from edit_jax.config.renames import RENAMED
    if key in RENAMED:
        return None  # a key that moved into a section: still read (translated), as the notes' older commands use it
    if key.endswith((".py", ".json", ".md", ".safetensors")):
        return None  # a file name such as model.safetensors, not a key
    if key in REGISTERED_IN_TESTS and REGISTERED_IN_TESTS[key] in _read(REGISTERED_IN_TESTS_FILE):
        return None  # the section of a rule the tests register (not the library's: no field of sections.py)
    parts = key.split(".")
    if os.path.exists(os.path.join(REPO, "edit_jax", parts[0], parts[1] + ".py")):
        return None  # a module and its name (data.corrupt.validate), not a key
    return f"config key {key} is not a field of edit_jax/config/sections.py"


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parse_command(words: list[str]):
    """The argparse namespace of ``edit-jax`` words (or an error message), from the command's own
    parser: its parse step is intercepted, nothing runs."""
    from edit_jax import cli

    originals = {name: getattr(argparse.ArgumentParser, name)
                 for name in ("parse_args", "parse_intermixed_args", "parse_known_args")}

    def intercept(name):
        def parse(self, args=None, namespace=None):
            result = originals[name](self, args, namespace)
            raise _Parsed(result[0] if name == "parse_known_args" else result)
        return parse

    for name in ("parse_args", "parse_intermixed_args"):
        setattr(argparse.ArgumentParser, name, intercept(name))
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.main(words)
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as e:
        return f"does not parse (exit {e.code}): {err.getvalue().strip().splitlines()[-1:] or ''}"
    finally:
        for name, fn in originals.items():
            setattr(argparse.ArgumentParser, name, fn)
    return "was not parsed (the command ran no parser)"


def check_command(command: str) -> str | None:
    """A problem with one documented command, or None."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        words.pop(0)
    if words[:1] == ["sudo"]:
        words = words[1:]
    if words[:1] == ["srun"]:
        words = words[next((i for i, w in enumerate(words) if w == "edit-jax"), len(words)):]
        if not words:
            return None
    if words[:1] == ["python"] and words[1:2] != ["-m"]:
        return None if _exists(words[1]) else f"script {words[1]} does not exist"
    words = without_optional(words[3:] if words[:3] == ["python", "-m", "edit_jax"] else words[1:])
    result = parse_command(words)
    if isinstance(result, str):
        return result
    overrides = [o for o in getattr(result, "overrides", None) or [] if "$" not in o]
    if words[0] in ("train", "plan") and overrides:
        from edit_jax.config import Config, ConfigError, apply_overrides

        try:
            apply_overrides(Config(), overrides)
        except ConfigError as e:
            return f"override: {e}"
    return None


def check_page(page: str, keys: set[str]) -> list[str]:
    """Every problem of one page, each prefixed with the page."""
    text = open(os.path.join(REPO, page)).read()
    problems = []
    external = page.startswith("docs/design/")  # the design docs also name the reference code's files
    for token in spans(text):
        for check in (check_path, check_module, lambda t: check_key(t, keys)):
            if external and check is check_path and token.split("/")[0] not in ROOTS:
                continue
            problem = check(token)
            if problem:
                problems.append(problem)
    for command in bash_commands(text):
        problem = check_command(command)
        if problem:
            problems.append(f"`{command}`: {problem}")
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S) if not page.startswith("docs/reference/") else []:
        try:
            ast.parse(block)
        except SyntaxError as e:
            problems.append(f"python block does not parse: {e}")
    # relative links (mkdocs checks the site's too)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose(text)):
        if "://" not in target and not os.path.exists(os.path.join(REPO, os.path.dirname(page), target)):
            problems.append(f"link {target} does not exist")
    return [f"{page}: {p}" for p in dict.fromkeys(problems)]


def check_all() -> list[str]:
    keys = config_keys()
    return [p for page in pages() for p in check_page(page, keys)]


def run_in_clone(work: str, steps: int) -> int:
    """The README's CPU commands as written, in a clone of HEAD, `train` with steps=N appended."""
    clone = os.path.join(work, "clone")
    subprocess.run(["git", "clone", "--quiet", REPO, clone], check=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = clone + os.pathsep + env.get("PYTHONPATH", "")
    failed = 0
    for command in bash_commands(open(os.path.join(REPO, "README.md")).read()):
        if any(key in command for key, _ in NEEDS) or not command.startswith(("edit-jax", "python -m")):
            print(f"skipped  {command}")
            continue
        words = without_optional(shlex.split(command))
        words = ([sys.executable, "-m", "edit_jax"] + words[1:] if words[0] == "edit-jax"
                 else [sys.executable] + words[1:])
        if "train" in words[:4]:
            words.append(f"steps={steps}")
        code = subprocess.run(words, cwd=clone, env=env).returncode
        failed += code != 0
        print(f"{'ok' if code == 0 else 'FAILED':8} {command}")
    return 1 if failed else 0


def readme_command(readme: str, start: str) -> list[str]:
    """The first README command starting with ``start``, as argv of ``edit-jax`` (optional parts left out)."""
    command = next(c for c in bash_commands(readme) if c.startswith(start))
    return without_optional(shlex.split(command))[1:]


def tour_paths(work: str) -> dict[str, str]:
    """Where the tour's outputs go under ``work``, by the README's own path."""
    run = os.path.join(work, "run")
    return {"runs/tiny": run, "runs/demo": run, "runs/diloco": run, "exports/demo": os.path.join(work, "export"),
            "plots/compare.png": os.path.join(work, "plot.png"), "plan.json": os.path.join(work, "plan.json")}


def tour_steps(work: str) -> list[tuple[str, list[str]]]:
    """The README's tour as (name, argv of ``edit-jax``), its paths moved under ``work``
    (``tour_paths``): train (configs/tiny.py, 2 steps), the same command with steps=4 (a resume),
    sample (4 tokens), plot, export, plan."""
    readme = open(os.path.join(REPO, "README.md")).read()
    moved = tour_paths(work)
    run = moved["runs/tiny"]

    def local(words):
        words = [moved.get(w, w) for w in words]
        return [w for i, w in enumerate(words) if w != run or run not in words[:i]]  # one run dir, once

    train = local(readme_command(readme, "edit-jax train --config configs/tiny.py"))
    return [("train", train + ["steps=2", "--no-progress"]), ("resume", train + ["steps=4", "--no-progress"]),
            ("sample", local(readme_command(readme, "edit-jax sample")) + ["--max-tokens", "4"]),
            ("plot", local(readme_command(readme, "edit-jax plot"))),
            ("export", local(readme_command(readme, "edit-jax export"))),
            ("plan", local(readme_command(readme, "edit-jax plan --config configs/tiny.py")))]


def run_tour(work: str) -> dict:
    """The README's tour (``tour_steps``) at tiny size in this one process (a new one: JAX not
    started). Returns each command's exit code, the run's record keys and what export wrote;
    tests/test_docs.py checks them."""
    from edit_jax import cli

    moved = tour_paths(work)
    run, out = moved["runs/tiny"], moved["exports/demo"]
    result = {"commands": {}}
    import json
    import time

    for name, argv in tour_steps(work):
        t0 = time.perf_counter()
        code = cli.main(argv)
        result["commands"][name] = {"argv": argv, "exit": code, "seconds": round(time.perf_counter() - t0, 1)}

    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    result["record_keys"] = sorted({k for r in records for k in r})
    result["last_step"] = max(r["step"] for r in records)
    result["exported"] = sorted(os.listdir(out)) if os.path.isdir(out) else []
    result["plot_bytes"] = (os.path.getsize(moved["plots/compare.png"])
                            if os.path.exists(moved["plots/compare.png"]) else 0)
    result["plan_fits"] = json.load(open(moved["plan.json"]))["fits"] if os.path.exists(moved["plan.json"]) else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", metavar="DIR", help="also run the README's CPU commands in a clone under DIR")
    parser.add_argument("--steps", type=int, default=6, help="steps=N appended to train commands (--run)")
    parser.add_argument("--tour", metavar="DIR", help="only run the README's tour at tiny size in this process "
                        "(paths under DIR) and print its outcome as JSON")
    parser.add_argument("--pages", action="store_true", help="with --tour: then every other page's CPU commands at "
                        "tiny size, deduplicated by code path (PAGES line: what ran, what was only parsed and why)")
    parser.add_argument("--stage", choices=("default", "3.12", "both"), default="both",
                        help="with --pages: run only this CI stage's share (tools/run_docs.py STAGE_312)")
    parser.add_argument("--skip-tour", action="store_true", help="with --tour DIR --pages: do not run the tour (its "
                        "commands still count as run for --pages: CI runs it in its default stage only), no TOUR line")
    args = parser.parse_args(argv)
    if args.tour:
        import json

        # one compilation cache for every command (the suite sets its own): their programs repeat
        os.environ.setdefault("EDIT_JAX_COMPILE_CACHE", os.path.join(args.tour, "compile_cache"))
        if args.skip_tour:
            tour = {"commands": {name: {"argv": argv} for name, argv in tour_steps(args.tour)}}
        else:
            tour = run_tour(args.tour)
            print("TOUR " + json.dumps(tour), flush=True)
        if args.pages:
            from tools.run_docs import run_pages

            print("PAGES " + json.dumps(run_pages(args.tour, tour, args.stage)), flush=True)
        return 0
    problems = check_all()
    for p in problems:
        print(p)
    print(f"{len(pages())} pages, {len(problems)} problems")
    code = 1 if problems else 0
    if args.run:
        code |= run_in_clone(args.run, args.steps)
    return code


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
