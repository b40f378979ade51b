"""`edit-jax plot`: a real DiLoCo run drawn through the CLI, labels from the differing config keys,
tolerant reading of metrics.jsonl, and bad run dirs named in the error."""

import json
import os

import jax
import numpy as np
import pytest

from edit_jax import cli
from edit_jax.config import OuterConfig, dumps
from edit_jax.localsgd.methods import plan_for
from edit_jax.commands.plot import DPI, PANEL_IN, WIDTH_IN, PlotError, load_run, make_figure, plot_runs, run_labels
from edit_jax.training.train import train
from tests.helpers import tiny_config
from tests.stages import one_stage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(path, records, method="edit", lines_after="", **kw) -> str:
    """A run dir as train() leaves it: the normalised config.json and the given records."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(dumps(plan_for(tiny_config(method=method, **kw)).cfg) + "\n")
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(lines_after)
    return str(path)


def _train_recs(steps, loss0=5.0):
    return [{"step": s, "loss": loss0 - 0.1 * s, "grad_norm": 1.0, "tokens_per_s": 1e4, "step_time": 0.05,
             "kind": "local"} for s in steps]


def _sync(step, norms, flagged, clip=1.0):
    return {"step": step, "sync": True, "pseudo_grad_norm": norms, "weight": [1 / len(norms)] * len(norms),
            "flagged": flagged, "clip_factor": clip, "outer_update_norm": 1.0, "inner_reset": [False] * len(norms)}


def test_cli_plots_a_real_diloco_run(tmp_path, capsys):
    # DiLoCo on 2 x 2, no warmup, a sync every 2 steps: sync records from the start (compiling the
    # local and the local-then-sync step is most of this test's time).
    one_stage("3.12", "plotting a real run", 14, other="test_api_records' plot of a loop's records")
    cfg = tiny_config(replica=2, shard=2, method="diloco", steps=6, eval_every=3, sync={"warmup_steps": 0, "tau": 2})
    run_dir = str(tmp_path / "run")
    train(cfg, run_dir, progress=False, devices=jax.devices()[:4])

    out = tmp_path / "plots" / "sub" / "run.png"  # parent dirs do not exist yet
    assert cli.main(["plot", run_dir, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    import matplotlib.image

    img = matplotlib.image.imread(str(out))
    # Three panels (loss, norms, weights / clip) at the module's size and dpi.
    assert img.shape[:2] == (round((3 * PANEL_IN + 0.4) * DPI), round(WIDTH_IN * DPI))
    assert img[..., :3].std() > 0.05  # not a blank canvas

    run = load_run(run_dir)
    assert [r["step"] for r in run.train] == list(range(1, 7))
    assert [r["step"] for r in run.evals] == [3, 6]
    assert [s["step"] for s in run.syncs] == [2, 4, 6]
    run.label = "diloco"
    fig = make_figure([run], x="step")
    loss_ax, norm_ax, weight_ax, clip_ax = fig.axes  # the clip factor on a twin axis of panel 3
    norm_lines = [ln for ln in norm_ax.get_lines() if ln.get_linestyle() != "None"]
    assert len(norm_lines) == 2  # one per worker
    norms = np.array([s["pseudo_grad_norm"] for s in run.syncs])
    for w, line in enumerate(norm_lines):
        np.testing.assert_allclose(line.get_xdata(), [2, 4, 6])
        np.testing.assert_allclose(line.get_ydata(), norms[:, w])
    # x = tokens is step x batch_size x seq_len; x = time grows with the steps.
    tokens_x = make_figure([run], x="tokens").axes[0].get_lines()[0].get_xdata()
    np.testing.assert_allclose(tokens_x, np.arange(1, 7) * cfg.batch_size * cfg.data.seq_len)
    time_x = make_figure([run], x="time").axes[0].get_lines()[0].get_xdata()
    assert np.all(np.diff(time_x) > 0) and time_x[0] > 0


def test_labels_name_the_differing_key(tmp_path, capsys):
    recs = _train_recs(range(1, 5))
    a = _fake_run(tmp_path / "a", recs, sync={"outer": OuterConfig(lr=0.5)})
    b = _fake_run(tmp_path / "b", recs)
    assert run_labels([load_run(a).config, load_run(b).config]) == ["edit outer.lr=0.5", "edit outer.lr=0.8"]
    # A top-level key whose last part is not unique (seed, data.seed) keeps its full name.
    c = _fake_run(tmp_path / "c", recs, method="diloco", seed=1)
    d = _fake_run(tmp_path / "d", recs, method="diloco")
    assert run_labels([load_run(c).config, load_run(d).config]) == ["diloco seed=1", "diloco seed=0"]
    # Fields a method fixes (the baseline's anomaly=false ...) are said by the method's name.
    e = _fake_run(tmp_path / "e", recs, method="baseline")
    assert run_labels([load_run(e).config, load_run(b).config]) == ["baseline", "edit"]
    # One run: method and mesh. Same configs: the dir names tell them apart.
    assert run_labels([load_run(a).config]) == ["edit mesh 2x4"]
    b2 = _fake_run(tmp_path / "b2", recs)
    assert run_labels([load_run(b).config, load_run(b2).config], [b, b2]) == ["edit [b]", "edit [b2]"]
    fig_path = tmp_path / "ab.png"
    assert cli.main(["plot", a, b, "--out", str(fig_path), "--label", "EDiT lr 0.5", "--label", "EDiT"]) == 0
    assert fig_path.read_bytes()[:8] == PNG_MAGIC
    assert cli.main(["plot", a, b, "--out", str(fig_path), "--label", "EDiT lr 0.5", "EDiT"]) == 0  # --label A B
    assert cli.main(["plot", a, b, "--out", str(fig_path), "--label", "only one"]) == 2
    assert "1 labels for 2 run dirs" in capsys.readouterr().err


def test_cut_line_repeated_steps_and_a_run_without_syncs(tmp_path):
    recs = _train_recs([1, 2, 3]) + [{"step": 2, "val_loss": 9.0, "val_ppl": 1.0, "time": 1.0}]
    recs += [_sync(2, [1.0, 2.0], [0, 0]), _sync(3, [1.5, 4.0], [0, 1], clip=0.5)]
    resumed = {**_train_recs([3])[0], "loss": 1.25}  # a resume redid step 3: the later record counts
    edit = _fake_run(tmp_path / "edit", recs + [resumed], replica=2, shard=2,
                     lines_after='{"step": 4, "loss": 3.1, "grad')  # killed mid-line
    run = load_run(edit)
    assert [(r["step"], r["loss"]) for r in run.train] == [(1, 4.9), (2, 4.8), (3, 1.25)]
    assert [s["step"] for s in run.syncs] == [2, 3]

    base = _fake_run(tmp_path / "base", _train_recs([1, 2, 3]), method="baseline")
    out = plot_runs([base, edit], str(tmp_path / "both.png"), x="step")
    assert open(out, "rb").read(8) == PNG_MAGIC
    base_run, edit_run = load_run(base), load_run(edit)
    base_run.label, edit_run.label = "baseline", "edit"
    _, norm_ax, weight_ax, clip_ax = make_figure([base_run, edit_run], x="step").axes
    assert any("no sync records: baseline" in t.get_text() for t in norm_ax.texts)
    marks = [ln for ln in norm_ax.get_lines() if ln.get_marker() == "x"]
    assert len(marks) == 1 and marks[0].get_color() == "red"  # worker 1 flagged at step 3 only
    assert list(marks[0].get_xdata()) == [3.0] and list(marks[0].get_ydata()) == [4.0]
    clip = [ln for ln in clip_ax.get_lines() if ln.get_marker() == "s"]
    assert len(clip) == 1 and list(clip[0].get_ydata()) == [1.0, 0.5]
    # Panel 3's weights on their own scale (before, on the clip factor's, changes of ~0.01 were flat).
    assert not [ln for ln in weight_ax.get_lines() if ln.get_marker() == "s"]
    assert weight_ax.get_ylim()[1] < 0.6 and clip_ax.get_ylim()[1] >= 1.0  # weights 0.5, clip factor up to 1


@pytest.mark.parametrize("setup,expect", [
    ("missing", "not a directory"),
    ("empty", "config.json: not found"),
    ("no_metrics", "metrics.jsonl: not found"),
    ("only_eval", "metrics.jsonl: no training loss records"),
])
def test_bad_run_dir_is_named(tmp_path, capsys, setup, expect):
    run_dir = tmp_path / "bad_run"
    if setup != "missing":
        run_dir.mkdir()
    if setup in ("no_metrics", "only_eval"):
        _fake_run(run_dir, [{"step": 2, "val_loss": 3.0, "val_ppl": 20.0, "time": 1.0}])
        if setup == "no_metrics":
            os.remove(run_dir / "metrics.jsonl")
    good = _fake_run(tmp_path / "good", _train_recs([1, 2]))
    out = tmp_path / "out.png"
    assert cli.main(["plot", good, str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edit-jax: plot error: ") and str(run_dir) in err and expect in err
    assert not out.exists()
    with pytest.raises(PlotError, match=expect):
        load_run(str(run_dir))


def test_binary_metrics_line_and_binary_config_json(tmp_path):
    """Issue 22, case 15: a non-UTF-8 line in metrics.jsonl (a damaged record) is skipped like a
    cut line, the others kept; a non-UTF-8 config.json is a PlotError naming it, no traceback."""
    from edit_jax.commands.plot import PlotError, _read_json, read_records

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe\x00garbage\n{"step": 2, "loss": 1.5}\n')
    assert [r["step"] for r in read_records(str(path))] == [1, 2]
    bad = tmp_path / "config.json"
    bad.write_bytes(b"\xff\xfe\x00{}")
    with pytest.raises(PlotError, match=str(bad)):
        _read_json(str(bad), "the run's config.json")
