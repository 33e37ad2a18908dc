"""Every accommodation for running torchtitan 0.3.0 without an accelerator, in one place.

Why this module exists: torchtitan targets CUDA/ROCm. On a CPU-only machine (CI, laptops,
this project's test suite) it fails in eight distinct places, recorded by the CPU probe in
`shared/reference/torchtitan-cpu-probe/README.md`. Each fix below names its blocker. When an
accelerator is present (`torch.cuda.is_available()`), `apply()` does nothing and every
`resolve_*` helper returns the GPU choice: NCCL, FlexAttention, bf16 params, async
checkpoints and torchtitan's defaults are left exactly as they are.

How it is used: `python -m train` calls `apply()` first, before `torchtitan.trainer` is
imported (torchtitan copies `device_type`/`device_module` into several modules at import;
`apply()` also rewrites the copies in modules imported earlier). `train.config` resolves
the config's "auto" values through the `resolve_*` helpers.

Blockers (probe numbering):
1. device_type falls back to "cuda" -> set "cpu" and a `device_module` shim over torch.cpu.
2. the memory monitor needs CUDA memory-stat calls -> stubs in the shim (peak memory = the
   process's peak RSS); current_device() = 0.
3. `torch.distributed.set_timeout` is missing in torch 2.13 -> alias `_set_pg_timeout`.
4. gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses after torchtitan sets the gradient
   divide factor to 1.0 -> force SUM-only comms on every FSDP module (same maths).
5. Float8LinearConverter refuses devices below SM89 -> skip the capability check;
   `torch._scaled_mm` runs real float8 GEMMs on CPU in torch 2.13.
6. FlexAttention/varlen have no CPU backward -> causal SDPA (`resolve_attention`). Packed
   documents then attend across their boundaries on CPU; RoPE still restarts per document.
   Document-aware (block-causal) attention is kept on GPU.
7. the default `spmd_types` backend fails with dp_shard or tp > 1 on CPU ->
   `partial_dtensor` (`resolve_spmd_backend`).
8. bf16 parameters are ~20x slower than fp32 on AVX2 CPUs -> fp32 (`resolve_param_dtype`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import torch

_applied = False


def has_accelerator() -> bool:
    return torch.cuda.is_available()


def _peak_rss_bytes() -> int:
    import resource

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
    process) before torchtitan's trainer is imported, next to `train.version_compat.apply()`
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


@contextlib.contextmanager
def float8_capability_check():
    """5. While building torchtitan's Float8LinearConverter: pass its SM89 check on a machine
    without an accelerator (`torch._scaled_mm` runs real float8 GEMMs on CPU in torch
    2.13). Scoped, so building a model spec patches nothing for good; on a GPU the check
    runs as torchtitan wrote it."""
    import torchtitan.components.quantization.float8 as tt_float8

    if has_accelerator():
        yield
        return
    check = tt_float8.has_cuda_capability
    tt_float8.has_cuda_capability = lambda *a, **k: True
    try:
        yield
    finally:
        tt_float8.has_cuda_capability = check


def resolve_attention(requested: str) -> str:
    """6. "auto" -> flex (document-masked) on GPU, sdpa (causal) on CPU."""
    if requested == "auto":
        return "flex" if has_accelerator() else "sdpa"
    if requested in ("flex", "varlen") and not has_accelerator():
        raise ValueError(
            f"model.attention = '{requested}' has no CPU backward pass; "
            "use attention = 'auto' or 'sdpa' on a machine without a GPU"
        )
    return requested


def resolve_param_dtype(requested: str) -> str:
    """8. "auto" -> bfloat16 on GPU, float32 on CPU."""
    if requested != "auto":
        return requested
    return "bfloat16" if has_accelerator() else "float32"
