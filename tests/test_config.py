"""Config files, overrides and presets."""

import glob
import os

import pytest

from edit_jax.config import Config, ConfigError, apply_overrides, from_dict, to_dict
from edit_jax.models.llama import count_params
from edit_jax.validate import load_config
from tests.helpers import REPO


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))))
def test_every_config_file_loads_and_validates(path):
    cfg = load_config(path)
    name = os.path.basename(path)
    for method in ("baseline", "post_local_sgd", "diloco", "edit", "co2"):
        if name.startswith(method + "_") or name == f"cpu_{method}.py":
            assert cfg.sync.method == method


def test_overrides_parse_types_and_aliases():
    cfg = apply_overrides(Config(), ["steps=7", "method=diloco", "mesh.replica=4", "optim.lr=1e-3",
                                     "sync.penalty.anomaly=false", "data.paths=a.txt,b/*.txt"])
    assert cfg.steps == 7 and cfg.sync.method == "diloco" and cfg.mesh.replica == 4
    assert cfg.optim.lr == 1e-3 and cfg.sync.penalty.anomaly is False and cfg.data.paths == ("a.txt", "b/*.txt")
    assert Config().steps != 7  # the default is not mutated


def test_dict_roundtrip_and_errors():
    cfg = load_config(os.path.join(REPO, "configs/demo.py"))
    assert from_dict(to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="unknown config key 'model.width'"):
        from_dict({"model": {"width": 3}})
    with pytest.raises(ConfigError, match="config key 'steps': expected int"):
        from_dict({"steps": "3"})
    with pytest.raises(ConfigError, match="is a section"):
        apply_overrides(Config(), ["model=3"])


def test_missing_config_file_is_named():
    with pytest.raises(ConfigError, match="nope.py"):
        load_config("nope.py")


def test_paper_presets_have_paper_sizes():
    import jax

    from edit_jax.models.llama import init_params
    from edit_jax.presets import paper

    want = {"350m": (0.3e9, 0.45e9), "1b": (0.95e9, 1.25e9), "3b": (3.0e9, 3.8e9), "7b": (6.5e9, 7.0e9)}
    for size, (lo, hi) in want.items():
        cfg = paper(size)
        shapes = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))  # noqa: B023 - called at once
        assert lo < count_params(shapes) < hi, (size, count_params(shapes))
        assert cfg.sync.tau == 128 and cfg.sync.penalty.clip_threshold == 10.0 and cfg.optim.lr == 1.5e-4
        assert cfg.sync.outer.lr == 0.8 and cfg.sync.outer.momentum == 0.85 and cfg.mesh.replica == 8
    assert paper("1b", "baseline").optim.lr == 3e-4


@pytest.mark.parametrize("where", ["import", "get_config"])
def test_config_file_calling_sys_exit_is_a_config_error(tmp_path, where):
    """Issue 22, case 15: a config file that calls sys.exit(7) (at import or in get_config()) made
    the CLI exit 7 with no message; it is a config error naming the file (exit 2 in the CLI)."""
    path = tmp_path / "exits.py"
    body = "import sys\n"
    body += "sys.exit(7)\n" if where == "import" else "def get_config():\n    sys.exit(7)\n"
    path.write_text(body)
    with pytest.raises(ConfigError, match=rf"config file '{path}'.*sys\.exit\(7\)"):
        load_config(str(path), [])


def test_keys_that_moved_into_a_section_are_read_as_their_new_key(tmp_path, capsys):
    """sync.compress (and the other five wire fields) moved into sync.wire, sync.outer_lr (and the
    outer optimizer's four others) into sync.outer: a command line, a run
    dir's config.json and a checkpoint's config written with the flat keys are read as the new ones,
    one line saying so; a Python config passing the old keyword fails naming the new key."""
    import json

    from edit_jax.config import renames as config_renames
    from edit_jax.localsgd.codec import Codec

    config_renames._TOLD.clear()
    cfg = load_config(None, ["sync.compress=int8", "sync.error_feedback=true", "sync.ef_decay=0.5"])
    assert (cfg.sync.wire.kind, cfg.sync.wire.error_feedback, cfg.sync.wire.decay) == ("int8", True, 0.5)
    err = capsys.readouterr().err
    assert "config key 'sync.compress' is now 'sync.wire.kind'" in err and err.count("\n") == 3
    load_config(None, ["sync.compress=bf16", "sync.error_feedback=true"])
    assert capsys.readouterr().err == ""  # once per key and process
    # The outer optimizer's five (sync.outer); a method's fixed value still wins over either name.
    cfg = load_config(None, ["sync.method=co2", "sync.outer_lr=0.5", "sync.nesterov=true", "sync.outer_b2=0.9"])
    assert (cfg.sync.outer.lr, cfg.sync.outer.b2) == (0.5, 0.9)
    assert "config key 'sync.nesterov' is now 'sync.outer.nesterov'" in capsys.readouterr().err
    from edit_jax.localsgd.methods import plan_for
    said = plan_for(cfg)
    assert said.cfg.sync.outer.nesterov is False and ("sync.outer.nesterov", True, False) in said.changed

    old = to_dict(Config())  # a config.json of the version before the section: the flat keys
    wire = old["sync"].pop("wire")
    old["sync"].update(compress="topk2", error_feedback=True, ef_decay=wire["decay"], ef_dtype="float32",
                       sparse_chunk=1024, sparse_k=32)
    outer = old["sync"].pop("outer")
    old["sync"].update(outer_optimizer=outer["optimizer"], outer_lr=0.3, outer_momentum=outer["momentum"],
                       nesterov=outer["nesterov"], outer_b2=outer["b2"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    cfg = load_config(str(path), ["sync.method=edit"])
    assert (cfg.sync.wire.kind, cfg.sync.wire.chunk, cfg.sync.wire.k, cfg.sync.outer.lr) == ("topk2", 1024, 32, 0.3)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sync.sparse_chunk -> sync.wire.chunk" in err, err
    assert Codec.from_sync(old["sync"]) == Codec.from_sync(cfg.sync)  # a checkpoint's saved config
    both = {**old, "sync": {**old["sync"], "wire": {"kind": "int8"}}}  # both names: the new one kept
    assert from_dict(config_renames.upgrade(both, config_renames.quiet)).sync.wire.kind == "int8"

    py = tmp_path / "old.py"
    py.write_text("from edit_jax.config import Config, SyncConfig\n\n\ndef get_config():\n"
                  "    return Config(sync=SyncConfig(compress='int8'))\n")
    with pytest.raises(ConfigError, match=r"'sync.compress' is now 'sync.wire.kind': pass wire=WireConfig\(kind="):
        load_config(str(py))
    py.write_text(py.read_text().replace("compress='int8'", "co2_gap_penalty=2.0"))
    with pytest.raises(ConfigError, match=r"is now 'sync.co2.gap_penalty': pass co2=CO2Config\(gap_penalty="):
        load_config(str(py))
    py.write_text(py.read_text().replace("co2_gap_penalty=2.0", "outer_lr=0.5"))
    with pytest.raises(ConfigError, match=r"is now 'sync.outer.lr': pass outer=OuterConfig\(lr="):
        load_config(str(py))


def test_the_timing_and_the_exchange_moved_into_sections(tmp_path, capsys):
    """sync.tau_time and its two fields into sync.time; sync.exchange (the URL) into
    sync.exchange.url, the exchange's five others beside it. The URL's old key is the new section's
    name, so each reader tells a section from the flat value: a command line, a run dir's
    config.json (as a string or as today's section), a checkpoint's, a Python config
    (SyncConfig(exchange="DIR") gives the section a string), the API's from_method, and the run-dir
    lock's reader of another run's config.json."""
    import json

    from edit_jax.config import ExchangeConfig, renames
    from edit_jax.localsgd.api_rules import from_method
    from edit_jax.rundir.runlock import exchange_problem

    renames._TOLD.clear()
    cfg = load_config(None, ["method=a_edit", "mesh.processes=2", "sync.exchange=dir:/x", "sync.tau_time=5",
                             "sync.grace=3", "sync.exchange_patience=7", "sync.step_weight_ratio=0.25"])
    assert (cfg.sync.exchange.url, cfg.sync.exchange.grace, cfg.sync.exchange.patience) == ("dir:/x", 3.0, 7.0)
    assert (cfg.sync.time.tau, cfg.sync.time.step_weight_ratio) == (5.0, 0.25)
    err = capsys.readouterr().err
    assert "'sync.exchange' is now 'sync.exchange.url'" in err and "'sync.tau_time' is now 'sync.time.tau'" in err
    assert (load_config(None, ["method=diloco", "sync.exchange.url=dir:/y"]).sync.exchange
            == ExchangeConfig(url="dir:/y"))

    old = to_dict(Config())  # before the sections: the URL a string, the fields flat
    del old["sync"]["time"], old["sync"]["exchange"]
    old["sync"].update(method="diloco", exchange=str(tmp_path / "ex"), grace=4.0, tau_time=9.0, carried_weight=0.5)
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = load_config(str(tmp_path / "config.json"))
    assert (cfg.sync.exchange.url, cfg.sync.exchange.grace, cfg.sync.exchange.carried_weight, cfg.sync.time.tau) == (
        str(tmp_path / "ex"), 4.0, 0.5, 9.0)
    assert from_dict(renames.upgrade(to_dict(cfg), renames.quiet)) == cfg  # today's section is left as it is
    assert exchange_problem(str(tmp_path), str(tmp_path / "ex")) is None  # the old config.json's exchange
    assert "belongs to another run" in exchange_problem(str(tmp_path), str(tmp_path / "other"))
    (tmp_path / "config.json").write_text(json.dumps(to_dict(cfg)))  # today's
    assert exchange_problem(str(tmp_path), str(tmp_path / "ex")) is None

    py = tmp_path / "old.py"
    py.write_text("from edit_jax.config import Config, SyncConfig\n\n\ndef get_config():\n"
                  "    return Config(sync=SyncConfig(exchange='dir:/x'))\n")
    with pytest.raises(ConfigError, match=r"'sync.exchange' is now 'sync.exchange.url': pass "
                                          r"exchange=ExchangeConfig\(url="):
        load_config(str(py))
    py.write_text(py.read_text().replace("exchange='dir:/x'", "tau_time=5.0"))
    with pytest.raises(ConfigError, match=r"is now 'sync.time.tau': pass time=TimeConfig\(tau="):
        load_config(str(py))
    with pytest.raises(ValueError, match="sync.exchange: the exchange is the trainer's"):
        from_method("diloco", exchange=ExchangeConfig(url="dir:/x"))
    with pytest.raises(ValueError, match="sync.exchange: the exchange is the trainer's"):
        from_method("diloco", exchange="dir:/x")  # the old keyword, read as the URL
    assert from_method("diloco", exchange=ExchangeConfig()).name == "diloco"
