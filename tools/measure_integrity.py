"""Cost of the pre-save finite check and the checkpoint checksums (issue 13) on the demo state:

    PYTHONPATH=. python tools/measure_integrity.py
"""
import itertools
import os
import shutil
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.rundir.checkpoint import Checkpointer
from edit_jax.rundir.integrity import finite_report, state_checksums
from edit_jax.runtime.mesh import make_mesh
from edit_jax.validate import load_config
cfg = load_config("configs/demo.py", ["method=edit"])
m = StepPrograms.for_config(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))
state = m.init_state(0)
n = sum(x.size for x in jax.tree.leaves(state))
def t(f, reps=5):
    f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps * 1e3
print(f"state elements {n:,}")
print(f"finite_report ms {t(lambda: finite_report(state)):.2f}")
print(f"state_checksums ms {t(lambda: state_checksums(state)):.2f}")
d = "/tmp/measure13run"
shutil.rmtree(d, ignore_errors=True)
ck = Checkpointer(d, 2)
c = itertools.count(1)
print(f"ckpt.save (incl. both) ms {t(lambda: ck.save(next(c), state, {'x': 1}, cfg), reps=3):.1f}")
ck.close()
