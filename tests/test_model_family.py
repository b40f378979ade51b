"""A model family is one module (its contract and its config class) and one registry line
(``models/family.py``): a family written in ``tests/toy_family.py`` (nothing of Llama's), registered
with one line, reads its own ``model`` fields from a command line, trains with EDiT's layer-wise sync
inside its forward, FSDP over ``shard``, checkpoints and an exact resume, refuses a checkpoint of
other sizes, is planned, and samples; what does not fit it fails before any work, naming the key."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.config import MODEL_CONFIGS, Config, ConfigError, ModelConfig, from_dict, to_dict
from edit_jax.models import family
from edit_jax.rundir.checkpoint import CheckpointError
from edit_jax.rundir.trained import load_trained
from edit_jax.commands.plan import plan
from edit_jax.commands.sample import Sampler
from edit_jax.training.train import train
from edit_jax.validate import load_config, validate
from tests.stages import one_stage
from tests.test_edit_sync import TINY
from tests.toy_family import ToyConfig


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(family.FAMILIES, "toy", "")  # (so that the test's registration is undone after it)
    monkeypatch.setitem(MODEL_CONFIGS, "toy", ModelConfig)
    family.register("toy", "tests.toy_family", ToyConfig)  # the one line


def test_a_family_reads_its_own_fields_and_refuses_anothers(toy, tmp_path):
    cfg = load_config(TINY, ["model.hidden=32", "model.family=toy", "model.n_layers=2", "mesh.shard=2"])
    assert type(cfg.model) is ToyConfig and (cfg.model.hidden, cfg.model.width, cfg.model.n_layers) == (32, 64, 2)
    assert from_dict(to_dict(cfg)) == cfg  # a run dir's config.json reads back as the family's class
    with pytest.raises(ConfigError, match=r"unknown config key 'model.d_model'.*ToyConfig"):
        load_config(TINY, ["model.family=toy", "model.d_model=64"])
    with pytest.raises(ConfigError, match=r"unknown config key 'model.d_model': model.family='toy' takes ToyConfig"):
        from_dict(to_dict(dataclasses.replace(Config(), model=ModelConfig(family="toy"))))
    with pytest.raises(ConfigError, match=r"config key 'model.family': 'toy' reads its model section as "
                                          r"tests.toy_family.ToyConfig, but .* is a ModelConfig"):
        validate(dataclasses.replace(Config(), model=ModelConfig(family="toy")))
    with pytest.raises(ConfigError, match=r"config key 'model.width': must be a positive multiple of mesh.shard=4"):
        load_config(TINY, ["model.family=toy", "model.width=30", "mesh.shard=4"])  # the family's own validate
    with pytest.raises(ConfigError, match=r"config key 'model.init_from': .* not model.family='toy'"):
        load_config(TINY, ["model.family=toy", f"model.init_from={tmp_path}"])
    # the command line's way in: a Python config file registers the family it builds
    own = tmp_path / "toy_config.py"
    own.write_text("from edit_jax.config import Config\nfrom edit_jax.models import family\n"
                   "from tests.toy_family import ToyConfig\n"
                   "family.register('toy', 'tests.toy_family', ToyConfig)\n\n"
                   "def get_config():\n    return Config(model=ToyConfig(family='toy', width=32, n_layers=2))\n")
    assert load_config(str(own), ["model.hidden=16"]).model == ToyConfig(family="toy", width=32, hidden=16, n_layers=2)
    with pytest.raises(TypeError, match="must subclass edit_jax.config.FamilyConfig"):
        family.register("other", "tests.toy_family", dict)


def test_a_family_of_ones_own_trains_with_every_guarantee(toy, tmp_path):
    one_stage("default", "a model family of one's own, trained, stopped and resumed", 30,
              other="test_api_checkpoint's exact resume of DiLoCo + int8")
    cfg = load_config(TINY, ["model.family=toy", "model.hidden=64", "model.n_layers=2", "mesh.replica=2",
                             "mesh.shard=2", "sync.method=edit", "sync.warmup_steps=2", "sync.tau=3", "steps=14",
                             "batch_size=8", "data.seq_len=32", "log_every=1", "eval_every=7", "checkpoint_every=7"])
    run = str(tmp_path / "run")
    devs = jax.devices()[:4]
    half = train(cfg, run, progress=False, stop_after=7, devices=devs)
    assert half.interrupted and half.steps == 7
    done = train(cfg, run, progress=False, devices=devs)
    assert done.resumed_from == 7 and done.steps == 14
    straight = train(cfg, str(tmp_path / "straight"), progress=False, devices=devs)
    np.testing.assert_array_equal(done.final_loss, straight.final_loss)  # resumed exactly
    losses = [r["loss"] for r in straight.history if "loss" in r]
    assert all(math.isfinite(x) for x in losses) and np.mean(losses[-3:]) < losses[0] - 0.3, losses
    kinds = {r.get("kind") for r in straight.history}
    assert {"hsdp", "local", "sync_forward"} <= kinds, kinds  # warmup, local steps, EDiT's sync in the forward
    assert straight.final_val_loss is not None and math.isfinite(straight.final_val_loss)  # evaluated by its forward
    # a checkpoint of other sizes is refused, naming the family's own field
    with pytest.raises(CheckpointError, match=r"model.hidden: checkpoint 64, config 32"):
        train(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden=32), steps=21), run,
              progress=False, devices=devs)
    # planned: compiled for the mesh, the family's own memory (the analytic estimate is Llama's)
    p = plan(cfg)
    assert p["config"]["family"] == "toy" and set(p["steps"]) >= {"hsdp", "local"}
    assert p["gpu_estimate"]["peak_phase"] == "compiled" and p["gpu_estimate"]["total_bytes"] > 0
    # sampled through the family's forward: greedy tokens are the argmax of a whole forward over the prefix
    trained = load_trained(run)
    assert type(trained.cfg.model) is ToyConfig
    sampler = Sampler(trained.cfg.model, trained.params, cfg.data.seq_len, eos_id=-1, vocab_limit=256)
    prompt = np.array([3, 70, 101], np.int32)
    gen = sampler.generate(prompt, 6, temperature=0.0, stop_at_eos=False)
    seq = list(prompt)
    model = family.model_family("toy")
    for _ in range(6):
        logits, _ = model.forward(trained.cfg.model, trained.params, jnp.asarray([seq]), family.identity_hook)
        seq.append(int(np.argmax(np.asarray(logits)[0, -1, :256])))
    assert gen.tokens[0].tolist() == seq[3:], (gen.tokens, seq)
