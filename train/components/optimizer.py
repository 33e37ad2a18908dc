"""`SkipStepOptimizersContainer`: torchtitan's optimizers, whose update a veto can skip.

Why: a step whose loss or gradients went non-finite on any rank, or that completes a loss
spike, must change no parameter and no optimizer state, on every rank alike
(train/reliability/health.py, train/reliability/rollback.py). The update is the optimizer
container's `step()`, which torchtitan's `train_step` calls once per step, after gradient
clipping. So the decision belongs there: the container asks its veto first and skips the
update when the veto says so, as OLMo-core's skip-step optimizers do. A reader of the step
sees the veto where the update happens, and the trainer swaps nothing.

How: `train.build` picks this container's `Config`; torchtitan builds it like its own.
The health step hook hands it its veto (`TrainingHealth.from_trainer`: `check_step`). The veto runs
a collective, so it must run on every rank exactly once per step: torchtitan's
`train_step` calls `step()` once per step on every rank. Without a veto (the dry run, a
test building the container alone) `step()` is torchtitan's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.components.optimizer import OptimizersContainer


class SkipStepOptimizersContainer(OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self._veto: Callable[[], bool] | None = None
        self.skipped = False  # the last step's update was vetoed

    def set_veto(self, veto: Callable[[], bool]) -> None:
        """`veto()` is asked before each update; True skips it (on every rank alike)."""
        self._veto = veto

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self.skipped = self._veto is not None and self._veto()
        if self.skipped:
            return None
        return super().step(closure)
