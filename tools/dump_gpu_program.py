"""Compiles one step program of a config for a GPU target (no GPU needed: the CUDA plugin and
``JAX_PLATFORMS=cpu``), with some of the project's XLA options changed, and writes XLA:GPU's
optimized HLO text: how the sync-window options of docs/benchmarks/gpu-program.md were measured.

    JAX_PLATFORMS=cpu python tools/dump_gpu_program.py configs/edit_7b.py 7b.txt \\
        --options '{"xla_gpu_all_reduce_combine_threshold_bytes": 1073741824}' model.n_layers=4
    python -m edit_jax.analysis.gpu_window 7b.txt 8 8 4      # the window of that program

``--options`` is a JSON object of compiler options set on top of the program's own (``null``
removes one); ``--step`` names the step kind (default ``sync_forward``). Prints the options in
force, the compile time and ``memory_analysis()``'s temp and argument bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("out", help="where the optimized HLO text goes")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--options", default="{}", help="JSON: compiler options to set (null removes)")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--step", default="sync_forward")
    args = ap.parse_args(argv)

    import jax
    jax.config.update("jax_platforms", "cpu")
    from edit_jax.localsgd.methods import plan_for
    from edit_jax.localsgd.programs import StepPrograms
    from edit_jax.runtime.mesh import make_mesh, set_cpu_device_count
    from edit_jax.analysis.gpu_target import load_target, target_devices
    from edit_jax.validate import load_config

    cfg = load_config(args.config, args.overrides)
    n = cfg.mesh.replica * cfg.mesh.shard
    set_cpu_device_count(n)
    method_plan = plan_for(cfg)
    programs = StepPrograms(method_plan, make_mesh(method_plan.cfg.mesh, target_devices(load_target(args.target), n)))
    for key, value in json.loads(args.options).items():
        if value is None:
            programs.compiler_options.pop(key, None)
        else:
            programs.compiler_options[key] = value
    print("options:", programs.compiler_options)
    start = time.time()
    compiled = programs.lowered(args.step).compile()
    memory = compiled.memory_analysis()
    print(f"compile {time.time() - start:.1f} s; temp {memory.temp_size_in_bytes} B, "
          f"argument {memory.argument_size_in_bytes} B")
    with open(args.out, "w") as f:
        f.write(compiled.as_text())


if __name__ == "__main__":
    main()
