"""`RunTrainer`: torchtitan's `Trainer`, plus preemption and FP8 bookkeeping.

Why a subclass and not a loop of our own: torchtitan's `Trainer.train()` already does the
step loop, gradient accumulation, checkpoint saves, validation and metrics. We override
two hooks, and the train-state dict:

- `should_continue_training()` (called at every step boundary) also asks every rank
  whether a preemption signal arrived (SIGUSR1 from SLURM's `--signal`, or SIGTERM): an
  all-reduce MAX over the flag, so all ranks stop at the same step. They then save a
  checkpoint for that step (DCP, complete before we exit) and stop; `python -m train`
  writes `RUN/preempted.json` and exits 0. The signal handler only sets the flag, so a
  signal that arrives during a checkpoint save cannot interrupt it.
- `train_step()` additionally refreshes FP8 scales for the FP8 FSDP all-gather (tensorwise
  recipe) after each optimizer step, as torchao requires.

- `forward_backward_step()` and the optimizer step feed `train.health.TrainingHealth`:
  a step with a non-finite loss or gradient on any rank is skipped (no optimizer update),
  too many in a row stop the run, and each rank's step time is gathered to name stragglers.

- `state_dict()`/`load_state_dict()` store the global token count, so it survives a
  resume on another number of ranks.

At startup it logs which linears run in FP8, whether real float8 GEMMs
(`torch._scaled_mm`) or emulation are used, and how many weights FSDP really gathers in
float8 (read off the parameters, not the config).
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from train import watchdog
from train.config import HealthConfig
from train.fp8 import describe_fp8_linears, refresh_fp8_all_gather_scales
from train.health import TrainingHealth, is_torchtitan_nonfinite_loss

# set by the signal handler, read at step boundaries; nothing else happens in the handler
_preempt_signal = {"signum": 0}


def _on_preempt_signal(signum, frame) -> None:
    _preempt_signal["signum"] = signum


def install_preemption_handlers() -> None:
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, _on_preempt_signal)


class RunTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        health: HealthConfig = field(default_factory=HealthConfig)

    def __init__(self, config: Config):
        super().__init__(config)
        self.preempted_signal: int = 0
        self._fp8_all_gather = self._log_fp8_linears()
        self.health = TrainingHealth(config.health, self)
        self.metrics_processor.extra_metrics_fn = self.health.metrics
        # the one place an update can be vetoed: the container's step, after clipping
        optimizer_step = self.optimizers.step
        self.optimizers.step = lambda: None if self.health.check_step() else optimizer_step()

    def _log_fp8_linears(self) -> bool:
        """Log the FP8 linears; True if any uses the FP8 FSDP all-gather."""
        line, gathered = describe_fp8_linears(self.model_parts)
        logger.info(line)
        return gathered

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        self.health.after_forward_backward(loss)
        return loss

    def train_step(self, data_iterator):
        self.health.begin_step(self.step)
        try:
            super().train_step(data_iterator)
        except RuntimeError as e:
            # torchtitan stops on a logged non-finite loss; this step's update was skipped
            if not (self.health.step_skipped and is_torchtitan_nonfinite_loss(e)):
                raise
            nan = math.nan
            self.metrics_processor.log(self.step, nan, nan, nan)
        finally:
            self.health.end_step()
        watchdog.progress(self.step, step_done=True)  # the save + validation: a new window
        if self._fp8_all_gather:
            refresh_fp8_all_gather_scales(self.model_parts)

    def _num_token_ranks(self) -> int:
        """Ranks whose token counts sum to the global count (torchtitan's "loss" mesh)."""
        if not self.parallel_dims.dp_cp_enabled:
            return 1
        return self.parallel_dims.get_optional_mesh("loss").size()

    # torchtitan saves `ntokens_seen` as this rank's count, so a resume on another number of
    # ranks would mis-count; every rank sees the same number of tokens per step, so store
    # the global count and divide on load.
    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen * self._num_token_ranks()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"] // self._num_token_ranks()

    def should_continue_training(self) -> bool:
        watchdog.progress(self.step)  # a step boundary is progress (train/watchdog.py)
        if self.health.stop:  # the same decision on every rank
            return False
        flag = torch.tensor([_preempt_signal["signum"]], dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        if signum:
            name = signal.Signals(signum).name
            logger.warning(
                f"{name} received: saving a checkpoint for step {self.step} and stopping"
            )
            if self.step > 0:
                self.checkpointer.save_now(self.step)
            self.preempted_signal = signum
            return False
        return super().should_continue_training()
