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

- a loss spike (`health.spike_rollback`, train/health.py) found in a step's check rolls
  the run back after that step, in process: `TrainingHealth.handle_spike` loads the last
  checkpoint before the spike and keeps the data loader where it was, so the data since
  is skipped exactly; that step saves no checkpoint and runs no validation. The injected
  `spike` fault scales the loss of the micro-batches that hold its global sequences
  (`_scale_injected_spikes`).

- checkpoint saves and validations get watchdog windows of their own
  (`_watch_saves_and_validation`, train/watchdog.py): a save may take `hang_timeout_s`
  plus its bytes at `fault_tolerance.min_save_gb_per_s`, a validation must start each
  batch within `hang_timeout_s`.

- `state_dict()`/`load_state_dict()` store the global token count, so it survives a
  resume on another number of ranks.

- each optimizer step, once its update is applied or skipped, is recorded in the data
  ledger (`train.ledger.DataLedgerRecorder`, RUN/ledger.jsonl), and each checkpoint load
  (a resume, a rollback) opens a new segment of it.

At startup it logs which linears run in FP8, whether real float8 GEMMs
(`torch._scaled_mm`) or emulation are used, and how many weights FSDP really gathers in
float8 (read off the parameters, not the config).
"""

from __future__ import annotations

import collections
import contextlib
import math
import signal
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from train import watchdog
from train.config import FaultToleranceConfig, Fp8Config, HealthConfig
from train.fp8 import describe_fp8_linears, refresh_fp8_all_gather_scales
from train.fp8_stats import Fp8Telemetry
from train.health import TrainingHealth, is_torchtitan_nonfinite_loss
from train.ledger import DataLedgerRecorder

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

    def __init__(self, config: Config):
        super().__init__(config)
        self.preempted_signal: int = 0
        self._fp8_all_gather = self._log_fp8_linears()
        self.health = TrainingHealth(config.health, self)
        self.ledger = DataLedgerRecorder(self)  # RUN/ledger.jsonl (train/ledger.py)
        self.fp8_stats = Fp8Telemetry(
            config.fp8, self.model_parts, config.dump_folder, logger.warning
        )
        self.metrics_processor.extra_metrics_fn = self._extra_metrics
        # the one place an update can be vetoed: the container's step, after clipping
        optimizer_step = self.optimizers.step
        self.optimizers.step = lambda: None if self.health.check_step() else optimizer_step()
        self._checkpoint_bytes = 0
        self._seq_lens_seen: set[int] = set()  # batch_generator: a new one recompiles
        self._batch_sequences: collections.deque[list[int]] = collections.deque()
        self._loss_factor = 1.0
        if self.health.spike_faults:
            self._scale_injected_spikes()
        self._watch_saves_and_validation()

    def _scale_injected_spikes(self) -> None:
        """Fault injection (tests only): the loss of a micro-batch holding a global sequence
        of a `spike` fault is multiplied by its factor, keyed to the data (the loader's
        `last_sequences`, noted per batch by `batch_generator`), not to the step."""
        loss_fn = self.loss_fn

        def scaled_loss(*args, **kwargs):
            loss, extra = loss_fn(*args, **kwargs)
            return loss * self._loss_factor, extra

        self.loss_fn = scaled_loss

    def _watch_saves_and_validation(self) -> None:
        """Open a watchdog phase around each checkpoint save and validation, and beat at
        each validation batch (train/watchdog.py), so a long save or validation that
        progresses is not a hang and one that stalls still is. torchtitan's `train()` calls
        `checkpointer.save` and `validator.validate` itself, so the hooks wrap them."""
        save = self.checkpointer.save

        def watched_save(curr_step: int, last_step: bool = False) -> bool:
            if self.health.spike:  # a spike's step (rolled back, or stopping) is not saved
                return False
            with self._save_phase(curr_step):
                return save(curr_step, last_step)

        self.checkpointer.save = watched_save
        if not self.config.validator.enable:
            return
        validator = self.validator
        validate, batch_context = validator.validate, validator.validation_context

        def watched_validate(model_parts, step: int) -> None:
            if self.health.spike:
                return
            with watchdog.phase("validation", step):
                validate(model_parts, step)

        def watched_batch_context():  # entered once per validation batch
            watchdog.beat("batch")
            self.health.inject_sleep("validation")
            return batch_context()

        validator.validate = watched_validate
        validator.validation_context = watched_batch_context

    @contextlib.contextmanager
    def _save_phase(self, step: int):
        """The watchdog window of a save: `hang_timeout_s` plus the checkpoint's bytes at
        `fault_tolerance.min_save_gb_per_s` (what a slow but working filesystem needs)."""
        if not self._checkpoint_bytes and self.checkpointer.enable:
            self._checkpoint_bytes = self._count_checkpoint_bytes()
            if self._checkpoint_bytes and dist.get_rank() == 0:
                logger.info(
                    f"watchdog: a checkpoint save may take {self._save_extra_s():.0f} s more "
                    f"than fault_tolerance.hang_timeout_s ({self._checkpoint_bytes / 1e9:.3g} "
                    f"GB at min_save_gb_per_s = {self.config.fault_tolerance.min_save_gb_per_s})"
                )
        with (
            watchdog.phase("checkpoint save", step, self._save_extra_s()),
            self._collective_timeout_covering(self._save_extra_s()),
        ):
            self.health.inject_sleep("save")
            yield

    @contextlib.contextmanager
    def _collective_timeout_covering(self, extra_s: float):
        """Ranks wait for each other inside a save (DCP's plan and metadata gathers); at 70B
        that can outlast `[comm] train_timeout_seconds`, and the collective timeout would
        end the job unnamed before the watchdog's save window runs out. So for the save the
        default group's timeout is the save window plus a margin (the watchdog speaks
        first, naming the rank), and the training timeout comes back after it."""
        train_s = self.config.comm.train_timeout_seconds
        needed_s = self.config.fault_tolerance.hang_timeout_s + extra_s + 60
        if not dist.is_initialized() or needed_s <= train_s:
            yield
            return
        dist.set_timeout(timedelta(seconds=needed_s))  # train/version_compat.py on torch 2.13
        try:
            yield
        finally:
            dist.set_timeout(timedelta(seconds=train_s))

    def _save_extra_s(self) -> float:
        return self._checkpoint_bytes / (self.config.fault_tolerance.min_save_gb_per_s * 1e9)

    def _count_checkpoint_bytes(self) -> int:
        """Bytes of a full checkpoint over all ranks: every parameter and optimizer state
        tensor at its global size (a DTensor's numel() is global). 0 before the optimizer
        state exists (no save happens before the first step)."""
        states = [
            v for o in self.optimizers.optimizers for s in o.state.values() for v in s.values()
        ]
        if not states:
            return 0
        tensors = [p for m in self.model_parts for p in m.parameters()] + states
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    def _extra_metrics(self, step: int) -> dict[str, float]:
        """train.health's metrics, plus the loader's counters (skipped tokens)."""
        metrics = self.health.metrics(step) | self.fp8_stats.metrics(step)
        loader_metrics = getattr(self.dataloader, "metrics", None)
        if loader_metrics is not None:
            metrics.update(loader_metrics())
        return metrics

    def _log_fp8_linears(self) -> bool:
        """Log the FP8 linears; True if any uses the FP8 FSDP all-gather."""
        line, gathered = describe_fp8_linears(self.model_parts)
        logger.info(line)
        return gathered

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        if self.health.spike_faults:
            self._loss_factor = self.health.loss_factor(self._batch_sequences.popleft())
        loss = super().forward_backward_step(**kwargs)
        self.health.after_forward_backward(loss)
        return loss

    def train_step(self, data_iterator):
        self._batch_sequences.clear()
        self.health.begin_step(self.step)
        self.fp8_stats.begin_step(self.step)  # hooks on fp8.stats_freq steps only
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
            self.fp8_stats.end_step()
        self.ledger.after_step(
            self.step, skipped=self.health.step_skipped or bool(self.health.spike)
        )
        if self.health.spike:  # the same decision on every rank
            # loading the checkpoint takes about as long as saving it
            with (
                watchdog.phase("loss-spike rollback", self.step, self._save_extra_s()),
                self._collective_timeout_covering(self._save_extra_s()),
            ):
                self.health.handle_spike()
        watchdog.progress(self.step, step_done=True)  # the save + validation: a new window
        if self._fp8_all_gather:
            refresh_fp8_all_gather_scales(self.model_parts)

    def batch_generator(self, data_iterable):
        """torchtitan's batches, and the first batch of each new seq_len (a schedule phase)
        tells the watchdog: that step compiles again, like the first one."""
        seen = self._seq_lens_seen
        for input_dict, labels in super().batch_generator(data_iterable):
            if self.health.spike_faults:
                self._batch_sequences.append(list(self.dataloader.last_sequences))
            seq_len = labels.shape[-1]
            if seq_len not in seen:
                if seen:
                    watchdog.new_shape(f"seq_len {seq_len}")
                seen.add(seq_len)
            yield input_dict, labels

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
        self.ledger.on_load(self.step)  # a resume or a rollback: the next step opens a segment

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
            saving = "saving a checkpoint for" if self.checkpointer.enable else "no checkpoint:"
            logger.warning(f"{name} received: {saving} step {self.step} and stopping")
            if self.step > 0 and self.checkpointer.enable:  # no checkpoints: just stop
                with self._save_phase(self.step):
                    self.checkpointer.save_now(self.step)
            self.preempted_signal = signum
            return False
        return super().should_continue_training()
