"""`RunTrainer`: torchtitan's `Trainer`, plus preemption, run health and FP8 bookkeeping.

Why a subclass and not a loop of our own: torchtitan's `Trainer.train()` already does the
step loop, gradient accumulation, checkpoint saves, validation and metrics. We extend it
the two ways torchtitan means: a component's behaviour lives in a subclass of that
component, picked by its `Config` in `train/build.py`, and the trainer overrides only the
Trainer methods torchtitan leaves to subclasses (plus `diverged`, read by `python -m
train`, and what the hooks call back: `judge`, `lanes`, `num_token_ranks`). Nothing here
replaces a method of a component after it is built (tests/train/test_no_method_patching.py).

The components (each module's docstring says why):
- the optimizers: `SkipStepOptimizersContainer` (train/components/optimizer.py) asks a veto before
  each update; the veto is `train.reliability.health.TrainingHealth.check_step`: a step with a
  non-finite loss or gradient on any rank, or one that completes a loss spike
  (`train.reliability.rollback`), changes no parameter and no optimizer state on any rank;
- the LR schedule: `RollbackLRSchedulersContainer` (train/reliability/rollback.py), torchtitan's
  lambda times the LR windows a rollback may open;
- validation: `RunValidator` (train/components/validator.py), in a watchdog window with a beat per
  batch;
- checkpoints: `RunCheckpointManager` (train/components/checkpoint.py), every save inside its
  watchdog window (train/components/save_window.py);
- the loss: torchtitan's, or `SpikedLoss` (train/reliability/faults.py) when a test injects a spike;
- metrics: `RunMetricsProcessor` (train/components/metrics.py), which also logs the trainer's extra
  metrics (run health, rollbacks, FP8 telemetry and the loader's counters).

The step hooks (`train.step_hooks.StepHook`): health, rollback, the FP8 format switch,
the end in time, faults, the data ledger, the FP8 telemetry and the watchdog's windows each
implement the points of a step in their own wing, and `train.build.step_hooks` picks their
ordered tuple from the config (`RunTrainer.Config.hooks`). The trainer builds each with its
`from_trainer` and calls every point on every hook in that order, naming none, so the
tuple's order is the step's (tests/train/test_step_order.py asserts it):
1. `FaultInjector` (train/reliability/faults.py; only when faults are injected): the NaN
   output, the injected spike's loss factor around each micro-batch, the backward sleeps;
2. `TrainingHealth` (train/reliability/health.py): non-finite skips and stragglers, and
   the optimizers' veto (`check_step`), which runs inside the optimizer step, after
   clipping: the step's one exchange (`train.reliability.exchange.StepExchange`, whose
   lanes every hook may fill: the health verdict, the preemption flag and the ledger's
   lanes in one all_reduce, read once), then each hook's `judge` of the global loss;
3. `Fp8Telemetry` (train/components/fp8_stats.py; only when fp8.stats_freq asks for it);
4. `FormatSwitchGate` (train/reliability/format_switch.py): right after a resume in another
   FP8 format it judges the loss first, so a loss jump there stops the run (diverged), with
   no rollback; its `state_dict` is the FP8 format the checkpoint was trained in;
5. `DataLedgerRecorder` (train/ledger/recorder.py; `ReplicaLedgerRecorder` in a replica
   group): each optimizer step, once its update is applied or skipped, is recorded from
   the lanes its exchange summed, before a rollback loads a checkpoint; each checkpoint
   load (a resume, a rollback) opens a new segment;
6. `LossSpikeRollback` (train/reliability/rollback.py): judges the loss after the gate;
   after a step that completed a loss spike it rolls the run back in process (the last
   checkpoint before the spike, the data loader kept where it was, so the data since is
   skipped exactly); that step saves no checkpoint and runs no validation;
7. `StepWindows` (train/reliability/watchdog.py): a watchdog window per micro-batch
   (derived from the plan: train/reliability/budgets.py), a new seq_len's compile window
   and every mesh group's collective timeout raised for that step, and the end of the
   step's compute, once the rollback is done: the save and validation get a new window;
8. `EndInTime` (train/reliability/time_limit.py): a preemption signal (SIGUSR1 from
   SLURM's `--signal`, or SIGTERM) or the job's end time found near on any rank rides the
   step's exchange, so at the next step boundary all ranks stop at the same step, the one
   whose exchange saw the flag first (a signal after a step's exchange, or an end-time
   verdict at a step boundary, stops the run one step later). They then save a checkpoint
   for that step (DCP, complete before we exit) and stop; `python -m train` writes
   `RUN/preempted.json` and exits 0.

The overrides, each a loop over the hooks at its points:
- `__init__` builds the step's one exchange and the hooks, and logs which linears run in
  FP8, whether real float8 GEMMs (`torch._scaled_mm`) or emulation are used, and how many
  weights FSDP really gathers in float8 (read off the parameters, not the config).
- `train_step()`: `begin_step`, torchtitan's step (a logged non-finite loss whose update a
  hook vetoed is not an error), `end_step`, `after_step`; then it refreshes FP8 scales
  for the FP8 FSDP all-gather (tensorwise recipe) after the optimizer step, as torchao
  requires.
- `batch_generator()` and `forward_backward_step()`: `on_batch` for each micro-batch
  drawn, `before_forward` and `after_backward` around each one's passes.
- `should_continue_training()` (at every step boundary): `at_boundary`; a diverged run
  (a hook's `stop`; `python -m train` exits 4) stops, and so does a preempted one.
- `state_dict()`/`load_state_dict()` store the global token count, so it survives a
  resume on another number of ranks, and each hook's own keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from train.config import FaultToleranceConfig, Fp8Config, HealthConfig
from train.fp8 import describe_fp8_linears, refresh_fp8_all_gather_scales
from train.reliability.budgets import Budgets
from train.reliability.exchange import StepExchange
from train.reliability.health import is_torchtitan_nonfinite_loss
from train.step_hooks import each, merged


class RunTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        health: HealthConfig = field(default_factory=HealthConfig)
        fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
        fp8: Fp8Config = field(default_factory=Fp8Config)
        budgets: Budgets | None = None
        """The run's time budgets (train/reliability/budgets.py; mapped by `train.build.to_trainer_config`)."""
        hooks: tuple = ()
        """The step hooks' classes, in the step's order (`train.build.step_hooks`)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.preempted_signal: int = 0  # a signal number, or END_TIME_FLAG
        self.stop_reason = ""  # why a preempted run stopped, for RUN/preempted.json
        line, self._fp8_all_gather = describe_fp8_linears(self.model_parts)
        logger.info(line)
        self.budgets = config.budgets or Budgets(
            config.fault_tolerance.hang_timeout_s,
            config.comm.init_timeout_seconds,
            config.comm.train_timeout_seconds,
        )
        # the step's one collective: every hook's lanes ride it (train/reliability/exchange.py)
        self.exchange = StepExchange(self.device, lanes=self.lanes)
        self.hooks = tuple(hook.from_trainer(self) for hook in config.hooks)
        self.metrics_processor.extra_metrics_fn = self._extra_metrics

    @property
    def diverged(self) -> str:
        """Why the run stops as diverged (non-finite steps in a row, a loss spike past
        health.max_rollbacks, or a loss jump after a resume in another FP8 format;
        `python -m train` then exits 4), or "" while it is not."""
        return next((hook.stop for hook in self.hooks if hook.stop), "")

    def judge(self, step: int, loss: float) -> bool:
        """The step's global loss, judged by each hook in order until one vetoes the
        update (True)."""
        return any(hook.judge(step, loss) for hook in self.hooks)

    def lanes(self) -> dict:
        """This rank's lanes of the step's exchange, from every hook."""
        return merged(self.hooks, "lanes")

    def _extra_metrics(self, step: int) -> dict[str, float]:
        """The metrics processor's extra metrics: the hooks' (run health, rollbacks, FP8
        telemetry) and the loader's counters (skipped tokens)."""
        metrics = merged(self.hooks, "metrics", step)
        loader_metrics = getattr(self.dataloader, "metrics", None)
        if loader_metrics is not None:
            metrics.update(loader_metrics())
        return metrics

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        each(self.hooks, "before_forward")
        loss = super().forward_backward_step(**kwargs)
        each(self.hooks, "after_backward", loss)
        return loss

    def batch_generator(self, data_iterable):
        for input_dict, labels in super().batch_generator(data_iterable):
            each(self.hooks, "on_batch", labels)
            yield input_dict, labels

    def train_step(self, data_iterator):
        each(self.hooks, "begin_step", self.step)
        try:
            super().train_step(data_iterator)
        except RuntimeError as e:
            # torchtitan stops on a logged non-finite loss; this step's update was skipped
            if not (self._skipped() and is_torchtitan_nonfinite_loss(e)):
                raise
            nan = math.nan
            self.metrics_processor.log(self.step, nan, nan, nan)
        finally:
            each(self.hooks, "end_step")
        if self.exchange.last is None:
            # the update never reached the veto (a replica group's quorum refused the step):
            # its flags (a preemption, the end time) still ride an exchange, empty
            zero = torch.zeros((), device=self.device)
            self.exchange.reduce(zero, zero, zero, step_s=0.0)
        each(self.hooks, "after_step", self.step, skipped=self._skipped(), sums=self.exchange.last)
        if self._fp8_all_gather:
            refresh_fp8_all_gather_scales(self.model_parts)

    def _skipped(self) -> bool:
        return any(hook.vetoed for hook in self.hooks)

    def num_token_ranks(self) -> int:
        """Ranks whose token counts sum to the global count (torchtitan's "loss" mesh)."""
        if not self.parallel_dims.dp_cp_enabled:
            return 1
        return self.parallel_dims.get_optional_mesh("loss").size()

    # torchtitan saves `ntokens_seen` as this rank's count, so a resume on another number of
    # ranks would mis-count; every rank sees the same number of tokens per step, so store
    # the global count and divide on load. The hooks add their keys (the FP8 format the
    # checkpoint was trained in; a checkpoint from before a key loads without it:
    # train/components/checkpoint.py).
    def state_dict(self) -> dict:
        state = {"step": self.step, "ntokens_seen": self.ntokens_seen * self.num_token_ranks()}
        return state | merged(self.hooks, "state_dict")

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"] // self.num_token_ranks()
        each(self.hooks, "load_state_dict", state_dict)  # a resume or a rollback

    def close(self) -> None:
        each(getattr(self, "hooks", ()), "close")  # the ledger's last records fsynced
        super().close()

    def should_continue_training(self) -> bool:
        stops = [stop for stop in each(self.hooks, "at_boundary", self.step) if stop]
        if self.diverged:  # the same decision on every rank
            return False
        if stops:
            signum, why = stops[0]
            saving = "saving a checkpoint for" if self.checkpointer.enable else "no checkpoint:"
            logger.warning(f"{why}: {saving} step {self.step} and stopping")
            if self.step > 0 and self.checkpointer.enable:  # no checkpoints: just stop
                self.checkpointer.save_now(self.step)  # inside the save's watchdog window
            self.preempted_signal, self.stop_reason = signum, why
            return False
        return super().should_continue_training()
