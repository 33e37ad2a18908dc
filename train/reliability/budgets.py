"""Every time budget of a run, derived from the plan's predicted times, the configured
keys as floors.

Why: a budget sized for toy models is wrong at scale in both directions. The long-context
stage's 128K step takes about 88 s on 64 H100s (8 micro-batches of 11 s, CP 8, selective
AC: `python -m train --dry-run`), longer than a whole-step watchdog window of 80 s, so a
healthy run was called a hang at its first 128K step and requeued forever. At each new
seq_len every rank compiles again, and only the watchdog's window widened: the FSDP and CP
groups kept their 100 s collective timeout, and a compile skew beyond it ended the job
inside NCCL with no rank named. The plan (`train.plan.time_model.Prediction`) knows these times
before any GPU hour, so the budgets come from it:

- **the watchdog** beats once per micro-batch (`train.reliability.watchdog.StepWindows`), and a
  micro-batch may take `STEP_MARGIN` x its predicted time, at least
  `[fault_tolerance] hang_timeout_s`. The first micro-batch of the first step, and of the
  first step at each new seq_len, gets the predicted compile time on top (at least
  `[comm] init_timeout_seconds`). A step of 8 micro-batches is then 8 windows, not one;
- **the collective timeouts of every mesh group** (FSDP, CP, TP, ... and the default
  group) outlast the watchdog's windows by `TIMEOUT_MARGIN_S`, so the watchdog, which names
  the rank, speaks first: the first step's (`init_timeout_seconds`), the training one
  (`train_timeout_seconds`), and, raised for the block and restored after it
  (`CollectiveTimeouts`), each seq_len change, save and rollback;
- **SLURM's signal lead** (`signal_lead_s`): one step plus one save of the checkpoint's
  bytes, times the margin, before the time limit (`scripts/slurm/submit.py`): a backstop
  since the run ends itself in time (train/reliability/time_limit.py), on the same rule
  with its measured times;
- **the save's time** is the checkpoint's bytes at `[checkpoint] storage_gb_per_s` (the
  plan's save, re-derived at the configured rate when it was planned at another), or at
  the rate the run measured (`MeasuredSave`, `RUN/save_rate.json`, written after each
  save by train/components/save_window.py) when that is slower;
- the save window stays `hang_timeout_s` plus the bytes at `[fault_tolerance]
  min_save_gb_per_s` (train/components/save_window.py): it is a floor on the write bandwidth, so a
  `min_save_gb_per_s` above the plan's storage bandwidth makes a healthy save a hang and
  is refused (`check_budgets`).

How the trainer gets the prediction: the plan traces one step on a fake process group of
the real world size (half a minute at 64 ranks on a laptop): too slow to repeat on every
start of every rank, and a torch-free estimate beside it would be a second time model
that drifts from the first. So `python -m train --dry-run --write-budgets` stores the
predicted times in `RUN/budgets.json` (`PlannedTimes`), keyed by a fingerprint of the
keys that change the step (model, FP8 but its telemetry, parallelism, compile, AC, batch,
seq_lens, world size: `NOT_THE_STEP` lists what is left out). A
launch (`--check`, every rank's start) reads them; a file planned for another config or
world size is refused in one line (`check_budgets`), and a run without one (CPU runs,
tests) keeps the configured keys as its budgets, with one line saying so.

`TIMEOUT_MARGIN_S` and `STEP_MARGIN` are stated assumptions: 60 s is more than the
watchdog needs to diagnose and dump (2 x its beat interval <= 10 s, plus the stacks), and
3x covers the model's error (<= 15 % on published runs) plus stragglers (warned at 1.5x,
`health.straggler_factor`) and the data and metrics work between micro-batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from common.io import write_json_atomic
from common.run_layout import BUDGETS, SAVE_RATE
from train.config import CheckpointConfig, ConfigError, RunConfig

STEP_MARGIN = 3.0  # a window is this many predicted micro-batch (or save + step) times
TIMEOUT_MARGIN_S = 60.0  # a collective timeout outlasts the watchdog's window by this


# [fp8] keys that change no step: the FP8 telemetry (train/components/fp8_stats.py: every
# `stats_freq` steps, off the step's critical path) and a start-up refusal. Editing one
# between requeues must not make the run's plan "another run's" (the next --check would
# end the job as bad input). Every other key is in, so a new key is replanned until it is
# listed here.
NOT_THE_STEP = {
    "fp8": (
        "allow_no_conversion",
        "stats_freq",
        "stats_underflow_warn",
        "stats_saturation_warn",
        "stats_sample_rows",
    ),
}


def fingerprint(run: RunConfig, world_size: int, every_key: bool = False) -> str:
    """What the predicted times depend on, the keys that change the step: a change here
    needs a new plan. `every_key`: the fingerprint written before `NOT_THE_STEP` (every
    [fp8] key), still accepted so that a run planned then keeps its plan."""
    t = run.training
    fp8 = asdict(run.fp8)
    if not every_key:
        fp8 = {k: v for k, v in fp8.items() if k not in NOT_THE_STEP["fp8"]}
    key = {
        "model": asdict(run.model),
        "fp8": fp8,
        "parallelism": asdict(run.parallelism),
        "compile": asdict(run.compile),
        "activation_checkpoint": asdict(run.activation_checkpoint),
        "batch": [t.seq_len, t.local_batch_size, t.global_batch_size],
        "seq_lens": sorted({p.seq_len for p in run.dataloader.schedule if p.seq_len}),
        "world_size": world_size,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PlannedTimes:
    """The plan's predicted times the budgets derive from (`RUN/budgets.json`)."""

    fingerprint: str
    world_size: int
    gpu: str
    accumulation: int
    step_s: dict[int, float]  # per seq_len (the planned one, or each schedule phase's)
    compile_s: float
    checkpoint_bytes: int
    storage_gb_per_s: float
    save_s: float
    command: str = ""  # the dry run that wrote it

    @classmethod
    def from_prediction(
        cls, prediction, run: RunConfig, world_size: int, seq_len: int, command: str = ""
    ) -> PlannedTimes:
        """From a `train.plan.time_model.Prediction` of `run` at `world_size` (`seq_len`: the
        planned step's, when the schedule has no phases)."""
        p = prediction
        step_s = {int(s): float(t) for s, t in p.phases} or {seq_len: p.step_s}
        return cls(
            fingerprint=fingerprint(run, world_size),
            world_size=world_size,
            gpu=p.gpu,
            accumulation=p.accumulation,
            step_s=step_s,
            compile_s=p.compile_s,
            checkpoint_bytes=p.checkpoint_bytes,
            storage_gb_per_s=p.storage_gb_per_s,
            save_s=p.save_s,
            command=command,
        )

    def at_storage(self, storage_gb_per_s: float) -> PlannedTimes:
        """These times with the save at `storage_gb_per_s` (a changed
        `checkpoint.storage_gb_per_s` needs no new plan: the bytes are the plan's)."""
        if storage_gb_per_s == self.storage_gb_per_s:
            return self
        save_s = self.checkpoint_bytes / (storage_gb_per_s * 1e9)
        return replace(self, storage_gb_per_s=storage_gb_per_s, save_s=save_s)

    def micro_batch_s(self, seq_len: int | None) -> float:
        """A micro-batch at `seq_len` (the step's time over the accumulation: the step's
        once-per-step work is shared out, an overestimate of a few %); an unplanned seq_len
        gets the longest phase's."""
        return self.step_s.get(seq_len, max(self.step_s.values())) / self.accumulation

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / BUDGETS
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, asdict(self))
        return path

    @classmethod
    def read(cls, run_dir: Path) -> PlannedTimes | None:
        path = Path(run_dir) / BUDGETS
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            raw["step_s"] = {int(k): float(v) for k, v in raw["step_s"].items()}
            return cls(**raw)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(
                f"{path}: not a plan's budgets ({e}); delete it, or write it again with "
                "python -m train --config C --dry-run --world-size N --gpu G --write-budgets"
            ) from e


@dataclass(frozen=True)
class MeasuredSave:
    """A checkpoint save as the run measured it, from its start to its last byte on disk
    (`RUN/save_rate.json`, the last save's; train/components/save_window.py)."""

    step: int
    seconds: float
    checkpoint_bytes: int

    @property
    def gb_per_s(self) -> float:
        return self.checkpoint_bytes / max(self.seconds, 1e-9) / 1e9

    def save_s(self, checkpoint_bytes: int) -> float:
        """A save of `checkpoint_bytes` at this measured rate."""
        return checkpoint_bytes / (self.gb_per_s * 1e9) if self.checkpoint_bytes else 0.0

    def write(self, run_dir: Path) -> None:
        write_json_atomic(Path(run_dir) / SAVE_RATE, asdict(self) | {"gb_per_s": self.gb_per_s})

    @classmethod
    def read(cls, run_dir: Path) -> MeasuredSave | None:
        """The record, or None when there is none or it is unreadable (a measurement, not
        an input: a torn one is measured again at the next save)."""
        try:
            raw = json.loads((Path(run_dir) / SAVE_RATE).read_text())
            return cls(int(raw["step"]), float(raw["seconds"]), int(raw["checkpoint_bytes"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class Budgets:
    """The windows and timeouts of one run: the configured keys as floors, raised to the
    plan's predicted times x `STEP_MARGIN` where a plan is given."""

    hang_timeout_s: float  # [fault_tolerance] hang_timeout_s: the floor of every window
    first_step_timeout_s: float  # [comm] init_timeout_seconds: the floor of a compile window
    train_timeout_s: float  # [comm] train_timeout_seconds: the floor of the collective one
    planned: PlannedTimes | None = None
    storage_gb_per_s: float = field(default=CheckpointConfig.storage_gb_per_s)
    """[checkpoint] storage_gb_per_s: a save's rate until the run measured its own."""
    measured: MeasuredSave | None = None  # RUN/save_rate.json, an earlier attempt's

    @classmethod
    def of(
        cls,
        run: RunConfig,
        planned: PlannedTimes | None = None,
        measured: MeasuredSave | None = None,
    ) -> Budgets:
        storage = run.checkpoint.storage_gb_per_s
        return cls(
            hang_timeout_s=run.fault_tolerance.hang_timeout_s,
            first_step_timeout_s=run.comm.init_timeout_seconds,
            train_timeout_s=run.comm.train_timeout_seconds,
            planned=planned.at_storage(storage) if planned else None,
            storage_gb_per_s=storage,
            measured=measured,
        )

    def save_s(self, checkpoint_bytes: int | None = None) -> float:
        """A save of `checkpoint_bytes` (the plan's when None): at the configured storage
        rate, or at the measured one when that is slower (0 without bytes to go by)."""
        if checkpoint_bytes is None:
            checkpoint_bytes = self.planned.checkpoint_bytes if self.planned else 0
        configured = checkpoint_bytes / (self.storage_gb_per_s * 1e9)
        measured = self.measured.save_s(checkpoint_bytes) if self.measured else 0.0
        return max(configured, measured)

    def micro_batch_window_s(self, seq_len: int | None = None) -> float:
        """How long a micro-batch at `seq_len` may take without progress."""
        if self.planned is None:
            return self.hang_timeout_s
        return max(self.hang_timeout_s, STEP_MARGIN * self.planned.micro_batch_s(seq_len))

    def compile_window_s(self, seq_len: int | None = None) -> float:
        """The first micro-batch of the first step, or of the first step at a new seq_len:
        its window plus the predicted compile."""
        compile_s = self.planned.compile_s if self.planned else 0.0
        window = self.micro_batch_window_s(seq_len) + compile_s
        return max(self.first_step_timeout_s, self.hang_timeout_s, window)

    def _seq_lens(self) -> list[int | None]:
        return list(self.planned.step_s) if self.planned else [None]

    @property
    def init_timeout_s(self) -> float:
        """Every group's collective timeout up to the end of the first step."""
        longest = max(self.compile_window_s(s) for s in self._seq_lens())
        return max(self.first_step_timeout_s, longest + TIMEOUT_MARGIN_S)

    @property
    def collective_timeout_s(self) -> float:
        """Every group's collective timeout in training (torchtitan sets it after step 1)."""
        longest = max(self.micro_batch_window_s(s) for s in self._seq_lens())
        return max(self.train_timeout_s, longest + TIMEOUT_MARGIN_S)

    def signal_lead_s(self) -> float | None:
        """Seconds before the time limit SLURM should warn: one step plus one save (`save_s`:
        the configured storage rate, or the measured one when slower), times the margin
        (None without a plan)."""
        if self.planned is None:
            return None
        return math.ceil(STEP_MARGIN * (max(self.planned.step_s.values()) + self.save_s()))

    def describe(self, save_window_s: float | None = None) -> list[str]:
        """The windows, one line each (the plan prints them)."""
        p = self.planned
        lines = [
            f"time budgets (train/reliability/budgets.py: {STEP_MARGIN:g}x the prediction, the configured "
            "keys as floors):"
        ]
        for seq_len in self._seq_lens():
            window = self.micro_batch_window_s(seq_len)
            at = f" at seq {seq_len}" if seq_len else ""
            predicted = "no plan"
            if p:  # 2 significant digits where .1f would print a positive time as 0.0
                s = p.micro_batch_s(seq_len)
                predicted = f"predicted {s:.1f} s" if s >= 0.05 else f"predicted {s:.2g} s"
            lines.append(
                f"  {'watchdog window per micro-batch' + at:<46} {window:9.0f} s ({predicted}; "
                f"floor hang_timeout_s {self.hang_timeout_s:g})"
            )
        first = max(self.compile_window_s(s) for s in self._seq_lens())
        compile_s = p.compile_s if p else 0.0
        lines.append(
            f"  {'first micro-batch at a new seq_len / start':<46} {first:9.0f} s (+ compile "
            f"{compile_s:.0f} s; floor init_timeout_seconds {self.first_step_timeout_s:g})"
        )
        if save_window_s is not None:
            lines.append(f"  {'checkpoint save or rollback':<46} {save_window_s:9.0f} s")
        lines.append(
            f"  {'collective timeouts, every mesh group':<46} first step "
            f"{self.init_timeout_s:.0f} s, training {self.collective_timeout_s:.0f} s, "
            f"raised to window + {TIMEOUT_MARGIN_S:.0f} s for a new seq_len, save, rollback"
        )
        lead = self.signal_lead_s()
        if lead is not None:
            rate = (
                f"measured {self.measured.gb_per_s:.3g} GB/s"
                if self.measured and self.save_s() > self.planned.save_s
                else f"storage_gb_per_s {self.storage_gb_per_s:g}"
            )
            lines.append(
                f"  {'SLURM signal lead (one step + one save)':<46} {lead:9.0f} s "
                f"(save at {rate}; scripts/slurm/submit.py; the run ends itself first, "
                "train/reliability/time_limit.py)"
            )
        return lines


def save_window_s(run: RunConfig, checkpoint_bytes: int) -> float:
    """The watchdog's window of a save of `checkpoint_bytes`
    (train/components/save_window.py's rule)."""
    ft = run.fault_tolerance
    return ft.hang_timeout_s + checkpoint_bytes / (ft.min_save_gb_per_s * 1e9)


def check_budgets(run: RunConfig, world_size: int, planned: PlannedTimes | None) -> None:
    """Refuse (ConfigError, one line) a plan for another run, or a configured budget that
    is shorter than the plan's prediction."""
    if planned is None:
        return
    path = run.run_dir / BUDGETS
    if planned.fingerprint not in (
        fingerprint(run, world_size),
        fingerprint(run, world_size, every_key=True),
    ):
        what = (
            f"world size {planned.world_size}, not {world_size}"
            if planned.world_size != world_size
            else "another model, parallelism, batch or seq_len"
        )
        raise ConfigError(
            f"{path} was planned for {what}; plan this run again: python -m train --config "
            f"CONFIG --dry-run --world-size {world_size} --gpu GPU --write-budgets "
            "(or delete it to run on the configured budgets)"
        )
    check_prediction(run, planned)


def check_prediction(run: RunConfig, planned: PlannedTimes) -> None:
    """A configured budget shorter than the plan's prediction, refused in one line."""
    ft = run.fault_tolerance
    if planned.checkpoint_bytes and ft.min_save_gb_per_s > planned.storage_gb_per_s:
        window = save_window_s(run, planned.checkpoint_bytes)
        raise ConfigError(
            f"fault_tolerance.min_save_gb_per_s = {ft.min_save_gb_per_s:g} allows a save of "
            f"{planned.checkpoint_bytes / 1e9:,.1f} GB {window:.0f} s, but the plan predicts "
            f"{planned.save_s + ft.hang_timeout_s:.0f} s ({planned.save_s:.0f} s at "
            f"{planned.storage_gb_per_s:g} GB/s storage, + hang_timeout_s): set it to at most "
            f"{planned.storage_gb_per_s:g}"
        )


def load_budgets(run: RunConfig, world_size: int) -> Budgets:
    """The budgets of a launch of `run` on `world_size` ranks: from RUN/budgets.json when
    the plan wrote one for this run (refused when it is for another; its save re-derived at
    the configured `checkpoint.storage_gb_per_s`), else the configured keys; and the save
    an earlier attempt measured (RUN/save_rate.json)."""
    planned = PlannedTimes.read(run.run_dir)
    if planned is not None:
        planned = planned.at_storage(run.checkpoint.storage_gb_per_s)
    check_budgets(run, world_size, planned)
    return Budgets.of(run, planned, MeasuredSave.read(run.run_dir))


# --------------------------------------------------------------------------- collectives
class CollectiveTimeouts:
    """The collective timeout of every group a run talks over: each one-dimensional mesh
    group (FSDP, CP, TP, ...) and the default group, as torchtitan's `set_pg_timeouts`
    lists them. `raised_to(seconds)` widens all of them for a block (a new seq_len's
    compile, a save, a rollback) and restores the training timeout after it, behind a
    barrier: a rank that restored first must not time out on one still inside the block.
    """

    def __init__(
        self,
        groups: dict[str, object],
        normal_s: float,
        set_timeout: Callable[[object, object], None] | None = None,
    ) -> None:
        self.groups = groups  # name -> ProcessGroup (None: the default group)
        self.normal_s = normal_s
        self._set_timeout = set_timeout  # tests pass a recorder; else dist.set_timeout

    @classmethod
    def of_mesh(cls, parallel_dims, normal_s: float, set_timeout=None) -> CollectiveTimeouts:
        meshes = parallel_dims.get_all_one_dimensional_meshes()
        groups = {name: mesh.get_group() for name, mesh in meshes.items()}
        return cls(groups | {"default": None}, normal_s, set_timeout)

    def _set(self, seconds: float) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        set_timeout = self._set_timeout or dist.set_timeout  # train/compat/version_compat.py
        for group in self.groups.values():
            set_timeout(timedelta(seconds=seconds), group)

    @contextlib.contextmanager
    def raised_to(self, needed_s: float) -> Iterator[None]:
        import torch.distributed as dist

        if needed_s <= self.normal_s or not dist.is_initialized():
            yield
            return
        from torchtitan.tools.utils import device_module

        self._set(needed_s)
        try:
            yield
        except BaseException:
            self._set(self.normal_s)  # no barrier: the others may be gone
            raise
        dist.barrier(device_ids=[device_module.current_device()])
        self._set(self.normal_s)
