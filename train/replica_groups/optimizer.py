"""`ReplicaOptimizersContainer`: our `SkipStepOptimizersContainer`, committed by torchft.

Why: a replica group may update only a step every live group finished: torchft's
`should_commit` says so, after the step's reductions. torchft's own optimizer wrapper (and
torchtitan's `TorchFTOptimizersContainer` around it) asks it in `step` and starts the
quorum in `zero_grad`; here the trainer starts the quorum itself, before the step draws
data (the quorum decides the step's slices), so only the commit is left: `step` asks
`should_commit`, then our health veto, then updates. The veto thus runs once, and only on a
step that counts.

`attach` hands the container the run's `ReplicaGroupsManager` after torchtitan built it
(torchtitan's `Trainer` builds the optimizers with the model parts alone), and creates the
optimizer state up front as torchtitan's FT container does, so that a peer's state can be
loaded into it and served from it while training (a first `state_dict` would otherwise run
an optimizer step to create it, from torchft's quorum thread).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.components.optimizer.utils import init_optim_state

from train.components.optimizer import SkipStepOptimizersContainer


class ReplicaOptimizersContainer(SkipStepOptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(SkipStepOptimizersContainer.Config):
        pass

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.ft = None
        self.committed = True  # the last step's commit

    def attach(self, ft) -> None:
        """Commit through `ft` (a `ReplicaGroupsManager`; disabled: every step commits)."""
        self.ft = ft if ft.enabled else None
        for optim in self.optimizers:
            init_optim_state(optim)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self.committed = self.ft is None or self.ft.should_commit()
        if not self.committed:
            self.skipped = True
            return None
        return super().step(closure)
