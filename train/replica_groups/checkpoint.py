"""`ReplicaCheckpointManager`: our checkpoint manager, for a run of replica groups.

Why a subclass: two things change when several groups train one run.
- Healing. A group that comes back receives the live state from a peer through torchft
  (no checkpoint read): the model, the optimizer, the LR schedule, the train state (step,
  tokens) and the loader's cursor. This manager hands torchft those states
  (`register_state_dict_fn`), the same `Stateful`s a checkpoint holds. torchtitan's
  `TorchFTCheckpointManager` leaves the loader out and saves one loader state per group
  instead, because torchft's sampler gives each group a fixed shard; here the cursor is
  global and identical in every group, so it travels with the rest and is saved once.
- Who saves. Every group holds the whole model, so one group writes each checkpoint: the
  one ranked first in the step's quorum (torchtitan's rule). A step that did not commit is
  not saved by anyone (`skip_next_save`, from the trainer): its state is not the run's.
- The step count. torchft numbers the steps (its committed count); a checkpoint load (a
  relaunch, a rollback) sets that count to the checkpoint's step, or a relaunched run would
  number its steps from 1 again, train `training.steps` more and record each step twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torchtitan.components.checkpoint import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, TRAIN_STATE
from torchtitan.tools.logging import logger

from train.components.checkpoint import RunCheckpointManager

HEALED_STATES = (MODEL, OPTIMIZER, LR_SCHEDULER, TRAIN_STATE, DATALOADER)
REJOIN_ENV = "TRAIN_REPLICA_REJOIN"
"""Set to 1 by the launcher when it restarts one group while others train on: the group
loads no checkpoint at start-up, and heals from a live peer in its first quorum."""


class ReplicaCheckpointManager(RunCheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(RunCheckpointManager.Config):
        pass

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.ft = None
        self.rejoin = False
        self.rejoining = False  # read no checkpoint: the first quorum must heal it

    def attach(self, ft) -> None:
        """Serve and receive the healed states through `ft` (a `ReplicaGroupsManager`)."""
        if not ft.enabled:
            return
        self.ft = ft
        self.rejoin = os.environ.get(REJOIN_ENV) == "1"

        def state_dict() -> dict:
            return {k: self.states[k].state_dict() for k in HEALED_STATES if k in self.states}

        def load_state_dict(state: dict) -> None:
            for key, value in state.items():
                self.states[key].load_state_dict(value)

        ft.manager.register_state_dict_fn("run", load_state_dict, state_dict)

    def _load(self, step: int = -1) -> bool:
        if self.rejoin:  # the live groups hold the run's state: heal from one of them
            self.rejoin, self.rejoining = False, True
            logger.info(
                "rejoining the run's replica groups: no checkpoint read; this group "
                "heals from a live peer at its first step"
            )
            return False
        loaded = super()._load(step)
        if loaded and self.ft is not None:  # a relaunch or a rollback: the count goes on from it
            manager = self.ft.manager
            manager.load_state_dict(
                {
                    "step": self.states[TRAIN_STATE].step,
                    "batches_committed": manager.batches_committed(),
                }
            )
        return loaded

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.ft is not None and self.ft.manager.participating_rank() != 0:
            return False  # the quorum's first group saves the run's checkpoints
        return super()._save(curr_step, last_step)

    def _purge_stale_checkpoints(self):
        if self.ft is not None and self.ft.manager.participating_rank() != 0:
            return  # the group that saves purges
        super()._purge_stale_checkpoints()
