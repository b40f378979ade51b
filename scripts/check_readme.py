"""Runs the README's commands as written, in a fresh clone, with few steps: each must exit 0.

    python scripts/check_readme.py [--steps 6] [--json readme_check.json] [--keep DIR] [--only bash|python]

Every ```bash block of README.md is read in order; each `edit-jax ...` / `python -m edit_jax ...`
command (a `&&` chain is split, `\\` continuations joined, comments dropped, optional `[...]`
parts left out, `VAR=value` prefixes passed as its environment) runs in a `git clone` of this
repository's HEAD, with the Python running this script (its edit-jax installation, the clone's
code first on PYTHONPATH). `train` commands get `steps=N` appended (a later override wins):
"runnable as written, with small steps". The demo of README command 1 runs first, as a new user
would. Commands that need what a CPU machine does not
have (GPUs and a cluster: `--distributed`, `srun`; the FineWeb-Edu parquet files and the paper
presets reading them) are listed as skipped with the reason. Prints a table, writes JSON, exits 1
if any command failed. Every ```python block (the Python API) then runs as written, as one
program (`python -c BLOCK`) in the clone, its `steps=` untouched; `--only` runs one kind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = [("--distributed", "needs a cluster"), ("srun", "needs SLURM"), ("fineweb", "needs the FineWeb-Edu files"),
         ("_1b.py", "a paper preset: needs the FineWeb-Edu shards and GPUs"), ("pytest", "the test suite (CI runs it)")]


def readme_commands(text: str) -> list[str]:
    """The edit-jax commands of the README's bash blocks, in order, as single lines."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            for part in line.split("&&"):  # (no README command has && inside quotes)
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                n = 0
                while n < len(words) and re.fullmatch(r"[A-Z_]+=.*", words[n]):  # VAR=value prefixes
                    n += 1
                if words[n:n + 1] == ["edit-jax"] or words[n:n + 3] == ["python", "-m", "edit_jax"]:
                    commands.append(shlex.join(words))
                elif words[n:n + 1] == ["srun"]:
                    commands.append(shlex.join(words))
    return commands


def readme_python_blocks(text: str) -> list[str]:
    """The README's ```python blocks, in order, each a whole program."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def as_run(command: str, steps: int) -> tuple[dict[str, str], list[str]]:
    """The command's ``VAR=value`` prefixes (its environment) and its words with optional [...]
    groups left out and, for train, steps appended."""
    words, out, depth, env = shlex.split(command), [], 0, {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    for w in words:
        if w.startswith("["):
            depth += 1
        if depth == 0:
            out.append(w)
        if w.endswith("]"):
            depth -= 1
    if "train" in out[:4]:
        out.append(f"steps={steps}")
    if out[0] == "edit-jax":
        out = [sys.executable, "-m", "edit_jax"] + out[1:]
    elif out[0] == "python":
        out[0] = sys.executable
    return env, out


def run_one(command: str, run: list[str], cwd: str, env: dict[str, str]) -> dict:
    """Runs one README command (or python block) and returns its row; a failure prints its last lines."""
    t0 = time.perf_counter()
    proc = subprocess.run(run, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    row = {"command": command, "status": "ok" if proc.returncode == 0 else "FAILED", "exit": proc.returncode,
           "seconds": round(time.perf_counter() - t0, 1), "last_line": out[-1][:160] if out else ""}
    print(f"{row['status']:7} {row['seconds']:6.1f} s  {command}", flush=True)
    if proc.returncode != 0:
        print("\n".join("    " + line for line in out[-15:]), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default="readme_check.json")
    parser.add_argument("--keep", default=None, help="clone into this dir (kept) instead of a temporary one")
    parser.add_argument("--only", choices=("bash", "python"), default=None,
                        help="run only the bash commands, or only the python blocks")
    args = parser.parse_args(argv)

    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    commands = readme_commands(text) if args.only != "python" else []
    programs = readme_python_blocks(text) if args.only != "bash" else []
    work = args.keep or tempfile.mkdtemp(prefix="readme_check_")
    clone = os.path.join(work, "clone")
    subprocess.run(["git", "clone", "--quiet", REPO, clone], check=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = clone + os.pathsep + env.get("PYTHONPATH", "")

    rows = []
    for command in commands:
        skip = next((why for key, why in NEEDS if key in command), None)
        if skip:
            rows.append({"command": command, "status": "skipped", "why": skip})
            continue
        extra, run = as_run(command, args.steps)
        rows.append(run_one(command, run, clone, {**env, **extra}))
    for program in programs:
        label = f"python -c <README python block: {program.strip().splitlines()[0][:40]} ...>"
        rows.append(run_one(label, [sys.executable, "-c", program], clone, env))

    print(f"\n| status | s | command |\n|---|---|---|")
    for r in rows:
        print(f"| {r['status']} | {r.get('seconds', '')} | `{r['command']}`{' (' + r['why'] + ')' if 'why' in r else ''} |")
    with open(args.json, "w") as f:
        json.dump({"steps": args.steps, "clone": clone, "rows": rows}, f, indent=1)
    failed = [r for r in rows if r["status"] == "FAILED"]
    print(f"\n{len(rows) - len(failed) - sum(r['status'] == 'skipped' for r in rows)} ok, {len(failed)} failed, "
          f"{sum(r['status'] == 'skipped' for r in rows)} skipped; JSON: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
