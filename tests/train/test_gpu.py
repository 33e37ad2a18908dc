"""GPU-only checks of the paths CPU CI cannot exercise (issue 7).

Skipped, with the reason shown, on machines without CUDA. On a lent GPU run:
`.venv/bin/python -m pytest -m gpu -rs tests/train/test_gpu.py`.
They have not yet run on a GPU: the first machine that runs them is their first test.
"""

from __future__ import annotations

import pytest
import torch

from tests.train.conftest import check_ok, torchrun, train_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; see issue 7)"
    ),
]


def test_cpu_compat_leaves_gpu_defaults_alone():
    from train import cpu_compat

    assert cpu_compat.resolve_attention("auto") == "flex"  # document-masked attention
    assert cpu_compat.resolve_param_dtype("auto") == "bfloat16"
    assert cpu_compat.resolve_spmd_backend("auto", dp_shard=-1, tp=1) == "spmd_types"
    assert cpu_compat.resolve_async_checkpoint("auto") == "async_with_pinned_mem"


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
