"""Run health: non-finite steps skipped and stragglers named, from one fixed-size exchange a step.

Why: on hundreds of ranks for weeks, two quiet failures cost the most. A NaN or Inf in the
loss or the gradients (a bad batch, an overflow, a flaky device) is trained through by
default: one optimizer step with NaN gradients poisons every weight and every later
checkpoint. And a rank that is slower than the rest slows every rank (they all wait for it
in the collectives) while the metrics only show a lower tokens/s for the whole job.

How, with one exchange per optimizer step (`TrainingHealth.check_step`, the veto of
`train.components.optimizer.SkipStepOptimizersContainer`, run after gradient clipping and before the
update): every rank reports whether its loss or its gradients are non-finite, its share of
the step's loss, the seconds from its step start to the end of its backward pass, and its
seconds in next() on the loader.
- Non-finite: the flag is set if this rank's loss (any micro-batch) or any of its local
  gradient shards is NaN/Inf. If any rank's flag is set, every rank skips the optimizer
  update (parameters and optimizer state stay as they were; the LR schedule still advances,
  so the learning rate at step N does not depend on how many steps were skipped). The skip
  is logged, counted (`health/nonfinite_skips` in metrics.jsonl/TensorBoard) and after
  `health.max_consecutive_nonfinite` skips in a row the run stops at that step boundary
  (`python -m train` exits 4, `ExitCode.DIVERGED` in `common.exit_codes`) with a one-line message that names the step
  and the last checkpoint saved before the streak.
- Loss: the shares, summed over the ranks (each counted once under TP), are the step's
  global mean loss; it goes to the loss-spike rule (`train.reliability.rollback`), which may
  veto the update too.
- Stragglers: the step time is when each rank finished its backward pass, measured from the
  start of its step (before clip_grad_norm_'s all-reduce, which would make every rank wait
  for the last). A rank that finishes late was slow in the work after the last collective it
  shared with the others. A warning names a rank (and its host) that was at least
  `health.straggler_factor` x the mean of the other ranks in each of the last
  `health.straggler_window` steps. Each logged interval, the per-rank times go to
  `RUN/rank_times.jsonl`, and the slowest rank and its lag behind the median of the others
  to metrics.jsonl/TensorBoard (`health/straggler_rank`, `health/straggler_lag_s`).
  Limit (docs/reliability.md): a delay that happens before a collective inside the step (an
  FSDP all-gather) is absorbed there: every rank waits, and the delay shows as lower
  throughput, not as a named rank; loader delays are named by the data-wait column.

Why the exchange is two all_reduces of ten numbers, not an all_gather: gathering every
rank's row each step costs O(world size) memory and latency on every rank, at 1,000+ ranks
a per-step collective that grows with the job. Each verdict above needs only a sum or a
maximum over the ranks, so each rank encodes its row (`encode`) into four numbers to sum
(the non-finite flags, counting the ranks; the loss share; the step time) and six to
maximise (the highest and lowest rank with a non-finite loss and gradient, as rank and
world size - 1 - rank; the step time in microseconds times the world size plus the rank,
whose maximum carries the slowest rank; the same time with that rank's data wait in the
low bits). `decode` reads the verdict from the reduced numbers; the bytes are the same at
8 ranks and at 1,024 (tests/train/reliability/test_health.py, on a fake process group of 1,024).
What that changed: a warning names the lowest and highest rank and the count of ranks with
a non-finite loss or gradient (all of them up to two ranks), not a list; and the straggler
rule compares the slowest rank with the mean of the others (the sum minus the maximum),
not their median, which no fixed-size reduction carries (with two ranks they are the same;
with many, the slowest rank is left out of its own reference, so it cannot raise it; other
slow ranks pull the mean up a little, where the median ignored them). The straggler's host
name is sent by the straggler itself, only when a warning fires. The per-rank times of
`RUN/rank_times.jsonl` and the interval's median are gathered once per logged interval
(`metrics`), where a line of the file holds them anyway.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from common.io import append_jsonl
from common.run_layout import RANK_TIMES, list_checkpoints, step_dir_name
from train.shards import local_shard

# --------------------------------------------------------------------------- the exchange

TIME_UNIT_S = 1e-6  # step times travel as whole microseconds...
DATA_UNIT_S = 1e-3  # ...and the slowest rank's data wait as whole milliseconds
DATA_SLOTS = 1 << 20  # below the time in its key: up to ~17 min of data wait
_KEY_LIMIT = (1 << 62) // DATA_SLOTS  # microseconds that fit under both keys at 2**20 ranks


@dataclass(frozen=True)
class StepReport:
    """One rank's numbers for one step. The first three may be 0-dim tensors on the
    device (no host sync before the exchange)."""

    loss_bad: torch.Tensor | bool
    grad_bad: torch.Tensor | bool
    loss_share: torch.Tensor | float  # local loss sum / global tokens, over micro-batches
    step_s: float  # step start -> end of backward
    data_s: float  # in next() on the loader


@dataclass(frozen=True)
class RankSet:
    """Ranks with a flag set, as a fixed-size reduction knows them."""

    count: int
    lowest: int
    highest: int

    def __str__(self) -> str:
        if self.count == 0:
            return "none"
        if self.count == 1:
            return str(self.lowest)
        if self.count == 2:
            return f"{self.lowest}, {self.highest}"
        return f"{self.lowest} ... {self.highest} ({self.count} ranks)"


@dataclass(frozen=True)
class StepVerdict:
    """What every rank knows after the exchange: the same numbers on every rank."""

    loss_bad: RankSet
    grad_bad: RankSet
    loss_sum: float  # the shares summed (divide by the copies of each share under TP)
    slowest_rank: int
    slowest_s: float
    others_mean_s: float  # the mean step time of the other ranks (its own, alone)
    slowest_data_s: float  # the slowest rank's data wait


def encode(
    report: StepReport, rank: int, world_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(4 float64 numbers to sum, 6 int64 numbers to maximise) of one rank's report."""
    step_us = min(max(0, round(report.step_s / TIME_UNIT_S)), _KEY_LIMIT - 1)
    data_ms = min(max(0, round(report.data_s / DATA_UNIT_S)), DATA_SLOTS - 1)
    loss_bad = torch.as_tensor(report.loss_bad, device=device).reshape(())
    grad_bad = torch.as_tensor(report.grad_bad, device=device).reshape(())
    share = torch.as_tensor(report.loss_share, dtype=torch.float64, device=device).reshape(())
    f64 = {"dtype": torch.float64, "device": device}
    sums = torch.stack(
        [loss_bad.to(**f64), grad_bad.to(**f64), share, torch.tensor(float(step_us), **f64)]
    )

    def flagged(flag: torch.Tensor, value: int) -> torch.Tensor:
        return torch.where(flag, value, -1).to(dtype=torch.int64, device=device)

    lowest = world_size - 1 - rank  # the maximum of these is the lowest rank
    i64 = {"dtype": torch.int64, "device": device}
    maxes = torch.stack(
        [
            flagged(loss_bad, rank),
            flagged(loss_bad, lowest),
            flagged(grad_bad, rank),
            flagged(grad_bad, lowest),
            torch.tensor(step_us * world_size + rank, **i64),  # the slowest rank (ties: highest)
            torch.tensor(step_us * DATA_SLOTS + data_ms, **i64),  # and its data wait
        ]
    )
    return sums, maxes


def decode(sums: list[float], maxes: list[int], world_size: int) -> StepVerdict:
    """The verdict of the summed and maximised numbers of every rank (`encode`)."""

    def ranks(count: float, highest: int, lowest: int) -> RankSet:
        return RankSet(round(count), world_size - 1 - lowest, highest)

    slowest_us, slowest_rank = divmod(int(maxes[4]), world_size)
    others = world_size - 1
    others_us = (sums[3] - slowest_us) / others if others else float(slowest_us)
    return StepVerdict(
        loss_bad=ranks(sums[0], int(maxes[0]), int(maxes[1])),
        grad_bad=ranks(sums[1], int(maxes[2]), int(maxes[3])),
        loss_sum=sums[2],
        slowest_rank=slowest_rank,
        slowest_s=slowest_us * TIME_UNIT_S,
        others_mean_s=others_us * TIME_UNIT_S,
        slowest_data_s=(int(maxes[5]) % DATA_SLOTS) * DATA_UNIT_S,
    )


def exchange(report: StepReport, device: torch.device | str = "cpu") -> StepVerdict:
    """Every rank's report reduced into the verdict: two all_reduces of fixed size (SUM,
    MAX), issued together, and one host sync; no collective in a world of one."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    sums, maxes = encode(report, rank, world_size, device)
    if world_size > 1:
        works = [
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, async_op=True),
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, async_op=True),
        ]
        for work in works:
            work.wait()
    return decode(sums.cpu().tolist(), maxes.cpu().tolist(), world_size)


# --------------------------------------------------------------------------- stragglers


def median_of_others(values: list[float], index: int) -> float:
    others = values[:index] + values[index + 1 :]
    return statistics.median(others) if others else values[index]


def slowest(values: list[float]) -> tuple[int, float, float]:
    """(rank, its value, its lag behind the median of the other ranks)."""
    rank = max(range(len(values)), key=values.__getitem__)
    reference = median_of_others(values, rank)
    return rank, values[rank], values[rank] - reference


def interval_summary(step_s: list[float], data_s: list[float]) -> dict[str, float]:
    """The metrics of a logged interval from every rank's mean step time and data wait."""
    rank, _, lag = slowest(step_s)
    return {
        "health/straggler_rank": float(rank),
        "health/straggler_lag_s": lag,
        "health/step_time_spread_s": max(step_s) - min(step_s),
        "health/data_wait_max_s": max(data_s),
    }


@dataclass
class StragglerStats:
    """The straggler rule over a sliding window of steps, and this rank's sums for the
    logged interval."""

    window: int
    factor: float
    min_lag_s: float
    recent: deque = field(init=False)
    interval_step_s: float = 0.0
    interval_data_s: float = 0.0
    interval_steps: int = 0

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.window)

    def reset_interval(self) -> None:
        self.interval_step_s = self.interval_data_s = 0.0
        self.interval_steps = 0

    def add(
        self, step_s: float, data_s: float, verdict: StepVerdict | None
    ) -> tuple[int, float, float] | None:
        """Record this rank's step and the step's verdict (None in a world of one); (rank,
        its window time, the others' mean summed) if the same rank was slower than the
        others' mean by `factor` (and `min_lag_s`) in every step of the window."""
        self.interval_step_s += step_s
        self.interval_data_s += data_s
        self.interval_steps += 1
        if verdict is None:
            return None
        rank, value, reference = verdict.slowest_rank, verdict.slowest_s, verdict.others_mean_s
        slow = value >= self.factor * reference and value - reference >= self.min_lag_s
        self.recent.append((rank if slow else None, value, reference))
        ranks = {entry[0] for entry in self.recent}
        if len(self.recent) < self.window or len(ranks) != 1 or None in ranks:
            return None
        total = sum(entry[1] for entry in self.recent)
        reference_total = sum(entry[2] for entry in self.recent)
        self.recent.clear()  # warn at most once per window
        return rank, total, reference_total


# --------------------------------------------------------------------------- the hooks


class TrainingHealth:
    """Owned by `RunTrainer`; see the module docstring for what each hook does.

    Given what it reads, not the trainer: the model parts (gradients), the device of the
    exchange, torchtitan's list of loader wait times (appended by the trainer's batch
    generator, cleared at each log), the run and checkpoint folders, the number of ranks
    whose loss shares sum to the global loss, and `judge_loss`, the loss-spike rule
    (`train.reliability.rollback.LossSpikeRollback.observe`), which may veto an update too."""

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
        judge_loss: Callable[[int, float], bool] | None = None,
    ) -> None:
        self.config = config  # train.config.HealthConfig
        self.model_parts = model_parts
        self.device = device
        self.data_loading_times = data_loading_times
        self.checkpoint_folder = checkpoint_folder
        self.judge_loss = judge_loss
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.loss_copies = self.world_size // token_ranks  # TP/PP ranks holding one share
        self.stragglers = StragglerStats(
            config.straggler_window, config.straggler_factor, config.straggler_min_lag_s
        )
        self.total_skips = 0
        self.consecutive_skips = 0
        self.streak_start = 0
        self.step_skipped = False
        self.stop = ""  # set when the run must stop: the one-line reason
        self._rank_times_path = run_folder / RANK_TIMES
        self._step = 0
        self._step_start = 0.0
        self._arrival_s = 0.0
        self._data_mark = 0
        self._local_bad: torch.Tensor | None = None
        self._local_loss: torch.Tensor | None = None

    # ---- step lifecycle (called by RunTrainer)
    def begin_step(self, step: int) -> None:
        self._step = step
        self.step_skipped = False
        self._local_loss = None
        self._local_bad = None
        self._step_start = time.perf_counter()
        self._arrival_s = 0.0
        self._data_mark = len(self.data_loading_times)

    def after_forward_backward(self, loss: torch.Tensor) -> None:
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
        if self.consecutive_skips >= self.config.max_consecutive_nonfinite and not self.stop:
            self.stop = self._stop_message()
            if self.rank == 0:
                logger.error(self.stop)

    # ---- the per-step check: the optimizers' veto
    def check_step(self) -> bool:
        """One exchange: True if this step's update must be skipped (on every rank)."""
        grads = [
            local_shard(p.grad)
            for m in self.model_parts
            for p in m.parameters()
            if p.grad is not None
        ]
        grad_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        if grads:
            grad_bad = ~torch.isfinite(torch.nn.utils.get_total_norm(grads, foreach=True))
        loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        if self._local_bad is not None:
            loss_bad = self._local_bad.to(self.device)
        loss_share = torch.zeros((), dtype=torch.float64, device=self.device)
        if self._local_loss is not None:
            loss_share = self._local_loss.to(self.device)
        data_s = sum(self.data_loading_times[self._data_mark :])
        report = StepReport(loss_bad, grad_bad, loss_share, self._arrival_s, data_s)
        verdict = exchange(report, self.device)
        self._note_times(report, verdict if self.world_size > 1 else None)
        if verdict.loss_bad.count or verdict.grad_bad.count:
            self._note_skip(verdict)
            return True
        self.consecutive_skips = 0
        if self.judge_loss is None:
            return False
        # with TP (or PP) several ranks hold the same share: count each share once
        return self.judge_loss(self._step, verdict.loss_sum / self.loss_copies)

    def _note_times(self, report: StepReport, verdict: StepVerdict | None) -> None:
        found = self.stragglers.add(report.step_s, report.data_s, verdict)
        if not found:
            return
        rank, total, reference = found
        # every rank has the same verdict; the straggler tells its host name
        host = [socket.gethostname() if self.rank == rank else None]
        dist.broadcast_object_list(host, src=rank)
        if self.rank == 0:
            window = self.config.straggler_window
            logger.warning(
                f"straggler: rank {rank} ({host[0]}) took {total / window:.3f} s per "
                f"step over the last {window} steps, {total / reference:.2f}x the mean of "
                f"the other ranks ({reference / window:.3f} s; health.straggler_factor = "
                f"{self.config.straggler_factor}); its data wait: "
                f"{verdict.slowest_data_s:.3f} s in the last step"
            )

    def _note_skip(self, verdict: StepVerdict) -> None:
        if self.consecutive_skips == 0:
            self.streak_start = self._step
        self.consecutive_skips += 1
        self.total_skips += 1
        self.step_skipped = True
        if self.rank == 0:
            logger.warning(
                f"step {self._step}: non-finite loss on rank(s) {verdict.loss_bad}, non-finite "
                f"gradients on rank(s) {verdict.grad_bad}: optimizer update skipped "
                f"({self.consecutive_skips} in a row, {self.config.max_consecutive_nonfinite} "
                f"allowed; {self.total_skips} in this run)"
            )

    def last_good_checkpoint(self) -> str:
        folder = self.checkpoint_folder
        good = [s for s in list_checkpoints(folder)[0] if s < self.streak_start]
        return str(folder / step_dir_name(good[-1])) if good else "none"

    def _stop_message(self) -> str:
        return (
            f"step {self._step}: {self.consecutive_skips} consecutive steps "
            f"({self.streak_start}-{self._step}) had non-finite loss or gradients and "
            f"were skipped (health.max_consecutive_nonfinite = "
            f"{self.config.max_consecutive_nonfinite}); stopping. Last good checkpoint: "
            f"{self.last_good_checkpoint()}"
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
        stats.reset_interval()
        summary = interval_summary(step_s, data_s)
        summary["health/nonfinite_skips"] = float(self.total_skips)
        summary["health/skipped"] = float(self.step_skipped)
        return summary


def is_torchtitan_nonfinite_loss(error: RuntimeError) -> bool:
    """torchtitan raises this when it logs a non-finite loss; our skip already handled it."""
    return str(error).startswith("Loss is not finite")


__all__ = [
    "StepReport",
    "StepVerdict",
    "StragglerStats",
    "TrainingHealth",
    "decode",
    "encode",
    "exchange",
    "interval_summary",
    "is_torchtitan_nonfinite_loss",
]
