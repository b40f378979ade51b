"""``edit-jax plan``: the compiled program's memory, FLOPs and traffic, before any run."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import jax
import pytest

from edit_jax.localsgd.methods import plan_for
from edit_jax.models.llama import count_params, init_params
from edit_jax.commands.plan import plan, step_kinds
from tests.helpers import REPO, child_xla_flags, tiny_config
from tests.stages import one_stage


def test_plan_of_a_small_edit_config():
    one_stage("default", "plan of a small EDiT config", 20,
              other="test_cli_writes_json_with_fits_and_exit_codes")
    cfg = tiny_config(2, 2, method="edit", sync={"warmup_steps": 2, "tau": 4})
    p = plan(cfg)
    assert p["fits"] is True and list(p["steps"]) == ["hsdp", "local", "sync_forward"]
    # params: every one FSDP-sharded over `shard` (2), replicated over `replica`, fp32
    n_params = count_params(jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0))))
    assert p["state_per_device"]["params"]["device_bytes"] == n_params * 4 / 2
    assert p["state_per_device"]["outer"]["device_bytes"] >= n_params * 4 / 2  # θ̄ + the Nesterov trace
    # a local step sends nothing across replica; the sync step and the hsdp step do
    assert p["steps"]["local"]["replica_ring_bytes"] == 0
    assert p["steps"]["sync_forward"]["replica_ring_bytes"] > 0 and p["steps"]["hsdp"]["replica_ring_bytes"] > 0
    window = p["tau_window"]["mean_replica_ring_bytes_per_step"]
    assert abs(window - p["steps"]["sync_forward"]["replica_ring_bytes"] / 4) < 1e-6 * window
    assert all(v["flops"] is None or v["flops"] > 0 for v in p["steps"].values())
    assert plan(cfg, device_memory_gb=1e-6)["fits"] is False
    # one estimate per step kind; the verdict is the state plus the largest
    state = p["state_per_device"]["total_device_bytes"]
    needs = {k: v["gpu_estimate_bytes"] for k, v in p["steps"].items()}
    assert needs == {k: state + e["total_bytes"] for k, e in p["gpu_estimate_by_kind"].items()}
    assert p["gpu_estimate_total_gb"] * 2 ** 30 == max(needs.values()) and p["estimate_fits"] is True


def test_step_kinds_follow_the_schedule():
    cfg = tiny_config(2, 2, method="diloco", sync={"warmup_steps": 1, "tau": 3})
    assert step_kinds(plan_for(cfg).schedule, cfg) == ["hsdp", "local", "local_then_sync"]
    assert step_kinds(plan_for(tiny_config(2, 2)).schedule, tiny_config(2, 2)) == ["hsdp"]


def test_cli_writes_json_with_fits_and_exit_codes(tmp_path):
    one_stage("3.12", "plan's CLI, JSON and exit codes", 23,
              other="test_plan_of_a_small_edit_config")
    env = dict(os.environ, XLA_FLAGS=child_xla_flags())
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "edit_jax", "plan", "--config", "configs/tiny.py", "mesh.replica=2", "mesh.shard=2",
           "method=diloco", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "fits:" in proc.stdout, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["fits"] is True and data["config"]["mesh"] == [2, 2] and "local_then_sync" in data["steps"]
    proc = subprocess.run(cmd + ["--device-memory", "0.000001"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "does NOT fit" in proc.stdout and json.loads(out.read_text())["fits"] is False
    proc = subprocess.run(cmd + ["optim.grad_accum=3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "optim.grad_accum" in proc.stderr, proc.stderr


def test_gpu_estimate_terms_against_a_hand_computation():
    from edit_jax.analysis.memory_estimate import gpu_estimate

    # tiny model on 2 x 2: b = 16 / 4 = 4 rows, T = 64, d = 64, f = 128, L = 2, h = 4 (2 kv heads,
    # head dim 16), V = 320, bf16 (c = 2), one loss chunk (loss_chunk 1024 >= T), remat
    cfg = tiny_config(2, 2, method="edit", seq_len=64, model={"compute_dtype": "bfloat16", "remat": True,
                                                              "attention": "xla"})
    b, t, d, f, n_layers, h, v, c = 4, 64, 64, 128, 2, 4, 320, 2
    act, mlp, logits = b * t * d * c, b * t * f * c, b * t * v * 4
    p = d * 16 * (2 * 4 + 2 * 2) + 3 * d * f + 2 * d  # q, o (4 heads), k, v (2 heads), MLP, norms
    layer_params = 4 * n_layers * p / 2  # fp32, sharded over shard = 2
    scores = b * h * t * t * (2 * 4 + 2 * c)  # fp32 scores + gradient, bf16 probabilities + gradient
    common = n_layers * act + layer_params + act + 2 * v * d * c
    local = gpu_estimate(cfg, 1000.0, "local")
    assert local["phases"]["loss"] == common + 3 * logits + 8 * act
    assert local["phases"]["layer"] == (common + layer_params + 4 * mlp + 8 * act + scores + 2 * p * c + logits)
    assert local["total_bytes"] == local["phases"]["layer"] and local["fused_attention"] is False
    sync = gpu_estimate(cfg, 1000.0, "sync_forward", synced_bytes=777.0)
    assert sync["phases"]["layer"] == common + layer_params + 4 * mlp + 4 * act + scores + 2 * p * c + 777.0
    assert sync["phases"]["loss"] == common + 3 * logits + 4 * act
    # with cuDNN's fused attention (auto on a GPU, bf16) no scores: the loss backward is the peak
    fused = gpu_estimate(replace(cfg, model=replace(cfg.model, attention="auto")), 1000.0, "local")
    assert fused["fused_attention"] and fused["phases"]["layer"] == local["phases"]["layer"] - scores
    assert fused["peak_phase"] == "loss" and fused["total_bytes"] == local["phases"]["loss"]
    # gradient accumulation keeps a running sum of the whole fp32 gradient (params_device_bytes)
    acc = gpu_estimate(replace(cfg, optim=replace(cfg.optim, grad_accum=2)), 1000.0, "local")
    assert acc["rows_per_micro_batch"] == 2 and acc["parts"]["grad_accumulation"] == 1000.0
    # model.remat_saves keeps the projections (q 4 x 16, k and v 2 x 16, gate and up f, one d) and,
    # with cuDNN's attention, its output and fp32 softmax statistics, for every layer
    dots = gpu_estimate(replace(cfg, model=replace(cfg.model, remat_saves="dots")), 1000.0, "local")
    projections = n_layers * b * t * (64 + 2 * 32 + 2 * f + d) * c
    assert dots["parts"]["saved_activations"] == n_layers * act + projections
    attn = gpu_estimate(replace(cfg, model=replace(cfg.model, remat_saves="dots_attention", attention="auto")),
                        1000.0, "local")
    assert attn["parts"]["saved_activations"] == n_layers * (act + b * t * 64 * c + b * h * t * 4) + projections


def test_gpu_estimate_says_the_7b_preset_does_not_fit_80_gb_with_unfused_attention():
    from edit_jax.presets import paper
    from edit_jax.analysis.memory_estimate import gpu_estimate

    cfg = paper("7b", "edit")
    n_params = count_params(jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0))))
    params = n_params * 4 / cfg.mesh.shard  # fp32, FSDP over shard = 8
    state = 5 * params  # params, AdamW's two moments, θ̄ and the outer momentum
    fused = gpu_estimate(cfg, params, "local")["total_bytes"]
    unfused = gpu_estimate(replace(cfg, model=replace(cfg.model, attention="xla")), params, "local")["total_bytes"]
    # XLA:GPU for an H100 (79.1 GiB): 50.6 GiB with cuDNN attention, 145.4 GiB with XLA's
    assert state + fused < 79 * 2 ** 30 < state + unfused
    assert unfused - fused > 32 * 16 * 4096 * 4096 * 12 * 0.95  # [16, 32, 4096, 4096] scores, 12 B each


@pytest.mark.parametrize("where", ["missing_dir", "under_a_file", "directory", "unwritable_dir"])
def test_json_path_that_cannot_be_written_is_refused_before_compiling(tmp_path, monkeypatch, capsys, where):
    """Issue 42 item 2: ``--json`` under a missing directory was a FileNotFoundError traceback
    (exit 1) after the whole compile. Now checked first, as ``export --out`` is (the same check,
    rundir.runlock.output_path_problem): one line naming the path, exit 2, nothing compiled."""
    from edit_jax.rundir import runlock
    from edit_jax.commands import plan as plan_mod

    monkeypatch.setattr(plan_mod, "plan", lambda *a, **k: pytest.fail("compiled with an unwritable --json"))
    (tmp_path / "a_file").write_text("x")
    missing, a_file = str(tmp_path / "missing"), str(tmp_path / "a_file")
    path, why = {"missing_dir": (tmp_path / "missing" / "plan.json", f"directory {missing!r} does not exist"),
                 "under_a_file": (tmp_path / "a_file" / "plan.json", f"{a_file!r} is not a directory"),
                 "directory": (tmp_path, "is a directory (expected a file path)"),
                 "unwritable_dir": (tmp_path / "ro" / "plan.json", "no write permission in")}[where]
    if where == "unwritable_dir":  # as root os.access says yes to anything: the check is asked "no"
        (tmp_path / "ro").mkdir()
        real = os.access
        monkeypatch.setattr(runlock.os, "access", lambda p, mode, **k: False if os.fspath(p) == str(tmp_path / "ro")
                            else real(p, mode, **k))
    code = plan_mod.main(["--config", os.path.join(REPO, "configs", "tiny.py"), "--json", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("edit-jax: plan error: --json"), err
    assert repr(str(path)) in err and why in err, err
    assert not path.exists() or path.is_dir()
