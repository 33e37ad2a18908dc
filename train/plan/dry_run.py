"""Plan a training run without GPUs: does it fit, how is it laid out, how long does it take?

Why: a 70B FP8 job that dies after queueing for a day on 64 GPUs because the degrees do not
multiply to the world size, because the first checkpoint save does not fit an H100, or
because its step outlasts a watchdog window, is an expensive way to learn arithmetic. This
planner answers on a laptop, by *running* what rank 0 of the real job runs, on tensors that
hold no memory, and by timing what it counted against the target GPU.

How (torchtitan's own `scripts/estimate/estimation.py` was the anchor: FakeTensorMode and
torch's memory tracker on a fake process group):
1. `train.launch_rules.check_launch`: the rules a real launch checks, one message each.
2. `train.plan.trace`: the launch's trainer (`RunTrainer`, from
   `train.build.to_trainer_config`, "auto" resolved for the target GPU) built on
   torchtitan's fake comm backend at the requested world size and materialised as fake
   tensors; one micro-batch, the clipping and the optimizer step run and are measured:
   memory (MemTracker), FLOPs by GEMM dtype and attention (as the GPU kernel executes
   them), memory-bound traffic, and every collective's bytes by mesh dimension. Deep
   models are traced at 2 and 3 layers and extended.
3. `train.plan.time_model`: the time of a micro-batch and of an optimizer step on the target GPU
   (compute against its peaks, collectives over the scale-up link and the node's network,
   `train.plan.network`, overlap), with constants fitted to published runs and checked
   holding out whole publications (`train.plan.calibration`,
   docs/bench/plan_published-2026-11-28.md).
4. `train.plan.report`: memory allocated and reserved, counts per micro-batch and per
   optimizer step (x torchtitan's accumulation count), the time, each with its range from
   the held-out error, the verdict (FITS, TIGHT, DOES NOT FIT).
A run with a seq_len schedule is also planned at each phase's seq_len (memory and step).

What differs from the GPU run, and why (also in docs/dry_run.md): the step runs eagerly
(torch.compile cannot trace fake tensors; the time model scales the eager memory-bound
traffic and the memory model the activations by fitted factors), attention is torch's SDPA
standing in for FlexAttention (same tensors saved for backward; causal, the document mask
not built), and a context-parallel step's sharded block mask is not built (a compiled
`create_block_mask`); its K/V all-gather and backward reduce-scatter run and are counted.

`run_dry(run, world_size, gpu)` returns the exit code for `python -m train --dry-run`:
0 when the plan fits the chosen GPU (FITS, or TIGHT: the point fits, the range's upper end
does not), 1 when it does not. User errors raise `ValueError`.
This module orchestrates; it holds no rule and no formula of its own.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from train.plan.gpu_specs import GPUS, gpu_spec
from train.plan.network import network as network_preset
from train.plan.report import DryRunReport, PhasePlan
from train.plan.step_counts import GIB, StepCounts
from train.plan.time_model import TimeConstants
from train.plan.trace import TRACED_LAYERS, measure, traced_config

__all__ = ["GIB", "GPUS", "StepCounts", "measure", "plan", "run_dry", "traced_config"]


def plan(
    run: Any,
    world_size: int,
    gpu: str,
    phases: bool = True,
    network: str | None = None,
    counts: StepCounts | None = None,
) -> DryRunReport:
    """Measure one step of `run` at `world_size` on fake tensors, as the trainer on `gpu`,
    and time it over `network` (a `train.plan.network.NETWORKS` key; the GPU's default
    when None); `phases`: also at each seq_len of a schedule. `counts`: the step already
    traced for this run and world size on any GPU target (the trace is the same for every
    GPU: only the timing and the verdict differ), reused instead of tracing again."""
    from train.build import to_trainer_config
    from train.launch_rules import check_launch

    spec = gpu_spec(gpu, run)
    net = network_preset(network or spec.default_network or "ndr-ib")
    c = TimeConstants()
    degrees = check_launch(run, world_size)
    accelerator = gpu != "cpu"
    tt_config = to_trainer_config(run, world_size, accelerator=accelerator)
    p = tt_config.parallelism
    seq_len = tt_config.training.seq_len  # the longest phase
    notes: list[str] = []
    if run.parallelism.spmd_backend == "auto":
        notes.append(f"parallelism.spmd_backend=auto resolves to {p.spmd_backend}")
    notes.append(
        "traced eagerly with attention as causal SDPA (compile and FlexAttention cannot run "
        "on fake tensors; attention FLOPs counted as the causal kernel runs them, one "
        "document per sequence; docs/dry_run.md)"
    )
    if run.parallelism.cp > 1:
        notes.append(
            "context parallel: K/V all-gather and its backward reduce-scatter traced and "
            "counted; the sharded block mask (int32 block indices, a few MiB at 128K) "
            "is not built (docs/dry_run.md)"
        )
    if run.fp8.enable and spec.fp8_format != "float8_e4m3fn":
        notes.append(
            f"{spec.name} trains FP8 in {spec.fp8_format} (largest value 240, not 448); "
            "the same FLOPs and bytes as float8_e4m3fn"
        )
    loss = f"chunked in {run.training.loss_chunks}" if run.training.loss_chunks else "whole logits"
    notes.append(f"loss: {loss} (training.loss_chunks), as the run trains it")
    if counts is None:
        counts = measure(traced_config(run), world_size, accelerator, TRACED_LAYERS)
    traced = min(TRACED_LAYERS, run.model.n_layers)
    report = DryRunReport.of(run, counts, world_size, degrees, spec, seq_len, net, c, notes=notes)
    report.spmd_backend, report.traced_layers = p.spmd_backend, traced
    lengths = sorted({run.training.seq_len, *(ph.seq_len for ph in run.dataloader.schedule)} - {0})
    if report.prediction is None or not phases or len(lengths) < 2:
        return report
    for length in lengths:
        phase = report
        if length != seq_len:
            # `run` as it trains at this phase's seq_len (the trainer is given the longest
            # length of its schedule, so the later phases go)
            phase_run = copy.deepcopy(run)
            phase_run.training.seq_len, phase_run.dataloader.schedule = length, []
            phase_counts = measure(traced_config(phase_run), world_size, accelerator, TRACED_LAYERS)
            phase = DryRunReport.of(
                phase_run, phase_counts, world_size, degrees, spec, length, net, c
            )
        step = phase.prediction
        report.phases.append(
            PhasePlan(length, step.step_s, step.tokens_per_s_per_gpu, phase.step_reserved)
        )
    phase_steps = tuple((ph.seq_len, ph.step_s) for ph in report.phases)
    report.prediction = dataclasses.replace(report.prediction, phases=phase_steps)
    return report


def run_dry(
    run: Any, world_size: int, gpu: str, write_budgets: bool = False, network: str | None = None
) -> int:
    """`python -m train --dry-run`: `plan` the run, print its report
    (`train.plan.report.DryRunReport.format`) and the time budgets derived from it; 0 if it
    fits `gpu`, 1 if it does not.

    Fits means the report's reserved peak (the larger of the step's, a checkpoint save's and
    each seq_len phase's) is within the GPU's memory less the share outside the allocator
    (FITS when the upper end of its held-out range is, TIGHT when only the point is);
    the predicted time never fails the plan, but a configured budget shorter than the
    prediction is a user error (ValueError, exit 2), as are `check_launch`'s refusals and an
    unknown GPU, raised before anything is traced. `write_budgets`: store the predicted
    times in RUN/budgets.json for the launches of this run (train/reliability/budgets.py).
    The caller has run `train.runtime.prepare_runtime()` (`python -m train` does, before it
    calls this)."""
    from train.reliability.budgets import Budgets, PlannedTimes, check_prediction, save_window_s

    report = plan(run, world_size, gpu, network=network)
    planned = None
    if report.prediction is not None:
        command = f"python -m train --dry-run --world-size {world_size} --gpu {gpu}"
        command += f" --network {network}" if network else ""
        planned = PlannedTimes.from_prediction(
            report.prediction, run, world_size, report.seq_len, command
        )
        budgets = Budgets.of(run, planned)
        report.budgets = budgets.describe(save_window_s(run, planned.checkpoint_bytes))
    print(report.format(), flush=True)
    if planned is not None:
        check_prediction(run, planned)
        if write_budgets:
            path = planned.write(run.run_dir)
            print(f"budgets written to {path} (read by --check and every launch)", flush=True)
    elif write_budgets:
        raise ValueError(
            f"--write-budgets: --gpu {gpu} has no time model; pass a GPU (h100, mi300x, ...)"
        )
    return 0 if report.runs else 1
