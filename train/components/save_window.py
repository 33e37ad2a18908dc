"""The hang-watchdog window of a checkpoint save (and of a rollback's load): its budget from
the checkpoint's bytes, and a collective timeout that covers it.

Why: a save has no progress to report inside it (DCP writes in one call), yet at 70B the
final save (~850 GB) takes many minutes: inside `hang_timeout_s` alone it would be called a
hang, and a save stuck for good must still be one. So a save is allowed `hang_timeout_s`
plus its bytes at `[fault_tolerance] min_save_gb_per_s`, the slowest write bandwidth that
still counts as working (train/reliability/watchdog.py, docs/reliability.md section 1).
Ranks also wait for each other inside a save (DCP's plan and metadata gathers), which can
outlast `[comm] train_timeout_seconds`: the collective timeout would then end the job
unnamed before the watchdog's window runs out. For the save the collective timeout of every
mesh group (FSDP, CP, TP, ... and the default group:
`train.reliability.budgets.CollectiveTimeouts`, which the trainer sets as the window's
`timeouts`) is the window plus a margin (the watchdog speaks first, naming the rank),
and the training timeout comes back after it. Without a trainer (a test of the window alone)
it is the default group's.

How: `RunCheckpointManager` (train/components/checkpoint.py) holds one `SaveWindow` and runs every
save inside `save(step)`, the preemption save too; a loss-spike rollback loads inside
`watch("loss-spike rollback", step)` (loading takes about as long as saving). The bytes
are counted once, at the first window after the optimizer state exists: every parameter
and optimizer-state tensor at its global size (a DTensor's numel() is global).

The save's real time (`measure`): the plan assumes the filesystem writes at
`[checkpoint] storage_gb_per_s`, which nothing checked. Each save that wrote is timed from
its window's start to its last byte on disk (an async save: when DCP's upload future
completes); rank 0 logs the rate and records it in `RUN/save_rate.json`
(`train.reliability.budgets.MeasuredSave`), which the next attempt's budgets and SLURM lead
read, and the trainer takes it at the next step boundary to end the run in time
(train/reliability/time_limit.py). A save that used over half its watchdog window warns.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from train.reliability import watchdog
from train.reliability.budgets import TIMEOUT_MARGIN_S, CollectiveTimeouts, MeasuredSave
from train.reliability.faults import FaultInjector


@dataclass(kw_only=True, slots=True)
class SaveWindowConfig:
    hang_timeout_s: float = 80.0
    """[fault_tolerance] hang_timeout_s: the window of any phase without progress."""
    min_save_gb_per_s: float = 0.5
    """[fault_tolerance] min_save_gb_per_s: a save may take its bytes at this rate more."""
    train_timeout_s: float = 100.0
    """[comm] train_timeout_seconds: the collective timeout a save may need to widen."""
    storage_gb_per_s: float = 5.0
    """[checkpoint] storage_gb_per_s: what the plan assumed, logged beside the measured rate."""
    inject_faults: list[str] = field(default_factory=list)
    """TESTS ONLY: health.inject_faults (its `at=save` sleeps apply inside a save)."""


class SaveWindow:
    def __init__(
        self,
        config: SaveWindowConfig,
        *,
        model_parts: list[torch.nn.Module],
        optimizers,
        enabled: bool = True,
        run_dir: str | Path = "",
    ) -> None:
        self.config = config
        self.model_parts = model_parts
        self.optimizers = optimizers  # torchtitan's OptimizersContainer
        self.enabled = enabled  # checkpointing is on: there are bytes to count
        self.run_dir = Path(run_dir) if run_dir else None  # RUN/save_rate.json's folder
        self.checkpoint_bytes = 0
        self._faults = FaultInjector(config.inject_faults)
        self._open = False
        self._began = 0.0  # time.monotonic() when the last save's window opened
        self._measured: list[MeasuredSave] = []  # completed saves the trainer has not taken
        # the groups whose timeouts a save widens (the trainer sets every mesh group's)
        self.timeouts = CollectiveTimeouts({"default": None}, config.train_timeout_s)

    def extra_s(self) -> float:
        """Seconds a save may take beyond `hang_timeout_s`."""
        return self.checkpoint_bytes / (self.config.min_save_gb_per_s * 1e9)

    @contextlib.contextmanager
    def save(self, step: int) -> Iterator[None]:
        """The window of the checkpoint save after `step`; inside an open window (a
        preemption save around the save itself) it adds nothing."""
        if self._open:
            yield
            return
        self._began = time.monotonic()
        with self.watch("checkpoint save", step):
            self._faults.sleep("save", step)
            yield

    def measure(self, step: int, upload: Future | None) -> None:
        """The save of `step` wrote: timed from its window's start to its last byte on disk,
        now for a synchronous save (`upload` None), when DCP's `upload` future completes
        for an async one (that thread records it; a failed upload is not a rate)."""
        began, nbytes = self._began, self.checkpoint_bytes

        def done(future: Future | None = None) -> None:
            if future is not None and (future.cancelled() or future.exception() is not None):
                return
            saved = MeasuredSave(step, time.monotonic() - began, nbytes)
            self._measured.append(saved)
            if nbytes and (not dist.is_initialized() or dist.get_rank() == 0):
                self._report(saved)

        if upload is None:
            done()
        else:
            upload.add_done_callback(done)

    def take_measured(self) -> list[MeasuredSave]:
        """The saves measured since the last call (the trainer's, at a step boundary)."""
        taken, self._measured = self._measured, []
        return taken

    def _report(self, saved: MeasuredSave) -> None:
        """Rank 0: the measured rate, logged and kept in RUN/save_rate.json."""
        if self.run_dir is not None:
            saved.write(self.run_dir)
        line = (
            f"checkpoint step-{saved.step}: {saved.checkpoint_bytes / 1e9:.3g} GB on disk in "
            f"{saved.seconds:.1f} s, {saved.gb_per_s:.3g} GB/s measured (the plan assumes "
            f"checkpoint.storage_gb_per_s = {self.config.storage_gb_per_s:g}; RUN/save_rate.json)"
        )
        window_s = self.config.hang_timeout_s + self.extra_s()
        if saved.seconds > window_s / 2:
            logger.warning(
                f"{line}: it used {saved.seconds:.0f} s of its {window_s:.0f} s watchdog "
                "window; lower fault_tolerance.min_save_gb_per_s (and storage_gb_per_s) to "
                "this storage's rate before a slower save is called a hang"
            )
        else:
            logger.info(line)

    @contextlib.contextmanager
    def watch(self, what: str, step: int) -> Iterator[None]:
        """A watchdog window named `what` after `step`, as long as a save's, with the
        collective timeout covering it."""
        self.count_bytes()
        extra_s = self.extra_s()
        needed_s = self.config.hang_timeout_s + extra_s + TIMEOUT_MARGIN_S
        self._open = True
        try:
            with (
                watchdog.phase(what, step, extra_s),
                self.timeouts.raised_to(needed_s),
            ):
                yield
        finally:
            self._open = False

    def count_bytes(self) -> int:
        """Bytes of a full checkpoint over all ranks: every parameter and optimizer state
        tensor at its global size, counted once. 0 before the optimizer state exists (no
        save happens before the first step)."""
        if self.checkpoint_bytes or not self.enabled:
            return self.checkpoint_bytes
        states = [
            v for o in self.optimizers.optimizers for s in o.state.values() for v in s.values()
        ]
        if not states:
            return 0
        tensors = [p for m in self.model_parts for p in m.parameters()] + states
        self.checkpoint_bytes = sum(
            t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)
        )
        if self.checkpoint_bytes and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info(
                f"watchdog: a checkpoint save may take {self.extra_s():.0f} s more than "
                f"fault_tolerance.hang_timeout_s ({self.checkpoint_bytes / 1e9:.3g} GB at "
                f"min_save_gb_per_s = {self.config.min_save_gb_per_s})"
            )
        return self.checkpoint_bytes
