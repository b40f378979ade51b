"""``model.init_from``: a Hugging Face Llama directory as the starting point. The round trip export
-> init_from gives back the very params (so identical logits), in every worker and in θ̄, loaded
as per-device slices; sharded safetensors files, bf16 weights, the architecture taken from
config.json, and every way the directory can be wrong."""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from edit_jax.config import ConfigError
from edit_jax.hf import load as hf_import
from edit_jax.hf.export import write_export
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.models import llama as model_lib
from edit_jax.rundir.trained import load_trained
from edit_jax.training.train import train
from edit_jax.validate import load_config, validate
from tests.helpers import mesh_for, tiny_config
from tests.test_export import _random_params, read_safetensors
from tests.stages import one_stage


def _exported(tmp_path, name="hf", dtype="float32", **model):
    """A random model (norm scales randomised too) exported to tmp_path/name: (its cfg, params, dir)."""
    cfg = tiny_config(model={"init_std": 0.1, **model})
    params = _random_params(cfg, seed=3)
    out = str(tmp_path / name)
    write_export(out, cfg, params, dtype=dtype, eos_id=256)
    return cfg, params, out


def _starting_from(out, replica=2, shard=2, method="edit", **kw):
    """A config whose model is the preset's default until init_from's architecture replaces it."""
    cfg = tiny_config(replica=replica, shard=shard, method=method, **kw)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(model_lib.preset("tiny"), d_model=32, n_layers=1,
                                                             init_from=out))
    cfg = hf_import.adopt_architecture(cfg)
    validate(cfg)
    return cfg



def _init_state(cfg, seed):
    """A run's starting state as the loop builds it with model.init_from: the directory's weights
    (hf.load.initial_params) handed to init_state."""
    programs = StepPrograms.for_config(cfg, mesh_for(cfg))
    return programs.init_state(seed, hf_import.initial_params(cfg, programs.layout))

@pytest.mark.parametrize("tie,kv,method", [(False, 4, "edit"), (True, 2, "baseline")])
def test_export_then_init_from_gives_the_same_params_in_every_worker_and_outer(tmp_path, tie, kv, method):
    cfg0, params, out = _exported(tmp_path, tie_embeddings=tie, n_kv_heads=kv)
    cfg = _starting_from(out, method=method)
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_kv_heads, cfg.model.tie_embeddings) == \
        (cfg0.model.d_model, cfg0.model.n_layers, kv, tie)
    state = _init_state(cfg, seed=11)  # another seed than the export's
    for r in range(cfg.mesh.replica):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[r], b),  # noqa: B023 - called at once
                     state.params, params)
    if method == "edit":
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.outer.params, params)
    else:
        assert state.outer is None
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 24)).astype(np.int32)
    theirs, _ = model_lib.forward(cfg0.model, params, ids)
    worker0 = jax.tree.map(lambda a: np.asarray(a)[0], state.params)
    ours, _ = model_lib.forward(cfg.model, worker0, ids)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))  # identical logits


def test_weights_load_as_per_device_slices(tmp_path):
    _, params, out = _exported(tmp_path)
    cfg = _starting_from(out, replica=1, shard=4)
    mesh = mesh_for(cfg)
    m = StepPrograms.for_config(cfg, mesh)
    abstract = jax.eval_shape(lambda: params)
    from edit_jax.localsgd.sharding import named, outer_specs
    loaded = hf_import.load_params(cfg.model, abstract, named(mesh, outer_specs(abstract, m.layout.shard_dims)))
    for (path, a), dim in zip(jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(m.layout.shard_dims),
                              strict=True):
        want = list(a.shape)
        want[dim] //= 4
        assert [list(s.data.shape) for s in a.addressable_shards] == [want] * 4, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(_leaf(params, path)))


def _leaf(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_sharded_safetensors_files_with_an_index_load_the_same(tmp_path):
    _, params, out = _exported(tmp_path)
    tensors, _ = read_safetensors(os.path.join(out, "model.safetensors"))
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    os.remove(os.path.join(out, "model.safetensors"))
    for file, part in parts.items():
        save_file({n: np.ascontiguousarray(tensors[n]) for n in part}, os.path.join(out, file))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {n: file for file, part in parts.items() for n in part}}, f)
    cfg = _starting_from(out, replica=1, shard=2, method="diloco")
    state = _init_state(cfg, seed=0)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.outer.params, params)


def test_bfloat16_weights_load_as_their_float32_values(tmp_path):
    _, params, out = _exported(tmp_path, dtype="bfloat16")
    cfg = _starting_from(out, replica=1, shard=2, method="baseline")
    state = _init_state(cfg, seed=0)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(
        np.asarray(a)[0], np.asarray(b).astype(ml_dtypes.bfloat16).astype(np.float32)), state.params, params)


def test_the_architecture_comes_from_the_directory(tmp_path):
    cfg0, _, out = _exported(tmp_path, n_kv_heads=2, tie_embeddings=True, rope_theta=500.0)
    cfg = load_config("configs/tiny.py", [f"model.init_from={out}", "model.n_kv_heads=2"])  # agreeing: fine
    for name in hf_import.ARCHITECTURE:
        assert getattr(cfg.model, name) == getattr(cfg0.model, name), name
    with pytest.raises(ConfigError, match=r"'model.d_model': '48' on the command line.*hidden_size=64"):
        load_config("configs/tiny.py", [f"model.init_from={out}", "model.d_model=48"])
    mismatched = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=cfg.model.n_layers + 1))
    with pytest.raises(ConfigError, match=r"'model.n_layers'.*num_hidden_layers="):
        validate(mismatched)  # a config built in Python is checked against the directory too


def _edit_json(path, **changes):
    with open(path) as f:
        d = json.load(f)
    d.update(changes)
    with open(path, "w") as f:
        json.dump(d, f)


def test_a_directory_that_is_not_a_loadable_llama_is_refused_naming_what(tmp_path):
    _, _, out = _exported(tmp_path)
    with pytest.raises(ConfigError, match="is not a directory"):
        hf_import.read_architecture(str(tmp_path / "nowhere"))
    cfg_file = os.path.join(out, "config.json")
    original = open(cfg_file).read()
    for changes, match in [({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'rope_scaling'"),
                           ({"attention_bias": True}, "'attention_bias'"), ({"model_type": "gpt2"}, "'model_type'"),
                           ({"head_dim": 8}, "'head_dim'"), ({"hidden_size": "64"}, "'hidden_size' is '64'")]:
        _edit_json(cfg_file, **changes)
        with pytest.raises(ConfigError, match=match):
            load_config("configs/tiny.py", [f"model.init_from={out}"])
        open(cfg_file, "w").write(original)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:  # a tokenizer of its own, not the byte one
        json.dump({"model": {"type": "BPE"}}, f)
    with pytest.raises(ConfigError, match=r"'data.tokenizer': 'byte', but model.init_from=.* was trained with"):
        load_config("configs/tiny.py", [f"model.init_from={out}"])
    load_config("configs/tiny.py", [f"model.init_from={out}", f"data.tokenizer={out}/tokenizer.json"])
    os.remove(cfg_file)
    with pytest.raises(ConfigError, match="config.json cannot be read"):
        load_config("configs/tiny.py", [f"model.init_from={out}"])


def test_missing_wrong_or_truncated_weights_are_reported_naming_the_tensor_or_file(tmp_path):
    _, _, out = _exported(tmp_path)
    cfg = _starting_from(out, replica=1, shard=2, method="baseline")
    file = os.path.join(out, "model.safetensors")
    tensors, _ = read_safetensors(file)

    def init():
        return _init_state(cfg, seed=0)

    for name, change, match in [("model.layers.1.mlp.up_proj.weight", None, "no tensor 'model.layers.1.mlp.up_proj"),
                                ("model.norm.weight", np.ones(3, np.float32), r"'model.norm.weight'.*has shape \[3\]"),
                                ("extra.weight", np.ones(3, np.float32), r"tensors \['extra.weight'\] have no place")]:
        changed = {k: np.ascontiguousarray(v) for k, v in tensors.items() if k != name}
        if change is not None:
            changed[name] = change
        save_file(changed, file)
        with pytest.raises(ConfigError, match=match):
            init()
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, file)
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ConfigError, match=r"model.safetensors' is truncated or damaged"):
        init()
    os.remove(file)
    with pytest.raises(ConfigError, match=r"has no \*.safetensors file"):
        init()


def test_training_starts_from_the_directory(tmp_path, capsys):
    """The loop's wiring: with a learning rate too small to move them, the trained run's θ̄ is the
    directory's params; the run says where its params came from."""
    one_stage("default", "training from a Hugging Face directory", 15)
    _, params, out = _exported(tmp_path)
    cfg = _starting_from(out, replica=2, shard=1, method="edit", steps=2, optim={"lr": 1e-12, "weight_decay": 0.0},
                         sync={"warmup_steps": 0, "tau": 2})
    run_dir = str(tmp_path / "run")
    train(cfg, run_dir, progress=False, verbose=True, devices=jax.devices()[:2])
    assert f"params from model.init_from={out}" in capsys.readouterr().err
    trained = load_trained(run_dir)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-8), trained.params, params)
