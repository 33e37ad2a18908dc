"""GPU checks (issue 7), run on CPU wherever the device is the only difference (issue 10).

`test_gpu_choices_*` run everywhere: the "auto" choices are pure functions of the request
and the device, so the GPU inputs are checked on CPU. The training test needs CUDA (NCCL,
compiled FlexAttention, bf16 params) and is skipped, with the reason shown, without it; its
CPU counterpart (same flags: FP8, compile, async checkpoints, FSDP) is the shrunk shipped
configs' test in tests/train/test_shipped_configs.py. On a GPU machine run:
`.venv/bin/python -m pytest -m gpu -rs tests/train/test_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils.runs import check_ok, torchrun, train_losses

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; see issue 7)"
)


def test_gpu_choices_leave_torchtitan_defaults_alone():
    from train.build import (
        resolve_async_checkpoint,
        resolve_attention,
        resolve_param_dtype,
        resolve_spmd_backend,
    )

    assert resolve_attention("auto", accelerator=True) == "flex"
    assert resolve_attention("varlen", accelerator=True) == "varlen"
    assert resolve_param_dtype("auto", accelerator=True) == "bfloat16"
    assert resolve_spmd_backend("auto", dp_shard=-1, tp=1, world_size=1) == "spmd_types"
    assert resolve_async_checkpoint("auto") == "async_with_pinned_mem"
    # and the CPU side of the same functions
    assert resolve_attention("auto", accelerator=False) == "sdpa"
    assert resolve_param_dtype("auto", accelerator=False) == "float32"
    with pytest.raises(ValueError, match="no CPU backward"):
        resolve_attention("flex", accelerator=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_debug_model_trains_on_cuda_with_fp8_compile_and_async_checkpoint(
    run_toml, tmp_path, recipe
):
    """NCCL, FlexAttention with document masks, torch.compile over FP8, async DCP."""
    config = run_toml(
        fp8={"enable": True, "recipe": recipe},
        compile={"enable": True},
        training={"steps": 20},
        checkpoint={"interval": 10},
    )
    nproc = min(2, torch.cuda.device_count())
    proc = torchrun(config, nproc, timeout=900)
    check_ok(proc)
    losses = train_losses(tmp_path / "run")
    assert losses[max(losses)] < losses[min(losses)]
    assert (tmp_path / "run" / "checkpoint" / "step-20" / ".metadata").exists()
    assert "emulat" not in proc.stdout.lower()  # real float8 GEMMs, not emulation
