"""The docs' pages and their commands, as text: which pages there are and the commands of their
```bash blocks. Read by ``check_docs.py`` (the static checks) and ``run_docs.py`` (running the
commands), which import it and not each other."""

from __future__ import annotations

import glob
import os
import re
import shlex

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pages() -> list[str]:
    """README.md and every Markdown page of the site, repository-relative."""
    found = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                                                recursive=True))
    return found


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def spans(text: str) -> list[str]:
    """Inline code spans of the prose."""
    return re.findall(r"`([^`\n]+)`", prose(text))


def bash_commands(text: str) -> list[str]:
    """The edit-jax / python commands of the page's ```bash blocks, in order, one line each."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            for part in line.split("&&"):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                n = 0
                while n < len(words) and re.fullmatch(r"[A-Z_]+=.*", words[n]):  # VAR=value prefixes
                    n += 1
                w = words[n:]
                if w[:1] in (["edit-jax"], ["srun"], ["sudo"]) or w[:3] == ["python", "-m", "edit_jax"] or \
                        (w[:1] == ["python"] and len(w) > 1 and w[1].endswith(".py")):
                    commands.append(shlex.join(words))
    return commands


def without_optional(words: list[str]) -> list[str]:
    """Words with optional ``[...]`` groups left out."""
    out, depth = [], 0
    for w in words:
        if w.startswith("["):
            depth += 1
        if depth == 0:
            out.append(w)
        if w.endswith("]") and depth:
            depth -= 1
    return out
