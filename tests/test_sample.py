"""Sampling: the KV-cache forward against the plain forward, the sampler against a naive
re-run-the-window loop, determinism for a seed, and `edit-jax sample` on real run dirs (θ̄ read
back from the checkpoint, byte tokenizer and tokenizer.json, clear errors)."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.localsgd.state import state_shapes
from edit_jax.models import llama as model_lib
from edit_jax.models.decode import forward_cached, init_cache
from edit_jax.rundir.checkpoint import Checkpointer
from edit_jax.rundir.trained import TrainedModelError, load_trained
from edit_jax.commands.sample import Sampler, main as sample_main
from tests.helpers import tiny_config
from tests.trained_runs import edit_run, tokenizer_run
from tests.stages import one_stage


def _model(init_std=0.02, **kw):
    cfg = tiny_config(model={"init_std": init_std, **kw}).model  # GQA: 4 query heads, 2 kv heads
    return cfg, model_lib.init_params(cfg, jax.random.key(3))


@pytest.mark.parametrize("tie", [False, True])
def test_cached_logits_match_uncached(tie):
    cfg, params = _model(tie_embeddings=tie)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size)
    full, _ = model_lib.forward(cfg, params, tokens)
    # Prefill 10 tokens into a cache of 32 slots, then one token at a time.
    cache = init_cache(cfg, 2, 32)
    step = jax.jit(lambda p, t, c, pos: forward_cached(cfg, p, t, c, pos))
    logits, cache = step(params, tokens[:, :10], cache, 0)
    got = [logits]
    for i in range(10, 24):
        logits, cache = step(params, tokens[:, i:i + 1], cache, jnp.int32(i))
        got.append(logits)
    got = jnp.concatenate(got, axis=1)
    assert float(jnp.max(jnp.abs(full))) > 1e-3  # not trivially zero
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=2e-5, rtol=1e-4)


def _naive_greedy(cfg, params, prompt, n, context):
    """No cache: re-run the plain forward on the current window for every token; when the window
    would pass `context` tokens it restarts from the last context // 2 (the sampler's rule).
    The window is right-padded to `context` (one compile; causal, so padding cannot leak back)."""
    fwd = jax.jit(lambda p, t: model_lib.forward(cfg, p, t)[0])
    seq, start = list(prompt[-context:]), 0
    for _ in range(n):
        if len(seq) - start > context:
            start = len(seq) - context // 2
        window = seq[start:]
        logits = fwd(params, jnp.asarray([window + [0] * (context - len(window))], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, len(window) - 1, :257])))
    return seq[len(prompt[-context:]):]


def test_sampler_matches_naive_loop_including_context_restart():
    cfg, params = _model(init_std=0.5)  # large weights: well separated logits, no argmax near-ties
    prompt = np.asarray([256, 5, 17, 99], np.int32)
    sampler = Sampler(cfg, params, context=8, eos_id=256, vocab_limit=257)
    gen = sampler.generate(prompt, 20, temperature=0.0, stop_at_eos=False)
    assert gen.tokens[0].tolist() == _naive_greedy(cfg, params, prompt.tolist(), 20, 8)
    assert gen.steps == 19


def test_sampling_is_deterministic_for_a_seed():
    cfg, params = _model(init_std=0.5)
    sampler = Sampler(cfg, params, context=16, eos_id=256, vocab_limit=257)
    prompt = np.asarray([256, 1, 2], np.int32)
    kw = dict(temperature=1.0, top_k=0, num_samples=3, stop_at_eos=False)
    a = sampler.generate(prompt, 40, seed=7, **kw).tokens
    b = sampler.generate(prompt, 40, seed=7, **kw).tokens
    c = sampler.generate(prompt, 40, seed=8, **kw).tokens
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and (a[0] != a[1]).any()  # other seed, other rows: other draws
    assert a.max() < 257  # the padding ids 257..319 are never drawn
    greedy = sampler.generate(prompt, 10, temperature=0.0, stop_at_eos=False).tokens
    top1 = sampler.generate(prompt, 10, temperature=1.0, top_k=1, seed=3, stop_at_eos=False).tokens
    np.testing.assert_array_equal(greedy, top1)  # top-k 1 leaves only the argmax


def test_stops_at_eos():
    """Layers silenced (wo = w_down = 0): the last token's embedding alone picks the next token.
    Token 0's embedding u points the head at token 5; token 5's v points it at EOS."""
    cfg, params = _model()
    d = cfg.d_model
    u, v = np.zeros(d, np.float32), np.zeros(d, np.float32)
    u[: d // 2], v[d // 2:] = 1.0, 1.0
    embed = np.zeros((cfg.vocab_size, d), np.float32)
    embed[0], embed[5], embed[256] = u, v, u
    head = np.zeros((d, cfg.vocab_size), np.float32)
    head[:, 5], head[:, 256] = 10 * u, 10 * v
    layers = dict(params["layers"])
    layers["attn"] = {**layers["attn"], "wo": jnp.zeros_like(layers["attn"]["wo"])}
    layers["mlp"] = {**layers["mlp"], "w_down": jnp.zeros_like(layers["mlp"]["w_down"])}
    params = {"root": {**params["root"], "embed": embed, "lm_head": head}, "layers": layers}
    sampler = Sampler(cfg, params, 16, eos_id=256, vocab_limit=257)
    gen = sampler.generate(np.asarray([256, 0]), 30, temperature=0.0, num_samples=2)
    assert gen.tokens.tolist() == [[5, 256], [5, 256]] and gen.lengths.tolist() == [2, 2]
    assert gen.steps == 1  # stopped: no step after the EOS
    # Without the stop, generation runs past EOS (EOS's embedding is u again) and keeps every token.
    assert sampler.generate(np.asarray([256, 0]), 5, temperature=0.0, stop_at_eos=False).tokens.tolist() == \
        [[5, 256, 5, 256, 5]]


def test_load_trained_picks_outer_params_or_replica(tmp_path_factory):
    cfg, run_dir = edit_run(tmp_path_factory)
    host, _ = Checkpointer(run_dir, 3).restore_host(6, state_shapes(cfg))  # the whole saved state
    latest = load_trained(run_dir)
    assert (latest.step, latest.source) == (6, "outer")
    jax.tree.map(np.testing.assert_array_equal, latest.params, host.outer.params)
    # θ̄ differs from the replicas' params (they took local steps after the last sync).
    assert any((np.asarray(a) != np.asarray(b)[0]).any()
               for a, b in zip(jax.tree.leaves(latest.params), jax.tree.leaves(host.params), strict=True))
    warm = load_trained(run_dir, step=2)  # step <= W: θ̄ not set yet, the replicas are identical
    host2, _ = Checkpointer(run_dir, 3).restore_host(2, state_shapes(cfg))
    assert (warm.step, warm.source) == (2, "replica")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)[1]), warm.params, host2.params)


def test_cli_sample_byte_tokenizer(tmp_path_factory, capsys):
    one_stage("3.12", "sampling with the byte tokenizer", 6,
              other="test_cli_sample_tokenizer_json")
    _, run_dir = edit_run(tmp_path_factory)
    args = ["--run-dir", run_dir, "--prompt", "def ", "--max-tokens", "12", "--seed", "3", "--no-eos-stop"]
    assert sample_main(args) == 0
    first = capsys.readouterr()
    assert sample_main(args) == 0
    second = capsys.readouterr()
    assert first.out == second.out and first.out.startswith("def ")
    assert "step 6" in first.err and "outer params" in first.err
    assert sample_main(args[:6] + ["--seed", "4", "--no-eos-stop", "--step", "4"]) == 0
    third = capsys.readouterr()
    assert "step 4" in third.err and third.out.startswith("def ")


def test_cli_sample_tokenizer_json(tmp_path_factory, capsys):
    one_stage("default", "sampling with a tokenizer.json", 6,
              other="test_cli_sample_byte_tokenizer")
    pytest.importorskip("tokenizers")
    _, run_dir, tok_path = tokenizer_run(tmp_path_factory)
    assert sample_main(["--run-dir", run_dir, "--prompt", "def f", "--max-tokens", "8", "--no-eos-stop"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def f") and "replica" in out.err  # Baseline: the replicas' params
    # The run dir holds its own copy (issue 21): sampling does not need data.tokenizer's file.
    copy = os.path.join(run_dir, "tokenizer.json")
    assert open(copy, "rb").read() == open(tok_path, "rb").read() and os.stat(copy).st_mode & 0o777 == 0o644
    moved = tok_path + ".moved"
    shutil.move(tok_path, moved)
    try:
        assert sample_main(["--run-dir", run_dir, "--prompt", "def f", "--max-tokens", "8", "--no-eos-stop"]) == 0
        assert capsys.readouterr().out == out.out  # the same text, from the copy
        # A run dir without the copy (trained before it existed): the error names the file and the flag.
        shutil.move(copy, copy + ".aside")
        try:
            assert sample_main(["--run-dir", run_dir, "--max-tokens", "4"]) == 2
            err = capsys.readouterr().err
            assert tok_path in err and "--tokenizer" in err
            assert sample_main(["--run-dir", run_dir, "--max-tokens", "4", "--tokenizer", moved]) == 0
        finally:
            shutil.move(copy + ".aside", copy)
    finally:
        shutil.move(moved, tok_path)


def test_clear_errors(tmp_path_factory, tmp_path, capsys):
    _, run_dir = edit_run(tmp_path_factory)
    assert sample_main(["--run-dir", run_dir, "--step", "5"]) == 2
    err = capsys.readouterr().err
    assert "step 5" in err and "2, 4, 6" in err and os.path.join(run_dir, "checkpoints") in err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TrainedModelError, match=r"has no checkpoint .*checkpoints/<step>/state"):
        load_trained(str(empty))
    with pytest.raises(TrainedModelError, match="not found"):
        load_trained(str(tmp_path / "nowhere"))
    assert sample_main(["--run-dir", run_dir, "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--temperature", "nan"], ["--temperature", "inf"], ["--temperature", "-0.5"],
                                   ["--top-k", "-1"], ["--top-p", "0"], ["--top-p", "1.5"], ["--top-p", "nan"]])
def test_nonsense_sampling_flags_are_refused(tmp_path_factory, capsys, flags):
    """Issue 22, case 11: a NaN temperature sampled NUL bytes with exit 0; a temperature must be a
    finite number >= 0 (and top-k >= 0): one line naming the flag, exit 2, before any work."""
    _, run_dir = edit_run(tmp_path_factory)
    capsys.readouterr()
    assert sample_main(["--run-dir", run_dir, "--max-tokens", "4", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and flags[0] in captured.err and flags[1] in captured.err, captured.err
    assert captured.out == ""


def test_top_p_draws_only_from_the_nucleus():
    """The nucleus recomputed in NumPy (sort, softmax at the temperature, the smallest prefix whose
    mass reaches p): 400 draws of rows with the same logits fall in it and cover it."""
    from edit_jax.commands.sample import choose

    rng = np.random.default_rng(0)
    logits = rng.normal(size=16).astype(np.float32) * 2
    for top_p, temperature, top_k in [(0.5, 1.0, 0), (0.8, 0.7, 0), (0.9, 1.3, 5), (0.01, 1.0, 0)]:
        z = logits.copy()
        if top_k:
            z[z < np.sort(z)[::-1][top_k - 1]] = -np.inf
        z = z / temperature
        order = np.argsort(-z)
        probs = np.exp(z[order] - z[order][0])
        probs /= probs.sum()
        size = int(np.searchsorted(np.cumsum(probs), top_p) + 1)  # the smallest prefix with mass >= p
        nucleus = set(order[:size].tolist())
        rows = jnp.asarray(np.tile(logits, (400, 1)))
        drawn = set(np.asarray(choose(rows, jax.random.key(1), temperature, top_k, 16, top_p)).tolist())
        assert drawn == nucleus, (top_p, temperature, top_k, drawn, nucleus)


def test_run_dir_tokenizer_copy_is_never_replaced_by_another(tmp_path):
    """Training stores data.tokenizer in RUN_DIR/tokenizer.json once; a later run on that dir with
    another tokenizer file is refused, naming both, and the copy is left as it was."""
    from edit_jax.data import DataError
    from edit_jax.rundir.trained import store_run_tokenizer

    cfg = tiny_config()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text('{"version": "1.0", "a": 1}')
    second.write_text('{"version": "1.0", "b": 2}')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg.data.tokenizer = str(first)
    store_run_tokenizer(cfg, str(run_dir))
    store_run_tokenizer(cfg, str(run_dir))  # the same file again: nothing to do
    assert (run_dir / "tokenizer.json").read_text() == first.read_text()
    cfg.data.tokenizer = str(second)
    with pytest.raises(DataError, match=r"tokenizer.json differs from data.tokenizer=.*b.json"):
        store_run_tokenizer(cfg, str(run_dir))
    assert (run_dir / "tokenizer.json").read_text() == first.read_text()
    cfg.data.tokenizer = "byte"
    store_run_tokenizer(cfg, str(tmp_path / "none"))  # the byte tokenizer: no file, nothing written
    assert not (tmp_path / "none").exists()
