"""The run ends itself in time: before SLURM's end time it saves a checkpoint and exits 0,
the way a preemption does, instead of relying on a signal that may come too late.

Why: SLURM's `--signal=B:USR1@N` warns N seconds before the time limit, and N is fixed at
submit time from the plan's step and save (`train.reliability.budgets.Budgets.signal_lead_s`:
3 x (step + save)). The save there is the checkpoint's bytes at an assumed storage rate. At
70B on 32 GPUs the lead holds only above about 1.5 GB/s (2.9 with a periodic save in
flight); a single NFS server gives about 1. Below that, the save after the signal is cut
off at the limit, and each time-limit requeue loses the steps since the last periodic
checkpoint (up to 250). Megatron-LM ends its runs itself instead (`--exit-duration-in-mins`:
each iteration compares the time trained with the budget, all ranks agree by an all-reduce,
then it saves and exits); here the budget is the job's own end time.

How (`EndInTime`, a step hook (`train.step_hooks`) asked at every step boundary, which also
carries the preemption signals: SIGUSR1 from SLURM's `--signal`, or SIGTERM, whose handler,
`install_preemption_handlers`, only sets a flag, so a signal during a save cannot cut it):
- the end time is `SLURM_JOB_END_TIME` (epoch seconds; SLURM sets it in the job's
  environment, and `scripts/slurm/train.sbatch` asks `squeue` once where an older SLURM
  does not); without it nothing changes;
- the step's time is measured, boundary to boundary: the longest of the last
  `RECENT_STEPS` (a validation or a save on the way is in it; the attempt's first step,
  with its compile, is not);
- the save's time is the slowest save this attempt measured (train/components/save_window.py
  times each to its last byte on disk), else the one an earlier attempt recorded
  (`RUN/save_rate.json`) or the plan's, at `[checkpoint] storage_gb_per_s` at worst
  (`Budgets.save_s`); a periodic async save still in flight is waited for first, so it
  counts twice;
- the run stops when the time left is under `STEP_MARGIN` x (step + save), the margin of
  the signal lead: one rank's clock is enough, since its flag travels in the next step's
  one exchange (`train.reliability.exchange`, the `END_TIME` lane beside the preemption
  signals; `END_TIME_FLAG`, above every signal number, is how the trainer names it). The
  run then saves the step after the verdict, writes `RUN/preempted.json` and exits 0, so
  `train.sbatch` requeues it as it requeues a preemption.

An attempt that has not finished a step stops for nothing: there is no step to measure,
and stopping then would requeue forever (submit.py warns when `--time` cannot fit the
first step and a save). The signal lead stays as the backstop.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable

from train.reliability.budgets import STEP_MARGIN, Budgets, MeasuredSave
from train.step_hooks import StepHook

END_TIME_ENV = "SLURM_JOB_END_TIME"
END_TIME_FLAG = 256  # the preemption exchange's value for "the end time is near" (signals < 65)
RECENT_STEPS = 20  # the step time is the longest of these many recent steps


def job_end_time(environ: dict[str, str] | None = None) -> float | None:
    """SLURM's end time of this job (epoch seconds), or None when there is none to keep."""
    raw = (os.environ if environ is None else environ).get(END_TIME_ENV, "").strip()
    try:
        end = float(raw)
    except ValueError:
        return None
    return end if math.isfinite(end) and end > 0 else None


# set by the signal handler, read at step boundaries; nothing else happens in the handler
_preempt_signal = {"signum": 0}


def _on_preempt_signal(signum, frame) -> None:
    _preempt_signal["signum"] = signum


def install_preemption_handlers() -> None:
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, _on_preempt_signal)


class EndInTime(StepHook):
    def __init__(
        self,
        end_time: float | None,
        budgets: Budgets,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.end_time = end_time
        self.budgets = budgets
        self._clock, self._monotonic = clock, monotonic  # tests pass fake ones
        self._steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self._boundary: tuple[int, float] | None = None  # (step, monotonic) of the last one
        self._first = True  # the attempt's first step compiles: not a step time
        self.slowest_save: MeasuredSave | None = None  # this attempt's
        self.checkpointer = None  # `from_trainer`: its save window times every save
        self.ending = ""  # why this rank found the job's end time near, once it did
        self.signal = 0  # the last step's exchange: a signal number, END_TIME_FLAG or 0

    @classmethod
    def from_trainer(cls, trainer) -> EndInTime:
        import torch.distributed as dist
        from torchtitan.tools.logging import logger

        guard = cls(job_end_time(), trainer.budgets)
        guard.checkpointer = trainer.checkpointer
        if guard.describe() and dist.get_rank() == 0:
            logger.info(guard.describe())
        return guard

    def lanes(self) -> dict:
        return {"signal": _preempt_signal["signum"] or (END_TIME_FLAG if self.ending else 0)}

    def after_step(self, step: int, *, skipped: bool, sums) -> None:
        self.signal = sums.signal if sums is not None else 0

    def at_boundary(self, step: int) -> tuple[int, str] | None:
        """This boundary's end-time verdict rides the next step's exchange; the flags of
        the last step's exchange decide now (no collective, no sync here): (the signal,
        why) when every rank stops at this boundary."""
        window = self.checkpointer.save_window  # it times every save
        upload = getattr(self.checkpointer, "save_future", None)  # an async save writing
        in_flight = upload is not None and not upload.done()
        nbytes = window.count_bytes() if self.checkpointer.enable and step else 0
        self.ending = self.reason(step, window.take_measured(), in_flight, nbytes) or self.ending
        if not self.signal:
            return None
        if self.signal == END_TIME_FLAG:
            return self.signal, self.ending or "another rank found the job's end time near"
        return self.signal, f"{signal.Signals(self.signal).name} received"

    def describe(self) -> str:
        """One line for the run's start ("" without an end time)."""
        if self.end_time is None:
            return ""
        return (
            f"{END_TIME_ENV}: the job ends in {self.end_time - self._clock():.0f} s; the run "
            f"saves and exits 0 (requeued as a preemption) once that is under "
            f"{STEP_MARGIN:g} x (its longest recent step + a save) (train/reliability/time_limit.py)"
        )

    def reason(
        self, step: int, saves: list[MeasuredSave], save_in_flight: bool, nbytes: int
    ) -> str:
        """At the boundary after `step`: why the run must stop now to end in time, or "".
        `saves`: the saves measured since the last boundary; `save_in_flight`: an async
        save still writing; `nbytes`: the checkpoint's bytes (0: checkpointing is off)."""
        now = self._monotonic()
        if self._boundary is not None and step > self._boundary[0]:
            if not self._first:
                self._steps.append((now - self._boundary[1]) / (step - self._boundary[0]))
            self._first = False
        self._boundary = (step, now)
        measured = [s for s in (self.slowest_save, *saves) if s is not None]
        self.slowest_save = max(measured, key=lambda saved: saved.seconds, default=None)
        if self.end_time is None or not self._steps:
            return ""
        step_s, save_s = max(self._steps), self.save_s(nbytes)
        saves_s = save_s * (2 if save_in_flight else 1)
        needed_s = STEP_MARGIN * (step_s + saves_s)
        left_s = self.end_time - self._clock()
        if left_s > needed_s:
            return ""
        in_flight = " x 2, one in flight" if save_in_flight else ""
        return (
            f"the job's end time ({END_TIME_ENV}) is {left_s:.0f} s away, within "
            f"{STEP_MARGIN:g} x (a step {step_s:.1f} s + a save {save_s:.1f} s{in_flight}) = "
            f"{needed_s:.0f} s"
        )

    def save_s(self, nbytes: int) -> float:
        """A save of `nbytes`: as slow as this attempt's slowest, else as the budgets say
        (an earlier attempt's measured rate, or the configured storage rate)."""
        if not nbytes:
            return 0.0
        if self.slowest_save is not None:
            return self.slowest_save.save_s(nbytes)
        return self.budgets.save_s(nbytes)
