"""A resume in another FP8 format: the loss must go on where the checkpoint left it.

Why: a run can move between vendors. A checkpoint trained on NVIDIA GPUs (FP8 in the `fn`
format, e4m3 up to 448) can resume on AMD MI300X/MI325X (`fnuz`, up to 240) and back
(common/fp8_formats.py). What a checkpoint holds is format-neutral: high-precision weights
(train/fp8.py saves the plain weight, never a float8 one or its scale), the optimizer's
moments, the loader's position and the data ledger; every FP8 scale is recomputed from
the weights and activations at each step. So the loss after the switch should continue
where it stopped, within FP8's noise. If it does not (a float8 tensor or a scale that did
travel, read in the other format, is off by a factor of two), the run would go on
training on damaged numbers, and nothing else looks at the loss right after a resume:
the loss-spike rule (train/reliability/rollback.py) waits for `health.spike_warmup` steps
of new history first.

The gate, like the warm start's check that the first loss is the loaded model's and not a
random one's (tests/train/components/test_hf_warm_start.py), compares the first losses of
the new format with the last ones of the old:
- the checkpoint records the format it was trained in (the trainer's state holds this
  gate's `state_dict`: `fp8_format`, read off the model's float8 casts; checkpoints from
  before have none and are not judged), and a load hands it to `on_load` with the step;
- when it differs from this run's format, the reference is RUN/metrics.jsonl's training
  loss up to the checkpoint (the last line of each step): the level is the mean of the
  last `SWITCH_CHECK_STEPS` logged losses, the noise the step-to-step scatter over the
  last `health.spike_window` of them (the standard deviation of consecutive differences,
  over the square root of 2: a falling trend does not count as noise, as it would in a
  plain standard deviation early in a run), and the bound is the loss-spike rule's form:
  level + max(`health.spike_sigmas` x noise, `health.spike_min_rise`);
- each of the next `SWITCH_CHECK_STEPS` steps' global loss (the number every rank gets
  from the per-step check, so every rank decides the same) must stay at or under it. One
  above it vetoes that step's update and stops the run like a divergence (exit 4,
  RUN/diverged.json: a requeue would only repeat it), naming both formats, the losses and
  the checkpoint. After the last one the run logs that the loss was continuous.
A resume in the same format, or a rollback, is not judged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan.tools.logging import logger

from common.run_layout import read_metrics, step_dir_name
from train.fp8 import model_fp8_format
from train.step_hooks import StepHook

SWITCH_CHECK_STEPS = 5
"""Steps after a format switch whose loss is judged: a broken switch shows at the first."""


def continuity_bound(
    losses: list[float], sigmas: float, min_rise: float
) -> tuple[float, float, float]:
    """(level, noise, bound) of a loss history (oldest first, at least 3): the mean of its
    last `SWITCH_CHECK_STEPS`, the step-to-step noise (std of consecutive differences /
    sqrt 2) and level + max(sigmas x noise, min_rise)."""
    level = statistics.fmean(losses[-SWITCH_CHECK_STEPS:])
    steps = [b - a for a, b in zip(losses, losses[1:], strict=False)]
    noise = statistics.pstdev(steps) / math.sqrt(2)
    return level, noise, level + max(sigmas * noise, min_rise)


@dataclass
class _Switch:
    saved: str
    step: int
    level: float
    noise: float
    threshold: float
    judged: list[float] = field(default_factory=list)


class FormatSwitchGate(StepHook):
    """A step hook (see the module docstring): `on_load` after each checkpoint load,
    `judge` with each step's global loss (True vetoes the update; its step is not
    `vetoed` for the ledger: the run stops), `stop` the one-line reason once the run must
    stop; its `state_dict` is the checkpoint's format."""

    def __init__(self, health, fp8_format: str, run_folder: Path):
        self.config = health  # train.config.HealthConfig: the spike rule's bound
        self.fp8_format = fp8_format  # this run's, read off the model; "" without FP8
        self.run_folder = Path(run_folder)
        self.switch: _Switch | None = None
        self.stop = ""

    @classmethod
    def from_trainer(cls, trainer) -> FormatSwitchGate:
        fp8_format = model_fp8_format(trainer.model_parts)
        return cls(trainer.config.health, fp8_format, Path(trainer.config.dump_folder))

    def state_dict(self) -> dict:
        return {"fp8_format": self.fp8_format}

    def load_state_dict(self, state: dict) -> None:
        self.on_load(state["step"], state.get("fp8_format"))

    def on_load(self, step: int, saved_format: str | None) -> None:
        self.switch = None
        if not saved_format or not self.fp8_format or saved_format == self.fp8_format:
            return
        losses = self._losses_up_to(step)
        what = (
            f"FP8 format switch at step {step}: {step_dir_name(step)} was trained in "
            f"'{saved_format}', this run computes in '{self.fp8_format}'"
        )
        if len(losses) < 3:
            logger.warning(f"{what}; fewer than 3 logged losses before it: not judged")
            return
        level, noise, threshold = continuity_bound(
            losses, self.config.spike_sigmas, self.config.spike_min_rise
        )
        self.switch = _Switch(saved_format, step, level, noise, threshold)
        logger.info(
            f"{what}; the next {SWITCH_CHECK_STEPS} steps' loss must stay under "
            f"{threshold:.4g} (the last {min(len(losses), SWITCH_CHECK_STEPS)} logged losses "
            f"average {level:.4g}; step-to-step noise {noise:.3g} over {len(losses)})"
        )

    def _losses_up_to(self, step: int) -> list[float]:
        try:
            records, _ = read_metrics(self.run_folder)
        except ValueError:  # no metrics.jsonl: nothing to compare with
            return []
        by_step = {r["step"]: r["loss"] for r in records if "loss" in r and r["step"] <= step}
        recent = sorted(by_step)[-self.config.spike_window :]
        return [by_step[s] for s in recent]

    def judge(self, step: int, loss: float) -> bool:
        """Judge the step's global loss while a switch is being checked; True (veto this
        update, and `stop` is set) when it breaks continuity."""
        s = self.switch
        if s is None:
            return False
        if loss > s.threshold:
            self.stop = (
                f"step {step}: loss {loss:.4g} after resuming {step_dir_name(s.step)} (trained "
                f"in FP8 '{s.saved}') in '{self.fp8_format}', above {s.threshold:.4g} (the "
                f"loss before it: {s.level:.4g}, step-to-step noise {s.noise:.3g}): "
                "the checkpoint does not continue in this format. Resume it in "
                f"'{s.saved}' (on its GPUs, or fp8.format = '{s.saved}' on CPU) and report it"
            )
            logger.error(self.stop)
            self.switch = None
            return True
        s.judged.append(loss)
        if len(s.judged) == SWITCH_CHECK_STEPS:
            logger.info(
                f"FP8 format switch '{s.saved}' -> '{self.fp8_format}' at step {s.step}: loss "
                f"continuous (steps {s.step + 1}-{step}: at most {max(s.judged):.4g}, bound "
                f"{s.threshold:.4g})"
            )
            self.switch = None
        return False
