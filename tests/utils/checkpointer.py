"""Our checkpoint manager around a real model, built in a test's own process: for the tests
of what a save stages and what a load reads (tests/train/components/test_async_checkpoint.py) and of
the host preflight's open-file limit (tests/train/test_host_preflight.py), without a
trainer's start-up.

The parts are the trainer's: the model of a run config (FP8 conversion included),
FSDP-sharded over the world's ranks, torchtitan's optimizer and LR schedule containers,
and `train.components.checkpoint.RunCheckpointManager` around them, built as torchtitan's Trainer
builds it. What the trainer adds to a checkpoint beside them (its step counter, the
dataloader's position) holds no tensor; a small stateful stand-in carries that part. A
process group must already be initialised.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful


class StepCounter(Stateful):
    """Stands in for the trainer's and the dataloader's states: plain numbers, no tensor."""

    def __init__(self) -> None:
        self.step = 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def model_and_checkpointer(run, world_size: int, folder: str, async_mode: str = "disabled"):
    """(model, RunCheckpointManager) for `run`, saving to FOLDER/checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from train.components.checkpoint import RunCheckpointManager
    from train.model import build_model_spec

    torch.manual_seed(0)
    model = build_model_spec(run).model.build()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})
        ]
    ).build(model_parts=[model])
    config = RunCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, async_mode=async_mode, keep_latest_k=0
    )
    checkpointer = RunCheckpointManager(
        config,
        dataloader=StepCounter(),
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=optimizers, training_steps=10
        ),
        states={"train_state": StepCounter()},
        sd_adapter=None,
        base_folder=folder,
    )
    return model, checkpointer


def staged_states(checkpointer) -> dict[str, Any]:
    """What a save hands the stager: the checkpointer's flattened states, each stateful one
    replaced by its state dict, as `dcp.async_save` does before it stages."""
    states = checkpointer._flattened_model_states_sd()
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}
