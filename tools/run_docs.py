"""Runs the documented CPU commands of every page at tiny size (``check_docs.py --tour DIR --pages``,
tests/test_docs.py), after the README's tour and in its process (one JAX start, one compile cache;
``--skip-tour``: its commands count as run without running, as CI's 3.12 stage does).

Each ```bash command of README.md and docs/**/*.md (``check_docs.bash_commands``) is, in order:
- not run, with the reason, when it needs what CI has not (``NOT_RUN``: a cluster, SLURM, root, a
  download, a GPU preset, several JAX processes; a benchmark's own smoke runs in test_benchmarks.py);
- covered, when a command already run takes its code path: the same command and method, its option
  and override names a subset (``code_path``: a run dir, a prompt or a size changes no path);
- else run through ``edit_jax.cli.main`` as written, its paths moved under DIR/pages and made tiny
  (``TINY``, appended so they win: the tiny model on the 2 x 4 mesh, 6 steps, one sync).
Trains run first, a train that starts from an export (the tour's) last.
"""

from __future__ import annotations

import os
import re
import shlex

from tools.doc_pages import REPO, bash_commands, pages, without_optional

# Documented commands the suite does not run (the first match in the command wins), and why; they are
# still parsed (check_command). Everything else a page shows in a ```bash block runs at tiny size.
NOT_RUN = [("--distributed", "needs a cluster (hosts and a coordinator)"), ("srun", "needs SLURM"),
           ("sudo", "needs root (tc shapes the link)"), ("fineweb", "needs the FineWeb-Edu download"),
           ("_1b.py", "a paper preset: the FineWeb-Edu shards, a GPU (plan --target: the cuda extra, minutes)"),
           ("_7b.py", "a paper preset: plan compiles the 7B model's step kinds (minutes; the tour plans tiny.py)"),
           ("benchmarks/", "a benchmark: tests/test_benchmarks.py runs its --smoke"),
           ("edit-jax worker", "joins the exchange of a running multi-process run: tests/test_elastic.py"),
           ("mesh.processes=", "starts several JAX processes (each its own start and compiles, minutes on 2 cores): "
                               "tests/test_multiprocess.py, test_elastic.py run the launcher at tiny size")]
# What makes a train / plan command tiny (appended, so it wins over the command's own values): the
# tiny model with 3 layers (sync.fragments=4 needs 4 units) on the tour's 2 x 4 mesh (a train from
# an export takes the export's architecture: the tour's tiny.py model, so no model.* there),
# 5 steps with a sync at step 5 (tau 4: sync.fragments=4 must divide it) and no synchronous warm-up
# (its HSDP program would be one more compile; the tour runs HSDP). Sizes, not paths: `SIZE_KEYS`.
TINY = ["model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "mesh.replica=2", "mesh.shard=4", "data.seq_len=32", "batch_size=8"]
TINY_TRAIN = ["steps=5", "sync.warmup_steps=0", "sync.tau=4", "eval_every=0", "eval_batches=1", "log_every=1",
              "checkpoint_every=0", "--no-progress"]
# CI runs the suite under two Pythons (tests/stages.py); the costliest commands are split between
# them so each pays about half and every CI run runs every one: these under 3.12, the rest under
# the default (which keeps the sample of runs/demo with the train that writes it).
STAGE_312 = ("method=diloco", "sync.fragments=")
SIZE_KEYS = {"steps", "batch_size", "sync.tau", "sync.time.tau", "sync.exchange.grace", "sync.warmup_steps",
             "mesh.replica", "mesh.shard", "method", "sync.method"}


def not_run_reason(command: str) -> str | None:
    return next((why for key, why in NOT_RUN if key in command), None)


def code_path(words: list[str]) -> tuple[str, str, frozenset]:
    """What decides the code a command runs: its command, its method (train / plan) and the names of
    its options and non-size overrides (a run dir, a prompt or a size does not change the path)."""
    from edit_jax.config.files import read_config

    names = {w.split("=")[0] for w in words[1:] if w.startswith("--")}
    overrides = [w for w in words[1:] if "=" in w and not w.startswith("-")]
    method = ""
    if words[0] in ("train", "plan"):
        config = words[words.index("--config") + 1] if "--config" in words else None
        method = read_config(config, overrides).sync.method
        names |= {o.split("=")[0] for o in overrides} - SIZE_KEYS
    return words[0], method, frozenset(names)


def page_runs(pages_: list[str]) -> list[dict]:
    """Every ```bash command of the pages, each marked: why it is not run, the command whose code path
    covers it (same command and method, its options a subset), or to run (trains first; a train
    that starts from an export last)."""
    out, seen = [], []
    for page in pages_:
        for command in bash_commands(open(os.path.join(REPO, page)).read()):
            entry = {"page": page, "command": command}
            words = shlex.split(command)
            env = {}
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                env.update([words.pop(0).split("=", 1)])
            why = not_run_reason(command)
            if why is None and not (words[:1] == ["edit-jax"] or words[:3] == ["python", "-m", "edit_jax"]):
                why = "not an edit-jax command"
            if why:
                out.append({**entry, "not_run": why})
                continue
            words = without_optional(words[3:] if words[0] == "python" else words[1:])
            sub, method, names = code_path(words)
            by = next((s for s in seen if s["path"][:2] == (sub, method) and names <= s["path"][2]), None)
            if by:
                out.append({**entry, "covered_by": by["command"]})
                continue
            run = {**entry, "argv": words, "env": env, "path": (sub, method, names)}
            seen.append(run)
            out.append(run)
    order = [r for r in out if "argv" in r]
    order.sort(key=lambda r: 2 if any(w.startswith("model.init_from=") for w in r["argv"]) else r["argv"][0] != "train")
    return order + [r for r in out if "argv" not in r]


def stage_of(command: str) -> str:
    return "3.12" if any(key in command for key in STAGE_312) else "default"


def run_pages(work: str, tour: dict, stage: str = "both") -> dict:
    """Runs every page command that `page_runs` keeps (after the tour, in this process: the tour's
    commands count as run), its paths moved under ``work``, made tiny (``TINY``); returns each
    command's exit code and seconds, and which commands were only parsed and why. ``stage``
    ("default", "3.12" or "both"): only that stage's commands run, the others are listed."""
    import time

    from edit_jax import cli

    tour_paths = [code_path(c["argv"]) for c in tour["commands"].values()]
    moved = {"exports/demo": os.path.join(work, "export")}  # the tour's export (of the tiny model)

    def local(w):
        if w in moved:
            return moved[w]
        if w.startswith(("runs/", "plots/", "exports/")) or re.fullmatch(r"[\w.-]+\.(json|png)", w):
            return os.path.join(work, "pages", w)  # a run dir, a plot, an export, plan.json, place.json
        return w

    result = {"ran": [], "covered": [], "not_run": [], "other_stage": []}
    for r in page_runs(pages()):
        if "not_run" in r:
            result["not_run"].append(r)
            continue
        if "covered_by" in r:
            result["covered"].append(r)
            continue
        if any(r["path"][:2] == p[:2] and r["path"][2] <= p[2] for p in tour_paths):
            result["covered"].append({**r, "covered_by": "the README tour", "path": None, "argv": None})
            continue
        if stage not in ("both", stage_of(r["command"])):
            result["other_stage"].append({**r, "stage": stage_of(r["command"])})
            continue
        argv = [local(w) for w in r["argv"]]
        argv = [w if "=" not in w or w.startswith("-") or not w.split("=", 1)[1].startswith(("runs/", "exports/"))
                else w.split("=")[0] + "=" + local(w.split("=", 1)[1]) for w in argv]
        tiny = [w for w in TINY if not (w.startswith("model.") and any("init_from=" in a for a in argv))]
        argv += (tiny + TINY_TRAIN) if argv[0] == "train" else tiny if argv[0] == "plan" else \
            ["--max-tokens", "4"] if argv[0] == "sample" else \
            ["--evaluations", "200", "--population", "20"] if argv[0] == "placement" else []
        saved = {k: os.environ.get(k) for k in r["env"]}
        os.environ.update(r["env"])
        t0 = time.perf_counter()
        try:
            code = cli.main(argv)
        finally:
            for k, v in saved.items():  # WANDB_MODE=offline and the like: for this command only
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        result["ran"].append({"page": r["page"], "command": r["command"], "argv": argv, "exit": code,
                              "seconds": round(time.perf_counter() - t0, 1)})
    for r in result["covered"] + result["not_run"] + result["other_stage"]:
        r.pop("path", None), r.pop("argv", None), r.pop("env", None)
    return result
