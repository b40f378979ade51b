"""The docs against the code (tools/check_docs.py, tools/gen_docs.py), and the documented CPU commands run.

Static: every page's paths, modules, config keys and commands (each parsed by its own argparse);
the generated reference pages are current; the config page lists exactly the dataclasses' fields.
Run, in one process of its own: the README's tour at tiny size (CI's default stage), sharing one run dir: `train`
(configs/tiny.py, 2 steps), the same command again with more steps (a resume), `sample`, `plot`,
`plan`, `export`; every record key the run wrote is documented in docs/reference/records.md. Then
every other page's CPU commands at tiny size, one per code path (tools/run_docs.py); the rest (GPUs,
clusters, the paper presets, downloads, multi-process runs, benchmarks) are parsed only, each with
its reason, and the test prints which is which.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import child_xla_flags
from tests.stages import one_stage, runs_here
from tools import check_docs, gen_docs


def test_every_page_names_real_paths_modules_keys_and_commands():
    assert check_docs.check_all() == []


def test_checker_catches_what_it_should():
    keys = check_docs.config_keys()
    assert check_docs.check_key("sync.taux=3", keys) and check_docs.check_key("sync.tau=3", keys) is None
    assert check_docs.check_path("edit_jax/nope.py") and check_docs.check_path("localsgd/methods.py") is None
    assert (check_docs.check_module("edit_jax.localsgd.nope")
            and check_docs.check_module("edit_jax.localsgd.api") is None)
    assert "unrecognized" in check_docs.check_command("edit-jax train --config configs/tiny.py --bogus")
    assert "unknown config key" in check_docs.check_command("edit-jax train sync.taux=3")
    assert check_docs.check_command("edit-jax export --run-dir r --out o [--step K]") is None


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES))
def test_generated_reference_pages_are_current(page):
    with open(os.path.join(gen_docs.OUT, page)) as f:
        assert f.read() == gen_docs.PAGES[page](), f"run python tools/gen_docs.py ({page} is stale)"


def test_config_page_lists_every_field_of_the_dataclasses():
    from edit_jax.config.renames import RENAMED

    with open(os.path.join(gen_docs.OUT, "config.md")) as f:
        fields, moved = f.read().split("\n## Keys that moved into a section\n")
    listed = re.findall(r"^\| `([a-z0-9_.]+)` \|", fields, flags=re.M)
    assert sorted(listed) == sorted(key for key, *_ in gen_docs.config_fields())
    assert len(listed) == len(set(listed))
    assert dict(re.findall(r"^\| `([a-z0-9_.]+)` \| `([a-z0-9_.]+)` \|", moved, flags=re.M)) == RENAMED


def test_readme_lists_what_export_writes():
    from edit_jax.hf.export import WRITTEN

    with open(os.path.join(check_docs.REPO, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200
    assert [name for name in WRITTEN if f"`{name}`" not in readme] == []


@pytest.fixture(scope="module")
def tour_and_pages(tmp_path_factory):
    """The README's tour, then every other page's CPU commands (tools/run_docs.py), in one CLI process of
    their own (the CLI sets its own CPU device count, which this process's 64 devices would contradict)."""
    work = tmp_path_factory.mktemp("tour")
    env = {**os.environ, "XLA_FLAGS": child_xla_flags(), "PYTHONPATH": check_docs.REPO}
    stage = "both" if runs_here("default") and runs_here("3.12") else "3.12" if runs_here("3.12") else "default"
    # The tour runs in the default stage only (test_readme_tour_runs_at_tiny_size); the 3.12 stage runs
    # its share of the pages without it (their "covered by the README tour" still read from its commands).
    skip = ["--skip-tour"] if stage == "3.12" else []
    proc = subprocess.run([sys.executable, "-m", "tools.check_docs", "--tour", str(work), "--pages", "--stage", stage,
                           *skip], cwd=check_docs.REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
             if line.startswith(("TOUR ", "PAGES "))}
    return proc, lines


def test_readme_tour_runs_at_tiny_size(tour_and_pages):
    """The README's own commands (train, the same again as a resume, sample, plot, export, plan),
    their paths moved under a temporary dir, small sizes appended. Under the default Python only:
    what it runs does not depend on the jax version more than the suite's own train, resume, sample,
    export and plan tests, which run in both stages; the 3.12 stage runs its share of the other
    pages' commands (DiLoCo, streamed and compressed sync) without it."""
    one_stage("default", "the README tour", 25, other="test_every_page_command_runs_or_says_why_not's 3.12 share")
    proc, lines = tour_and_pages
    assert "TOUR" in lines, proc.stderr[-3000:]
    tour = lines["TOUR"]
    assert {name: c["exit"] for name, c in tour["commands"].items()} == dict.fromkeys(
        ("train", "resume", "sample", "plot", "export", "plan"), 0), tour["commands"]
    assert tour["last_step"] == 4  # the second train resumed the first's run dir to steps=4
    assert sorted(set(tour["record_keys"]) - gen_docs.record_keys()) == [], "document them in tools/gen_docs.py RECORDS"
    from edit_jax.hf.export import WRITTEN

    assert tour["exported"] == sorted(WRITTEN) and tour["plot_bytes"] > 1000 and tour["plan_fits"] is True


def test_every_page_command_runs_or_says_why_not(tour_and_pages):
    """Every ```bash command of every page: run at tiny size (exit 0), covered by one that ran (the
    same code path), or not run for a stated reason (a cluster, SLURM, root, a download, a GPU
    preset, several processes, a benchmark). Prints which is which (pytest -s, or on failure)."""
    proc, lines = tour_and_pages
    assert proc.returncode == 0 and "PAGES" in lines, proc.stderr[-3000:]
    pages = lines["PAGES"]
    report = ["ran:"] + [f"  exit {r['exit']} {r['seconds']:5.1f} s  {r['page']}: {r['command']}" for r in pages["ran"]]
    report += ["covered:"] + [f"  {r['page']}: {r['command']}  <- {r['covered_by']}" for r in pages["covered"]]
    report += ["parsed only:"] + [f"  {r['page']}: {r['command']}  ({r['not_run']})" for r in pages["not_run"]]
    report += ["run under the other Python (tests/stages.py):"] + [
        f"  {r['page']}: {r['command']}  (Python stage {r['stage']})" for r in pages["other_stage"]]
    print("\n".join(report))
    listed = sorted((r["page"], r["command"]) for part in pages.values() for r in part)
    assert listed == sorted((p, c) for p in check_docs.pages() for c in check_docs.bash_commands(
        open(os.path.join(check_docs.REPO, p)).read())), "every command is accounted for once"
    assert [r["command"] for r in pages["ran"] if r["exit"] != 0] == [], "\n".join(report) + proc.stderr[-3000:]
    ran = {(r["argv"][0], next((w.split("=")[0] if w.startswith("model.") else w for w in r["argv"]
                                if w.startswith(("method=", "sync.f", "model.init_from="))), "")) for r in pages["ran"]}
    if runs_here("default"):  # EDiT, sampling options, placement, a train from an export
        assert {("train", ""), ("sample", ""), ("placement", ""), ("train", "model.init_from")} <= ran, ran
    if runs_here("3.12"):  # DiLoCo, streamed and compressed sync
        assert {("train", "method=diloco"), ("train", "sync.fragments=4")} <= ran, ran
