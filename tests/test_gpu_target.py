"""XLA:GPU's own program for an H100, compiled without a GPU (issue 29): ``edit-jax plan --target``.

Needs the CUDA plugin (the ``cuda`` extra; CI's Python 3.12 stage installs it); skipped where it
is absent. One tiny EDiT config (2 x 2 mesh, bf16, remat, a real layer loop) is compiled once for
the module: its sync step crosses ``replica`` once per unit and cuDNN's attention is in it. plan's
estimate is checked against XLA:GPU's peak on the same config widened (d 256, ffn 768, vocab 4096,
1024 tokens in loss chunks of 256), so that activations and logits, not XLA's fixed buffers, make
the peak: its local and sync steps, compiled once more each.
"""

import os
import subprocess
import sys

import jax
import pytest

from edit_jax.analysis.gpu_target import TARGETS, cuda_plugin_missing, load_target
from tests.helpers import REPO, tiny_config

needs_cuda = pytest.mark.skipif(cuda_plugin_missing() is not None,
                                reason="the CUDA plugin (pip install -e '.[cuda]') is not installed")
GPU_CFG = dict(method="edit", sync={"warmup_steps": 1, "tau": 4}, seq_len=128,
               model={"remat": True, "scan_unroll": 1, "n_layers": 3, "compute_dtype": "bfloat16"})
# The sync in flight under most of the layer's GEMM FLOPs and its attention (issue 40: >= 80% at the
# 1B / 7B presets, where it is 100%; this tiny layer, d 64, gets 3 of its 4 GEMMs, 78%; 33% before)
WINDOW_GEMM_SHARE = 0.75
WIDE_CFG = {**GPU_CFG, "seq_len": 1024, "model": {**GPU_CFG["model"], "d_model": 256, "ffn_dim": 768,
                                                  "vocab_size": 4096, "loss_chunk": 256}}


@pytest.fixture(scope="module")
def h100_sync_step():
    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.localsgd.sharding import BATCH_SPEC, named
    from edit_jax.runtime.mesh import make_mesh
    from edit_jax.analysis import gpu_plan
    from edit_jax.analysis.gpu_target import target_devices

    cfg = tiny_config(2, 2, **GPU_CFG)
    programs = StepPrograms.for_config(cfg, make_mesh(cfg.mesh, target_devices(load_target("h100"), 4)))
    abstract = programs.abstract_state()
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.data.seq_len + 1), jax.numpy.int32,
                                 sharding=named(programs.mesh, BATCH_SPEC))
    compiled = programs.lowered("sync_forward", abstract, batch).compile()
    return programs, compiled.as_text(), gpu_plan.step_report(compiled, "sync_forward", programs, 0.0)


def _memory_reports(gpu_cfg: dict, kinds: tuple[str, ...]) -> dict:
    """XLA:GPU's memory figures (``gpu_plan.step_report``) of each step kind of ``gpu_cfg``'s tiny
    config, with plan's estimate (state + ``gpu_estimate`` of that kind) beside them."""
    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.localsgd.sharding import BATCH_SPEC, named
    from edit_jax.runtime.mesh import make_mesh
    from edit_jax.analysis import gpu_plan
    from edit_jax.analysis.gpu_target import target_devices
    from edit_jax.commands.plan import gpu_estimate, state_bytes

    cfg = tiny_config(2, 2, **gpu_cfg)
    programs = StepPrograms.for_config(cfg, make_mesh(cfg.mesh, target_devices(load_target("h100"), 4)))
    abstract = programs.abstract_state()
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.data.seq_len + 1), jax.numpy.int32,
                                 sharding=named(programs.mesh, BATCH_SPEC))
    state = state_bytes(abstract)
    out = {}
    for kind in kinds:
        compiled = programs.lowered(kind, abstract, batch).compile()
        synced = gpu_plan.sync_units(programs, kind)[1] * 2 if kind.startswith("sync_forward") else None  # bf16
        need = state["total_device_bytes"] + gpu_estimate(cfg, state["params"]["device_bytes"], kind,
                                                          synced)["total_bytes"]
        out[kind] = gpu_plan.step_report(compiled, kind, programs, need)["memory"]
    return out


@needs_cuda
def test_attention_follows_the_mesh_devices_not_the_default_backend(h100_sync_step):
    programs, text, _ = h100_sync_step
    assert jax.default_backend() == "cpu" and programs.mesh.devices.flat[0].platform == "gpu"
    assert programs.model_cfg.attention == "cudnn"
    fmha = [line for line in text.splitlines() if "__cudnn$fmha" in line]
    assert fmha and all("bf16[" in line for line in fmha)


@needs_cuda
def test_sync_step_crosses_replica_once_per_unit(h100_sync_step):
    programs, _, report = h100_sync_step
    o = report["sync_overlap"]
    assert o["units"] == programs.cfg.model.n_layers + 1
    # each unit's elements once (XLA may split a layer's all-reduce in pieces, xla_options; and
    # combine the root's with layer 0's, both before the loop), and the bytes no more than that
    assert o["once_per_unit"] and o["elements_moved"] <= 1.05 * o["unit_elements"], o
    assert o["replica_tensor_collectives_per_step"] >= o["units"] - 1, o
    assert any(c["async"] and c["compute_between"] > 0 for c in o["collectives"] if c["in_loop"]), o["collectives"]


@needs_cuda
def test_sync_window_holds_the_layer_gemms_and_attention(h100_sync_step):
    """The layer loop issues layer l+1's sync in iteration l (llama ``_pipelined_layers``): its
    all-reduce across ``replica`` is async, and the GEMMs and cuDNN attention issued while it is in
    flight (``gpu_window.sync_window``) are most of the layer's forward compute (issue 40)."""
    w = h100_sync_step[2]["sync_window"]
    assert w["layer_gemms"] >= 4 and w["layer_attention_calls"] == 1 and w["pieces"] >= 2, w
    assert w["gemm_share"] >= WINDOW_GEMM_SHARE and w["attention_inside"], w
    assert w["window_flops"] <= w["layer_flops"] and w["bare_pieces"] < w["pieces"], w


@needs_cuda
def test_sync_window_flops_and_verdict_against_numpy(h100_sync_step):
    """The layer's GEMM FLOPs from the program equal the model's (NumPy: 2 x tokens x each weight
    matrix's size per device), and the verdict's times follow from the window and the link."""
    import numpy as np

    from edit_jax.analysis import gpu_window

    programs, _, report = h100_sync_step
    w, m = report["sync_window"], programs.cfg.model
    tokens = programs.cfg.batch_size // programs.n * programs.cfg.data.seq_len // programs.s
    kv = m.n_kv_heads * (m.d_model // m.n_heads)
    weights = np.array([m.d_model * m.d_model, m.d_model * kv, m.d_model * kv, m.d_model * m.d_model,
                        3 * m.d_model * m.ffn_dim], dtype=np.float64)
    assert w["layer_gemm_flops"] == pytest.approx(2.0 * tokens * weights.sum(), rel=1e-6), w
    v = gpu_window.window_verdict(w, 0.001, gpu_window.H100_BF16_PEAK_FLOPS)
    assert v["sync_ms"] == pytest.approx(w["sync_ring_bytes_per_layer"] * 8 / 1e6 * 1e3)
    bare = w["bare_ring_bytes_per_layer"] * 8 / 1e6 * 1e3
    assert not v["hidden"] and v["exposed_ms_per_layer"] == pytest.approx(
        bare + max(0.0, v["sync_ms"] - bare - v["window_ms_at_mfu"]))
    fast = gpu_window.window_verdict({**w, "bare_ring_bytes_per_layer": 0.0}, 1e9, gpu_window.H100_BF16_PEAK_FLOPS)
    assert fast["verdict"] == "hidden" and fast["exposed_ms_per_layer"] == 0.0


@needs_cuda
def test_estimate_within_its_band_of_xla_gpu():
    reports = _memory_reports(WIDE_CFG, ("local", "sync_forward"))
    local_step, sync_step = reports["local"], reports["sync_forward"]
    for m in reports.values():
        assert m["peak_bytes"] > 0 and m["argument_bytes"] > 0 and m["alias_bytes"] > 0
    # the local step: within 5%, as at the paper presets (docs/benchmarks/gpu-program.md, the estimate
    # against XLA:GPU's peak); the sync step: XLA schedules it here as the local step (it keeps the first
    # chunk's logit gradient and 8 activations of the recomputed layer), where at the 7B preset it
    # keeps neither, so the estimate's sync terms, read from the presets, are 13% under at this size
    assert 0.95 <= local_step["estimate_over_xla"] <= 1.05, local_step
    assert 0.85 <= sync_step["estimate_over_xla"] <= 1.05, sync_step


def _plan_cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "edit_jax", "plan", "--config", "configs/tiny.py", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_bad_target_is_one_line_naming_it(tmp_path):
    proc = _plan_cli("--target", "h900")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--target: unknown GPU 'h900'" in proc.stderr
    bad = tmp_path / "x.txtpb"
    bad.write_text("not a description\n")
    proc = _plan_cli("--target-file", str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and str(bad) in proc.stderr, proc.stderr
    assert all(load_target(t).memory_bytes > 40e9 for t in TARGETS)


@pytest.mark.skipif(cuda_plugin_missing() is None, reason="the CUDA plugin is installed here")
def test_missing_cuda_plugin_is_one_line_exit_2():
    proc = _plan_cli("--target", "h100")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "CUDA plugin" in proc.stderr and "pip install -e '.[cuda]'" in proc.stderr


def test_gpu_programs_get_the_overlap_options_unless_xla_flags_set_them():
    from edit_jax.localsgd.xla_options import COMBINE, GPU_OVERLAP, SYNC_PIECES, compiler_options

    assert compiler_options("gpu", "") == GPU_OVERLAP
    # a layer's sync of 100 MB per device crosses replica in SYNC_PIECES all-reduces of at most 25 MB
    opts = compiler_options("gpu", "", layer_sync_bytes=100_000_001)
    assert opts[COMBINE] == 25_000_001 and SYNC_PIECES * opts[COMBINE] >= 100_000_001
    assert COMBINE not in compiler_options("gpu", f"--{COMBINE}=1 --x=1", layer_sync_bytes=100)
    assert "xla_disable_hlo_passes" not in compiler_options("gpu", "--xla_disable_hlo_passes=foo", 100)
    assert compiler_options("cpu", "", 100) == {}


@pytest.mark.parametrize("kind", ["binary", "missing", "directory", "unreadable"])
def test_target_file_that_cannot_be_a_description_is_one_line_exit_2(tmp_path, monkeypatch, capsys, kind):
    """Issue 42 item 1: ``--target-file`` a binary file was an 18-line UnicodeDecodeError traceback
    (exit 1). That, a missing path, a directory and an unreadable file: one line naming the path
    and what was expected, exit 2, before any compile (in-process: ``plan.main``)."""
    import errno

    from edit_jax.analysis import gpu_target
    from edit_jax.commands import plan as plan_mod

    monkeypatch.setattr(plan_mod, "plan", lambda *a, **k: pytest.fail("compiled with a bad --target-file"))
    path = tmp_path / "target.txtpb"
    if kind == "binary":
        path.write_bytes(bytes(range(256)) * 8)  # 0x80.. is no UTF-8 start byte
    elif kind == "directory":
        path.mkdir()
    elif kind == "unreadable":  # as root chmod 000 reads anyway: the open itself refuses
        with open(os.path.join(gpu_target.TARGETS_DIR, "h100.txtpb")) as f:
            path.write_text(f.read())
        real = open

        def refusing(p, *a, **k):
            if os.fspath(p) == str(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real(p, *a, **k)

        monkeypatch.setattr(gpu_target, "open", refusing, raising=False)
    code = plan_mod.main(["--config", os.path.join(REPO, "configs", "tiny.py"), "--target-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("edit-jax: plan error: --target-file"), err
    assert str(path) in err and "GpuTargetConfigProto" in err and "gpu_targets/h100.txtpb" in err, err


@pytest.mark.parametrize("flag", ["--link-gbps", "--device-memory"])
@pytest.mark.parametrize("rate", ["0", "-5", "nan"])
def test_link_gbps_must_be_positive_one_line_exit_2(monkeypatch, capsys, rate, flag):
    from edit_jax.commands import plan as plan_mod

    monkeypatch.setattr(plan_mod, "plan", lambda *a, **k: pytest.fail(f"compiled with a bad {flag}"))
    code = plan_mod.main(["--config", os.path.join(REPO, "configs", "tiny.py"), flag, rate])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{flag} must be a positive number" in err, err
