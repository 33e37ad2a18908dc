"""Loss spikes: roll back to the last checkpoint before one, skip exactly the data since, go on.

Why: a loss spike that stays finite (a bad stretch of data, an FP8 scale gone wrong, an
optimizer instability) is the costliest numerical failure of a long run: trained through,
it can set the run back by days or never recover. With `health.spike_rollback` the run goes
back to the last complete checkpoint before the spike and skips the data it drew since,
in process, with no restart and no human (docs/reliability.md section 3).

What it is given, and why only that: the rollback reloads a checkpoint (the checkpointer),
moves the data position (the loader), may lower the learning rate for a while (the LR
schedulers), writes a marker (the metrics logger) and records each incident under the run
folder. It takes those five off the trainer (and the validator, which the step after a
spike skips) and keeps nothing else of it, so what it can touch is what it says. It is a step hook
(`train.step_hooks`): it judges each step's loss after the FP8 format switch's gate, and
rolls back after the data ledger has recorded the step.

How:
- The rule (`SpikeRule`, `spike_threshold`): every step the per-step check of
  `train.reliability.health` reduces each rank's share of the loss into the global mean loss, the
  number torchtitan logs, and hands it to `LossSpikeRollback.judge`. Every rank gets the
  same number, so every rank decides the same. A step is judged once `spike_warmup` steps
  of history exist: it spikes above mean + max(k std, min rise) of the recent history;
  `spike_steps` spiking steps in a row make a spike, and the update of the step that
  completes it is vetoed like a non-finite one.
- The rollback (`LossSpikeRollback.handle_spike`, after that step): reload the newest
  complete checkpoint before the spike while the loader keeps its position, so the global
  sequences drawn since are skipped exactly; the skip is appended to `RUN/incidents.jsonl`
  before training goes on (a resume reads it back and skips them again, on any number of
  ranks); checkpoints after the one gone back to are deleted; past `health.max_rollbacks`,
  or with no checkpoint to go back to, the run stops like a non-finite streak (exit 4,
  RUN/diverged.json).
- Quarantine: `python -m train.forensics --quarantine-*` appends records of kind
  `quarantine` (a document's dataset content hash and on-disk token range); a resume hands
  them to the loader, which passes over their windows in every epoch (dataloader/loader.py).
  A resume reads the file through `dataloader.incidents`, the one reader of both kinds,
  which the data ledger's `verify` applies the same way.
- The LR windows (`RollbackLRSchedulersContainer`, picked in `train.build`): after a
  rollback the learning rate may be multiplied by `health.rollback_lr_factor` for
  `health.rollback_lr_steps` steps. The container composes torchtitan's LR lambda with the
  windows when it is built (`RollbackLR`), so the schedule is one function of the step
  from the start, and a window added later only appends to the list it reads.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.tools.logging import logger

from common.io import append_jsonl
from common.run_layout import (
    INCIDENTS,
    SPIKE_KIND,
    list_checkpoints,
    step_dir_name,
)
from dataloader.incidents import read_incidents
from train.step_hooks import StepHook

# --------------------------------------------------------------------------- the rule


def spike_threshold(
    losses: list[float], sigmas: float, min_rise: float
) -> tuple[float, float, float]:
    """(mean, standard deviation, threshold) of a loss history: a loss above the threshold,
    mean + max(sigmas x std, min_rise), is a spiking one."""
    mean = statistics.fmean(losses)
    std = statistics.pstdev(losses, mean)
    return mean, std, mean + max(sigmas * std, min_rise)


@dataclass
class SpikeRule:
    """The loss-spike rule (health.spike_*), fed the globally reduced loss of each step.

    A step is judged once `warmup` accepted steps are in the history (the last `window`);
    a spiking step does not enter the history (it would hide the next one), and `steps`
    spiking steps in a row make a spike. Every rank feeds the same numbers (the loss is
    reduced over all ranks first), so every rank decides the same."""

    window: int
    warmup: int
    sigmas: float
    min_rise: float
    steps: int
    history: deque = field(init=False)  # (step, loss) of accepted steps
    flagged: list = field(init=False)  # (step, loss, mean, std) of the current spiking run

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.window)
        self.flagged = []

    def observe(self, step: int, loss: float) -> list[tuple[int, float, float, float]] | None:
        """The spiking steps (step, loss, mean, std) when `step` completes a spike, else None."""
        if len(self.history) >= self.warmup:
            mean, std, threshold = spike_threshold(
                [value for _, value in self.history], self.sigmas, self.min_rise
            )
            if loss > threshold:
                self.flagged.append((step, loss, mean, std))
                if len(self.flagged) < self.steps:
                    return None
                found, self.flagged = self.flagged, []
                return found
        self.flagged = []
        self.history.append((step, loss))
        return None

    def forget_after(self, step: int) -> None:
        """Drop the history of steps after `step` (they are rolled back)."""
        self.history = deque([e for e in self.history if e[0] <= step], maxlen=self.window)
        self.flagged = []


# --------------------------------------------------------------------------- LR windows


class RollbackLR:
    """A torchtitan LR lambda times the factor of the rollback windows holding the step.

    LambdaLR's lambda at epoch e gives the LR of step e + 1; a window (first, last, factor)
    lowers steps first..last (the steps after a rollback's checkpoint). Windows come from
    RUN/incidents.jsonl, so a resume inside one keeps it; overlapping windows take the
    lowest factor. torchtitan's schedule itself is untouched."""

    def __init__(self, inner: Callable[[int], float], windows: list[tuple[int, int, float]]):
        self.inner, self.windows = inner, windows

    def __call__(self, epoch: int) -> float:
        step = epoch + 1
        factors = [f for first, last, f in self.windows if first <= step <= last]
        return self.inner(epoch) * min(factors, default=1.0)


class RollbackLRSchedulersContainer(LRSchedulersContainer):
    """torchtitan's LR schedulers, each built on `RollbackLR(torchtitan's lambda, windows)`.

    The windows list starts empty (the schedule is torchtitan's exactly) and is the one
    `LossSpikeRollback` appends to; `refresh` hands the optimizers the LR of the next step
    once a window changed it."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        def build(self, *, optimizers, training_steps):
            # torchtitan's build derives the warmup/decay lambda from this config and
            # constructs its own container class with it (no hook for a subclass): take the
            # lambda from that container and build ours around it. Its schedulers are
            # dropped; building a LambdaLR sets each group's initial LR only once
            # (setdefault) and its LR for step 1, which ours sets again, identically.
            upstream = LRSchedulersContainer.Config.build(
                self, optimizers=optimizers, training_steps=training_steps
            )
            return RollbackLRSchedulersContainer(optimizers, upstream.schedulers[0].lr_lambdas[0])

    def __init__(self, optimizers, lr_lambda: Callable[[int], float]) -> None:
        self.lr_windows: list[tuple[int, int, float]] = []
        super().__init__(optimizers, RollbackLR(lr_lambda, self.lr_windows))

    def add_window(self, first: int, last: int, factor: float) -> None:
        """Multiply the LR of steps first..last by `factor` (call `refresh` before the next
        step reads the LR)."""
        self.lr_windows.append((first, last, factor))

    def refresh(self) -> None:
        """Give each optimizer the LR its schedule (with the windows) sets for the next
        step: a checkpoint from before a window holds the LR without it. torchtitan's own
        load path recomputes each scheduler's LR from its lambda at the restored step."""
        self.load_state_dict(self.state_dict())
        for scheduler in self.schedulers:
            for group, lr in zip(
                scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True
            ):
                group["lr"] = lr


# --------------------------------------------------------------------------- the rollback


class LossSpikeRollback(StepHook):
    """A step hook: the spike rule's verdict each step (`judge`), the rollback after a
    spike (`after_step`), and the incidents of earlier rollbacks honoured at start."""

    def __init__(self, trainer) -> None:
        run_folder = Path(trainer.config.dump_folder)
        self.config = config = trainer.config.health  # train.config.HealthConfig
        self.checkpointer = trainer.checkpointer
        self.dataloader = trainer.dataloader
        self.lr_schedulers: RollbackLRSchedulersContainer = trainer.lr_schedulers
        self.metrics_logger = trainer.metrics_processor.logger
        self.checkpoint_folder = run_folder / trainer.config.checkpoint.folder
        # the validation that a spike step skips
        self.validator = trainer.validator if trainer.config.validator.enable else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rule = (
            SpikeRule(
                config.spike_window,
                config.spike_warmup,
                config.spike_sigmas,
                config.spike_min_rise,
                config.spike_steps,
            )
            if config.spike_rollback
            else None
        )
        self.spike: list[tuple[int, float, float, float]] | None = None  # this step's
        self.stop = ""  # set when the run must stop: the one-line reason
        self.rollbacks = 0
        self._incidents_path = run_folder / INCIDENTS
        self._lr_stale = False  # the optimizer's LR predates a window: recompute it
        self._resume_after_incidents()

    @classmethod
    def from_trainer(cls, trainer) -> LossSpikeRollback:
        return cls(trainer)

    def _resume_after_incidents(self) -> None:
        """A resume honours the rollbacks recorded so far: their skipped sequences are
        skipped again (a preemption between a rollback and the next checkpoint resumes
        before them), and they count towards health.max_rollbacks; and the quarantined
        documents are passed over from here on. A --fresh start forgets them (rank 0
        removes the file; no rank reads it)."""
        if getattr(self.checkpointer, "fresh", False):
            if self.rank == 0:
                self._incidents_path.unlink(missing_ok=True)
            return
        incidents = read_incidents(self._incidents_path.parent)  # the rule verify applies too
        if incidents.num_torn and self.rank == 0:
            logger.warning(f"{self._incidents_path}: skipped {incidents.num_torn} torn line(s)")
        self.rollbacks = len(incidents.spikes)
        for record in incidents.spikes:
            self._add_lr_window(record)
        if incidents.quarantines:
            matched = self.dataloader.add_quarantine(incidents.quarantine_entries())
            if self.rank == 0:
                logger.info(
                    f"{self._incidents_path}: {len(incidents.quarantines)} quarantined "
                    f"document(s), {matched} in this run's data: their windows are passed over "
                    "in every epoch"
                )
        ranges = incidents.skip_ranges()
        if ranges:
            self.dataloader.add_skip_ranges(ranges)
            if self.rank == 0:
                logger.info(
                    f"{self._incidents_path}: {len(ranges)} rollback(s); global sequences "
                    f"{ranges} are skipped"
                )

    def _add_lr_window(self, record: dict) -> None:
        factor, steps = record.get("lr_factor", 1.0), record.get("lr_steps", 0)
        if factor != 1.0 and steps > 0:
            first = record["rolled_back_to"] + 1
            self.lr_schedulers.add_window(first, first + steps - 1, factor)
            self._lr_stale = True

    def _refresh_lr(self) -> None:
        self.lr_schedulers.refresh()
        self._lr_stale = False

    @property
    def vetoed(self) -> bool:
        return bool(self.spike)

    # ---- step lifecycle (the step's hook points; `judge` is asked by the per-step check)
    def begin_step(self, step: int) -> None:
        if self._lr_stale:  # after the start's checkpoint load, before the step's LR is read
            self._refresh_lr()
        self.spike = None

    def judge(self, step: int, loss: float) -> bool:
        """Judge the step's global mean loss; True if it completes a spike (its update must
        not be applied). Called by `train.reliability.health`'s check on every rank, same
        numbers."""
        if self.rule is None:
            return False
        self.spike = self.rule.observe(step, loss)
        return self.spike is not None

    def metrics(self, step: int) -> dict[str, float]:
        return {"health/rollbacks": float(self.rollbacks)}

    def after_step(self, step: int, *, skipped: bool, sums) -> None:
        """After a step that completed a spike (the same decision on every rank): rolled
        back (the step is now the checkpoint's) or stopping, it is neither saved nor
        validated; loading the checkpoint takes about as long as saving it."""
        if not self.spike:
            return
        self.checkpointer.skip_next_save()
        if self.validator is not None:
            self.validator.skip_next()
        with self.checkpointer.save_window.watch("loss-spike rollback", step):
            self.handle_spike(step)

    # ---- the rollback, or the stop
    def handle_spike(self, step: int) -> None:
        """After `step` completed a spike (`self.spike`), on every rank: go back to the last
        complete checkpoint before the spike's first step, keeping the data loader where it
        is, so the sequences drawn since that checkpoint are skipped exactly; record it in
        RUN/incidents.jsonl before going on. Sets `stop` instead when health.max_rollbacks
        is spent or there is no such checkpoint. The caller keeps the step from being saved
        or validated: after a rollback the trainer's step is the checkpoint's."""
        found = self.spike
        assert found and self.rule is not None, "handle_spike without a spike"
        first = found[0][0]
        last_loss, mean, std = found[-1][1], found[-1][2], found[-1][3]
        what = (
            f"step {step}: loss spike ({last_loss:.4g} against a mean of {mean:.4g} +- "
            f"{std:.3g} over the last {len(self.rule.history)} steps"
            + (f", {len(found)} steps in a row from step {first})" if len(found) > 1 else ")")
        )
        checkpointer = self.checkpointer
        checkpointer.maybe_wait_for_staging()
        checkpointer.maybe_wait_for_saving()  # a save still in flight may be the one to go to
        target = self._checkpoint_before(first)
        if self.rollbacks >= self.config.max_rollbacks:
            good = "none" if target is None else self.checkpoint_folder / step_dir_name(target)
            self._stop(
                f"{what}; {self.rollbacks} rollback(s) already (health.max_rollbacks = "
                f"{self.config.max_rollbacks}): stopping. Last good checkpoint: {good}"
            )
            return
        if target is None:
            self._stop(
                f"{what}; no complete checkpoint before step {first} to roll back to: "
                "stopping (checkpoint.enable must be true, checkpoint.interval short enough)"
            )
            return
        loader = self.dataloader
        kept, end = loader.state_dict(), loader.num_sequences_consumed
        checkpointer.load(step=target)  # model, optimizer, LR schedule, step, data position
        start = loader.num_sequences_consumed
        loader.add_skip_ranges([[start, end]])
        loader.load_state_dict(kept)  # the data goes on from where it was: [start, end) skipped
        self.rollbacks += 1
        later = [
            s for group in list_checkpoints(self.checkpoint_folder) for s in group if s > target
        ]
        record = {
            "step": step,
            "kind": SPIKE_KIND,
            "first_spike_step": first,
            "rolled_back_to": target,
            "skipped_sequences": [start, end],
            "losses": [round(f[1], 6) for f in found],
            "mean": round(mean, 6),
            "std": round(std, 6),
            "rollback": self.rollbacks,
            "discarded_checkpoints": later,
            "lr_factor": self.config.rollback_lr_factor,
            "lr_steps": self.config.rollback_lr_steps,
            "time": time.time(),
        }
        if self.rank == 0:
            append_jsonl(self._incidents_path, record)  # persisted before training goes on
            for s in later:  # they hold the spike: a resume must not pick them
                shutil.rmtree(self.checkpoint_folder / step_dir_name(s), ignore_errors=True)
            logger.warning(
                f"{what}: rolled back to checkpoint step {target} "
                f"(rollback {self.rollbacks} of health.max_rollbacks = "
                f"{self.config.max_rollbacks}); global sequences [{start}, {end}) are skipped; "
                f"recorded in {self._incidents_path}"
            )
        if dist.is_initialized():
            dist.barrier()
        self.rule.forget_after(target)
        self._add_lr_window(record)
        if self._lr_stale:
            self._refresh_lr()
        marker = {
            "health/rollback_to_step": float(target),
            "health/rollback_skipped_sequences": float(end - start),
        }
        self.metrics_logger.log(marker, step)  # TensorBoard + metrics.jsonl

    def _checkpoint_before(self, step: int) -> int | None:
        """The newest complete checkpoint before `step` (rank 0's listing, for every rank)."""
        if not self.checkpointer.enable:
            return None
        found = [None]
        if self.rank == 0:
            complete = list_checkpoints(self.checkpoint_folder)[0]
            found = [max((s for s in complete if s < step), default=None)]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def _stop(self, message: str) -> None:
        self.stop = message
        if self.rank == 0:
            logger.error(message)
