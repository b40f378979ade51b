"""GPU targets for ``edit-jax plan --target``: XLA:GPU compiles for a GPU without one.

``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<description>,
topology="1x1xN")`` gives N abstract GPU devices of the described kind; a mesh of them, abstract
state and ``.lower(...).compile()`` give XLA:GPU's own optimized program and ``memory_analysis()``.
It needs the CUDA plugin (``pip install -e '.[cuda]'``), not a device.

Descriptions shipped (``gpu_targets/``, the source of every number in each file's header): ``h100``
(H100 SXM 80 GB), ``a100`` (A100 SXM4 80 GB, OpenXLA's own spec), ``h200`` (derived from the H100's,
memory and bandwidth from NVIDIA's datasheet). ``--target-file`` takes any other
``stream_executor.GpuTargetConfigProto`` text (XLA's ``xla/tools/hlo_opt/gpu_specs/*.txtpb``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from edit_jax.config import ConfigError

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
TARGETS = ("h100", "a100", "h200")
CUDA_HINT = "pip install -e '.[cuda]' (jax[cuda12]: the CUDA plugin; no GPU needed)"
# What --target-file takes, said by every error about one.
EXPECTED = ("a text protobuf of an XLA GPU target description (stream_executor.GpuTargetConfigProto, like "
            "edit_jax/analysis/gpu_targets/h100.txtpb)")
MAX_TARGET_BYTES = 2**20  # the shipped descriptions are about 1 KB: a larger file is another kind of file


class TargetError(ConfigError):
    """A GPU target that cannot be used: unknown name, unreadable file, or no CUDA plugin."""


@dataclass(frozen=True)
class GpuTarget:
    name: str  # "h100", or the file's path
    text: str  # the GpuTargetConfigProto text
    description: str  # device_description_str
    memory_bytes: int  # device_memory_size


def load_target(name: str | None = None, path: str | None = None) -> GpuTarget:
    """The target ``name`` (one of ``TARGETS``) or the description in file ``path``."""
    if (name is None) == (path is None):
        raise TargetError("give one of --target NAME or --target-file FILE")
    if name is not None:
        if name not in TARGETS:
            raise TargetError(f"--target: unknown GPU {name!r}; known: {', '.join(TARGETS)} "
                              "(--target-file FILE for another GpuTargetConfigProto description)")
        path = os.path.join(TARGETS_DIR, f"{name}.txtpb")
        what = f"--target {name}"
    else:
        what = f"--target-file {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TARGET_BYTES + 1)
    except OSError as e:  # missing, a directory, no permission: one line, before any compile
        raise TargetError(f"{what}: cannot read {path} ({e.strerror or e}); expected {EXPECTED}") from None
    if len(raw) > MAX_TARGET_BYTES:
        raise TargetError(f"{what}: {path} is larger than {MAX_TARGET_BYTES // 2**20} MiB, not a GPU target "
                          f"description; expected {EXPECTED}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # a binary file (e.g. a serialized proto, a checkpoint): not the text form
        raise TargetError(f"{what}: {path} is not a text file (byte {e.start} is not UTF-8); expected "
                          f"{EXPECTED}") from None
    mem = re.search(r"^\s*device_memory_size:\s*(\d+)", text, re.M)
    desc = re.search(r'^\s*device_description_str:\s*"([^"]*)"', text, re.M)
    if "gpu_device_info" not in text or mem is None:
        raise TargetError(f"{what}: {path} is not a GPU target description (no gpu_device_info {{ ... "
                          f"device_memory_size: ... }}); expected {EXPECTED}")
    return GpuTarget(name or path, text, desc.group(1) if desc else (name or path), int(mem.group(1)))


def cuda_plugin_missing() -> str | None:
    """Why the CUDA plugin cannot be used (None: it can)."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401 - only whether it imports (the plugin of jax[cuda12])
    except ImportError:
        return f"the CUDA plugin is not installed: {CUDA_HINT}"
    return None


def target_devices(target: GpuTarget, count: int) -> list:
    """``count`` abstract GPU devices of ``target`` (the CPU backend stays the process's default)."""
    missing = cuda_plugin_missing()
    if missing:
        raise TargetError(f"--target {target.name}: {missing}")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target.text, topology=f"1x1x{count}")
    except NotImplementedError:
        raise TargetError(f"--target {target.name}: this jax has no CUDA topologies: {CUDA_HINT}") from None
    except Exception as e:  # XLA's parse error of a bad description
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"--target {target.name}: XLA cannot use this description: {first}") from None
    return list(topo.devices)


__all__ = ["TARGETS", "TARGETS_DIR", "GpuTarget", "TargetError", "load_target", "cuda_plugin_missing",
           "target_devices"]
