"""Fault injection, for the tests of failure handling only: one switch, `health.inject_faults`.

Why: the reliability features (train/reliability/health.py, train/reliability/rollback.py,
train/reliability/watchdog.py) act on failures a healthy test run never has: a slow rank, a
NaN, a loss spike, a stuck save. A test must make its failure happen, at a known rank and
step, rather than race for it. So a list of strings in the config injects each one where it
would really occur, and the code under test is the code a real run executes. No shipped
config sets it (tests/train/reliability/test_health.py checks), a run with it logs `FAULT
INJECTION ON` at start (`FaultInjector.announce`), and the resolved `RUN/config.toml`
records it.

The language (`parse_faults`; a bad string is a ValueError naming it):
- `"sleep rank=R seconds=S [steps=A-B] [at=backward|validation|save]"`: rank R sleeps S
  seconds at the end of its backward pass (the default: a straggler), at the start of each
  validation batch after those steps, or inside the checkpoint save after those steps
  (before DCP writes: a slow or stuck save, for the hang watchdog).
- `"nan steps=A-B|A,B,... [rank=R]"`: on those steps the model output is NaN (on rank R
  only, or on every rank), as a poisoned batch would make it.
- `"spike sequences=A-B factor=F"`: the loss of every micro-batch holding one of the global
  sequences A..B is multiplied by F. Keyed to data, not to steps: a rollback that skips
  those sequences, or a run that never draws them, sees no spike.

How each reaches its place: every component that injects holds a `FaultInjector` built
from the same strings, through its own `Config` (`train.build` passes them): the trainer's
step hook (`FaultInjector.from_trainer`, in `train.build.step_hooks` only when faults are
asked for: backward sleeps, NaN output, spikes), `RunValidator` (validation sleeps),
`RunCheckpointManager` (save sleeps). A spike needs the loss itself, so `train.build` picks
`SpikedLoss` (torchtitan's chunked loss, multiplied by the factor the hook sets around each
micro-batch) only when a spike is asked for; a run without one keeps torchtitan's loss class.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.tools.logging import logger

from train.step_hooks import StepHook

FAULT_KEY = "health.inject_faults"
SLEEP_POINTS = ("backward", "validation", "save")


def _parse_steps(text: str, spec: str) -> frozenset[int]:
    try:
        bounds = [part.partition("-")[::2] for part in text.split(",")]  # (first, last or "")
        return frozenset(s for a, b in bounds for s in range(int(a), int(b or a) + 1))
    except ValueError:
        raise ValueError(
            f"{FAULT_KEY}: bad steps '{text}' in {spec!r}; write steps=3, steps=3-5 or steps=3,7"
        ) from None


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
            if key in ("rank", "seconds"):
                try:
                    args[key] = (int if key == "rank" else float)(value)
                except ValueError:
                    raise ValueError(f"{FAULT_KEY}: bad {key} {value!r} in {spec!r}") from None
            else:
                args[key] = _parse_steps(value, spec) if key == "steps" else value
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


class FaultInjector(StepHook):
    """The faults of `health.inject_faults` that concern this rank, applied on request; as
    the trainer's step hook, at their points of the step.

    Empty (every method a no-op) in every real run."""

    def __init__(self, specs: list[str]):
        self.specs = list(specs)
        self.faults = parse_faults(self.specs)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.spikes = [f for f in self.faults if f.kind == "spike"]
        self.step = 0
        self._sequences: deque[list[int]] = deque()  # each drawn micro-batch's, with spikes
        self._poisoned = None

    @classmethod
    def from_trainer(cls, trainer) -> FaultInjector:
        faults = cls(trainer.config.health.inject_faults)
        faults.announce()
        faults.model, faults.loader = trainer.model_parts[-1], trainer.dataloader
        faults.loss_fn = trainer.loss_fn  # a `SpikedLoss` when spikes are injected
        return faults

    def begin_step(self, step: int) -> None:
        self.step = step
        self._sequences.clear()
        if any(f.kind == "nan" and f.applies(self.rank, step) for f in self.faults):
            # the model's output NaN for this step (`end_step` removes the hook)
            self._poisoned = self.model.register_forward_hook(lambda m, a, out: out * float("nan"))

    def on_batch(self, labels) -> None:
        if self.spikes:  # the global sequences of each micro-batch, as torchtitan draws them
            self._sequences.append(list(self.loader.last_sequences))

    def before_forward(self) -> None:
        if self.spikes:  # the loss of chosen global sequences, scaled
            self.loss_fn.factor = self.loss_factor(self._sequences.popleft())

    def after_backward(self, loss) -> None:
        if self.spikes:
            self.loss_fn.factor = 1.0
        self.sleep("backward", self.step)

    def end_step(self) -> None:
        if self._poisoned is not None:
            self._poisoned.remove()
            self._poisoned = None

    def announce(self) -> None:
        """The start-up warning of a run with faults (rank 0; once per run, by the trainer)."""
        if self.faults and self.rank == 0:
            logger.warning(
                f"FAULT INJECTION ON ({FAULT_KEY} = {self.specs}): "
                "this run is a test of failure handling, not a real training run"
            )

    def sleep(self, at: str, step: int) -> None:
        """The injected sleeps of this rank at this point (`SLEEP_POINTS`) of `step`."""
        for fault in self.faults:
            if fault.kind == "sleep" and fault.at == at and fault.applies(self.rank, step):
                time.sleep(fault.seconds)

    def loss_factor(self, sequences: list[int]) -> float:
        """The injected loss multiplier of a micro-batch holding these global sequences."""
        held = [
            f for f in self.spikes if any(f.sequences[0] <= n <= f.sequences[1] for n in sequences)
        ]
        return math.prod((f.factor for f in held), start=1.0)


class SpikedLoss(ChunkedLossWrapper):
    """torchtitan's chunked loss, multiplied by the factor of an injected `spike` fault.

    Picked by `train.build` only when a spike is injected. `FaultInjector` sets the
    `factor` around each training micro-batch; outside it (validation shares this loss)
    the factor is 1 and the loss is torchtitan's, untouched. The product is taken before
    the backward pass, so the gradients see the spike as a real one would make them."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        pass

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.factor = 1.0

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, extra = super().__call__(*args, **kwargs)
        return (loss if self.factor == 1.0 else loss * self.factor), extra
