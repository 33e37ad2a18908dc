"""Run health: non-finite steps skipped and stragglers named, from the step's one exchange.

Why: on hundreds of ranks for weeks, two quiet failures cost the most. A NaN or Inf in the
loss or the gradients (a bad batch, an overflow, a flaky device) is trained through by
default: one optimizer step with NaN gradients poisons every weight and every later
checkpoint. And a rank that is slower than the rest slows every rank (they all wait for it
in the collectives) while the metrics only show a lower tokens/s for the whole job.

How, with the step's one exchange (`TrainingHealth.check_step`, the veto of
`train.components.optimizer.SkipStepOptimizersContainer`, run after gradient clipping and
before the update; the exchange, its layout and why it is one all_reduce and one sync:
`train.reliability.exchange`): every rank reports whether its loss or its gradients are
non-finite, its share of the step's loss and the seconds from its step start to the end of
its backward pass.
- Non-finite: the flag is set if this rank's loss (any micro-batch) or any of its local
  gradient shards is NaN/Inf. If any rank's flag is set, every rank skips the optimizer
  update (parameters and optimizer state stay as they were; the LR schedule still advances,
  so the learning rate at step N does not depend on how many steps were skipped). The skip
  is logged, naming the lowest and highest rank and the count of ranks with a non-finite
  loss or gradient (all of them up to two ranks; that step alone runs one more small
  collective for the names), counted (`health/nonfinite_skips` in
  metrics.jsonl/TensorBoard), and after `health.max_consecutive_nonfinite` skips in a row
  the run stops at that step boundary (`python -m train` exits 4, `ExitCode.DIVERGED` in
  `common.exit_codes`) with a one-line message that names the step and the last checkpoint
  saved before the streak.
- Loss: the shares, summed over the ranks (each counted once under TP), are the step's
  global mean loss; it goes to the loss-spike rule (`train.reliability.rollback`), which may
  veto the update too.
- Stragglers: the step time is when each rank finished its backward pass, measured from the
  start of its step (before clip_grad_norm_'s all-reduce, which would make every rank wait
  for the last). A rank that finishes late was slow in the work after the last collective it
  shared with the others. Each rank compares its own time with the mean of the others (the
  sum of every rank's time, less its own; `StragglerStats`): a rank that was at least
  `health.straggler_factor` x that mean (and `health.straggler_min_lag_s` behind) in each
  of the last `health.straggler_window` steps says so in the next step's exchange, and a
  warning names it (and its host; that step runs the extra collectives of the names). A
  slow node's ranks are named together. The slowest rank is left out of its own
  reference, so it cannot raise it. Each logged interval, the per-rank times go to
  `RUN/rank_times.jsonl`, and the slowest rank and its lag behind the median of the others
  to metrics.jsonl/TensorBoard (`health/straggler_rank`, `health/straggler_lag_s`): the
  per-rank times are gathered once per logged interval (`metrics`, O(world size), as the
  line of the file they make), never per step.
  Limit (docs/reliability.md): a delay that happens before a collective inside the step (an
  FSDP all-gather) is absorbed there: every rank waits, and the delay shows as lower
  throughput, not as a named rank; loader delays are named by the data-wait column.

The bytes a step moves are the same at 8 ranks and at 1,024 (one all_reduce of
`train.reliability.exchange.NUM_LANES` numbers; tests/train/reliability/test_health.py, on
a fake process group of 1,024).
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.utils import get_total_norm
from torchtitan.tools.logging import logger

from common.io import append_jsonl
from common.run_layout import RANK_TIMES, list_checkpoints, step_dir_name
from train.reliability.exchange import StepExchange, StepSums, Straggling, flagged_ranks
from train.shards import local_shard
from train.step_hooks import StepHook

# --------------------------------------------------------------------------- stragglers


def interval_summary(step_s: list[float], data_s: list[float]) -> dict[str, float]:
    """The metrics of a logged interval from every rank's mean step time and data wait:
    the slowest rank, and its lag behind the median of the other ranks."""
    rank = max(range(len(step_s)), key=step_s.__getitem__)
    others = step_s[:rank] + step_s[rank + 1 :]
    return {
        "health/straggler_rank": float(rank),
        "health/straggler_lag_s": step_s[rank] - statistics.median(others or step_s),
        "health/step_time_spread_s": max(step_s) - min(step_s),
        "health/data_wait_max_s": max(data_s),
    }


@dataclass
class StragglerStats:
    """This rank's own straggler rule over a sliding window of steps, and its sums for the
    logged interval."""

    window: int
    factor: float
    min_lag_s: float
    recent: list[tuple[float, float]] = field(default_factory=list)  # its slow steps
    ended: Straggling | None = None  # a window that ended, for the next exchange
    interval_step_s: float = 0.0
    interval_data_s: float = 0.0
    interval_steps: int = 0

    def add(self, step_s: float, data_s: float, step_s_sum: float, world_size: int) -> None:
        """Record this rank's step, given every rank's step time summed. If this rank was
        slower than the others' mean by `factor` (and `min_lag_s`) in every step of the
        window, `ended` holds the window until `take_ended` (at most once per window)."""
        self.interval_step_s += step_s
        self.interval_data_s += data_s
        self.interval_steps += 1
        if world_size == 1:
            return
        reference = (step_s_sum - step_s) / (world_size - 1)  # the others' mean
        if step_s < self.factor * reference or step_s - reference < self.min_lag_s:
            self.recent.clear()
            return
        self.recent.append((step_s, reference))
        if len(self.recent) == self.window:
            total, reference_total = (sum(column) for column in zip(*self.recent, strict=True))
            self.ended = Straggling(total, reference_total, data_s)
            self.recent.clear()

    def take_ended(self) -> Straggling | None:
        ended, self.ended = self.ended, None
        return ended


# --------------------------------------------------------------------------- the hooks


class TrainingHealth(StepHook):
    """A step hook (`train.step_hooks`); see the module docstring for what each point does.

    Given what it reads, not the trainer: the model parts (gradients), the device of the
    exchange, torchtitan's list of loader wait times (appended by the trainer's batch
    generator, cleared at each log), the run and checkpoint folders, the number of ranks
    whose loss shares sum to the global loss, `judge_loss`, the loss-spike rule
    (`train.reliability.rollback.LossSpikeRollback.judge`), which may veto an update too,
    and `exchange`, the trainer's one exchange per step (the preemption flag and the
    ledger's lanes ride in it; its own without)."""

    def __init__(
        self,
        config,
        *,
        model_parts: list[torch.nn.Module],
        device: torch.device,
        data_loading_times: list[float],
        run_folder: Path,
        checkpoint_folder: Path,
        token_ranks: int,
        judge_loss: Callable[[int, float], bool],
        exchange: StepExchange | None = None,
    ) -> None:
        self.config = config  # train.config.HealthConfig
        self.model_parts = model_parts
        self.device = device
        self.data_loading_times = data_loading_times
        self.checkpoint_folder = checkpoint_folder
        self.judge_loss = judge_loss
        self.exchange = exchange or StepExchange(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.loss_copies = self.world_size // token_ranks  # TP/PP ranks holding one share
        self.stragglers = StragglerStats(
            config.straggler_window, config.straggler_factor, config.straggler_min_lag_s
        )
        self.total_skips = 0
        self.consecutive_skips = 0
        self.streak_start = 0
        self.vetoed = False  # this step's update skipped: non-finite on some rank
        self.stop = ""  # set when the run must stop: the one-line reason
        self._rank_times_path = run_folder / RANK_TIMES
        self._step = 0
        self._step_start = 0.0
        self._arrival_s = 0.0
        self._data_mark = 0
        self._local_bad: torch.Tensor | None = None
        self._local_loss: torch.Tensor | None = None

    @classmethod
    def from_trainer(cls, trainer) -> TrainingHealth:
        """Built off the trainer, judging each step's loss with the trainer's judges, and
        the optimizers' veto: the one place an update can be skipped, after clipping."""
        run_folder = Path(trainer.config.dump_folder)
        health = cls(
            trainer.config.health,
            model_parts=trainer.model_parts,
            device=trainer.device,
            data_loading_times=trainer.metrics_processor.data_loading_times,
            run_folder=run_folder,
            checkpoint_folder=run_folder / trainer.config.checkpoint.folder,
            token_ranks=trainer.num_token_ranks(),
            judge_loss=trainer.judge,
            exchange=trainer.exchange,
        )
        trainer.optimizers.set_veto(health.check_step)
        return health

    # ---- step lifecycle (the step's hook points)
    def begin_step(self, step: int) -> None:
        self._step = step
        self.exchange.begin_step()
        self.vetoed = False
        self._local_loss = None
        self._local_bad = None
        self._step_start = time.perf_counter()
        self._arrival_s = 0.0
        self._data_mark = len(self.data_loading_times)

    def after_backward(self, loss: torch.Tensor) -> None:
        """Note a micro-batch's loss and when this rank finished its backward pass."""
        local = local_shard(loss.detach())
        bad = ~torch.isfinite(local).all()
        self._local_bad = bad if self._local_bad is None else self._local_bad | bad
        # this rank's share of the step's loss (local sum / global tokens): summed over the
        # loss ranks, the global mean loss the spike rule judges
        share = local.sum().to(torch.float64)
        self._local_loss = share if self._local_loss is None else self._local_loss + share
        # before clip_grad_norm_'s all-reduce, which would make every rank wait for the last
        self._arrival_s = time.perf_counter() - self._step_start

    def end_step(self) -> None:
        if self.consecutive_skips < self.config.max_consecutive_nonfinite or self.stop:
            return
        folder = self.checkpoint_folder
        good = [s for s in list_checkpoints(folder)[0] if s < self.streak_start]
        self.stop = (
            f"step {self._step}: {self.consecutive_skips} consecutive steps "
            f"({self.streak_start}-{self._step}) had non-finite loss or gradients and "
            f"were skipped (health.max_consecutive_nonfinite = "
            f"{self.config.max_consecutive_nonfinite}); stopping. Last good checkpoint: "
            f"{folder / step_dir_name(good[-1]) if good else 'none'}"
        )
        if self.rank == 0:
            logger.error(self.stop)

    # ---- the per-step check: the optimizers' veto
    def check_step(self) -> bool:
        """The step's exchange: True if this step's update must be skipped (on every rank)."""
        grads = [
            local_shard(p.grad)
            for m in self.model_parts
            for p in m.parameters()
            if p.grad is not None
        ]
        false = torch.zeros((), dtype=torch.bool, device=self.device)
        grad_bad = ~torch.isfinite(get_total_norm(grads, foreach=True)) if grads else false
        loss_bad = false if self._local_bad is None else self._local_bad.to(self.device)
        loss_share = torch.zeros((), dtype=torch.float64, device=self.device)
        if self._local_loss is not None:
            loss_share = self._local_loss.to(self.device)
        straggling = self.stragglers.take_ended()
        sums = self.exchange.reduce(
            loss_bad, grad_bad, loss_share, step_s=self._arrival_s, straggling=straggling
        )
        data_s = sum(self.data_loading_times[self._data_mark :])
        self.stragglers.add(self._arrival_s, data_s, sums.step_s, self.world_size)
        if sums.stragglers:  # a window ended on some rank: name them (every rank)
            self._warn_stragglers(sums, straggling is not None)
        if sums.loss_bad or sums.grad_bad:
            self._note_skip(sums, loss_bad, grad_bad)
            return True
        self.consecutive_skips = 0
        # with TP (or PP) several ranks hold the same share: count each share once
        return self.judge_loss(self._step, sums.loss_sum / self.loss_copies)

    def _warn_stragglers(self, sums: StepSums, mine: bool) -> None:
        (ranks,) = flagged_ranks([mine], [sums.stragglers], self.device)
        # the lowest of them tells its host name
        host = [socket.gethostname() if self.rank == ranks.lowest else None]
        dist.broadcast_object_list(host, src=ranks.lowest)
        if self.rank != 0:
            return
        n, window = sums.stragglers, self.config.straggler_window
        who = f"rank {ranks} ({host[0]})"
        if n > 1:
            who = f"ranks {ranks} (rank {ranks.lowest} on {host[0]}; their mean)"
        ratio = sums.straggler_s / sums.straggler_ref_s if sums.straggler_ref_s else math.inf
        logger.warning(
            f"straggler: {who} took {sums.straggler_s / n / window:.3f} s per step over the "
            f"last {window} steps, {ratio:.2f}x the mean of the other ranks "
            f"({sums.straggler_ref_s / n / window:.3f} s; "
            f"health.straggler_factor = {self.config.straggler_factor}); its data wait: "
            f"{sums.straggler_data_s / n:.3f} s in the last step"
        )

    def _note_skip(self, sums: StepSums, loss_bad: torch.Tensor, grad_bad: torch.Tensor) -> None:
        """A skipped update: counted, and logged with the ranks named (every rank takes
        part in the names' collective)."""
        loss_ranks, grad_ranks = flagged_ranks(
            [loss_bad, grad_bad], [sums.loss_bad, sums.grad_bad], self.device
        )
        if self.consecutive_skips == 0:
            self.streak_start = self._step
        self.consecutive_skips += 1
        self.total_skips += 1
        self.vetoed = True
        if self.rank == 0:
            logger.warning(
                f"step {self._step}: non-finite loss on rank(s) {loss_ranks}, non-finite "
                f"gradients on rank(s) {grad_ranks}: optimizer update skipped "
                f"({self.consecutive_skips} in a row, {self.config.max_consecutive_nonfinite} "
                f"allowed; {self.total_skips} in this run)"
            )

    # ---- metrics (called inside RunMetricsProcessor.log, on every rank, logged steps only)
    def metrics(self, step: int) -> dict[str, float]:
        """The interval's straggler metrics and this run's skips. Every rank's mean step
        time and data wait are gathered here, once per logged interval (O(world size), as
        the line of RUN/rank_times.jsonl they make), never per step."""
        stats = self.stragglers
        n = max(1, stats.interval_steps)
        mine = [stats.interval_step_s / n, stats.interval_data_s / n]
        if self.world_size > 1:
            local = torch.tensor(mine, dtype=torch.float64, device=self.device)
            table = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(table, local)
            rows = torch.stack(table).cpu().tolist()
        else:
            rows = [mine]
        step_s, data_s = [row[0] for row in rows], [row[1] for row in rows]
        if self.rank == 0 and self.world_size > 1 and stats.interval_steps:
            slowest_s = max(step_s)
            record = {
                "step": step,
                "steps": stats.interval_steps,
                "step_s": [round(t, 6) for t in step_s],
                "wait_s": [round(slowest_s - t, 6) for t in step_s],
                "data_s": [round(t, 6) for t in data_s],
            }
            append_jsonl(self._rank_times_path, record)
        stats.interval_step_s = stats.interval_data_s = 0.0  # the next interval
        stats.interval_steps = 0
        summary = interval_summary(step_s, data_s)
        summary["health/nonfinite_skips"] = float(self.total_skips)
        summary["health/skipped"] = float(self.vetoed)
        return summary


def is_torchtitan_nonfinite_loss(error: RuntimeError) -> bool:
    """torchtitan raises this when it logs a non-finite loss; our skip already handled it."""
    return str(error).startswith("Loss is not finite")
