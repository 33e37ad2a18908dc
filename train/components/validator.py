"""`RunValidator`: torchtitan's validator, inside a hang-watchdog window with a beat per batch.

Why: a validation is a phase of its own for the hang watchdog
(train/reliability/watchdog.py). At 70B it can outlast `hang_timeout_s` while making
progress, and then it is not a hang; a batch that never ends still is. So the whole
validation runs in a watchdog window, and the start of each batch is a beat: each batch must
start within `hang_timeout_s` of the last, however many there are (docs/reliability.md
section 1).

How: torchtitan's `Validator.validate` enters its `validation_context` once per batch,
around the forward. This subclass composes that context when it is built: the context it
hands torchtitan's constructor beats first (and sleeps, where a test injects a sleep at
`validation`), then enters the context it was given. `validate` opens the window.
`skip_next` keeps the next validation from running (the trainer calls it after a step that
completed a loss spike: rolled back, or stopping, that step is not validated).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torchtitan.components.validate import Validator

from train.reliability import watchdog
from train.reliability.faults import FaultInjector


class RunValidator(Validator):
    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        inject_faults: list[str] = field(default_factory=list)
        """TESTS ONLY: health.inject_faults (its `at=validation` sleeps apply here)."""

    def __init__(
        self,
        config: Config,
        *,
        validation_context: Callable[[], AbstractContextManager[None]],
        **kwargs,
    ) -> None:
        self._faults = FaultInjector(config.inject_faults)
        self._step = 0
        self._skip_next = False

        def each_batch() -> AbstractContextManager[None]:
            watchdog.beat("batch")
            self._faults.sleep("validation", self._step)
            return validation_context()

        super().__init__(config, validation_context=each_batch, **kwargs)

    def skip_next(self) -> None:
        """The next `should_validate` says no (a rolled-back or stopping step)."""
        self._skip_next = True

    def should_validate(self, step: int) -> bool:
        if self._skip_next:
            self._skip_next = False
            return False
        return super().should_validate(step)

    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        self._step = step
        with watchdog.phase("validation", step):
            super().validate(model_parts, step)
