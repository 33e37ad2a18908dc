"""Stand-ins for an AMD GPU machine, for tests on a CPU-only one: the two ways software here
asks about AMD GPUs, each answered with what a real MI300X or MI355X node answers.

- `fake_amd_smi(folder, *gpus)`: an `amd-smi` on PATH whose `static --asic` prints one
  `GPU: N` block per (market name, architecture) in the layout of amd-smi 6.2+ (AMD's
  documented sample output: MARKET_NAME ... TARGET_GRAPHICS_VERSION), which
  `common.launch_env` reads. A real node also needs /dev/kfd: tests hand a stand-in file
  to the functions that check it (`kfd=`).
- `stand_in_amdsmi(folder, arch)`: a Python package `amdsmi` (the AMD SMI library's
  Python binding) answering the calls vLLM's ROCm platform makes at import and when it
  picks the platform (`rocm_platform_plugin`, `_query_gcn_arch_from_amdsmi`): one GPU of
  architecture `arch` (its `ARCH`). Put `folder` first on PYTHONPATH of a subprocess
  that imports `vllm.platforms.rocm`, which then runs its own code on CPU.
"""

from __future__ import annotations

from pathlib import Path

MI300X = ("AMD Instinct MI300X", "gfx942")
MI325X = ("AMD Instinct MI325X", "gfx942")
MI355X = ("AMD Instinct MI355X", "gfx950")


def fake_amd_smi(folder: Path, *gpus: tuple[str, str]) -> str:
    """A PATH (folder, then the system's) whose `amd-smi static --asic` lists `gpus`."""
    folder.mkdir(parents=True, exist_ok=True)
    blocks = "".join(
        f"GPU: {i}\n    ASIC:\n        MARKET_NAME: {name}\n        VENDOR_ID: 0x1002\n"
        f"        NUM_COMPUTE_UNITS: 304\n        TARGET_GRAPHICS_VERSION: {arch}\n\n"
        for i, (name, arch) in enumerate(gpus)
    )
    script = folder / "amd-smi"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = static ]; then\ncat <<'EOF'\n{blocks}EOF\nfi\n")
    script.chmod(0o755)
    return f"{folder}:/usr/bin:/bin"


_AMDSMI = '''"""Stand-in for AMD SMI's Python binding: one GPU of architecture ARCH (a test may
change it before importing, or reloading, the module that asks)."""

ARCH = {arch!r}


class AmdSmiException(Exception):
    pass


class AmdSmiMemoryType:
    VRAM = 0


def amdsmi_init(*args):
    pass


def amdsmi_shut_down():
    pass


def amdsmi_get_processor_handles():
    return ["gpu-0"]


def amdsmi_get_gpu_asic_info(handle):
    return {{"market_name": {name!r}, "target_graphics_version": ARCH, "device_id": "0x74a1"}}


def amdsmi_get_gpu_device_uuid(handle):
    return "GPU-0000000000000000"


def amdsmi_get_gpu_memory_total(handle, kind):
    return 192 * 1024**3


def amdsmi_topo_get_link_type(a, b):
    return {{"hops": 1, "type": 2}}


def amdsmi_topo_get_numa_node_number(handle):
    return 0
'''


def stand_in_amdsmi(folder: Path, arch: str, name: str = "AMD Instinct") -> Path:
    """`folder` holding an `amdsmi` package for one GPU of `arch`; returns `folder`."""
    package = folder / "amdsmi"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(_AMDSMI.format(arch=arch, name=name))
    return folder
