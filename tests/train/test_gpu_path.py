"""The GPU path, checked on CPU: what a first GPU run would have met (issue 10).

Each test here failed before its fix on a CPU-only machine:
- the torch 2.13 `set_timeout` gap is filled on a machine with an accelerator too;
- `spmd_backend = "auto"` picks the backend FSDP accepts on a sharded mesh, whatever the
  device (a pure function of the degrees and the world size);
- FSDP really all-gathers FP8 weights in float8 (the payload's dtype, seen in FSDP's own
  all-gather on 2 gloo ranks), the startup log says so from the weights, and torchao's
  scale precompute finds them;
- DCP's async checkpoint daemon survives the preemption signal SLURM sends every process of
  a job step (real processes, a real DCP save after the signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common.io import free_port
from tests.utils.distributed import BACKENDS, rank_device, run_distributed_test
from tests.utils.runs import REPO, train_env

# --------------------------------------------------------------------------- defect 1


def test_set_timeout_version_gap_is_filled_with_an_accelerator_too():
    """torchtitan calls torch.distributed.set_timeout after step 1 on every device; torch
    2.13 lacks it. The entry points' setup must fill it where a GPU is present (the CPU
    accommodations must then stay off)."""
    code = textwrap.dedent(
        f"""
        import datetime
        import torch, torch.distributed as dist
        from train.runtime import prepare_runtime
        from train.compat import cpu_compat
        assert not hasattr(dist, "set_timeout"), "torch has set_timeout now: drop the alias"
        prepare_runtime(accelerator=True)
        assert not cpu_compat._applied, "CPU accommodations applied on a GPU machine"
        # gloo on any machine: the gap is in torch.distributed's API, whatever the backend
        dist.init_process_group(
            "gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        dist.set_timeout(datetime.timedelta(seconds=7), None)  # as torchtitan calls it
        dist.barrier()
        dist.destroy_process_group()
        print("set_timeout ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "set_timeout ok" in proc.stdout


# --------------------------------------------------------------------------- defect 2


@pytest.mark.parametrize(
    ("world_size", "dp_shard", "tp", "cp", "expected"),
    [
        (8, -1, 1, 1, "partial_dtensor"),  # llama3_8b_fp8 / llama3_1b: FSDP over 8 GPUs
        (16, -1, 8, 1, "partial_dtensor"),  # llama3_70b_fp8: FSDP x TP8 on 2 nodes
        (8, 1, 8, 1, "partial_dtensor"),  # TP only
        (4, 2, 1, 2, "partial_dtensor"),  # FSDP x CP
        (1, -1, 1, 1, "spmd_types"),  # one GPU: nothing sharded, torchtitan's default
    ],
)
def test_auto_spmd_backend_is_the_sharded_one_on_any_device(world_size, dp_shard, tp, cp, expected):
    from train.build import resolve_spmd_backend

    got = resolve_spmd_backend("auto", dp_shard, tp, world_size, cp=cp)
    assert got == expected
    assert resolve_spmd_backend("full_dtensor", dp_shard, tp, world_size) == "full_dtensor"


# --------------------------------------------------------------------------- defect 3


def _fp8_all_gather_rank(rank: int, world_size: int, config: str, out: str) -> None:
    import json

    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.tensor import DTensor

    from train.runtime import prepare_runtime

    prepare_runtime()
    from torchtitan.tools.logging import init_logger

    from train.build import to_trainer_config
    from train.config import load_config
    from train.fp8 import fp8_all_gather_weights

    init_logger()
    payload_dtypes: list[str] = []
    all_gather = _fsdp_param_group.foreach_all_gather

    def recording_all_gather(*args, **kwargs):  # records, then calls FSDP's own
        result = all_gather(*args, **kwargs)
        if result is not None:
            for dtypes in result.param_all_gather_input_dtypes:
                payload_dtypes.extend(str(d) for d in dtypes)
        return result

    _fsdp_param_group.foreach_all_gather = recording_all_gather
    trainer = to_trainer_config(load_config(config)).build()
    try:
        assert trainer._fp8_all_gather, "startup saw no FP8 all-gather weights"
        trainer.train()
        model = trainer.model_parts[0]
        gathered = fp8_all_gather_weights(model)
        scales = [
            m.weight._local_tensor._precomputed_scale
            for m in model.modules()
            if isinstance(getattr(m, "weight", None), DTensor)
            and hasattr(m.weight._local_tensor, "_precomputed_scale")
        ]
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "payload_dtypes": payload_dtypes,
                "gathered": gathered,
                "scales_set": sum(s is not None for s in scales),
            }
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp_all_gathers_fp8_weights_in_float8_on_two_ranks(run_toml, tmp_path, backend):
    """The trainer picks its device and process group itself (gloo ranks see no GPU)."""
    import json

    config = run_toml(
        fp8={"recipe": "tensorwise", "fsdp_float8_all_gather": True},
        training={"steps": 2, "local_batch_size": 1},
        validation={"enable": False},
        checkpoint={"enable": False},
    )
    run_distributed_test(
        _fp8_all_gather_rank, 2, str(config), str(tmp_path), init=False, backend=backend
    )
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        dtypes = set(result["payload_dtypes"])
        # 4 layers x (wq, wk, wv, wo, w1, w2, w3) gathered as float8; norms/embeddings/lm_head fp32
        assert len(result["gathered"]) == 28, result["gathered"]
        assert "torch.float8_e4m3fn" in dtypes, dtypes
        n_float8 = result["payload_dtypes"].count("torch.float8_e4m3fn")
        assert n_float8 >= 2 * 28, n_float8  # forward of 2 steps, every FP8 weight
        # torchao's precompute after each optimizer step found every wrapped weight
        assert result["scales_set"] == 28, result


# --------------------------------------------------------------------------- defect 5


def _daemon_preemption_rank(rank: int, world_size: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _async_process_executor as executor
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from train.components.dcp_workarounds import (
        protect_checkpoint_daemon,
        shutdown_checkpoint_daemon,
    )
    from train.reliability.time_limit import _preempt_signal, install_preemption_handlers

    install_preemption_handlers()
    protect_checkpoint_daemon()
    pg = dist.new_group(backend="gloo")  # as torchtitan's async checkpointer, on any device
    state = {"w": torch.full((64, 64), float(rank), device=rank_device())}

    def save(step: int) -> None:
        dcp.async_save(
            state,
            checkpoint_id=str(Path(out) / f"step-{step}"),
            process_group=pg,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        ).result()

    save(1)  # starts the daemon
    daemon = executor._CHECKPOINT_PROCESS._save_process
    assert daemon.is_alive()
    dist.barrier()
    # SLURM's preemption: the signal reaches every process of the step, the daemon too
    for pid in (daemon.pid, os.getpid()):
        os.kill(pid, signal.SIGTERM)
    daemon.join(timeout=3)
    assert daemon.is_alive(), f"checkpoint daemon died of SIGTERM (exit {daemon.exitcode})"
    assert _preempt_signal["signum"] == signal.SIGTERM  # the trainer got the flag
    state["w"] += 1
    save(2)  # the preemption save, through the same daemon
    shutdown_checkpoint_daemon()
    assert not daemon.is_alive()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_async_checkpoint_daemon_survives_the_preemption_signal(tmp_path, backend):
    import torch
    import torch.distributed.checkpoint as dcp

    run_distributed_test(_daemon_preemption_rank, 2, str(tmp_path), backend=backend)
    assert (tmp_path / "step-2" / ".metadata").is_file()
    loaded = {"w": torch.zeros(64, 64)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "step-2"), no_dist=True)
    assert loaded["w"][0, 0].item() in (1.0, 2.0)  # one rank's value after the update
