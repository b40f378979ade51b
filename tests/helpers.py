"""Shared test helpers: tiny configs and meshes on the CPU-emulated devices of conftest.py."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from edit_jax.config import Config, DataConfig, MeshConfig, OptimConfig, PenaltyConfig, SyncConfig
from edit_jax.models.llama import preset
from edit_jax.runtime.launch import without_cpu_device_count
from edit_jax.runtime.mesh import make_mesh
from edit_jax.validate import validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example(name: str):
    """``examples/NAME.py`` imported as a module (its ``main`` callable in this process), registered
    in ``sys.modules``: flax's dataclasses look their module up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def child_xla_flags() -> str:
    """The suite's XLA_FLAGS (conftest.py) for a CLI process a test starts, less the device count:
    the CLI and the launcher set their own from the mesh."""
    return without_cpu_device_count(os.environ.get("XLA_FLAGS", ""))


def tiny_config(replica=2, shard=4, method="baseline", **kw) -> Config:
    sync = dict(kw.pop("sync", {}))
    penalty = sync.pop("penalty", {})  # (fields over K = 3, or a PenaltyConfig as it is)
    penalty = penalty if isinstance(penalty, PenaltyConfig) else PenaltyConfig(**{"anomaly_warmup": 3, **penalty})
    optim = kw.pop("optim", {})
    model = kw.pop("model", {})
    cfg = Config(model=preset("tiny", **model), mesh=MeshConfig(replica=replica, shard=shard),
                 data=DataConfig(seq_len=kw.pop("seq_len", 32)),
                 optim=OptimConfig(**{"lr": 3e-3, "warmup_steps": 0, **optim}),
                 sync=SyncConfig(**{"method": method, "warmup_steps": 0, "tau": 2, **sync, "penalty": penalty}),
                 **{"steps": 10, "batch_size": 16, "log_every": 1, "eval_every": 0, "eval_batches": 1,
                    "checkpoint_every": 0, **kw})
    validate(cfg)
    return cfg


def assert_stop_and_resume_is_exact(cfg, work_dir) -> None:
    """``cfg`` (6 steps, a checkpoint at 3) on a 2 x 2 mesh: stopped at step 3 and resumed, it logs
    the same losses and final validation loss as an uninterrupted run."""
    from edit_jax.training.train import train

    devices = jax.devices()[:4]
    full = train(cfg, os.path.join(work_dir, "full"), progress=False, devices=devices)
    first = train(cfg, os.path.join(work_dir, "cut"), progress=False, devices=devices, stop_after=3)
    assert first.interrupted and first.steps == 3
    rest = train(cfg, os.path.join(work_dir, "cut"), progress=False, devices=devices)
    assert rest.resumed_from == 3
    losses = {r["step"]: r["loss"] for r in first.history + rest.history}
    assert losses == {r["step"]: r["loss"] for r in full.history} and len(losses) == 6
    assert rest.final_val_loss == full.final_val_loss


def mesh_for(cfg):
    return make_mesh(cfg.mesh, jax.devices()[: cfg.mesh.replica * cfg.mesh.shard])


def random_batch(cfg, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (cfg.batch_size, cfg.data.seq_len + 1)).astype(np.int32)


def kill_group(proc) -> None:
    """Kills a process started with ``start_new_session=True`` and everything in its session (a
    launcher and its worker processes)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def interrupt_when(cmd: list[str], ready, env: dict | None = None, signals: int = 1,
                   wait: float = 120) -> tuple[int, str]:
    """Runs ``cmd`` from the repo in a session of its own, sends it ``signals`` SIGINTs (0.2 s apart)
    once ``ready()`` is true (at most ``wait`` seconds; the process must still be running), and
    waits for it: (exit code, stdout + stderr). The session is killed on the way out."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.time() + wait
        while not ready():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.02)
        for _ in range(signals):
            os.kill(proc.pid, signal.SIGINT)
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    return proc.returncode, out


def run_session(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Runs ``cmd`` from the repo in a session of its own: (exit code, stdout + stderr). Whatever is
    left of the session is killed on the way out (tests clean up by PID)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, out


def damage_checkpoint_arrays(ckpt_dir, spots=16, n=64) -> None:
    """Flips ``n`` bytes at ``spots`` places spread over every array data file of checkpoint
    ``ckpt_dir`` (``RUN_DIR/checkpoints/<step>``): which arrays land in which OCDBT data file
    depends on the timing of TensorStore's parallel writes, so every file is hit, and with it
    every array a reader may restore (the params too)."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(ckpt_dir, "state")) for f in fs
             if os.path.basename(r) == "d"]  # OCDBT's data files: <state>/ocdbt.process_*/d/<hash>
    assert files, f"no OCDBT data files under {ckpt_dir}/state"
    for victim in files:
        size = os.path.getsize(victim)
        with open(victim, "r+b") as f:
            for k in range(1, spots + 1):
                f.seek(size * k // (spots + 1))
                raw = f.read(n)
                f.seek(-len(raw), os.SEEK_CUR)
                f.write(bytes(b ^ 0xFF for b in raw))


def exchange_run_through(workdir, args: list[str], ex_dir: str, fault) -> str:
    """``edit-jax train ARGS`` (an exchange run of one-device workers) with ``fault()`` done once its
    round 1 closed; asserts it ends by itself, exit 0, no traceback; returns its output."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    log = open(os.path.join(workdir, "log.txt"), "w+")
    p = subprocess.Popen([sys.executable, "-m", "edit_jax", "train", *args], env=env, stdout=log,
                         stderr=subprocess.STDOUT, cwd=str(workdir))
    try:
        end = time.monotonic() + 120
        while not os.path.exists(os.path.join(ex_dir, "rounds", "r00000001.json")):
            assert time.monotonic() < end and p.poll() is None, "the run did not reach round 1"
            time.sleep(0.1)
        fault()
        code = p.wait(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    log.seek(0)
    out = log.read()
    assert code == 0 and "Traceback" not in out, out[-3000:]
    return out
