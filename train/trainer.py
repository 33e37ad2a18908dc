"""`RunTrainer`: torchtitan's `Trainer`, plus preemption, run health and FP8 bookkeeping.

Why a subclass and not a loop of our own: torchtitan's `Trainer.train()` already does the
step loop, gradient accumulation, checkpoint saves, validation and metrics. We extend it
the two ways torchtitan means: a component's behaviour lives in a subclass of that
component, picked by its `Config` in `train/build.py`, and the trainer overrides only the
Trainer methods torchtitan leaves to subclasses (plus `diverged`, read by `python -m
train`, and two small helpers of those overrides). Nothing here replaces a method of a
component after it is built (tests/train/test_no_method_patching.py).

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

The overrides:
- `__init__` builds what reads the built components: the data ledger's recorder, the
  step's one exchange (`train.reliability.exchange.StepExchange`, given the preemption flag
  and the recorder's lanes to carry), `TrainingHealth` (non-finite skips, stragglers, over
  that exchange), `LossSpikeRollback` (given the checkpointer, loader, LR schedulers,
  metrics logger and run folder), the FP8 telemetry and the fault injector, and hands the
  optimizers their veto. At startup it logs which linears run in FP8, whether real float8
  GEMMs (`torch._scaled_mm`) or emulation are used, and how many weights FSDP really
  gathers in float8 (read off the parameters, not the config).
- `should_continue_training()` (called at every step boundary) stops a diverged run, and
  a preempted one: whether any rank received a preemption signal (SIGUSR1 from SLURM's
  `--signal`, or SIGTERM) or found the job's end time near
  (`train.reliability.time_limit.EndInTime`: the measured step and save against SLURM's
  end time) travels in the step's one exchange (`train.reliability.exchange`: the health
  verdict, these flags and the ledger's lanes in one all_reduce, read once), so all ranks
  stop at the same step, the one whose exchange saw the flag first (a signal after a step's
  exchange, or an end-time verdict at a step boundary, stops the run one step later).
  They then save a checkpoint for that step (DCP, complete before we exit) and stop;
  `python -m train` writes `RUN/preempted.json` and exits 0. The signal handler only sets
  the flag, so a signal that arrives during a checkpoint save cannot interrupt it.
- `train_step()` runs the step's health bookkeeping around torchtitan's step, and after a
  step that completed a loss spike rolls the run back in process
  (`LossSpikeRollback.handle_spike`: the last checkpoint before the spike, the data loader
  kept where it was, so the data since is skipped exactly); that step saves no checkpoint
  and runs no validation. It then refreshes FP8 scales for the FP8 FSDP all-gather
  (tensorwise recipe) after the optimizer step, as torchao requires.
- `forward_backward_step()` is a watchdog beat (each micro-batch has its own window,
  derived from the plan: train/reliability/budgets.py), notes each micro-batch's loss and the end of
  this rank's backward pass for the per-step check (and applies the injected sleeps and
  spike factor of a fault-injection test).
- `batch_generator()` tells the watchdog when a new seq_len starts (that step compiles
  again) and raises the collective timeout of every mesh group for that step
  (`train.reliability.budgets.CollectiveTimeouts`, restored after it), and notes which global
  sequences each micro-batch holds when a spike is injected.
- `state_dict()`/`load_state_dict()` store the global token count, so it survives a
  resume on another number of ranks, and the FP8 format the checkpoint was trained in: a
  resume in the other one (a run moving between NVIDIA and AMD MI300) must continue the
  loss where it stopped (`train.reliability.format_switch`), or the run stops.
- each optimizer step, once its update is applied or skipped, is recorded in the data
  ledger (`train.ledger.recorder.DataLedgerRecorder`, RUN/ledger.jsonl) from the lanes its
  exchange summed, and each checkpoint load (a resume, a rollback) opens a new segment of it.
"""

from __future__ import annotations

import collections
import contextlib
import math
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from train.components.fp8_stats import Fp8Telemetry
from train.config import FaultToleranceConfig, Fp8Config, HealthConfig
from train.fp8 import describe_fp8_linears, model_fp8_format, refresh_fp8_all_gather_scales
from train.ledger.recorder import DataLedgerRecorder
from train.reliability import watchdog
from train.reliability.budgets import Budgets, CollectiveTimeouts
from train.reliability.exchange import StepExchange
from train.reliability.faults import FaultInjector
from train.reliability.format_switch import FormatSwitchGate
from train.reliability.health import TrainingHealth, is_torchtitan_nonfinite_loss
from train.reliability.rollback import LossSpikeRollback
from train.reliability.time_limit import END_TIME_FLAG, EndInTime

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
        fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
        fp8: Fp8Config = field(default_factory=Fp8Config)
        budgets: Budgets | None = None
        """The run's time budgets (train/reliability/budgets.py; mapped by `train.build.to_trainer_config`)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.preempted_signal: int = 0  # a signal number, or END_TIME_FLAG
        self.stop_reason = ""  # why a preempted run stopped, for RUN/preempted.json
        line, self._fp8_all_gather = describe_fp8_linears(self.model_parts)
        logger.info(line)
        run_folder = Path(config.dump_folder)
        checkpoint_folder = run_folder / config.checkpoint.folder
        self.faults = FaultInjector(config.health.inject_faults)
        self.faults.announce()
        self.rollback = LossSpikeRollback(
            config.health,
            checkpointer=self.checkpointer,
            dataloader=self.dataloader,
            lr_schedulers=self.lr_schedulers,
            metrics_logger=self.metrics_processor.logger,
            run_folder=run_folder,
            checkpoint_folder=checkpoint_folder,
        )
        self.ledger = self.build_ledger_recorder(run_folder)  # train/ledger/recorder.py
        self.checkpointer.before_save(self.ledger.sync)  # a checkpoint never outruns its ledger
        # the step's one collective: the health verdict, the preemption flag, the ledger
        self._ending = ""  # why this rank found the job's end time near, once it did
        self.exchange = StepExchange(
            self.device,
            signal=lambda: _preempt_signal["signum"] or (END_TIME_FLAG if self._ending else 0),
            ledger=self.ledger.take_lanes,
        )
        self.health = TrainingHealth(
            config.health,
            model_parts=self.model_parts,
            device=self.device,
            data_loading_times=self.metrics_processor.data_loading_times,
            run_folder=run_folder,
            checkpoint_folder=checkpoint_folder,
            token_ranks=self._num_token_ranks(),
            judge_loss=self._judge_loss,
            exchange=self.exchange,
        )
        # a resume in another FP8 format: its first losses must continue the checkpoint's
        self.format_switch = FormatSwitchGate(
            config.health, model_fp8_format(self.model_parts), run_folder
        )
        # the one place an update can be vetoed: the container's step, after clipping
        self.optimizers.set_veto(self.health.check_step)
        self.fp8_stats = Fp8Telemetry(
            config.fp8, self.model_parts, config.dump_folder, logger.warning
        )
        self.metrics_processor.extra_metrics_fn = self._extra_metrics
        self._seq_lens_seen: set[int] = set()  # batch_generator: a new one recompiles
        self.budgets = config.budgets or Budgets(
            config.fault_tolerance.hang_timeout_s,
            config.comm.init_timeout_seconds,
            config.comm.train_timeout_seconds,
        )
        # every mesh group's collective timeout: raised for a new seq_len, a save, a rollback
        self.timeouts = CollectiveTimeouts.of_mesh(
            self.parallel_dims, config.comm.train_timeout_seconds
        )
        self.checkpointer.save_window.use_timeouts(self.timeouts)
        self.end_in_time = EndInTime.from_env(self.budgets)  # SLURM's end time, if any
        if self.end_in_time.describe() and torch.distributed.get_rank() == 0:
            logger.info(self.end_in_time.describe())
        self._micro_batch = 0  # forward_backward_step's count within the step
        self._step_seq_len: int | None = None
        self._new_seq_len_timeouts: contextlib.ExitStack | None = None
        self._batch_sequences: collections.deque[list[int]] = collections.deque()

    @property
    def diverged(self) -> str:
        """Why the run stops as diverged (non-finite steps in a row, a loss spike past
        health.max_rollbacks, or a loss jump after a resume in another FP8 format;
        `python -m train` then exits 4), or "" while it is not."""
        return self.health.stop or self.rollback.stop or self.format_switch.stop

    def _judge_loss(self, step: int, loss: float) -> bool:
        """The step's global loss, judged: right after a resume in another FP8 format by
        the continuity gate, else by the loss-spike rule; True vetoes the update."""
        if self.format_switch.observe(step, loss):
            return True  # the run stops (diverged): no rollback
        return self.rollback.observe(step, loss)

    def _extra_metrics(self, step: int) -> dict[str, float]:
        """The metrics processor's extra metrics: run health, rollbacks, FP8 telemetry and
        the loader's counters (skipped tokens)."""
        metrics = self.health.metrics(step) | self.rollback.metrics()
        metrics |= self.fp8_stats.metrics(step)
        loader_metrics = getattr(self.dataloader, "metrics", None)
        if loader_metrics is not None:
            metrics.update(loader_metrics())
        return metrics

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        self._micro_batch += 1
        watchdog.micro_batch(self._micro_batch, self._step_seq_len)
        if self.faults.spikes:  # tests only: the loss of chosen global sequences, scaled
            factor = self.faults.loss_factor(self._batch_sequences.popleft())
            with self.loss_fn.scaled(factor):
                loss = super().forward_backward_step(**kwargs)
        else:
            loss = super().forward_backward_step(**kwargs)
        self.faults.sleep("backward", self.step)
        self.health.after_forward_backward(loss)
        return loss

    def train_step(self, data_iterator):
        self._micro_batch = 0
        self._batch_sequences.clear()
        self.rollback.begin_step()
        self.health.begin_step(self.step)
        self.fp8_stats.begin_step(self.step)  # hooks on fp8.stats_freq steps only
        poisoned = self.faults.poison_output(self.model_parts[-1], self.step)
        try:
            super().train_step(data_iterator)
        except RuntimeError as e:
            # torchtitan stops on a logged non-finite loss; this step's update was skipped
            if not (self.health.step_skipped and is_torchtitan_nonfinite_loss(e)):
                raise
            nan = math.nan
            self.metrics_processor.log(self.step, nan, nan, nan)
        finally:
            if poisoned is not None:
                poisoned.remove()
            self.health.end_step()
            self.fp8_stats.end_step()
        if self._new_seq_len_timeouts is not None:  # the step at a new seq_len is done
            self._new_seq_len_timeouts.close()  # behind a barrier: every rank is done too
            self._new_seq_len_timeouts = None
        self.record_step()
        if self.rollback.spike:  # the same decision on every rank
            # rolled back (the step is now the checkpoint's) or stopping: neither saved
            # nor validated
            self.checkpointer.skip_next_save()
            if self.config.validator.enable:
                self.validator.skip_next()
            # loading the checkpoint takes about as long as saving it
            with self.checkpointer.save_window.watch("loss-spike rollback", self.step):
                self.rollback.handle_spike(self.step)
        watchdog.progress(self.step, step_done=True)  # the save + validation: a new window
        if self._fp8_all_gather:
            refresh_fp8_all_gather_scales(self.model_parts)

    def build_ledger_recorder(self, run_folder: Path) -> DataLedgerRecorder:
        """The run's data ledger, RUN/ledger.jsonl."""
        return DataLedgerRecorder(
            self.dataloader,
            run_folder=run_folder,
            micro_batches=self.gradient_accumulation_steps
            * self.num_pipeline_parallel_microbatches,
            fresh=getattr(self.checkpointer, "fresh", False),
        )

    def record_step(self) -> None:
        """The step's ledger record, from the lanes its exchange summed over the ranks."""
        exchanged = self.exchange.last  # this step's, from the optimizers' veto
        assert exchanged is not None, f"step {self.step} made no exchange"
        self.ledger.after_step(
            self.step,
            skipped=self.health.step_skipped or bool(self.rollback.spike),
            lanes=exchanged.ledger,
        )

    def batch_generator(self, data_iterable):
        """torchtitan's batches, and the first batch of each new seq_len (a schedule phase)
        tells the watchdog: that step compiles again, like the first one."""
        seen = self._seq_lens_seen
        for input_dict, labels in super().batch_generator(data_iterable):
            if self.faults.spikes:
                self._batch_sequences.append(list(self.dataloader.last_sequences))
            seq_len = labels.shape[-1]
            self._step_seq_len = seq_len
            if seq_len not in seen:
                if seen:
                    watchdog.new_shape(f"seq_len {seq_len}")
                    self._raise_timeouts_for_new_seq_len(seq_len)
                seen.add(seq_len)
            yield input_dict, labels

    def _raise_timeouts_for_new_seq_len(self, seq_len: int) -> None:
        """Every rank compiles again at a new seq_len, some slower than others: for this
        step every mesh group's collective timeout outlasts the compile window, so the
        watchdog names a rank that never finishes, not NCCL; `train_step` restores it."""
        if self._new_seq_len_timeouts is not None:
            return
        stack = contextlib.ExitStack()
        needed = self.budgets.covering_s(self.budgets.compile_window_s(seq_len))
        stack.enter_context(self.timeouts.raised_to(needed))
        self._new_seq_len_timeouts = stack

    def _num_token_ranks(self) -> int:
        """Ranks whose token counts sum to the global count (torchtitan's "loss" mesh)."""
        if not self.parallel_dims.dp_cp_enabled:
            return 1
        return self.parallel_dims.get_optional_mesh("loss").size()

    # torchtitan saves `ntokens_seen` as this rank's count, so a resume on another number of
    # ranks would mis-count; every rank sees the same number of tokens per step, so store
    # the global count and divide on load.
    # The FP8 format the checkpoint was trained in goes with it (a checkpoint from before
    # the key loads without it: train/components/checkpoint.py), for the format-switch gate.
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "ntokens_seen": self.ntokens_seen * self._num_token_ranks(),
            "fp8_format": self.format_switch.fp8_format,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"] // self._num_token_ranks()
        self.ledger.on_load(self.step)  # a resume or a rollback: the next step opens a segment
        self.format_switch.on_load(self.step, state_dict.get("fp8_format"))

    def close(self) -> None:
        if getattr(self, "ledger", None) is not None:
            self.ledger.close()  # the ledger's last records appended and fsynced
        super().close()

    def should_continue_training(self) -> bool:
        watchdog.progress(self.step)  # a step boundary is progress (train/reliability/watchdog.py)
        if self.diverged:  # the same decision on every rank
            return False
        # this boundary's end-time verdict rides the next step's exchange; the flags of the
        # last step's exchange decide now: no collective, no sync here
        self._ending = self._end_in_time() or self._ending
        signum = self.exchange.last.signal if self.exchange.last is not None else 0
        if signum:
            if signum == END_TIME_FLAG:
                why = self._ending or "another rank found the job's end time near"
            else:
                why = f"{signal.Signals(signum).name} received"
            saving = "saving a checkpoint for" if self.checkpointer.enable else "no checkpoint:"
            logger.warning(f"{why}: {saving} step {self.step} and stopping")
            if self.step > 0 and self.checkpointer.enable:  # no checkpoints: just stop
                self.checkpointer.save_now(self.step)  # inside the save's watchdog window
            self.preempted_signal, self.stop_reason = signum, why
            return False
        return super().should_continue_training()

    def _end_in_time(self) -> str:
        """Why this rank would stop now to end before SLURM's end time, or "" (the measured
        step and save against it: train/reliability/time_limit.py)."""
        window = self.checkpointer.save_window  # it times every save
        upload = getattr(self.checkpointer, "save_future", None)  # an async save writing
        return self.end_in_time.reason(
            self.step,
            window.take_measured(),
            save_in_flight=upload is not None and not upload.done(),
            nbytes=window.count_bytes() if self.checkpointer.enable and self.step else 0,
        )
