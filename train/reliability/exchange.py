"""The step exchange: one fixed-size all_reduce per optimizer step carries every per-step verdict.

Why one: beyond torchtitan's own step, ours needs a few numbers from every rank each step:
whether any loss or gradient went non-finite, the step's mean loss (the spike rule), the
step times (stragglers), whether a preemption signal arrived, and the data ledger's row
digest. Until issue 34 each had a collective and a host read of its own: the health verdict
two all_reduces (a SUM and a MAX) read back twice, the ledger's lanes one all_reduce read
back, the preemption flag one all_reduce and an `.item()` at the step boundary. That is
four collectives and four device-to-host syncs a step, where torchtitan's own loop makes
none on a step that does not log. On a GPU each sync stops the host from running ahead to
queue the next step's kernels; at 1,024 ranks each small all_reduce costs its latency, whatever
its bytes. Now they are one all_reduce of one float64 tensor of `NUM_LANES` numbers, read
back once, where a decision cannot wait (below). scripts/bench_step_overhead.py counts the
syncs and collectives of a step against torchtitan's bare `Trainer`
(docs/bench/step_overhead-2026-11-26.md); tests/train/reliability/test_exchange.py holds
the counts on two real gloo ranks.

The layout (`LAYOUT`; every lane is summed over the ranks):

| lanes | each rank writes | the sum is |
| --- | --- | --- |
| `loss_bad`, `grad_bad` | 1 if its loss (any micro-batch) / its gradients are non-finite | how many ranks; > 0 skips the update on every rank |
| `loss_share` | its local loss sum over the global token count | the step's mean loss (times the copies of each share under TP/PP), for the spike rule |
| `step_s` | its seconds from step start to the end of its backward pass | with its own, each rank's reference: the mean of the others |
| `stragglers`, `straggler_s`, `straggler_ref_s`, `straggler_data_s` | if its own straggler window ended on the step before: 1, its seconds over the window, the others' mean over it, its last data wait | how many ranks are stragglers, and their sums |
| `SIGUSR1`, `SIGTERM` | 1 if it received that preemption signal | > 0: every rank stops at the same boundary |
| `END_TIME` | 1 if it found the job's end time near (`train.reliability.time_limit`, at the last boundary) | > 0 and no signal: every rank saves and stops, as for a preemption |
| `ledger0`-`ledger4` | the data ledger's lanes of the rows it trained this step | the ledger's step record (`train.ledger.recorder`) |

Why a SUM alone: one all_reduce has one op. Every lane above is a count or a sum; the old
exchange also had a MAX, for three things, and each went where it costs nothing on a
healthy step:
- the names of the ranks with a non-finite loss or gradient: only a skipped step needs
  them, so that step (every rank knows it from the counts) runs one more small all_reduce
  MAX that names the lowest and highest (`flagged_ranks`);
- the slowest rank: each rank judges itself against the mean of the others, which the
  summed step times give it (`train.reliability.health.StragglerStats`), and a rank slow
  in every step of its window says so in the next step's exchange. The warning is the same,
  one step later; several slow ranks (a slow node) are named as a set, where the rule on
  the slowest rank alone could flicker between them and never warn. Naming them, and the host, is again a
  rare step's extra collective;
- the signal of any rank: a count above 0 (SIGTERM wins over SIGUSR1, as the MAX had it).

Why float64: the lanes are integers (flags, counts, the ledger's 31-bit hash lanes summed
over a step's rows) and floats (the loss, times, waits). float64 sums integers exactly up
to 2^53: the ledger's lanes stay exact while a step holds at most 2^22 rows over all ranks
(copies included; `train.ledger.recorder` refuses more). The reduced tensor is the same on
every rank, so every rank takes the same decision from it.

Where the one sync is, and why it stays: the update veto. torchtitan's `train_step` clips
the gradients and calls the optimizers' `step()`;
`train.components.optimizer.SkipStepOptimizersContainer` asks
`train.reliability.health.TrainingHealth.check_step` first, and that is where the exchange
is issued and read. A step with a non-finite loss or gradient on any rank, or one that
completes a loss spike, must change no parameter and no optimizer state. The update is
issued from the host, so the host must know before it issues it. Keeping the veto on the
device instead (every update masked by a device flag) would mean another copy of the
optimizer state or our own optimizers; reading 128 bytes once a step costs less.

What waits a step: everything else rides in the same tensor and is read from the same
result. The preemption flags of step N's exchange stop the run at the boundary after step N
(`train.trainer.RunTrainer.should_continue_training`, no collective there any more), so a
signal that lands after step N's exchange stops the run after step N+1: one step later at
most, and that step is saved like any other (a whole step: its ledger record and the
loader's state are exact). The ledger records step N after torchtitan's step, from the
lanes of step N's exchange. A straggler is named one step after its window ends. A loss-spike
rollback reloads a checkpoint anyway, after the step.

How the lanes get there without another sync: the device lanes (the flags and the loss
share) are computed on the device; the host lanes come from a pinned host buffer (on a
GPU), copied in without blocking. The buffer is rewritten only at the next step, after
this step's read has waited for the copy. In a world of one there is no collective; the
read stays (the veto needs it).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dataloader.ledger_record import NUM_LANES as LEDGER_LANES
from train.reliability.time_limit import END_TIME_FLAG

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)  # what SLURM sends to preempt or end a job
DEVICE_LANES = ("loss_bad", "grad_bad", "loss_share")
HOST_LANES = (
    "step_s",
    "stragglers",
    "straggler_s",
    "straggler_ref_s",
    "straggler_data_s",
    *(s.name for s in PREEMPT_SIGNALS),
    "END_TIME",
    *(f"ledger{i}" for i in range(LEDGER_LANES)),
)
LAYOUT = DEVICE_LANES + HOST_LANES
NUM_LANES = len(LAYOUT)
LEDGER = slice(LAYOUT.index("ledger0"), NUM_LANES)


@dataclass(frozen=True)
class Straggling:
    """A rank's straggler window that ended: its seconds over the window, the others'
    mean summed over it, and its data wait in the window's last step."""

    window_s: float
    reference_s: float
    data_s: float


@dataclass(frozen=True)
class StepReport:
    """One rank's numbers for one step. The first three may be 0-dim tensors on the
    device: they reach the exchange without a host sync."""

    loss_bad: torch.Tensor | bool
    grad_bad: torch.Tensor | bool
    loss_share: torch.Tensor | float  # local loss sum / global tokens, over micro-batches
    step_s: float  # step start -> end of backward
    straggling: Straggling | None = None  # this rank's window that ended the step before
    signal: int = 0  # the preemption signal this rank received, or END_TIME_FLAG (0: none)
    ledger: Sequence[int] = (0,) * LEDGER_LANES  # the data ledger's lanes of this step


@dataclass(frozen=True)
class StepSums:
    """What every rank knows after the exchange: the same numbers on every rank."""

    loss_bad: int  # ranks with a non-finite loss
    grad_bad: int  # ranks with non-finite gradients
    loss_sum: float  # the shares summed (divide by the copies of each share under TP)
    step_s: float  # every rank's step time, summed
    stragglers: int  # ranks whose straggler window ended the step before
    straggler_s: float  # their window seconds, summed
    straggler_ref_s: float  # the others' mean over their windows, summed
    straggler_data_s: float  # their last data waits, summed
    signal: int  # any rank's preemption signal (SIGTERM first), else END_TIME_FLAG, else 0
    ledger: list[int]  # the data ledger's lanes, summed (exact)


def encode(
    report: StepReport, device: torch.device | str = "cpu", host: torch.Tensor | None = None
) -> torch.Tensor:
    """One rank's row: `NUM_LANES` float64 on `device`. `host`: a (pinned) buffer of
    `len(HOST_LANES)` the host lanes go through, copied without blocking."""
    f64 = {"dtype": torch.float64, "device": device}
    s = report.straggling
    straggler = [0.0, 0.0, 0.0, 0.0] if s is None else [1.0, s.window_s, s.reference_s, s.data_s]
    signals = [float(report.signal == sig) for sig in (*PREEMPT_SIGNALS, END_TIME_FLAG)]
    assert len(report.ledger) == LEDGER_LANES
    lanes = [float(report.step_s), *straggler, *signals, *map(float, report.ledger)]  # HOST_LANES
    values = torch.tensor(lanes, dtype=torch.float64)
    host = values if host is None else host.copy_(values)
    on_device = [
        torch.as_tensor(x, device=device).reshape(()).to(**f64)
        for x in (report.loss_bad, report.grad_bad, report.loss_share)
    ]
    return torch.cat([torch.stack(on_device), host.to(device, non_blocking=True)])


def decode(values: Sequence[float]) -> StepSums:
    """The sums of every rank's row (`encode`), read."""
    lane = dict(zip(LAYOUT, values, strict=True))
    received = [sig for sig in PREEMPT_SIGNALS if lane[sig.name] > 0]
    counts = {k: round(lane[k]) for k in ("loss_bad", "grad_bad", "stragglers")}
    times = {k: lane[k] for k in ("step_s", "straggler_s", "straggler_ref_s", "straggler_data_s")}
    return StepSums(
        **counts,
        **times,
        loss_sum=lane["loss_share"],
        signal=int(max(received)) if received else (END_TIME_FLAG if lane["END_TIME"] else 0),
        ledger=[round(x) for x in values[LEDGER]],
    )


class StepExchange:
    """The trainer's one exchange per step (this module's essay). `lanes` gives the host
    lanes that ride along (`StepReport`'s `signal` and `ledger`: the preemption signal this
    rank received, this rank's data ledger lanes of the step), taken once per step from the
    trainer's hooks (`train.step_hooks.StepHook.lanes`). `last` holds the sums of this
    step's exchange, once it ran, for what reads them after the step."""

    def __init__(
        self, device: torch.device | str, *, lanes: Callable[[], dict] = lambda: {}
    ) -> None:
        self.device = torch.device(device)
        self.lanes = lanes
        pinned = self.device.type == "cuda"  # the copy in cannot block on the device's queue
        self._host = torch.zeros(len(HOST_LANES), dtype=torch.float64, pin_memory=pinned)
        self.last: StepSums | None = None

    def begin_step(self) -> None:
        self.last = None

    def reduce(
        self,
        loss_bad: torch.Tensor,
        grad_bad: torch.Tensor,
        loss_share: torch.Tensor,
        *,
        step_s: float,
        straggling: Straggling | None = None,
    ) -> StepSums:
        """Every rank's row summed: one all_reduce (none in a world of one) and one read,
        the step's one host sync."""
        report = StepReport(loss_bad, grad_bad, loss_share, step_s, straggling, **self.lanes())
        row = encode(report, self.device, self._host)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(row)
        self.last = decode(row.tolist())
        return self.last


# --------------------------------------------------------------------------- the rare names


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


def rank_keys(
    flags: Sequence[torch.Tensor | bool], rank: int, world_size: int, device="cpu"
) -> torch.Tensor:
    """Two int64 per flag, to maximise over the ranks: this rank if it set the flag, and
    world_size - 1 - this rank if it did (-1 where not). Their maxima are the highest
    flagged rank and the complement of the lowest."""
    keys = []
    for flag in flags:
        flag = torch.as_tensor(flag, device=device).reshape(())
        keys += [torch.where(flag, rank, -1), torch.where(flag, world_size - 1 - rank, -1)]
    return torch.stack(keys).to(dtype=torch.int64, device=device)


def rank_sets(maxima: Sequence[int], counts: Sequence[int], world_size: int) -> list[RankSet]:
    """The `RankSet` of each flag from the maximised `rank_keys` and the flag's count."""
    return [
        RankSet(count, world_size - 1 - maxima[2 * i + 1], maxima[2 * i])
        for i, count in enumerate(counts)
    ]


def flagged_ranks(
    flags: Sequence[torch.Tensor | bool], counts: Sequence[int], device: torch.device | str
) -> list[RankSet]:
    """Which ranks set each flag (their `counts` known from the step's sums): one
    all_reduce MAX of `rank_keys`. Every rank calls it, on a step that must name ranks
    only (a skipped update, a straggler warning): never on a healthy step."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    keys = rank_keys(flags, rank, world_size, device)
    if world_size > 1:
        dist.all_reduce(keys, op=dist.ReduceOp.MAX)
    return rank_sets(keys.tolist(), counts, world_size)
