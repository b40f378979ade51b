"""``LocalSGDRecords`` (``rundir/localsgd_records.py``): a user's own loop writes the records of
``edit-jax train``'s run dirs, and ``edit-jax plot`` draws them beside a trainer's run: the loss, each
sync's per-worker norms and weights, the evaluations; a run dir with records is refused unless
resumed (the records past the restored step dropped), and one of another rule is refused."""

from __future__ import annotations

import json
import os

import numpy as np
import optax
import pytest
from flax import nnx

import edit_jax
from edit_jax.localsgd.api import LocalSGD
from edit_jax.commands import plot
from tests.test_api import N, _mesh
from tests.test_api_nnx import StackedLM, _lm_batch, _lm_loss
from tests.stages import one_stage


def _trainer(rule=None):
    return LocalSGD.for_nnx(rule or edit_jax.edit(), _mesh(), 3, StackedLM(nnx.Rngs(0)), optax.adam(0.05),
                            _lm_loss, blocks="blocks")


def _loop(trainer, records, state, steps):
    syncs = []
    for k in range(int(state.step), int(state.step) + steps):
        state, metrics = trainer.step(state, _lm_batch(k))
        records.step(state, metrics)
        if "sync" in metrics:
            syncs.append((int(state.step), np.asarray(metrics["sync"]["pseudo_grad_norm"])))
    return state, syncs


def test_a_loops_records_plot_beside_a_run_and_resume_drops_what_is_redone(tmp_path):
    one_stage("default", "a loop's records plotted", 11, other="test_plot's real run")
    run = str(tmp_path / "mine")
    trainer = _trainer()
    records = edit_jax.LocalSGDRecords(run, trainer, batch_size=N * 4, seq_len=6)
    state, syncs = _loop(trainer, records, trainer.init(), 7)
    records.evaluation(state, 2.5)
    got = plot.load_run(run)
    assert [r["step"] for r in got.train] == list(range(1, 8))
    assert [s["step"] for s in got.syncs] == [k for k, _ in syncs] == [4, 7]  # EDiT: in the forward of steps 3, 6
    for rec, (_, norms) in zip(got.syncs, syncs, strict=True):
        assert len(rec["pseudo_grad_norm"]) == len(rec["weight"]) == N
        np.testing.assert_allclose(rec["pseudo_grad_norm"], norms, rtol=1e-6)
    assert [e["val_loss"] for e in got.evals] == [2.5] and got.config["sync"]["method"] == "edit"
    assert all(r["tokens_per_s"] > 0 for r in got.train[1:])
    fig = plot.make_figure([got], x="tokens")
    assert len(fig.axes) >= 3 and fig.axes[0].lines[0].get_xdata()[-1] == 7 * N * 4 * 6
    out = plot.plot_runs([run], str(tmp_path / "mine.png"))
    assert os.path.getsize(out) > 1000

    with pytest.raises(ValueError, match="already holds records; pass resume_step"):
        edit_jax.LocalSGDRecords(run, trainer)
    with pytest.raises(ValueError, match="written for rule 'edit' with tau 3, this trainer runs 'diloco'"):
        edit_jax.LocalSGDRecords(run, _trainer(edit_jax.diloco()), resume_step=4)
    with pytest.raises(ValueError, match="batch_size: expected a non-negative integer"):
        edit_jax.LocalSGDRecords(str(tmp_path / "other"), trainer, batch_size=2.5)
    assert not os.path.exists(tmp_path / "other")  # refused before anything was written

    edit_jax.LocalSGDRecords(run, trainer, batch_size=N * 4, seq_len=6, resume_step=4)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        kept = [json.loads(line) for line in f]
    assert max(r["step"] for r in kept) == 4 and len([r for r in kept if r.get("sync")]) == 1
