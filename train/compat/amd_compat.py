"""What differs on AMD GPUs (a ROCm build of torch): the FP8 format, and MXFP8.

Why a module of its own: a ROCm torch answers `torch.cuda` calls for AMD GPUs, so
torchtitan, torchao and this project run the same code on both vendors; everything else
about AMD (RCCL reads NCCL's settings, HIP the CUDA calls, the launchers' ROCm defaults
live in `common.launch_env`) needs no fork. Two things do:

1. The FP8 format (`common.fp8_formats`): gfx942 (MI300X, MI325X) computes FP8 only in the
   `fnuz` encoding, e4m3 up to 240; every other GPU, gfx950 (MI355X) included, in `fn`,
   up to 448. torchao picks its format once, when `torchao.float8.config` is imported
   (`Float8TypeConfig`: fnuz when `torch.version.hip` and `is_MI300()`), into the module
   globals `e4m3_dtype`/`e5m2_dtype` that its recipes fill in as each cast's
   `target_dtype`. This project does not rely on that global: `fp8.format` ("auto": the
   device's, from `gcn_arch`) is resolved by `train.build.resolve_fp8_format` and
   written into every cast of the torchao config explicitly (`train.fp8.with_fp8_format`),
   which is what torchao's casts, GEMMs, FSDP float8 all-gather and scale precomputation
   read. On an AMD GPU an explicit format the hardware lacks is refused in one line; on a
   CPU (no FP8 hardware: torch runs both formats in software) either may be asked for,
   which is how the fnuz format is trained and tested without an MI300.
2. MXFP8 (`fp8.recipe = "mxfp8"`): gfx950 has MX GEMMs, but torchtitan 0.3.0's
   `MXFP8LinearConverter` accepts only NVIDIA SM100+ (`has_cuda_capability(10, 0)`,
   torchtitan/components/quantization/mx.py), and this project does not wire that
   converter on any device yet. The recipe is refused in one line before any process
   starts (`train.fp8.check_fp8_device`), naming MI355's case where it applies: retire the
   ROCm half of the refusal when torchtitan's converter accepts gfx950.

What is not here: torchtitan's own FP8 gate (`Float8LinearConverter` accepts
`has_rocm_capability(9, 4)`, gfx942 and later) needs nothing.
"""

from __future__ import annotations

from common.fp8_formats import FN, FNUZ, describe_arch, format_of_arch


def gcn_arch() -> str | None:
    """The first visible AMD GPU's architecture as torch reports it (`gcnArchName`, e.g.
    "gfx942:sramecc+:xnack-"), None without a ROCm GPU (a CPU, an NVIDIA GPU)."""
    import torch

    from train.compat import cpu_compat

    if not torch.version.hip or not cpu_compat.has_accelerator():
        return None
    return torch.cuda.get_device_properties(0).gcnArchName


def check_fp8_format(requested: str, arch: str | None, accelerator: bool) -> str:
    """`fp8.format` resolved: "auto" -> the device's format; an explicit one must be the
    device's on a GPU (ValueError, one line), and is taken as asked on a CPU."""
    device_format = format_of_arch(arch)
    if requested == "auto":
        return device_format
    assert requested in (FN, FNUZ), f"unvalidated fp8.format {requested!r}"
    if accelerator and requested != device_format:
        gpu = f"this AMD {describe_arch(arch)} GPU" if arch else "this NVIDIA GPU"
        raise ValueError(
            f"fp8.format = '{requested}' but {gpu} computes FP8 in the '{device_format}' "
            "format only; set fp8.format = 'auto' (a forced format is for CPU tests)"
        )
    return requested
