"""torch.compile + tensor parallel + full activation checkpointing trains (2 ranks, TP 2).

This combination used to fail at the first step in AOT autograd ("expected all
tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh"). The cause is in torch 2.13's
partitioner (docs/upstream/compile_tp_ac.md): an op tagged `nondeterministic_seeded` inside
a checkpointed region gets its RNG state saved for the recompute, and on a device without
graph-safe RNG (CPU) that state is appended after the opaque DeviceMesh TP saves, which
shifts the mesh into the saved-tensor slice. SDPA's fused CPU kernel is such an op (it could
do dropout); compiled, `DocumentMaskedSDPA` runs SDPA's math backend instead (no RNG op).
This test is what would fail if that changed. Selective AC with compile + TP is covered by
the 8B config's TP 2 resume in test_shipped_configs.py.
"""

from __future__ import annotations

import pytest

from tests.utils.runs import check_ok, torchrun, train_losses
from train.config import load_config

pytestmark = pytest.mark.slow


def test_compile_tp2_full_activation_checkpointing_trains(run_toml, tmp_path):
    run_dir = tmp_path / "run"
    config = run_toml(
        run_dir,
        model={"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden_dim": 128},
        fp8={"enable": False},
        validation={"enable": False},
        training={"steps": 2, "seq_len": 64, "local_batch_size": 2},
        lr_scheduler={"warmup_steps": 1},
        checkpoint={"interval": 100},
        parallelism={"tp": 2},
        compile={"enable": True, "components": ["model", "loss"]},
        activation_checkpoint={"mode": "full"},
    )
    proc = torchrun(config, 2, timeout=600)
    check_ok(proc)
    ran = load_config(run_dir / "config.toml")
    assert ran.compile.enable and ran.parallelism.tp == 2
    assert ran.activation_checkpoint.mode == "full"
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2] and all(v == v and v < 20 for v in losses.values())
