"""``--distributed``: which process of a cluster job this is and which devices of its host it owns
(``edit_jax/cluster.py``), from emulated SLURM / explicit environments, and a real 2-process join."""

import os
import socket
import subprocess
import sys

import pytest

from edit_jax.runtime.cluster import ClusterError, cluster_params, local_device_ids
from edit_jax.runtime.compile_cache import ENV_DIR
from tests.helpers import REPO, child_xla_flags
from tests.stages import one_stage

SLURM_ONE_TASK_PER_NODE = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "8", "SLURM_PROCID": "3", "SLURM_LOCALID": "0",
                           "SLURM_STEP_NODELIST": "node[001-008]", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def test_slurm_one_task_per_node_owns_all_eight_gpus():
    """The README's layout (--ntasks-per-node=1 --gpus-per-node=8): JAX's own detection gives
    local_device_ids=[SLURM_LOCALID]=[0], one GPU; each process must own all eight."""
    p = cluster_params(SLURM_ONE_TASK_PER_NODE, processes=8, shard=8)
    assert (p.num_processes, p.process_id, p.local_device_ids) == (8, 3, tuple(range(8)))
    assert p.coordinator is None and p.source == "SLURM"  # JAX reads the node list


def test_several_processes_per_host_split_its_devices():
    env = {**SLURM_ONE_TASK_PER_NODE, "SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}
    assert cluster_params(env, processes=16, shard=4).local_device_ids == (4, 5, 6, 7)
    # A launcher that binds 4 GPUs per task renumbers them 0..3 for it.
    bound = {**env, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert cluster_params(bound, processes=16, shard=4).local_device_ids == (0, 1, 2, 3)
    assert local_device_ids({}, local_rank=2, shard=3) == (6, 7, 8)  # no CUDA_VISIBLE_DEVICES: by rank


@pytest.mark.parametrize("env,processes,shard,expected", [
    ({**SLURM_ONE_TASK_PER_NODE, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 8, 8,
     "mesh.shard=8: the process with local rank 0 needs devices 0..7 of its host, which shows 4"),
    (SLURM_ONE_TASK_PER_NODE, 4, 8, "SLURM_NTASKS=8 processes, but mesh.processes=4"),
    ({k: v for k, v in SLURM_ONE_TASK_PER_NODE.items() if k != "SLURM_LOCALID"}, 8, 8,
     "a SLURM job (SLURM_JOB_ID is set) without SLURM_LOCALID"),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, 2, 2,
     "EDIT_JAX_NUM_PROCESSES, EDIT_JAX_PROCESS_ID not set (have only JAX_COORDINATOR_ADDRESS)"),
    ({"EDIT_JAX_COORDINATOR": "h:1", "EDIT_JAX_NUM_PROCESSES": "2", "EDIT_JAX_PROCESS_ID": "2"}, 2, 2,
     "EDIT_JAX_PROCESS_ID=2: expected 0..1"),
    ({"EDIT_JAX_COORDINATOR": "h:1", "EDIT_JAX_NUM_PROCESSES": "two", "EDIT_JAX_PROCESS_ID": "0"}, 2, 2,
     "EDIT_JAX_NUM_PROCESSES='two': expected an integer"),
])
def test_inconsistent_environments_are_named(env, processes, shard, expected):
    with pytest.raises(ClusterError, match=None) as e:
        cluster_params(env, processes, shard)
    assert expected in str(e.value), str(e.value)


def test_explicit_variables_with_torchrun_local_rank():
    env = {"EDIT_JAX_COORDINATOR": "host0:4321", "EDIT_JAX_NUM_PROCESSES": "4", "EDIT_JAX_PROCESS_ID": "3",
           "LOCAL_RANK": "1"}
    p = cluster_params(env, processes=4, shard=2)
    assert (p.coordinator, p.num_processes, p.process_id, p.local_device_ids) == ("host0:4321", 4, 3, (2, 3))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_join_under_an_emulated_slurm_job(tmp_path):
    """Two real processes with SLURM's variables (one task per node, 2 devices each): they join
    through the coordinator JAX derives from the node list, and each owns its 2 devices
    (``jax_cuda_visible_devices`` = "0,1": JAX's default would have set "0" alone)."""
    code = ("import os, jax\n"
            "from edit_jax.runtime import cluster, multihost\n"
            "p = cluster.from_environment(2, 2)\n"
            "multihost.initialize(10, p)\n"
            "print('RESULT', jax.process_index(), jax.process_count(), jax.local_device_count(), "
            "jax.device_count(), jax.config._read('jax_cuda_visible_devices'), flush=True)\n"
            "multihost.barrier()\n")
    port = _free_port()
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "EDIT_JAX_", "OMPI_")) or k == ENV_DIR}
        env.update(XLA_FLAGS=f"{child_xla_flags()} --xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
                   PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), JAX_COORDINATOR_PORT=str(port),
                   SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_PROCID=str(i), SLURM_LOCALID="0",
                   SLURM_STEP_NODELIST="localhost")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = sorted(line.split()[1:] for out in outs for line in out.splitlines() if line.startswith("RESULT"))
    assert results == [["0", "2", "2", "4", "0,1"], ["1", "2", "2", "4", "0,1"]], outs


def _cli_env(**extra):
    """The environment of a CLI process started as a cluster would: no cluster variables of this
    shell's (the suite's shared compile cache kept), the suite's XLA flags, then ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "EDIT_JAX_", "OMPI_", "JAX_COORDINATOR")) or k == ENV_DIR}
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
               XLA_FLAGS=child_xla_flags())
    env.update(extra)
    return env


TRAIN = [sys.executable, "-m", "edit_jax", "train", "--distributed", "--config", "configs/tiny.py", "--no-progress",
         "mesh.replica=2", "mesh.shard=2", "mesh.processes=2", "batch_size=8", "data.seq_len=32", "steps=2"]


def test_distributed_without_a_cluster_is_one_line(tmp_path):
    one_stage("3.12", "--distributed without a cluster", 12)
    proc = subprocess.run(TRAIN + ["--run-dir", str(tmp_path / "r")], cwd=REPO, env=_cli_env(), capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and out.count("\n") == 1, out
    assert ("edit-jax: cluster error: --distributed: no cluster environment found" in out
            and "EDIT_JAX_COORDINATOR" in out)
    assert not (tmp_path / "r").exists()
    proc = subprocess.run(TRAIN[:-4] + ["mesh.processes=1", "mesh.replica=1", "--run-dir", str(tmp_path / "r")],
                          cwd=REPO, env=_cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--distributed runs one process per worker" in proc.stderr, proc.stderr


def test_a_two_process_slurm_training_run_is_quiet_and_reports_once(tmp_path):
    """A real run of two `--distributed` processes under SLURM's variables: both finish, the
    summary is printed once (process 0), and none of gloo's connection lines reach the output."""
    one_stage("3.12", "a 2-process SLURM training run", 43)
    port = _free_port()
    procs = [subprocess.Popen(TRAIN + ["--run-dir", str(tmp_path / "run")], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=_cli_env(JAX_COORDINATOR_PORT=str(port), SLURM_JOB_ID="99", SLURM_NTASKS="2",
                                           SLURM_PROCID=str(i), SLURM_LOCALID="0",
                                           SLURM_STEP_NODELIST="localhost")) for i in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    text = "\n".join(outs)
    assert "[Gloo]" not in text and "Traceback" not in text, outs
    assert text.count("edit-jax: done at step 2") == 1 and "edit-jax: done at step 2" in outs[0], outs
    assert '"loss"' in (tmp_path / "run" / "metrics.jsonl").read_text()
