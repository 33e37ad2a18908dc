"""The replay's own plan: does this launch hold the model, and if not, how many ranks would.

Why: a replay trains (train/forensics/replay.py), so each rank holds its share of the fp32
master weights, their gradients and Adam's two moments, 16 bytes a parameter, plus the
step's activations, at the layout of the replay, not of the run. At 70B that state alone is
about 1.13 TB: the plan puts the replay at 32 H100s or more (docs/reliability.md), where
"8 GPUs" was once suggested. A layout that cannot hold it fails with an out-of-memory
error only after every rank has read its share of the checkpoint; planned first, it is one
line in seconds, naming the world size that fits.

Why its own: the training run's plan (`RUN/budgets.json`, written by `python -m train
--dry-run --write-budgets`) is fingerprinted on the run's world size and `[parallelism]`,
both of which a replay changes on purpose (fewer ranks; `cp 1`, since a row is scored on
one rank). Checking the replay against it refused every such replay, and the advice to
re-plan or delete it acted on the training run's folder, whose next `--check` then refused
the run itself. So forensics never reads, writes or names that file: the replay's
preflight skips it (`train.preflight.preflight(..., budgets=False)`), and its memory is
planned here. Its time budgets stay the configured keys (the replay runs no watchdog).

How: the planner (`train.plan.dry_run.plan`), on rank 0 before anything is loaded, traces
the replay's own step (`replay_run`: the run's config with the replay's layout, at the
seq_len of the replayed steps) at this launch's world size, as a GPU run on a GPU and as a
CPU run without one. Its reserved step peak is compared with this device's memory: a GPU's
own, or on CPU the host's RAM shared by its ranks, less the planner's share outside the
allocator. A replay never saves, so a save's peak is not counted. When it does not fit, the
next world sizes the launch rules admit with the same tp, cp and dp_replicate are planned
in turn, and the refusal names the first that fits. More ranks shard the model state, not
the activations: a world size whose state plus the activations planned so far cannot fit is
passed over without a trace, and when the activations alone cannot fit, no world size of
the layout does, which the refusal says (at cp 1 the long-context stage's 128K phase needs
tp 8 and full activation checkpointing). Only rank 0 plans: the trace sets the device of local
rank 0 (`train.plan.trace`), which on another rank would put a CUDA context on rank 0's
GPU; the other ranks wait for it at the rendezvous, and end with it if it refuses.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

from train.config import ConfigError, RunConfig
from train.launch_rules import check_launch
from train.plan.gpu_specs import GPUS
from train.plan.report import OUTSIDE_ALLOCATOR_FRACTION
from train.preflight import GIB, larger_launches, local_ranks, state_floor


@dataclass(frozen=True)
class Device:
    """What one rank of this launch can hold: `bytes` of `name`."""

    name: str
    bytes: int
    accelerator: bool


def this_device(world_size: int) -> Device:
    """This rank's device in a launch of `world_size` ranks: the GPU's total memory, or
    without one the host's RAM (the planner's "cpu" row) shared by this node's ranks."""
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        props = torch.cuda.get_device_properties(local)
        return Device(props.name, int(props.total_memory), True)
    ram = int(GPUS["cpu"].memory_gib * GIB)
    ranks = local_ranks(world_size)
    return Device(
        f"this host's {ram / GIB:.1f} GiB of RAM over {ranks} rank(s)", ram // ranks, False
    )


def planner_gpu(device: Device) -> str:
    """The planner's row (`train.plan.gpu_specs.GPUS`) to trace as: the row of this GPU's
    model when the planner has one, any GPU row otherwise (only "GPU or not" changes the
    trace; the memory compared is the device's own), "cpu" without a GPU."""
    if not device.accelerator:
        return "cpu"
    name = device.name.lower()
    rows = [k for k in GPUS if k != "cpu" and k.split("-")[0] in name]
    # the closest capacity among the rows of this model (h100 80 GB vs 96 GB)
    return min(rows, key=lambda k: abs(GPUS[k].memory_gib * GIB - device.bytes), default="h100")


def replay_run(run: RunConfig, seq_len: int) -> RunConfig:
    """`run` (the replay's config: the run's, with its layout overrides) as the replay
    trains it: no validation, no saves, at the seq_len of the replayed steps."""
    replay = copy.deepcopy(run)
    replay.validation.enable = False
    replay.health.inject_faults = []  # tests' faults change no memory; the tracer has none
    replay.training.seq_len = seq_len
    replay.dataloader.schedule = []
    return replay


def seq_len_at(run: RunConfig, steps: list[int]) -> int:
    """The longest seq_len the run trains at any of `steps` (its schedule's phases)."""

    def at(step: int) -> int:
        length = run.training.seq_len
        for phase in sorted(run.dataloader.schedule, key=lambda p: p.start_step):
            if phase.start_step <= step and phase.seq_len:
                length = phase.seq_len
        return length

    return max(at(step) for step in steps)


@dataclass(frozen=True)
class ReplayPlan:
    """The replay's memory at one world size: its reserved step peak against the device."""

    world_size: int
    degrees: dict
    peak: int  # the reserved step peak
    activations: int  # what of it is not model state (allocated): no more ranks shrink it
    usable: int
    device: Device

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "degrees": self.degrees,
            "peak_gib": round(self.peak / GIB, 2),
            "usable_gib": round(self.usable / GIB, 2),
            "device": self.device.name,
            "fits": self.fits,
        }


def usable_bytes(device: Device) -> int:
    return int(device.bytes * (1.0 - OUTSIDE_ALLOCATOR_FRACTION))


def plan_replay(run: RunConfig, world_size: int, device: Device) -> ReplayPlan:
    """The planner's reserved step peak of `run` (a `replay_run`) on `world_size` ranks."""
    from train.plan.dry_run import plan

    report = plan(run, world_size, planner_gpu(device), phases=False)
    memory = report.memory
    # a replay loads and never saves: its peak is the step's, not a save's
    return ReplayPlan(
        world_size,
        dict(report.degrees),
        report.step_reserved,
        memory.activations + memory.state_dict_cache,
        usable_bytes(device),
        device,
    )


def smallest_fitting(
    run: RunConfig, world_size: int, device: Device, activations: int = 0
) -> tuple[ReplayPlan | None, int]:
    """(the plan at the first world size above `world_size` the launch rules admit with the
    replay's tp, cp and dp_replicate that fits `device`, or None when none does up to
    `train.preflight.MAX_RANKS`, the launch's own search bound; the largest activations
    planned). `activations`: a rank's bytes besides the model state, as planned at
    `world_size`: more ranks shard the state, not those, so a world size whose state plus
    them cannot fit is passed over without a trace, and once they alone cannot fit no world
    size does."""
    usable = usable_bytes(device)
    for search, world, floor in larger_launches(run, world_size):
        if activations > usable:
            return None, activations
        if floor + activations > usable:
            continue  # cannot fit: no trace needed
        candidate = plan_replay(search, world, device)
        if candidate.fits:
            return candidate, activations
        activations = max(activations, candidate.activations)
    return None, activations


def check_replay_fits(run: RunConfig, world_size: int) -> ReplayPlan:
    """Plan the replay `run` on this launch (rank 0); ConfigError, one line naming the
    smallest world size that fits, when it does not. A layout whose model state alone
    exceeds the device is refused without a trace."""
    device = this_device(world_size)
    usable = usable_bytes(device)
    floor = state_floor(run, check_launch(run, world_size))
    activations = 0
    if floor > usable:
        need = (
            f"a rank's model state alone (fp32 weights, gradients, Adam's moments) is "
            f"{floor / GIB:.1f} GiB"
        )
    else:
        planned = plan_replay(run, world_size, device)
        if planned.fits:
            return planned
        activations = planned.activations
        need = f"the plan puts a rank's peak at {planned.peak / GIB:.1f} GiB"
    p = run.parallelism
    layout = f"tp {p.tp}, cp {p.cp}" + f", dp_replicate {p.dp_replicate}" * (p.dp_replicate > 1)
    larger, activations = smallest_fitting(run, world_size, device, activations)
    if larger is not None:
        fix = (
            f"launch at least {larger.world_size} ranks with this layout (planned peak there "
            f"{larger.peak / GIB:.1f} GiB a rank): torchrun --nnodes N --nproc_per_node M -m "
            f"train.forensics ... with N x M = {larger.world_size}"
        )
    else:
        alone = f"a rank's activations alone are {activations / GIB:.1f} GiB; " * bool(activations)
        fix = (
            f"no world size fits with {layout} ({alone}more ranks shard only the model state): "
            "raise --parallelism.tp or set --activation_checkpoint.mode full "
            "(docs/reliability.md, 'Spike forensics', gives the sizes that fit)"
        )
    raise ConfigError(
        f"the replay does not fit on {world_size} rank(s) ({layout}): it trains, and {need}, "
        f"but a rank has {usable / GIB:.1f} GiB usable ({device.name}); {fix}"
    )
