"""Run health: non-finite steps skipped, loss spikes rolled back, stragglers named, and a
switch to inject each.

Why: on hundreds of ranks for weeks, two quiet failures cost the most. A NaN or Inf in the
loss or the gradients (a bad batch, an overflow, a flaky device) is trained through by
default: one optimizer step with NaN gradients poisons every weight and every later
checkpoint. And a rank that is slower than the rest slows every rank (they all wait for it
in the collectives) while the metrics only show a lower tokens/s for the whole job.

How, with one small collective per optimizer step (`TrainingHealth.check_step`, run just
before `optimizer.step()`): every rank contributes
`[loss non-finite, gradients non-finite, seconds from its step start to the end of its
backward, seconds it spent in next() on the loader]`
to one `all_gather`.
- Non-finite: the flag is set if this rank's loss (any micro-batch) or any of its local
  gradient shards is NaN/Inf. If any rank's flag is set, every rank skips the optimizer
  update (parameters and optimizer state stay as they were; the LR schedule still advances,
  so the learning rate at step N does not depend on how many steps were skipped). The skip
  is logged, counted (`nonfinite_skips` in metrics.jsonl/TensorBoard) and after
  `health.max_consecutive_nonfinite` skips in a row the run stops at that step boundary
  (`python -m train` exits 4, `EXIT_NONFINITE`) with a one-line message that names the step and the last
  checkpoint saved before the streak.
- Stragglers: the second number is when each rank finished its backward pass, measured from
  the start of its step (before clip_grad_norm_'s all-reduce, which would make every rank
  wait for the last). A rank that finishes late was slow in the work after the last
  collective it shared with the others. The per-rank times of each logged
  interval go to `RUN/rank_times.jsonl`; the slowest rank and its lag behind the median of
  the others go to metrics.jsonl/TensorBoard (`straggler_rank`, `straggler_lag_s`); and a
  warning names a rank (and its host) that was at least `health.straggler_factor` x the
  median of the others in each of the last `health.straggler_window` steps.
  Limit (docs/reliability.md): a delay that happens before a collective inside the step
  (an FSDP all-gather) is absorbed there: every rank waits, and the delay shows as lower
  throughput, not as a named rank; loader delays are named by the data-wait column.

Loss spikes (`health.spike_rollback`, off by default; docs/reliability.md section 3): each
rank adds its share of the step's loss to the same all_gather, so every rank judges the
same global loss with `SpikeRule` (above mean + max(k std, min rise) of the recent history
for m steps in a row). On a spike `handle_spike` reloads the newest complete checkpoint
before it while the loader keeps its position, so the global sequences drawn since are
skipped exactly; the skip goes to `RUN/incidents.jsonl` first (a resume reads it back and
skips them again, on any number of ranks), checkpoints after the one gone back to are
deleted, the learning rate may be lowered for a while (`RollbackLR`), and past
`health.max_rollbacks` the run stops like a non-finite streak (exit 4, diverged.json).

Fault injection (`health.inject_faults`, a list of strings; empty by default, never set in
a shipped config, and a run with it logs a warning at start and records it in
RUN/config.toml):
- `"sleep rank=R seconds=S [steps=A-B] [at=backward|validation|save]"`: rank R sleeps S
  seconds at the end of its backward pass (the default: a straggler), at the start of each
  validation batch after those steps, or inside the checkpoint save after those steps
  (before DCP writes: a slow or stuck save, for the hang watchdog).
- `"nan steps=A-B|A,B,... [rank=R]"`: on those steps the model output is NaN (on rank R
  only, or on every rank), as a poisoned batch would make it.
- `"spike sequences=A-B factor=F"`: the loss of every micro-batch holding one of the global
  sequences A..B is multiplied by F (keyed to data: skipping them removes the spike).
"""

from __future__ import annotations

import shutil
import socket
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from common.exit_codes import ExitCode
from common.io import append_jsonl, read_jsonl
from common.run_layout import INCIDENTS, RANK_TIMES, list_checkpoints, step_dir_name

FAULT_KEY = "health.inject_faults"
SLEEP_POINTS = ("backward", "validation", "save")
EXIT_NONFINITE = ExitCode.DIVERGED
"""Exit status of a diverged run: stopped by non-finite steps or by a loss spike past
health.max_rollbacks (the table: `common.exit_codes`)."""
SPIKE_KIND = "loss_spike"  # an RUN/incidents.jsonl record's kind


# --------------------------------------------------------------------------- fault injection


def _parse_steps(text: str, spec: str) -> frozenset[int]:
    steps: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            steps.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(
            f"{FAULT_KEY}: bad steps '{text}' in {spec!r}; write steps=3, steps=3-5 or steps=3,7"
        ) from None
    return frozenset(steps)


@dataclass(frozen=True)
class Fault:
    kind: str  # "sleep" | "nan" | "spike"
    rank: int | None = None  # None: every rank
    at: str = "backward"  # where a sleep happens: one of SLEEP_POINTS
    seconds: float = 0.0
    steps: frozenset[int] | None = None  # None: every step
    sequences: tuple[int, int] | None = None  # a spike: global sequences [first, last]
    factor: float = 1.0  # a spike: the loss multiplier

    def applies(self, rank: int, step: int) -> bool:
        return (self.rank is None or self.rank == rank) and (
            self.steps is None or step in self.steps
        )


def parse_faults(specs: list[str]) -> list[Fault]:
    """`["sleep rank=1 seconds=0.5", "nan steps=3-5 rank=0"]` -> Faults; ValueError if bad."""
    faults = []
    for spec in specs:
        kind, *pairs = spec.split()
        if kind not in ("sleep", "nan", "spike"):
            raise ValueError(
                f"{FAULT_KEY}: unknown fault {kind!r} in {spec!r}; use 'sleep rank=R seconds=S', "
                "'nan steps=A-B [rank=R]' or 'spike sequences=A-B factor=F'"
            )
        if kind == "spike":
            faults.append(_parse_spike(spec, pairs))
            continue
        args: dict[str, Any] = {}
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or key not in ("rank", "seconds", "steps", "at"):
                raise ValueError(
                    f"{FAULT_KEY}: bad argument {pair!r} in {spec!r}; expected rank=R, "
                    f"seconds=S, steps=A-B or at={'|'.join(SLEEP_POINTS)}"
                )
            if key == "at" and (kind != "sleep" or value not in SLEEP_POINTS):
                raise ValueError(
                    f"{FAULT_KEY}: bad at={value} in {spec!r}; a sleep takes "
                    f"at={'|'.join(SLEEP_POINTS)}"
                )
            if key == "at":
                args["at"] = value
            try:
                if key == "rank":
                    args["rank"] = int(value)
                elif key == "seconds":
                    args["seconds"] = float(value)
            except ValueError:
                raise ValueError(f"{FAULT_KEY}: bad {key} {value!r} in {spec!r}") from None
            if key == "steps":
                args["steps"] = _parse_steps(value, spec)
        if kind == "sleep" and ("rank" not in args or "seconds" not in args):
            raise ValueError(f"{FAULT_KEY}: {spec!r} needs rank=R and seconds=S")
        if kind == "nan" and "steps" not in args:
            raise ValueError(f"{FAULT_KEY}: {spec!r} needs steps=A-B (which steps get NaN)")
        faults.append(Fault(kind=kind, **args))
    return faults


def _parse_spike(spec: str, pairs: list[str]) -> Fault:
    """'spike sequences=A-B factor=F': the loss of every micro-batch holding one of the
    global sequences A..B is multiplied by F. Keyed to data, not to steps: a rollback that
    skips those sequences, or a run that never draws them, never sees the spike."""
    args = dict(pair.partition("=")[::2] for pair in pairs)
    try:
        first, _, last = args.pop("sequences").partition("-")
        sequences = (int(first), int(last or first))
        factor = float(args.pop("factor"))
    except (KeyError, ValueError):
        raise ValueError(
            f"{FAULT_KEY}: {spec!r} needs sequences=A-B (global sequence indices) and factor=F"
        ) from None
    if args or sequences[0] > sequences[1]:
        raise ValueError(f"{FAULT_KEY}: bad {spec!r}; write 'spike sequences=A-B factor=F'")
    return Fault(kind="spike", sequences=sequences, factor=factor)


# --------------------------------------------------------------------------- statistics


def median_of_others(values: list[float], index: int) -> float:
    others = values[:index] + values[index + 1 :]
    return statistics.median(others) if others else values[index]


def slowest(values: list[float]) -> tuple[int, float, float]:
    """(rank, its value, its lag behind the median of the other ranks)."""
    rank = max(range(len(values)), key=values.__getitem__)
    reference = median_of_others(values, rank)
    return rank, values[rank], values[rank] - reference


@dataclass
class StragglerStats:
    """Per-rank step times: a sliding window for the warning, sums for the logged interval."""

    world_size: int
    window: int
    factor: float
    min_lag_s: float
    recent: deque = field(init=False)
    interval_step_s: list[float] = field(init=False)
    interval_data_s: list[float] = field(init=False)
    interval_steps: int = 0

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.window)
        self.reset_interval()

    def reset_interval(self) -> None:
        self.interval_step_s = [0.0] * self.world_size
        self.interval_data_s = [0.0] * self.world_size
        self.interval_steps = 0

    def add(self, step_s: list[float], data_s: list[float]) -> tuple[int, float, float] | None:
        """Record one step; (rank, its window time, the others' median summed) if the same
        rank was slower than the others' median by `factor` (and `min_lag_s`) in every step
        of the window."""
        for r in range(self.world_size):
            self.interval_step_s[r] += step_s[r]
            self.interval_data_s[r] += data_s[r]
        self.interval_steps += 1
        if self.world_size < 2:
            return None
        rank, value, lag = slowest(step_s)
        reference = value - lag
        slow = value >= self.factor * reference and lag >= self.min_lag_s
        self.recent.append((rank if slow else None, value, reference))
        ranks = {entry[0] for entry in self.recent}
        if len(self.recent) < self.window or len(ranks) != 1 or None in ranks:
            return None
        total = sum(entry[1] for entry in self.recent)
        reference_total = sum(entry[2] for entry in self.recent)
        self.recent.clear()  # warn at most once per window
        return rank, total, reference_total

    def interval_summary(self) -> dict[str, float]:
        n = max(1, self.interval_steps)
        step_s = [t / n for t in self.interval_step_s]
        data_s = [t / n for t in self.interval_data_s]
        rank, _, lag = slowest(step_s)
        return {
            "health/straggler_rank": float(rank),
            "health/straggler_lag_s": lag,
            "health/step_time_spread_s": max(step_s) - min(step_s),
            "health/data_wait_max_s": max(data_s),
        }


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


class RollbackLR:
    """A torchtitan LR lambda times the factor of the rollback windows holding the step.

    LambdaLR's lambda at epoch e gives the LR of step e + 1; a window (first, last, factor)
    lowers steps first..last (the steps after a rollback's checkpoint). Windows come from
    RUN/incidents.jsonl, so a resume inside one keeps it; overlapping windows take the
    lowest factor. torchtitan's schedule itself is untouched."""

    def __init__(self, inner, windows: list[tuple[int, int, float]]):
        self.inner, self.windows = inner, windows

    def __call__(self, epoch: int) -> float:
        step = epoch + 1
        factors = [f for first, last, f in self.windows if first <= step <= last]
        return self.inner(epoch) * min(factors, default=1.0)


def refresh_lr(schedulers) -> None:
    """Give each optimizer the LR its schedule (with the rollback windows) sets for the
    next step: a checkpoint from before a window holds the LR without it. torchtitan's own
    load path recomputes each scheduler's LR from its lambda at the restored step."""
    schedulers.load_state_dict(schedulers.state_dict())
    for scheduler in schedulers:
        for group, lr in zip(
            scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr


# --------------------------------------------------------------------------- the hooks


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TrainingHealth:
    """Owned by `RunTrainer`; see the module docstring for what each hook does."""

    def __init__(self, config, trainer) -> None:
        self.config = config
        self.trainer = trainer
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.faults = parse_faults(list(config.inject_faults))
        if self.faults and self.rank == 0:
            logger.warning(
                f"FAULT INJECTION ON ({FAULT_KEY} = {list(config.inject_faults)}): "
                "this run is a test of failure handling, not a real training run"
            )
        self.stragglers = StragglerStats(
            self.world_size,
            config.straggler_window,
            config.straggler_factor,
            config.straggler_min_lag_s,
        )
        self.hosts = [socket.gethostname()] * self.world_size
        if dist.is_initialized() and self.world_size > 1:
            dist.all_gather_object(self.hosts, socket.gethostname())
        self.total_skips = 0
        self.consecutive_skips = 0
        self.streak_start = 0
        self.step_skipped = False
        self._local_bad: torch.Tensor | None = None
        self._step_start = 0.0
        self._arrival_s = 0.0
        self.stop = ""  # set when the run must stop: the one-line reason
        self._data_mark = 0
        self._nan_hook = None
        self._rank_times_path = Path(trainer.config.dump_folder) / RANK_TIMES
        # loss spikes: the rule, this step's verdict, the rollbacks so far (RUN/incidents.jsonl)
        self.spike_rule = (
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
        self.spike: list[tuple[int, float, float, float]] | None = None
        self._local_loss: torch.Tensor | None = None
        self.spike_faults = [f for f in self.faults if f.kind == "spike"]
        self._incidents_path = Path(trainer.config.dump_folder) / INCIDENTS
        self.rollbacks = 0
        self.lr_windows: list[tuple[int, int, float]] = []  # shared with every RollbackLR
        for scheduler in trainer.lr_schedulers:
            scheduler.lr_lambdas = [RollbackLR(f, self.lr_windows) for f in scheduler.lr_lambdas]
        self._lr_stale = False  # the optimizer's LR predates a window: recompute it
        self._resume_after_incidents()

    def _resume_after_incidents(self) -> None:
        """A resume honours the rollbacks recorded so far: their skipped sequences are
        skipped again (a preemption between a rollback and the next checkpoint resumes
        before them), and they count towards health.max_rollbacks. A --fresh start forgets
        them (rank 0 removes the file; no rank reads it)."""
        if getattr(self.trainer.checkpointer, "fresh", False):
            if self.rank == 0:
                self._incidents_path.unlink(missing_ok=True)
            return
        if not self._incidents_path.is_file():
            return
        records, num_torn = read_jsonl(self._incidents_path)
        if num_torn and self.rank == 0:
            logger.warning(f"{self._incidents_path}: skipped {num_torn} torn line(s)")
        spikes = [r for r in records if r.get("kind") == SPIKE_KIND]
        self.rollbacks = len(spikes)
        for record in spikes:
            self._add_lr_window(record)
        ranges = [r["skipped_sequences"] for r in spikes]
        if ranges:
            self.trainer.dataloader.add_skip_ranges(ranges)
            if self.rank == 0:
                logger.info(
                    f"{self._incidents_path}: {len(ranges)} rollback(s); global sequences "
                    f"{ranges} are skipped"
                )

    def _add_lr_window(self, record: dict) -> None:
        factor, steps = record.get("lr_factor", 1.0), record.get("lr_steps", 0)
        if factor != 1.0 and steps > 0:
            first = record["rolled_back_to"] + 1
            self.lr_windows.append((first, first + steps - 1, factor))
            self._lr_stale = True

    def _refresh_lr(self) -> None:
        refresh_lr(self.trainer.lr_schedulers)
        self._lr_stale = False

    # ---- step lifecycle (called by RunTrainer)
    def begin_step(self, step: int) -> None:
        if self._lr_stale:  # after the start's checkpoint load, before the step's LR is read
            self._refresh_lr()
        self.step_skipped = False
        self.spike = None
        self._local_loss = None
        self._local_bad = None
        self._step_start = time.perf_counter()
        self._arrival_s = 0.0
        self._data_mark = len(self.trainer.metrics_processor.data_loading_times)
        if any(f.kind == "nan" and f.applies(self.rank, step) for f in self.faults):
            model = self.trainer.model_parts[-1]
            self._nan_hook = model.register_forward_hook(
                lambda module, args, output: output * float("nan")
            )

    def after_forward_backward(self, loss: torch.Tensor) -> None:
        """Note a micro-batch's loss and when this rank finished its backward pass."""
        local = local_shard(loss.detach())
        bad = ~torch.isfinite(local).all()
        self._local_bad = bad if self._local_bad is None else self._local_bad | bad
        # this rank's share of the step's loss (local sum / global tokens): summed over the
        # loss ranks, the global mean loss the spike rule judges
        share = local.sum().to(torch.float64)
        self._local_loss = share if self._local_loss is None else self._local_loss + share
        self.inject_sleep("backward")
        # before clip_grad_norm_'s all-reduce, which would make every rank wait for the last
        self._arrival_s = time.perf_counter() - self._step_start

    def inject_sleep(self, at: str) -> None:
        """The injected sleeps at this point of this rank's current step (tests only)."""
        for fault in self.faults:
            if (
                fault.kind == "sleep"
                and fault.at == at
                and fault.applies(self.rank, self.trainer.step)
            ):
                time.sleep(fault.seconds)

    def end_step(self) -> None:
        if self._nan_hook is not None:
            self._nan_hook.remove()
            self._nan_hook = None
        if self.consecutive_skips >= self.config.max_consecutive_nonfinite and not self.stop:
            self.stop = self._stop_message()
            if self.rank == 0:
                logger.error(self.stop)

    # ---- the per-step check, run in place of/just before optimizer.step()
    def check_step(self) -> bool:
        """One all_gather: True if this step's update must be skipped (on every rank)."""
        trainer = self.trainer
        grads = [
            local_shard(p.grad)
            for m in trainer.model_parts
            for p in m.parameters()
            if p.grad is not None
        ]
        device = trainer.device
        grad_bad = torch.zeros((), dtype=torch.bool, device=device)
        if grads:
            grad_bad = ~torch.isfinite(torch.nn.utils.get_total_norm(grads, foreach=True))
        loss_bad = torch.zeros((), dtype=torch.bool, device=device)
        if self._local_bad is not None:
            loss_bad = self._local_bad.to(device)
        data_s = sum(trainer.metrics_processor.data_loading_times[self._data_mark :])
        loss_share = torch.zeros((), dtype=torch.float64, device=device)
        if self._local_loss is not None:
            loss_share = self._local_loss.to(device)
        mine = torch.stack(
            [
                loss_bad.to(torch.float64),
                grad_bad.to(device=device, dtype=torch.float64),
                torch.tensor(self._arrival_s, dtype=torch.float64, device=device),
                torch.tensor(data_s, dtype=torch.float64, device=device),
                loss_share,
            ]
        )
        if dist.is_initialized() and self.world_size > 1:
            gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine)
            table = torch.stack(gathered).cpu().tolist()
        else:
            table = [mine.cpu().tolist()]
        self._note_times([row[2] for row in table], [row[3] for row in table])
        loss_ranks = [r for r, row in enumerate(table) if row[0]]
        grad_ranks = [r for r, row in enumerate(table) if row[1]]
        if loss_ranks or grad_ranks:
            self._note_skip(loss_ranks, grad_ranks)
            return True
        self.consecutive_skips = 0
        if self.spike_rule is None:
            return False
        # with TP (or PP) several ranks hold the same share: count each share once
        copies = self.world_size // trainer._num_token_ranks()
        loss = sum(row[4] for row in table) / copies  # same numbers, same order: every rank
        self.spike = self.spike_rule.observe(trainer.step, loss)
        return self.spike is not None  # a spike's last update is not applied

    # ---- loss spikes: roll back, or stop
    def loss_factor(self, sequences: list[int]) -> float:
        """The injected loss multiplier of a micro-batch holding these global sequences."""
        factor = 1.0
        for fault in self.spike_faults:
            first, last = fault.sequences
            if any(first <= n <= last for n in sequences):
                factor *= fault.factor
        return factor

    def handle_spike(self) -> None:
        """After a step that completed a spike (`self.spike`), on every rank: go back to
        the last complete checkpoint before the spike's first step, keeping the data loader
        where it is, so the sequences drawn since that checkpoint are skipped exactly; record
        it in RUN/incidents.jsonl before going on. Sets `stop` instead when
        health.max_rollbacks is spent or there is no such checkpoint."""
        trainer, found = self.trainer, self.spike
        assert found, "handle_spike without a spike"
        step, first = trainer.step, found[0][0]
        last_loss, mean, std = found[-1][1], found[-1][2], found[-1][3]
        what = (
            f"step {step}: loss spike ({last_loss:.4g} against a mean of {mean:.4g} +- "
            f"{std:.3g} over the last {len(self.spike_rule.history)} steps"
            + (f", {len(found)} steps in a row from step {first})" if len(found) > 1 else ")")
        )
        checkpointer = trainer.checkpointer
        checkpointer.maybe_wait_for_staging()
        checkpointer.maybe_wait_for_saving()  # a save still in flight may be the one to go to
        target = self._checkpoint_before(first)
        if self.rollbacks >= self.config.max_rollbacks:
            self._stop(
                f"{what}; {self.rollbacks} rollback(s) already (health.max_rollbacks = "
                f"{self.config.max_rollbacks}): stopping. Last good checkpoint: "
                f"{self._checkpoint_path(target)}"
            )
            return
        if target is None:
            self._stop(
                f"{what}; no complete checkpoint before step {first} to roll back to: "
                "stopping (checkpoint.enable must be true, checkpoint.interval short enough)"
            )
            return
        loader = trainer.dataloader
        kept, end = loader.state_dict(), loader.num_sequences_consumed
        checkpointer.load(step=target)  # model, optimizer, LR schedule, step, data position
        start = loader.num_sequences_consumed
        loader.add_skip_ranges([[start, end]])
        loader.load_state_dict(kept)  # the data goes on from where it was: [start, end) skipped
        self.rollbacks += 1
        folder = Path(checkpointer.folder)
        later = [s for group in list_checkpoints(folder) for s in group if s > target]
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
                shutil.rmtree(folder / step_dir_name(s), ignore_errors=True)
            logger.warning(
                f"{what}: rolled back to checkpoint step {target} "
                f"(rollback {self.rollbacks} of health.max_rollbacks = "
                f"{self.config.max_rollbacks}); global sequences [{start}, {end}) are skipped; "
                f"recorded in {self._incidents_path}"
            )
        if dist.is_initialized():
            dist.barrier()
        self.spike_rule.forget_after(target)
        self._add_lr_window(record)
        if self._lr_stale:
            self._refresh_lr()
        marker = {
            "health/rollback_to_step": float(target),
            "health/rollback_skipped_sequences": float(end - start),
        }
        trainer.metrics_processor.logger.log(marker, step)  # TensorBoard + metrics.jsonl

    def _checkpoint_before(self, step: int) -> int | None:
        """The newest complete checkpoint before `step` (rank 0's listing, for every rank)."""
        checkpointer = self.trainer.checkpointer
        if not checkpointer.enable:
            return None
        found = [None]
        if self.rank == 0:
            complete = list_checkpoints(checkpointer.folder)[0]
            found = [max((s for s in complete if s < step), default=None)]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def _checkpoint_path(self, step: int | None) -> str:
        if step is None:
            return "none"
        return str(Path(self.trainer.checkpointer.folder) / step_dir_name(step))

    def _stop(self, message: str) -> None:
        self.stop = message
        if self.rank == 0:
            logger.error(message)

    def _note_times(self, step_s: list[float], data_s: list[float]) -> None:
        found = self.stragglers.add(step_s, data_s)
        if found and self.rank == 0:
            rank, total, reference = found
            window = self.config.straggler_window
            logger.warning(
                f"straggler: rank {rank} ({self.hosts[rank]}) took {total / window:.3f} s per "
                f"step over the last {window} steps, {total / reference:.2f}x the median of "
                f"the other ranks ({reference / window:.3f} s; health.straggler_factor = "
                f"{self.config.straggler_factor}); its data wait: "
                f"{data_s[rank]:.3f} s in the last step"
            )

    def _note_skip(self, loss_ranks: list[int], grad_ranks: list[int]) -> None:
        step = self.trainer.step
        if self.consecutive_skips == 0:
            self.streak_start = step
        self.consecutive_skips += 1
        self.total_skips += 1
        self.step_skipped = True
        if self.rank == 0:
            logger.warning(
                f"step {step}: non-finite loss on rank(s) {_ranks(loss_ranks)}, non-finite "
                f"gradients on rank(s) {_ranks(grad_ranks)}: optimizer update skipped "
                f"({self.consecutive_skips} in a row, {self.config.max_consecutive_nonfinite} "
                f"allowed; {self.total_skips} in this run)"
            )

    def last_good_checkpoint(self) -> str:
        folder = Path(self.trainer.checkpointer.folder)
        good = [s for s in list_checkpoints(folder)[0] if s < self.streak_start]
        return str(folder / step_dir_name(good[-1])) if good else "none"

    def _stop_message(self) -> str:
        return (
            f"step {self.trainer.step}: {self.consecutive_skips} consecutive steps "
            f"({self.streak_start}-{self.trainer.step}) had non-finite loss or gradients and "
            f"were skipped (health.max_consecutive_nonfinite = "
            f"{self.config.max_consecutive_nonfinite}); stopping. Last good checkpoint: "
            f"{self.last_good_checkpoint()}"
        )

    # ---- metrics (called inside RunMetricsProcessor.log, on every rank)
    def metrics(self, step: int) -> dict[str, float]:
        summary = self.stragglers.interval_summary()
        if self.rank == 0 and self.world_size > 1 and self.stragglers.interval_steps:
            n = self.stragglers.interval_steps
            step_s = [t / n for t in self.stragglers.interval_step_s]
            slowest_s = max(step_s)
            record = {
                "step": step,
                "steps": n,
                "step_s": [round(t, 6) for t in step_s],
                "wait_s": [round(slowest_s - t, 6) for t in step_s],
                "data_s": [round(t / n, 6) for t in self.stragglers.interval_data_s],
            }
            append_jsonl(self._rank_times_path, record)
        self.stragglers.reset_interval()
        summary["health/nonfinite_skips"] = float(self.total_skips)
        summary["health/skipped"] = float(self.step_skipped)
        summary["health/rollbacks"] = float(self.rollbacks)
        return summary


def _ranks(ranks: list[int], limit: int = 8) -> str:
    if not ranks:
        return "none"
    return ", ".join(str(r) for r in ranks[:limit]) + (" ..." if len(ranks) > limit else "")


def is_torchtitan_nonfinite_loss(error: RuntimeError) -> bool:
    """torchtitan raises this when it logs a non-finite loss; our skip already handled it."""
    return str(error).startswith("Loss is not finite")


__all__ = [
    "EXIT_NONFINITE",
    "Fault",
    "RollbackLR",
    "SpikeRule",
    "TrainingHealth",
    "parse_faults",
    "is_torchtitan_nonfinite_loss",
    "local_shard",
    "refresh_lr",
    "spike_threshold",
]
