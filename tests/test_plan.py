"""``edit-jax plan``: the compiled program's memory, FLOPs and traffic, before any run."""

import json
import os
import subprocess
import sys

import jax

from edit_jax.localsgd.methods import plan_for
from edit_jax.models.llama import count_params, init_params
from edit_jax.tools.plan import plan, step_kinds
from tests.helpers import REPO, tiny_config


def test_plan_of_a_small_edit_config():
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


def test_step_kinds_follow_the_schedule():
    cfg = tiny_config(2, 2, method="diloco", sync={"warmup_steps": 1, "tau": 3})
    assert step_kinds(plan_for(cfg).schedule, cfg) == ["hsdp", "local", "local_then_sync"]
    assert step_kinds(plan_for(tiny_config(2, 2)).schedule, tiny_config(2, 2)) == ["hsdp"]


def test_cli_writes_json_with_fits_and_exit_codes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
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
