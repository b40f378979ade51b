"""Export to the Hugging Face Llama layout, checked by a NumPy Llama forward that reads only the
exported files (config.json + model.safetensors) and follows that format's definitions: Linear
weights [out, in], rotate-half rotary with inv_freq = theta^(-2i/head_dim) over
cat(freqs, freqs), key/value head h // n_rep for query head h, RMSNorm weight * x / rms."""

import json
import os
import shutil
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors

from edit_jax.hf.export import WRITTEN, ExportError, main as export_main, write_export
from edit_jax.models import llama as model_lib
from edit_jax.rundir.trained import load_trained
from tests.helpers import damage_checkpoint_arrays, tiny_config
from tests.trained_runs import edit_run, tokenizer_run
from tests.stages import one_stage


def read_safetensors(path):
    """{name: array} from the raw bytes (BF16 viewed through ml_dtypes), and the header."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    kinds = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a: 8 + n + b], kinds[info["dtype"]]).reshape(info["shape"])
    return out, header


def llama_logits(export_dir, ids):
    """LlamaForCausalLM's forward in float64 NumPy, from the export alone. ids: 1-D."""
    with open(os.path.join(export_dir, "config.json")) as f:
        c = json.load(f)
    w, _ = read_safetensors(os.path.join(export_dir, "model.safetensors"))
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h_n, kv_n = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // h_n
    t = len(ids)

    def rms(x, weight):
        return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c["rms_norm_eps"]))

    inv_freq = 1.0 / (c["rope_theta"] ** (np.arange(0, hd, 2) / hd))
    freqs = np.arange(t)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)

    def rotate_half(x):
        return np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], axis=-1)

    x = w["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, h_n, hd).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv_n, hd).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv_n, hd).transpose(1, 0, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, h_n // kv_n, axis=0), np.repeat(v, h_n // kv_n, axis=0)  # repeat_kv
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(t, h_n * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


def _random_params(cfg, seed=0):
    """Init params with every norm scale randomised too (ones would hide a mix-up of norms)."""
    params = model_lib.init_params(cfg.model, jax.random.key(seed))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    out = [np.asarray(x) + (rng.normal(0, 0.3, np.shape(x)).astype(np.float32) if "scale" in jax.tree_util.keystr(p)
                            else 0) for p, x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.parametrize("tie", [False, True])
def test_numpy_llama_forward_of_the_export_matches_ours(tmp_path, tie):
    cfg = tiny_config(model={"tie_embeddings": tie, "init_std": 0.1, "rope_theta": 500.0})  # 4 heads, 2 kv
    params = _random_params(cfg)
    write_export(str(tmp_path), cfg, params, eos_id=256)
    with open(tmp_path / "config.json") as f:
        c = json.load(f)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["num_key_value_heads"] == 2
    assert c["tie_word_embeddings"] is tie and c["rope_theta"] == 500.0 and c["eos_token_id"] == 256
    names, _ = read_safetensors(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in names) is not tie
    assert names["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # [out, in]
    assert names["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    rng = np.random.default_rng(1)
    for length in (1, 7, 31):
        ids = rng.integers(0, cfg.model.vocab_size, length)
        ours, _ = model_lib.forward(cfg.model, params, ids[None].astype(np.int32))
        ref = llama_logits(str(tmp_path), ids)
        assert np.abs(ref).max() > 0.1
        np.testing.assert_allclose(np.asarray(ours[0], np.float64), ref, atol=2e-4, rtol=1e-4)


def test_bfloat16_export_is_the_rounded_float32(tmp_path):
    cfg = tiny_config()
    params = _random_params(cfg)
    write_export(str(tmp_path / "f32"), cfg, params)
    write_export(str(tmp_path / "bf16"), cfg, params, dtype="bfloat16")
    f32, _ = read_safetensors(tmp_path / "f32" / "model.safetensors")
    bf16, header = read_safetensors(tmp_path / "bf16" / "model.safetensors")
    assert header["__metadata__"] == {"format": "pt"}
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    for name, x in f32.items():
        np.testing.assert_array_equal(bf16[name], x.astype(ml_dtypes.bfloat16))
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"


def test_export_run_cli(tmp_path_factory, tmp_path, capsys):
    one_stage("default", "export of a trained run through the CLI", 47)
    _, run_dir = edit_run(tmp_path_factory)
    out = tmp_path / "hf"
    assert export_main(["--run-dir", run_dir, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == sorted(WRITTEN)  # the byte tokenizer as a file too
    assert all(os.stat(out / name).st_mode & 0o777 == 0o644 for name in WRITTEN)  # before: safetensors 0600
    with open(out / "tokenizer_config.json") as f:
        tok_cfg = json.load(f)
    with open(out / "generation_config.json") as f:
        gen_cfg = json.load(f)
    assert tok_cfg["eos_token"] == "<|endoftext|>" and tok_cfg["model_max_length"] == 32
    assert gen_cfg == {"bos_token_id": 256, "eos_token_id": 256, "max_length": 32}
    with open(out / "edit_jax_export.json") as f:
        prov = json.load(f)
    assert prov["step"] == 6 and prov["params"].startswith("outer") and prov["eos_token_id"] == 256
    model = load_trained(run_dir)  # θ̄ of step 6 (tests/test_sample.py checks it against the checkpoint)
    ids = np.arange(0, 300, 13)
    ours, _ = model_lib.forward(model.cfg.model, model.params, ids[None].astype(np.int32))
    np.testing.assert_allclose(np.asarray(ours[0], np.float64), llama_logits(str(out), ids), atol=2e-4, rtol=1e-4)
    # A non-empty --out is refused (named), unless --force.
    capsys.readouterr()
    assert export_main(["--run-dir", run_dir, "--out", str(out), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not empty" in err and "--force" in err
    assert export_main(["--run-dir", run_dir, "--out", str(out), "--step", "4", "--force"]) == 0
    with open(out / "edit_jax_export.json") as f:
        assert json.load(f)["step"] == 4
    with pytest.raises(ExportError, match="--dtype"):
        write_export(str(tmp_path / "x"), model.cfg, model.params, dtype="int8")


def test_export_ships_the_tokenizer(tmp_path_factory, tmp_path):
    pytest.importorskip("tokenizers")
    _, run_dir, tok_path = tokenizer_run(tmp_path_factory)
    out = tmp_path / "hf"
    assert export_main(["--run-dir", run_dir, "--out", str(out), "--dtype", "bfloat16"]) == 0
    with open(out / "tokenizer.json", "rb") as a, open(tok_path, "rb") as b:
        assert a.read() == b.read()
    import tokenizers

    eos = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|endoftext|>")
    with open(out / "config.json") as f:
        assert json.load(f)["eos_token_id"] == eos
    assert isinstance(safetensors.safe_open(str(out / "model.safetensors"), "numpy").keys(), list)


def test_export_and_sample_refuse_a_damaged_checkpoint(tmp_path_factory, tmp_path, capsys):
    """Issue 22, case 5: export and sample verify the arrays they read against the checksums
    recorded at save time (as a resume does) and refuse a damaged checkpoint in one line, exit 2,
    naming it and the older checkpoints to pass with --step; nothing is exported."""
    from edit_jax.commands.sample import main as sample_main

    _, shared = edit_run(tmp_path_factory)
    run_dir = str(tmp_path / "run")
    shutil.copytree(shared, run_dir)  # the shared run stays intact for the other tests
    damage_checkpoint_arrays(os.path.join(run_dir, "checkpoints", "6"))
    capsys.readouterr()
    out = tmp_path / "hf"
    assert export_main(["--run-dir", run_dir, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and os.path.join(run_dir, "checkpoints", "6") in err, err
    assert ("is damaged" in err or "could not be read" in err) and "--step 4" in err, err
    assert not out.exists() or not os.listdir(out)
    assert sample_main(["--run-dir", run_dir, "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and os.path.join(run_dir, "checkpoints", "6") in err and "--step 4" in err, err
    assert export_main(["--run-dir", run_dir, "--out", str(out), "--step", "4"]) == 0  # an older one verifies
    with open(out / "edit_jax_export.json") as f:
        assert json.load(f)["step"] == 4


def test_export_to_an_unwritable_out_leaves_nothing(tmp_path_factory, tmp_path, capsys, monkeypatch):
    """Issue 22, case 15: an --out that cannot be made (its parent is a regular file) is refused in
    one line, exit 2, before the checkpoint is read; a write that fails half way (a full disk)
    removes the directory it started, so no partial export is left behind."""
    import errno

    import edit_jax.hf.export as export_lib

    _, run_dir = edit_run(tmp_path_factory)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    capsys.readouterr()
    assert export_main(["--run-dir", run_dir, "--out", str(blocker / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and str(blocker) in err and "not a directory" in err, err

    def full_disk(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export_lib, "hf_config", full_disk)  # after model.safetensors is written
    out = tmp_path / "hf"
    assert export_main(["--run-dir", run_dir, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and os.strerror(errno.ENOSPC) in err, err
    assert not out.exists()


def _export_under_a_file_size_limit(run_dir, out, *extra, limit=4096):
    """``edit-jax export`` in a child process whose files cannot grow past ``limit`` bytes
    (RLIMIT_FSIZE: a write past it fails with EFBIG, as one on a full disk fails with ENOSPC;
    SIGXFSZ ignored, so the write returns the error instead of killing the process): (code, stderr)."""
    import subprocess
    import sys

    from tests.helpers import REPO

    child = ("import resource, signal, sys\n"
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
             "from edit_jax.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, "-c", child, "export", "--run-dir", run_dir, "--out", str(out), *extra],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    return done.returncode, done.stderr


def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path_factory, tmp_path):
    """Issue 31, item 5: a disk that fills during the export (here: a file size limit, EFBIG)
    gave a 23-line safetensors traceback, exit 1, and left an empty --out. Now one line naming
    --out and the error, exit 2; a new --out (and the parents it would have made) does not
    remain, and an existing export written over with --force is left exactly as it was."""
    one_stage("default", "an export on a full disk", 13)
    import errno

    _, run_dir = edit_run(tmp_path_factory)
    out = tmp_path / "new" / "deeper" / "hf"
    code, err = _export_under_a_file_size_limit(run_dir, out)
    assert code == 2, err
    assert err.count("\n") == 1 and str(out) in err and os.strerror(errno.EFBIG) in err, err
    assert os.listdir(tmp_path) == []  # neither new/ nor a staging dir
    old = tmp_path / "old"
    assert export_main(["--run-dir", run_dir, "--out", str(old), "--step", "4"]) == 0
    before = {name: (old / name).read_bytes() for name in os.listdir(old)}
    code, err = _export_under_a_file_size_limit(run_dir, old, "--force")
    assert code == 2 and err.count("\n") == 1 and os.strerror(errno.EFBIG) in err, err
    assert {name: (old / name).read_bytes() for name in os.listdir(old)} == before


def test_byte_tokenizer_export_has_our_ids():
    """The exported byte tokenizer, read by the `tokenizers` library itself: every byte of a text
    with multi-byte characters, tabs, newlines and runs of spaces is its own id (= edit-jax's byte
    ids), EOS is 256, and decoding gives the text back."""
    tokenizers = pytest.importorskip("tokenizers")
    from edit_jax.data.tokenizers import make_tokenizer
    from edit_jax.hf.tokenizer import byte_tokenizer_json

    hf = tokenizers.Tokenizer.from_str(json.dumps(byte_tokenizer_json(256)))
    ours = make_tokenizer("byte")
    for text in ["def f(x):\n\treturn  x  # é, €, 日本\n", " leading", "", "\u00ff\u0100 \x7f\x00"]:
        ids = hf.encode(text).ids
        assert ids == list(ours.encode(text)) == list(text.encode("utf-8")), text
        assert hf.decode(ids) == text
    assert hf.encode("a<|endoftext|>b").ids == [97, 256, 98] and hf.get_vocab_size() == 257


def test_exported_directory_loads_in_transformers(tmp_path_factory, tmp_path):
    """Where transformers is installed: AutoTokenizer on the byte-tokenizer export round-trips a
    text with our ids and knows EOS (skipped otherwise; the file-level checks above always run)."""
    transformers = pytest.importorskip("transformers")
    _, run_dir = edit_run(tmp_path_factory)
    out = tmp_path / "hf"
    assert export_main(["--run-dir", run_dir, "--out", str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def f(x):\n    return x  # é\n"
    assert tok(text)["input_ids"] == list(text.encode("utf-8")) and tok.eos_token_id == 256
    assert tok.decode(list(text.encode("utf-8"))) == text
