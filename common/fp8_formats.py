"""The two FP8 formats, and which GPU computes in which: one rule for training and serving.

Why it matters: "FP8" names two different encodings of the same 8 bits.
- `fn` (OCP FP8: torch's `float8_e4m3fn` and `float8_e5m2`): NVIDIA Hopper and Blackwell,
  AMD gfx950 (MI350X, MI355X), and torch on CPU. e4m3 reaches 448.
- `fnuz` (`float8_e4m3fnuz` and `float8_e5m2fnuz`, "finite, no negative zero"): AMD gfx942
  (MI300X, MI300A, MI325X; gfx940 and gfx941 were its early steppings). Its exponent bias
  is one larger, so the same bits mean half the value and e4m3 reaches only 240; there is
  one NaN and no negative zero. The hardware computes in this format only.
A scale computed for one format and applied in the other doubles or halves every value;
a saturation bound of 448 on an fnuz tensor never fires. So every part that casts, scales
or judges FP8 values asks the format first, here.

Who asks: the trainer (`train.compat.amd_compat.check_fp8_format`, from torch's view of the
GPU: the `gcnArchName` torchao reads too), the launch checks (`train.fp8.check_fp8_device`,
from `amd-smi`, torch-free) and the server wrapper (`eval.serve`: vLLM's FP8 KV cache on an
fnuz GPU). The rule is vLLM's own (`RocmPlatform.is_fp8_fnuz`: "gfx94" in the arch name,
vllm/platforms/rocm.py, vLLM 0.32) and torchao's (`is_MI300`: gfx940, gfx941, gfx942,
torchao/utils.py, torchao 0.18); tests/eval/test_serve_rocm.py holds it to vLLM's on
vLLM's own ROCm platform code. Standard library only: the launchers import it.
"""

from __future__ import annotations

from dataclasses import dataclass

FN = "fn"
FNUZ = "fnuz"


@dataclass(frozen=True)
class Fp8Format:
    e4m3: str  # torch dtype name of the forward operands (and rowwise gradients)
    e5m2: str  # torch dtype name of tensorwise gradients


# (their ranges are torch's: `torch.finfo(torch.float8_e4m3fnuz).max` is 240)
FORMATS = {
    FN: Fp8Format("float8_e4m3fn", "float8_e5m2"),
    FNUZ: Fp8Format("float8_e4m3fnuz", "float8_e5m2fnuz"),
}

# AMD architectures by family, for messages (vLLM's and torchao's tables)
AMD_GPUS = {
    "gfx942": "MI300X/MI300A/MI325X",
    "gfx950": "MI350X/MI355X",
}


def format_of_arch(arch: str | None) -> str:
    """The FP8 format a GPU of this architecture computes in: `fnuz` for AMD gfx94x, `fn`
    for everything else (NVIDIA, gfx950, a CPU: `arch` None or "")."""
    return FNUZ if arch and arch.strip().lower().startswith("gfx94") else FN


def describe_arch(arch: str) -> str:
    """`gfx942:sramecc+:xnack-` -> `gfx942 (MI300X/MI300A/MI325X)`."""
    base = arch.split(":")[0].strip()
    return f"{base} ({AMD_GPUS[base]})" if base in AMD_GPUS else base


def has_mx(arch: str | None) -> bool:
    """Whether an AMD architecture has MX (microscaling) FP8 GEMMs: gfx950 (vLLM's
    `RocmPlatform.supports_mx`: "gfx95" in the arch name)."""
    return bool(arch) and "gfx95" in arch.lower()
