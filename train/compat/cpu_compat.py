"""What truly differs when torchtitan 0.3.0 runs without an accelerator, and nothing else.

Why this module exists: torchtitan targets CUDA/ROCm. On a CPU-only machine (CI, laptops,
this project's test suite) a few things really are different; they are kept here so the
rest of the code is one path for every device. What is *not* here, on purpose: version
gaps (`train.compat.version_compat`, applied on every device), the SPMD backend and the async
checkpoint mode (the same on every device: `train.build.resolve_spmd_backend`,
`train.preflight.resolve_async_checkpoint`), FP8 conversion and its FSDP
all-gather, compile, and the "auto" choices themselves (`train.build` resolves them,
asking this module only whether there is an accelerator). `tests/train/compat/test_fork_points.py`
lists every remaining place that asks whether there is an accelerator, so a new fork is a
deliberate change.

How it is used: each entry point (`python -m train`, the dry run, in-process tests) calls
`apply()` once through `train.runtime.prepare_runtime()`, before `torchtitan.trainer` is
imported (torchtitan copies `device_type`/`device_module` into several modules at import;
`apply()` also rewrites the copies in modules imported earlier). Building a model spec
never applies it. With an accelerator `apply()` does nothing.

The differences (numbered as in the CPU probe, shared/reference/torchtitan-cpu-probe/):
1. device type and module: torchtitan falls back to "cuda" -> "cpu" and a `device_module`
   shim over torch.cpu.
2. the memory monitor needs CUDA memory-stat calls -> stubs in the shim (peak memory = the
   process's peak RSS); current_device() = 0.
4. gloo instead of NCCL: gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses after torchtitan
   sets the gradient divide factor to 1.0 -> SUM-only comms on every FSDP module (same
   maths).
5. the FP8 capability check: Float8LinearConverter refuses devices below SM89 ->
   `float8_capability_check()` passes it while the converter is built (scoped);
   `torch._scaled_mm` runs real float8 GEMMs on CPU in torch 2.13.
6. a missing CPU kernel: FlexAttention has no CPU backward -> `train.build.resolve_attention`
   picks "sdpa", which is `train.attention.DocumentMaskedSDPA`: FlexAttention's own causal +
   document mask applied through SDPA (the same attention, tested equal).
8. fp32 params: bf16 parameters are ~20x slower than fp32 on AVX2 CPUs
   (`train.build.resolve_param_dtype`).
9. oneDNN's reference float8 kernel on AMX CPUs (below, in `apply()`).
10. async checkpoint staging: no non-blocking device-to-host copy without a device
   (`staging_non_blocking_copy`); the DCP daemon writes on every device.
(3, the set_timeout gap, and 7, the SPMD backend, turned out not to be CPU matters.)

And one guard: `check_gpus_usable()` refuses to train on CPU on a machine whose GPUs (NVIDIA
or AMD, as the launchers count them) this torch cannot use (a CPU build installed by setup
on a login node, a driver too old for the wheel), which would otherwise train silently
with gloo, fp32 and SDPA; the fix it names is the setup of that vendor's build.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import types
from unittest import mock

import torch

# the GPUs the launchers count, counted the same way here (one rule: common/launch_env.py)
from common.launch_env import visible_gpus, visible_nvidia_gpus

_applied = False


def has_accelerator() -> bool:
    return torch.cuda.is_available()


def check_gpus_usable() -> None:
    """Refuse to train when GPUs are visible but this torch cannot use them (ValueError,
    one line naming the cause and the fix). Without it such a run trains on CPU, silently."""
    gpus = visible_gpus()
    if not gpus or has_accelerator():
        return
    build = "cuda" if visible_nvidia_gpus() else "rocm"  # the vendor whose build to set up
    seen = f"{len(gpus)} GPU(s) are visible ({gpus[0].split(' (UUID')[0]}{', ...' if len(gpus) > 1 else ''})"
    setup = f"`scripts/setup.sh --device {build}`"
    if torch.version.cuda is None and not torch.version.hip:
        cause = f"this venv has a CPU build of torch ({torch.__version__})"
        fix = f"reinstall it with {setup}"
    else:
        runtime, vendor = ("ROCm", "AMD") if torch.version.hip else ("CUDA", "NVIDIA")
        cause = (
            f"torch {torch.__version__} ({runtime} {torch.version.hip or torch.version.cuda}) "
            f"cannot initialise them, most likely an {vendor} driver older than that {runtime} "
            "version"
        )
        fix = f"update the driver, or install a matching build with {setup}"
    raise ValueError(
        f"{seen} but {cause}; {fix} (or hide the GPUs with CUDA_VISIBLE_DEVICES= to train "
        "on CPU on purpose)"
    )


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _cpu_device_module() -> types.SimpleNamespace:
    """torch.cpu plus the CUDA-only calls torchtitan makes (blockers 1 and 2)."""
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shim = types.SimpleNamespace(
        **{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")}
    )
    shim.get_device_name = lambda *a, **k: "cpu"
    shim.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        total_memory=total_memory, name="cpu"
    )
    shim.reset_peak_memory_stats = lambda *a, **k: None
    shim.empty_cache = lambda *a, **k: None
    # peak resident set size stands in for "reserved" device memory in the memory metrics
    shim.memory_stats = lambda *a, **k: {
        "active_bytes.all.peak": _peak_rss_bytes(),
        "reserved_bytes.all.peak": _peak_rss_bytes(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    # set_pg_timeouts() passes device_ids=[current_device()]; torch.cpu returns "cpu"
    shim.current_device = lambda: 0
    return shim


def apply(accelerator: bool | None = None) -> None:
    """Patch torchtitan for a machine without an accelerator; a no-op with one. Idempotent.

    Called once by each entry point (`python -m train`, the dry run, tests that train in
    process) before torchtitan's trainer is imported, next to `train.compat.version_compat.apply()`
    (which applies on every device). `accelerator` defaults to what this machine has.
    """
    global _applied
    if accelerator is None:
        accelerator = has_accelerator()
    if _applied or accelerator:
        return
    _applied = True

    # 1 + 2. device type and module, also in modules that copied them at import
    import torchtitan.tools.utils as tt_utils

    device_module = _cpu_device_module()
    tt_utils.device_type = "cpu"
    tt_utils.device_module = device_module
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan.") and module is not None:
            if getattr(module, "device_type", None) == "cuda":
                module.device_type = "cpu"
            if isinstance(getattr(module, "device_module", None), types.ModuleType):
                module.device_module = device_module

    # 4. gloo: SUM-only FSDP reductions
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    disable_division = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_sum_only(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division_sum_only

    # 9. on CPUs with AMX-INT8 (Sapphire Rapids and newer) torch routes `_scaled_mm` to
    # oneDNN, which has only its reference float8 matmul ("ref:any" in ONEDNN_VERBOSE):
    # 3.6 s for a 256x768x256 GEMM, ~75x slower than torch's own dequantize-and-matmul
    # path that AVX2 CPUs take. Disabling oneDNN sends every CPU to that path (same
    # maths); fp32 GEMMs go through BLAS either way.
    torch.backends.mkldnn.enabled = False


def float8_capability_check() -> contextlib.AbstractContextManager:
    """5. While building torchtitan's Float8LinearConverter: pass its SM89 check on a machine
    without an accelerator (`torch._scaled_mm` runs real float8 GEMMs on CPU in torch
    2.13). Scoped, so building a model spec patches nothing for good; on a GPU the check
    runs as torchtitan wrote it."""
    import torchtitan.components.quantization.float8 as tt_float8

    if has_accelerator():
        return contextlib.nullcontext()
    return mock.patch.object(tt_float8, "has_cuda_capability", lambda *a, **k: True)


def staging_non_blocking_copy() -> bool:
    """10. async checkpoints: DCP's stager copies device tensors to host memory with a
    non-blocking copy on a side stream, which only exists with an accelerator (DCP refuses
    the option otherwise). On CPU the tensors already are in host memory: a plain copy."""
    return has_accelerator()
