"""Run health: non-finite steps skipped, stragglers named, and a switch to inject both.

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

Fault injection (`health.inject_faults`, a list of strings; empty by default, never set in
a shipped config, and a run with it logs a warning at start and records it in
RUN/config.toml):
- `"sleep rank=R seconds=S [steps=A-B] [at=backward|validation|save]"`: rank R sleeps S
  seconds at the end of its backward pass (the default: a straggler), at the start of each
  validation batch after those steps, or inside the checkpoint save after those steps
  (before DCP writes: a slow or stuck save, for the hang watchdog).
- `"nan steps=A-B|A,B,... [rank=R]"`: on those steps the model output is NaN (on rank R
  only, or on every rank), as a poisoned batch would make it.
"""

from __future__ import annotations

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

from common.io import append_jsonl
from common.run_layout import RANK_TIMES, step_dir_name

FAULT_KEY = "health.inject_faults"
SLEEP_POINTS = ("backward", "validation", "save")
EXIT_NONFINITE = 4
"""Exit status of a run stopped by non-finite steps (2: user error, 3: hang, train/watchdog.py)."""


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
    kind: str  # "sleep" | "nan"
    rank: int | None = None  # None: every rank
    at: str = "backward"  # where a sleep happens: one of SLEEP_POINTS
    seconds: float = 0.0
    steps: frozenset[int] | None = None  # None: every step

    def applies(self, rank: int, step: int) -> bool:
        return (self.rank is None or self.rank == rank) and (
            self.steps is None or step in self.steps
        )


def parse_faults(specs: list[str]) -> list[Fault]:
    """`["sleep rank=1 seconds=0.5", "nan steps=3-5 rank=0"]` -> Faults; ValueError if bad."""
    faults = []
    for spec in specs:
        kind, *pairs = spec.split()
        if kind not in ("sleep", "nan"):
            raise ValueError(
                f"{FAULT_KEY}: unknown fault {kind!r} in {spec!r}; use 'sleep rank=R seconds=S' "
                "or 'nan steps=A-B [rank=R]'"
            )
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


# --------------------------------------------------------------------------- the hooks


def _local(tensor: torch.Tensor) -> torch.Tensor:
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

    # ---- step lifecycle (called by RunTrainer)
    def begin_step(self, step: int) -> None:
        self.step_skipped = False
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
        bad = ~torch.isfinite(_local(loss.detach())).all()
        self._local_bad = bad if self._local_bad is None else self._local_bad | bad
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
            _local(p.grad)
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
        mine = torch.stack(
            [
                loss_bad.to(torch.float64),
                grad_bad.to(device=device, dtype=torch.float64),
                torch.tensor(self._arrival_s, dtype=torch.float64, device=device),
                torch.tensor(data_s, dtype=torch.float64, device=device),
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
        return False

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
        from train.checkpoint import list_checkpoints

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
    "TrainingHealth",
    "parse_faults",
    "is_torchtitan_nonfinite_loss",
]
