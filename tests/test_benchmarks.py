"""Every benchmark runs (``benchmarks/``): each module imports without side effects and parses its
arguments, and its ``--smoke`` run (tiny sizes) runs here, in this process (one JAX start for the
in-process ones), writing its JSON stamped by the harness; the costliest run under one of CI's two
Python stages each. Benches and tools reach edit_jax through public names only, and monkeypatch
nothing of it. Also: the repo's .gitignore covers what the documented commands create."""

import ast
import glob
import importlib
import json
import os
import re
import subprocess

import numpy as np
import pytest

from tests.helpers import REPO
from tests.stages import one_stage

BENCHES = ("bench_compile", "bench_data", "bench_edit", "codec_roundtrip", "bench_faults", "bench_gpu", "bench_kill",
           "bench_late_posts", "bench_links", "bench_live", "bench_outages", "bench_sample",
           "bench_sparse_wire", "bench_spike", "bench_step", "bench_straggler", "compare_methods", "plan_presets",
           "pool_live", "reproduce_placement", "spike_experiment")
# Every bench's `--smoke` runs here, in this process (one JAX start for the in-process ones; the
# kill, spike and straggler benches time `edit-jax train` processes, so theirs start processes).
SMOKE = ("bench_step", "bench_faults", "bench_sample", "plan_presets", "reproduce_placement", "bench_edit",
         "bench_data", "bench_gpu", "spike_experiment", "bench_kill", "bench_spike", "bench_straggler", "bench_links",
         "bench_sparse_wire", "bench_late_posts", "bench_live", "compare_methods", "codec_roundtrip", "bench_compile")


def _module(name):
    return importlib.import_module(f"benchmarks.{name}")


def test_every_bench_is_a_module_with_a_main():
    names = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "benchmarks"))
                   if f.endswith(".py") and f not in ("__init__.py", "harness.py"))
    assert names == sorted(BENCHES)  # a new bench joins this list (and SMOKE when it can)
    for name in set(BENCHES) - {"bench_kill", "bench_spike", "bench_live"}:
        main = _module(name).main
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0, name
    for name in ("bench_kill", "bench_spike", "bench_live"):  # parts of bench_faults: its --help covers them
        assert callable(getattr(_module(name), "part_" + name.split("_")[1]))


def test_bench_gpu_plans_its_configs():
    gpu = _module("bench_gpu")
    a = gpu._args(["--smoke"])  # the bench's own helpers, not the library's
    cfg = gpu._config(a, "xla")
    assert (a.platform, cfg.model.attention, cfg.mesh.replica, cfg.batch_size) == ("cpu", "xla", 2, 4)
    assert cfg.sync.method == "edit" and cfg.sync.tau == 1


# CI (.ci/run) runs this file twice, under the default Python and under 3.12; each smoke runs in one
# of the two stages (~ CPU s on the loaded 2-core box at tiny sizes), so every CI run runs every bench
# once and each stage pays about half. plan_presets and reproduce_placement (seconds) run in both.
# EDIT_JAX_ALL_SMOKES=1 (or EDIT_JAX_BOTH_STAGES=1, tests/stages.py) runs all of them under any Python.
ONE_STAGE = {"bench_straggler": ("default", 70), "spike_experiment": ("default", 21), "bench_step": ("default", 13),
             "bench_sample": ("default", 9), "bench_gpu": ("default", 10), "bench_kill": ("3.12", 58),
             "bench_spike": ("3.12", 16), "bench_edit": ("3.12", 21), "bench_faults": ("3.12", 9),
             "bench_data": ("3.12", 13), "bench_links": ("default", 17), "bench_sparse_wire": ("default", 20),
             "bench_late_posts": ("default", 25), "bench_live": ("default", 75), "compare_methods": ("3.12", 21),
             "codec_roundtrip": ("3.12", 10), "bench_compile": ("default", 40)}


def _stage_skip(name: str) -> None:
    stage, cpu_s = ONE_STAGE.get(name, (None, 0))
    if stage is not None:
        one_stage(stage, f"{name}'s smoke", cpu_s)


# run as bench_faults.py --part kill|spike
PART_OF = {"bench_kill": "bench_faults", "bench_spike": "bench_faults", "bench_live": "bench_faults"}


def _json_path(tmp_path, name):
    return str(tmp_path / f"{name}.json")


@pytest.mark.parametrize("name", SMOKE)
def test_bench_smoke(name, tmp_path, monkeypatch, capsys):
    _stage_skip(name)
    monkeypatch.chdir(REPO)  # configs/... as the docs' commands name them
    out = _json_path(tmp_path, name)
    runs = str(tmp_path / "runs")
    argv = {"bench_sample": ["--smoke", "--out", out],
            "reproduce_placement": ["--smoke", "--out-dir", str(tmp_path)],
            "spike_experiment": ["--smoke", "--out-dir", str(tmp_path)],
            "compare_methods": ["--smoke", "--run-root", str(tmp_path)],
            "bench_faults": ["--smoke", "--json", out, "--run-root", runs],
            "bench_kill": ["--smoke", "--part", "kill", "--json", out, "--run-root", runs],
            "bench_spike": ["--smoke", "--part", "spike", "--json", out, "--run-root", runs],
            "bench_live": ["--smoke", "--part", "live", "--json", out, "--run-root", runs],
            "bench_straggler": ["--smoke", "--json", out, "--run-root", runs],
            "bench_data": ["--smoke", "--json", out, "--work-dir", str(tmp_path / "work")]}.get(
        name, ["--smoke", "--json", out])
    code = _module(PART_OF.get(name, name)).main(argv)
    assert code in (None, 0) or isinstance(code, (dict, list)), code
    path = os.path.join(str(tmp_path), "results.json") if name in ("reproduce_placement", "spike_experiment",
                                                                  "compare_methods") else out
    with open(path) as f:
        result = json.load(f)
    env = result.get("env") or {}
    if name != "reproduce_placement":  # the harness's stamp
        assert {"git_commit", "jax", "flax", "optax", "python", "machine", "cpu_model"} <= set(env), name
    if name == "bench_faults":  # the loop's own timings (train(on_timing=)): saves and steps seen
        assert result["save"]["async"]["saves"] == 2 and result["save"]["sync"]["saves"] == 2
        assert result["save"]["async"]["normal_median_s"] > 0
    if name == "codec_roundtrip":  # the candidate within issue 59's bounds; the shipped topk2's outlier error beside
        table = result["table"]
        for chunks in ("one outlier in 1e-3 noise", "10 nonzeros (< k)", "at topk2's level boundary",
                       "Student-t, 1.5 d.o.f. (7 seeds)"):
            assert max(table[chunks][f"topk{b} candidate"]["one_round_worst"] for b in (2, 4)) <= 0.5, chunks
        assert table["one outlier in 1e-3 noise"]["topk2"]["one_round_worst"] > 3.5
    if name == "bench_compile":  # every program of the run, compiled one by one and side by side
        (one,), (side,) = result["runs"]["one_by_one"], result["runs"]["side_by_side"]
        programs = {"step hsdp", "evaluation", "save report", "save checksums"}  # (the smoke: tiny's baseline)
        assert set(one["seconds"]) == set(side["seconds"]) == programs
        assert 0 < result["longest_s"] <= result["sum_s"] and result["side_by_side_s"] > 0
    if name == "bench_step":  # the one-program experiment over the public StepPrograms.local_step
        assert {"mesh/local", "mesh/one:local"} <= set(result["kinds"])
    if name == "bench_live":  # both runs ended by SIGTERM (130), one kill restarted, the joiner joined
        live = result["live"]
        assert live["fault_free"]["exit"] == live["live"]["exit"] == {"launcher": 130, "hand": 130}
        kills = [f for f in live["live"]["faults"] if f["event"] == "kill"]
        assert len(kills) == 1 and kills[0]["restart_s"] is not None
        join = next(f for f in live["live"]["faults"] if f["event"] == "join")  # its catch-up, from its record
        assert join["catch_up_s"] >= join["read_s"] > 0 and join["replayed"] >= 0
        assert live["live"]["tokens"] > 0 and live["states"]["live"]["read_state_s"] > 0
        assert "rel_diff_fit" in live["states"]  # (None where a run published under 3 rounds)
        assert os.path.exists(live["figure"])
    if name == "bench_late_posts":  # both policies ran to the budget, every worker exit 0
        assert [r["policy"] for r in result["runs"]] == ["carry", "drop"]
        assert all(set(r["codes"].values()) == {0} and r["tally"] > 0 for r in result["runs"])
    if name == "bench_kill":  # one SIGKILL, the launcher's restart seen, the same losses as without it
        kill = result["kill"]
        assert (kill["fault_free"]["exit"], kill["faulty"]["exit"], len(kill["faults"])) == (0, 0, 1), kill
        assert kill["faults"][0]["restart"] == 1 and kill["losses_equal"] and kill["kill_to_next_step_s"]
    if name == "bench_spike":  # the spiked run rolled back (the smoke leaves out lr=1e6's exit 3 and its rerun:
        mode = result["spike"]["1 process"]  # test_spike.py::test_blown_up_run_exits_3_and_a_sane_rerun_...)
        assert mode["spiked"]["rollbacks"] and mode["clean"]["exit"] == mode["spiked"]["exit"] == 0
        assert "blown" not in mode and "rerun" not in mode
    if name == "bench_straggler":  # both summaries: lock-step (EDiT) and per-worker records (A-EDiT)
        assert [r["name"] for r in result["runs"]] == ["edit", "a_edit_straggler"]
        assert all(r["tokens_per_s"] > 0 and r["syncs"] > 0 for r in result["runs"])
    if name == "spike_experiment":
        assert len(result["runs"]) == 3 and result["noise"]["twin"] is not None
        assert "excess_max" in result["runs"][2]["summary"]
    if name == "bench_links":  # (no root here: plan's bytes per step kind, the prediction's input)
        assert result["replica_bytes_per_kind"]["edit_t8"]["sync_forward"] > 0
    if name == "bench_sparse_wire":
        assert result["rows"]["topk2"]["sync_step_s"] > 0 and result["codec_s"]["topk2"] > 0
    if name == "compare_methods":  # the sweep picked EDiT's one setting; both final runs trained and were tabled
        assert [r["name"] for r in result["sweep"]] == ["sweep_edit_lr0.5_m0.5"]
        assert [r["method"] for r in result["rows"]] == ["baseline", "edit"] and result["best"] == {
            "edit": {"outer_lr": 0.5, "outer_momentum": 0.5}}
        assert all(r["tokens"] > 0 and 0 < r["val_loss"] < 10 for r in result["final"])
        assert list(result["checks"]) == ["edit within 1% of baseline (or better)"]  # the one both methods allow
        assert os.path.getsize(os.path.join(str(tmp_path), "compare_methods.png")) > 1000
    if name == "bench_data":
        assert [r["ok"] for r in result["runs"]] == [True]


def test_live_abba_ratio_by_hand():
    """bench_live --abba: the ratio of the two live runs' mean to the two fault-free runs' mean (a
    linear drift of the machine cancels), by hand."""
    from benchmarks.bench_live import abba

    runs = {"fault_free": 100.0, "live": 90.0, "live_b": 80.0, "fault_free_b": 80.0}
    got = abba({n: {"tokens_per_s_window": v} for n, v in runs.items()})
    assert got["ratio"] == pytest.approx(85 / 90) and got["fault_free_drift"] == pytest.approx(0.8)
    assert (got["ratio_first_pair"], got["ratio_second_pair"]) == (pytest.approx(0.9), pytest.approx(1.0))


def test_live_fitted_val_loss_by_hand():
    """bench_live's val loss at equal tokens from a line: exact on points of a line, only the
    FIT_ROUNDS rounds nearest the tally in the fit (before it or, in a run that went on, after it),
    None under 3 rounds."""
    from benchmarks.bench_live import FIT_ROUNDS, fitted_val_loss

    on_line = [[r, 1000 * r, 3.0 - 0.0001 * 1000 * r] for r in range(1, FIT_ROUNDS + 1)]
    outliers = [[0, -1000, 50.0]] * 5  # older rounds far off the line: outside the fit
    assert fitted_val_loss(outliers + on_line, 12345.0) == pytest.approx(3.0 - 1.2345)
    later = [[FIT_ROUNDS + i, 10 ** 6 * i, 50.0] for i in range(1, 6)]  # a longer run's later rounds, off the line
    assert fitted_val_loss(on_line + later, 12345.0) == pytest.approx(3.0 - 1.2345)
    assert fitted_val_loss(on_line[:2], 100.0) is None


def test_live_abba_val_loss_by_hand():
    """bench_live --abba's val loss: every run's line read at the smallest last tally of the four;
    the live runs' mean against the fault-free runs' mean, and each kind's two runs apart."""
    from benchmarks.bench_live import abba_val_loss

    def line(level, last):  # val loss = level - 1e-5 * tally, rounds up to tally `last`
        return [[r, t, level - 1e-5 * t] for r, t in enumerate(range(last - 9000, last + 1, 1000), 1)]
    states = {"fault_free": {"kept": line(3.0, 20000)}, "live": {"kept": line(3.3, 18000)}}
    states_b = {"fault_free": {"kept": line(2.8, 21000)}, "live": {"kept": line(3.1, 19000)}}
    got = abba_val_loss(states, states_b)  # at tally 18,000: 2.82, 3.12, 2.92, 2.62
    assert got["tally"] == 18000
    assert got["rel_diff_of_means"] == pytest.approx((3.12 + 2.92) / (2.82 + 2.62) - 1)
    assert got["fault_free_apart"] == pytest.approx(2.62 / 2.82 - 1)
    assert got["live_apart"] == pytest.approx(2.92 / 3.12 - 1)
    assert abba_val_loss({**states, "live": {"kept": line(3.3, 18000)[:2]}}, states_b) is None


def test_pool_live_t_quantile_against_the_t_density():
    """pool_live's 95% t quantile, integrated back: the t density over [-q, q] holds 0.95 (NumPy,
    trapezoids), whole and Welch-like fractional degrees of freedom alike."""
    from math import exp, lgamma, pi, sqrt

    from benchmarks.pool_live import t95, t975

    for df in (1, 2, 3, 4.4, 6, 9.5, 17, 45, 200, 1000):
        for quantile, mass in ((t975, 0.95), (t95, 0.90)):  # t95: one-sided 95%, so two-sided 90%
            q = quantile(df)
            x = np.linspace(-q, q, 400001)
            dens = exp(lgamma((df + 1) / 2) - lgamma(df / 2)) / sqrt(df * pi) * (1 + x * x / df) ** (-(df + 1) / 2)
            assert np.trapezoid(dens, x) == pytest.approx(mass, abs=1.5e-3), (df, mass)
    with pytest.raises(ValueError, match="df 0.5 < 1"):
        t975(0.5)


def test_pool_live_by_hand(tmp_path):
    """Two ABBA runs of one setting pooled: every run's line read at the group's smallest last tally;
    fault-free at 2.0 / 2.2, live at 2.1 / 2.3 in each: live / fault-free of the means 2.2 / 2.1, its
    Welch interval (df 6 here: equal scatter, 4 runs each) by hand; goodput's t interval by hand; a
    run of another setting is its own group; a JSON that is not an ABBA run is refused by name."""
    from benchmarks.pool_live import load, main

    def line(level, last):  # val loss = level + 1e-6 * (tally - 20,000): level at tally 20,000
        return [[r, t, level + 1e-6 * (t - 20000)] for r, t in enumerate(range(last - 9000, last + 1, 1000), 1)]

    def abba(ratio, levels, lasts, carried_weight=0.5):
        st = {n: {"kept": line(v, t)} for n, v, t in zip(("fault_free", "live"), levels[:2], lasts[:2], strict=True)}
        sb = {n: {"kept": line(v, t)} for n, v, t in zip(("live", "fault_free"), levels[2:], lasts[2:], strict=True)}
        return {"env": {"git_commit": "abc1234def", "date_utc": "2026-11-28T00:00:00Z"},
                "args": {"abba": True, "kill_config": "configs/tiny.py", "live_workers": 4, "tau_time": 5.0,
                         "grace": 3.0, "mtbf": 30.0, "duration": 600.0, "stop_s": 60.0, "progress_every": 1.0,
                         "carried_weight": carried_weight},
                "live": {"abba": {"ratio": ratio, "ratio_first_pair": ratio, "ratio_second_pair": ratio},
                         "states": st, "states_b": sb}}

    files = []
    for i, doc in enumerate([abba(0.96, [2.0, 2.1, 2.3, 2.2], [21000, 20000, 22000, 23000]),
                             abba(0.98, [2.2, 2.3, 2.1, 2.0], [24000, 21000, 20500, 22000]),
                             abba(0.90, [2.0, 2.0, 2.0, 2.0], [20000] * 4, carried_weight=1.0),
                             {"env": {}, "args": {"abba": False}, "live": {}}]):
        files.append(str(tmp_path / f"run{i}.json"))
        with open(files[-1], "w") as f:
            json.dump(doc, f)
    out = tmp_path / "pool.json"
    assert main(files + ["--json", str(out)]) == 0
    with pytest.raises(ValueError, match="not an ABBA run"):
        load(files[3])
    short = abba(0.96, [2.0, 2.1, 2.3, 2.2], [21000, 20000, 22000, 23000])
    del short["live"]["abba"]["ratio"]
    (tmp_path / "short.json").write_text(json.dumps(short))
    with pytest.raises(ValueError, match="no field 'ratio'"):
        load(str(tmp_path / "short.json"))
    half, full = json.loads(out.read_text())["groups"]
    assert half["setting"]["carried_weight"] == 0.5 and full["setting"]["carried_weight"] == 1.0
    assert [r["goodput"] for r in half["runs"]] == [0.96, 0.98] and len(full["runs"]) == 1
    vl = half["val_loss"]
    assert vl["tally"] == 20000
    assert [r["fit"]["fault_free"] for r in half["runs"]] == pytest.approx([2.0, 2.2])
    assert [r["fit"]["live_b"] for r in half["runs"]] == pytest.approx([2.3, 2.1])
    assert vl["rel_diff"] == pytest.approx(2.2 / 2.1 - 1)
    se = (2 * (4 * 0.1 ** 2 / 3) / 4) ** 0.5  # each kind: 2.0, 2.2, 2.0, 2.2 (or +0.1), sample variance 0.04 / 3
    assert vl["welch_df"] == pytest.approx(6.0)
    assert vl["ci95"] == pytest.approx([2.2 / 2.1 - 1 - 2.447 * se / 2.1, 2.2 / 2.1 - 1 + 2.447 * se / 2.1], abs=1e-4)
    assert vl["upper95"] == pytest.approx(2.2 / 2.1 - 1 + 1.943 * se / 2.1, abs=1e-4)  # t 0.95 quantile, df 6
    assert [r["loss_rel_diff_of_means"] for r in half["runs"]] == pytest.approx([4.4 / 4.2 - 1, 4.4 / 4.2 - 1])
    gp = half["goodput"]
    assert gp["mean"] == pytest.approx(0.97) and gp["runs_at_target"] == 2
    assert gp["ci95"] == pytest.approx([0.97 - 12.706 * 0.01, 0.97 + 12.706 * 0.01], abs=1e-4)  # sd 0.01414 / sqrt 2
    assert gp["lower95"] == pytest.approx(0.97 - 6.314 * 0.01, abs=1e-4)
    assert vl["rel_sd_per_run"] == pytest.approx((0.04 / 3) ** 0.5 / 2.1)  # 5.50%: 2 (1.96 x 5.50)^2 = 232.3
    assert vl["runs_for_target"] == 233


def test_live_fault_rows_by_hand():
    """bench_live's per-kill rows: a worker killed after its post, before that round closed, misses
    the next round and is back when it posts again; one killed just after a round closed that posts
    in time for the next misses none (it used to be matched to a round without it much later)."""
    from benchmarks.bench_live import analyse

    members = {1: [0, 1], 2: [0, 1], 3: [0], 4: [0, 1], 5: [0, 1], 6: [0, 1], 7: [0]}
    manifests = [{"round": r, "close": 10.0 * r, "members": m, "expected": [0, 1], "closed_by": "all posted"}
                 for r, m in members.items()]
    posts = {(r, w): 10.0 * r - (5.0 if (r, w) == (5, 1) else 1.0) for r, m in members.items() for w in m}
    events = [{"event": "origin", "at": 1.0}, {"event": "kill", "slot": 1, "at": 19.5},
              {"event": "kill", "slot": 1, "at": 40.5}, {"event": "end", "at": 100.0, "exit": {"launcher": 0}}]
    out = analyse(0.0, events, manifests, [], posts, [], 256, 15.0)
    after_post, after_close = out["faults"]
    assert (after_post["round_without"], after_post["round_back"]) == (3, 4)
    assert after_post["to_round_without_s"] == pytest.approx(10.5)
    assert (after_close["round_without"], after_close["round_back"]) == (None, 5)
    assert after_close["to_member_s"] == pytest.approx(9.5)


def test_committed_results_hold_no_path_of_the_machine_they_ran_on():
    """Results under docs/ give run roots and outputs relative to the repository (runs/..., docs/...):
    an absolute path says nothing to another reader and leaks the machine's layout.
    (tests/fixtures/ are checkpoints as Orbax wrote them, paths included: they stay byte for byte.)"""
    absolute = re.compile(r"(?<![\w.~$-])/(?:tmp|root|home|work|var|opt|mnt|Users|private)/")
    found = {}
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "*.json"))):
        with open(path) as f:
            hits = absolute.findall(f.read())
        if hits:
            found[os.path.basename(path)] = len(hits)
    assert found == {}, found
    from benchmarks.harness import repo_relative

    assert repo_relative({"a": [os.path.join(REPO, "docs", "x.json"), "/tmp/y"]}) == {"a": ["docs/x.json", "/tmp/y"]}


def test_gitignore_covers_what_the_commands_create():
    made = ["runs/demo/metrics.jsonl", "runs/demo/compile_cache/x", "plots/compare.png", "data/shards/index.json",
            "exports/demo/edit_jax_export.json", "plan.json", "plan_h100.json", "site/index.html",
            "mydir/edit_jax_export.json"]
    kept = ["benchmarks/harness.py", "docs/bench_faults_kill.json", "configs/demo.py"]
    proc = subprocess.run(["git", "-C", REPO, "check-ignore", "--no-index", *made, *kept], capture_output=True,
                          text=True)
    assert proc.returncode in (0, 1), proc.stderr  # 128: not a git checkout (then nothing to check)
    assert sorted(proc.stdout.split()) == sorted(made)


# ----------------------------------------------------------------------------- public entry points only


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def library_reach(sources: dict[str, str]) -> list[str]:
    """Where code (``{file: source}``) reaches into edit_jax: a private name imported from it, an
    ``x._name`` attribute whose ``_name`` is not defined in these files themselves (a library
    object's private member: the files' own ``self._x``, helpers and modules are theirs), and
    monkeypatching: assigning or deleting an attribute of something imported from edit_jax,
    ``setattr`` / ``patch.object`` on it, or ``patch("edit_jax...")``."""
    trees = {f: ast.parse(src, f) for f, src in sources.items()}
    own = set()  # private names the files define: functions, classes, attributes, variables
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _root(n) in ("self", "cls"):
                own.add(n.attr)
    found = []
    for f, tree in trees.items():
        lib = set()  # names bound to edit_jax modules or objects
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                lib |= {(a.asname or a.name.split(".")[0]) for a in n.names if a.name.split(".")[0] == "edit_jax"}
            elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "edit_jax":
                lib |= {a.asname or a.name for a in n.names}
                found += [f"{f}:{n.lineno}: from {n.module} import {a.name}" for a in n.names if _private(a.name)]
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own:
                found.append(f"{f}:{n.lineno}: private .{n.attr}")
            targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else \
                [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
            found += [f"{f}:{n.lineno}: assigns {ast.unparse(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and _root(t) in lib]
            if isinstance(n, ast.Call):
                name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                first = n.args[0] if n.args else None
                if name in ("setattr", "delattr", "object") and first is not None and _root(first) in lib:
                    found.append(f"{f}:{n.lineno}: {name}() on {ast.unparse(first)}")
                if name == "patch" and isinstance(first, ast.Constant) and str(first.value).startswith("edit_jax"):
                    found.append(f"{f}:{n.lineno}: patch({first.value!r})")
    return sorted(found, key=lambda x: (x.split(":")[0], int(x.split(":")[1])))


def test_benches_and_tools_use_public_entry_points_only():
    bad = {"a.py": "from edit_jax.localsgd.programs import _x, StepPrograms\nStepPrograms.save = None\n"
                   "p = StepPrograms()\np._local_step(1)\nimport edit_jax.training.loop as lp\nsetattr(lp, 'f', 1)\n"
                   "lp.train.x += 1\nfrom unittest import mock\nmock.patch('edit_jax.cli.main')\n"
                   "mock.patch.object(StepPrograms, 'x')\n",
           "b.py": "class A:\n    def __init__(self):\n        self._own = 1\n    def _m(self):\n"
                   "        return self._own + A()._own\n"}
    assert [x.split(": ", 1)[1] for x in library_reach(bad)] == [
        "from edit_jax.localsgd.programs import _x", "assigns StepPrograms.save", "private ._local_step",
        "setattr() on lp", "assigns lp.train.x", "patch('edit_jax.cli.main')", "object() on StepPrograms"]
    sources = {}
    for folder in ("benchmarks", "tools", "scripts"):
        d = os.path.join(REPO, folder)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if name.endswith(".py"):
                with open(os.path.join(d, name)) as fh:
                    sources[f"{folder}/{name}"] = fh.read()
    assert len(sources) > 10
    assert library_reach(sources) == []
