"""The NNX example (``examples/own_nnx_model.py``): a Flax NNX byte-level LM of its own, through
``LocalSGD.for_nnx`` with DiLoCo and with layer-wise EDiT (its stacked blocks synced one by one
inside ``edit_jax.scan_blocks``), the loss falling over the run; and its checkpoints as a user
meets them: the process killed (SIGKILL) after a save, the same command again resumes and ends
bit for bit where the uninterrupted run ends. (The linen example, through ``LayerStack``, trains
with each rule in ``test_api.py``.)"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from tests.helpers import REPO, kill_group, load_example
from tests.stages import one_stage

EXAMPLE = os.path.join(REPO, "examples", "own_nnx_model.py")


def _falls(losses):
    """The loss keeps falling: each third of the run's mean below the one before."""
    thirds = [np.mean(part) for part in np.array_split(np.asarray(losses), 3)]
    assert thirds[0] > thirds[1] > thirds[2], (thirds, losses)
    assert all(math.isfinite(x) for x in losses)


def test_nnx_example_trains_with_diloco():
    one_stage("default", "the NNX example with DiLoCo", 15, other="the NNX example's EDiT, killed and resumed")
    out = load_example("own_nnx_model").main(["--rule", "diloco", "--tiny", "--steps", "24"])
    _falls(out["losses"])
    assert out["val_loss"] < math.log(256) - 2.0, out["val_loss"]


def test_nnx_example_with_edit_killed_after_a_save_resumes_bit_for_bit(tmp_path):
    one_stage("3.12", "the NNX example's EDiT, killed and resumed", 60, other="the NNX example with DiLoCo")
    ckpt, steps = str(tmp_path / "ckpt"), 16
    args = ["--rule", "edit", "--tiny", "--steps", str(steps), "--checkpoint", ckpt, "--save-every", "4"]
    proc = subprocess.Popen([sys.executable, EXAMPLE, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
        deadline = time.time() + 240
        for line in proc.stdout:  # kill it as a user's machine would: at once, after its second save
            seen.append(line)
            if line.split() == ["step", "7", "saved"]:
                os.kill(proc.pid, signal.SIGKILL)
                break
            assert time.time() < deadline, "".join(seen)
        proc.wait(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    assert "step    7  saved\n" in seen and not any("done" in line for line in seen), "".join(seen)

    example = load_example("own_nnx_model")
    resumed = example.main(args)  # the same command again: it reads the newest checkpoint
    whole = example.main(["--rule", "edit", "--tiny", "--steps", str(steps)])
    restored_at = steps - len(resumed["losses"])
    assert restored_at in (8, 12), restored_at  # step 7's save, or step 11's if it got that far
    _falls(whole["losses"])
    assert resumed["losses"] == whole["losses"][restored_at:]
    assert resumed["val_loss"] == whole["val_loss"]
    for a, b in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(whole["state"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
