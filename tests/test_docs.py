"""The docs against the code (tools/check_docs.py, tools/gen_docs.py), and the documented CPU commands run.

Static: every page's paths, modules, config keys and commands (each parsed by its own argparse);
the generated reference pages are current; the config page lists exactly the dataclasses' fields.
Run: the README's tour at tiny size, in this process, sharing one run dir: `train` (configs/tiny.py,
2 steps), the same command again with more steps (a resume), `sample`, `plot`, `plan`, `export`;
every record key the run wrote is documented in docs/reference/records.md. The other documented
commands (GPUs, clusters, the paper presets, multi-process runs) are checked statically only.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import child_xla_flags
from tools import check_docs, gen_docs


def test_every_page_names_real_paths_modules_keys_and_commands():
    assert check_docs.check_all() == []


def test_checker_catches_what_it_should():
    keys = check_docs.config_keys()
    assert check_docs.check_key("sync.taux=3", keys) and check_docs.check_key("sync.tau=3", keys) is None
    assert check_docs.check_path("edit_jax/nope.py") and check_docs.check_path("localsgd/methods.py") is None
    assert check_docs.check_module("edit_jax.localsgd.nope") and check_docs.check_module("edit_jax.localsgd.api") is None
    assert "unrecognized" in check_docs.check_command("edit-jax train --config configs/tiny.py --bogus")
    assert "unknown config key" in check_docs.check_command("edit-jax train sync.taux=3")
    assert check_docs.check_command("edit-jax export --run-dir r --out o [--step K]") is None


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES))
def test_generated_reference_pages_are_current(page):
    with open(os.path.join(gen_docs.OUT, page)) as f:
        assert f.read() == gen_docs.PAGES[page](), f"run python tools/gen_docs.py ({page} is stale)"


def test_config_page_lists_every_field_of_the_dataclasses():
    with open(os.path.join(gen_docs.OUT, "config.md")) as f:
        listed = re.findall(r"^\| `([a-z0-9_.]+)` \|", f.read(), flags=re.M)
    assert sorted(listed) == sorted(key for key, *_ in gen_docs.config_fields())
    assert len(listed) == len(set(listed))


def test_readme_lists_what_export_writes():
    from edit_jax.hf.export import WRITTEN

    with open(os.path.join(check_docs.REPO, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200
    assert [name for name in WRITTEN if f"`{name}`" not in readme] == []


def test_readme_tour_runs_at_tiny_size(tmp_path):
    """The README's own commands (train, the same again as a resume, sample, plot, export, plan),
    their paths moved under tmp_path, small sizes appended, in one CLI process of their own (the CLI
    sets its own CPU device count, which this process's 64 devices would contradict)."""
    env = {**os.environ, "XLA_FLAGS": child_xla_flags(), "PYTHONPATH": check_docs.REPO}
    proc = subprocess.run([sys.executable, "-m", "tools.check_docs", "--tour", str(tmp_path)], cwd=check_docs.REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("TOUR ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    tour = json.loads(line[5:])
    assert {name: c["exit"] for name, c in tour["commands"].items()} == dict.fromkeys(
        ("train", "resume", "sample", "plot", "export", "plan"), 0), tour["commands"]
    assert tour["last_step"] == 4  # the second train resumed the first's run dir to steps=4
    assert sorted(set(tour["record_keys"]) - gen_docs.record_keys()) == [], "document them in tools/gen_docs.py RECORDS"
    from edit_jax.hf.export import WRITTEN

    assert tour["exported"] == sorted(WRITTEN) and tour["plot_bytes"] > 1000 and tour["plan_fits"] is True
