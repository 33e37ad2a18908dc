"""Async checkpoints (`async_with_pinned_mem`, the default) of real 2-rank gloo runs.

The model has one KV head: torchtitan's fused-QKV state-dict hook then hands DCP `wk`/`wv`
as DTensors that view one gathered buffer at an offset, which torch's staging copy once
mistook for tensors with storage of their own (train/checkpoint.py,
`_WrapperSafeStateDictStager`): the run died at the step after its first async save.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.utils.distributed import run_distributed_test
from tests.utils.runs import check_ok, complete_steps, torchrun, train_losses

MQA_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 128}


def _stage_offset_views_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from train.checkpoint import _pinned_memory_stager

    mesh = init_device_mesh("cpu", (world_size,))
    fused = torch.arange(4 * 32 * 64, dtype=torch.float32).reshape(128, 64)
    # what FusedQKVLinear's hook does: gather the sharded wqkv, then slice q, k and v
    rows = distribute_tensor(fused, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    rows = rows.reshape(4, 32, 64)
    views = {"wq": rows[:2].reshape(-1, 64), "wk": rows[2], "wv": rows[3], "step": 7}
    assert views["wk"].storage_offset() == 2 * 32 * 64  # a wrapper with a nonzero offset
    stager = _pinned_memory_stager()
    try:
        for _ in range(2):  # the second save reuses the cached staging buffers
            staged = stager.stage(views).result()
            for name in ("wq", "wk", "wv"):
                assert isinstance(staged[name], DTensor), name
                assert staged[name].shape == views[name].shape, name
                assert torch.equal(staged[name].to_local(), views[name].to_local()), name
            assert staged["step"] == 7
            rows.to_local().add_(1)  # the next "step" changes the weights in place
    finally:
        stager.close()


def test_staging_copies_dtensors_that_view_their_storage_at_an_offset():
    run_distributed_test(_stage_offset_views_rank, 2)


def _assert_same(a, b, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def _load(checkpoint: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_async_saves_every_step_then_resume_from_an_async_checkpoint(run_toml, tmp_path):
    run_dir = tmp_path / "run"
    sections = {
        "model": MQA_MODEL,
        "validation": {"enable": False},
        "training": {"steps": 4, "seq_len": 64},
        "checkpoint": {"interval": 1, "keep_last": 0},  # async_mode: the default
    }
    config = run_toml(run_dir, **sections)
    first = torchrun(config, 2)
    check_ok(first)
    out = first.stdout + first.stderr
    assert out.count("Staging the checkpoint") >= 3, out[-3000:]  # steps 1-3: async
    assert complete_steps(run_dir) == [1, 2, 3, 4]  # step 4, the last, is synchronous
    losses = train_losses(run_dir)

    # resume from step 3, written by the checkpoint daemon, and redo step 4
    straight = tmp_path / "step-4-straight"
    shutil.move(run_dir / "checkpoint" / "step-4", straight)
    second = torchrun(config, 2)
    check_ok(second)
    out = second.stdout + second.stderr
    assert "Training starts at step 4" in out, out[-3000:]
    assert complete_steps(run_dir) == [1, 2, 3, 4]
    assert train_losses(run_dir)[4] == losses[4]
    # the same model, optimizer, LR, train step and data position as without the resume
    _assert_same(
        _load(straight, tmp_path / "straight.pt"),
        _load(run_dir / "checkpoint" / "step-4", tmp_path / "resumed.pt"),
    )
