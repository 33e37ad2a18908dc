"""The plan's report: memory by consumer, counts per micro-batch and per step, time, verdict.

Why apart from the tracer: what a step holds and does (`train.plan.trace`) is measured
once; how it is judged and shown changes more often (a verdict, a table, a budget read by
another tool), and a reader of either should not wade through the other. `DryRunReport`
holds the measured counts, the memory derived from them, the time prediction
(`train.plan.time_model.Prediction`), and renders them (`format`).

Memory (rank 0, bytes): parameters, gradients and optimizer state are read off the
tensors; the checkpointer's state-dict cache is what it allocates beyond the parameters'
storage (nothing with Q/K/V unfused); activations and buffers are the traced step peak
minus those. The step peak and the checkpoint-save peak are given as **allocated** (what
the trace measured) and as **reserved** (what the caching allocator holds: compiled code's
activations and the allocator's overhead, `train.plan.time_model.reserved_bytes`); the verdict
compares the larger reserved peak with the card less `OUTSIDE_ALLOCATOR_FRACTION`.

How sure: every figure the time and memory models give is printed with its range, from the
error the model made on published runs it never saw (`train.plan.time_model.HELD_OUT_MEMORY`
and `HELD_OUT_TOKENS_PER_S`, per vendor: leave-one-publication-out). The verdict reads the range, not
the point: **FITS** when the upper end of the reserved peak fits, **TIGHT** (with the
margin) when only the point does, **DOES NOT FIT** when the point does not. A plan that
says FITS for a run that then dies of OOM is the worst outcome a planner has.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from train.plan.gpu_specs import GIB, GpuSpec
from train.plan.network import NETWORKS
from train.plan.time_model import (
    HELD_OUT_MEMORY,
    HELD_OUT_TOKENS_PER_S,
    Prediction,
    TimeConstants,
    held_out_range,
)

# What lives outside torch's caching allocator on a GPU: the CUDA context, NCCL's and
# cuBLAS's buffers. A plan must leave this share of the card free to count as fitting.
OUTSIDE_ALLOCATOR_FRACTION = 0.05


@dataclass
class MemoryBreakdown:
    """Bytes per GPU (rank 0) for each consumer; `total` is the training-step peak."""

    parameters: int
    gradients: int
    optimizer: int
    state_dict_cache: int
    activations: int  # step peak minus the above: activations, FSDP buffers, temporaries

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


def memory_of(counts: Any) -> tuple[MemoryBreakdown, int]:
    """The step peak by consumer, and the checkpoint-save peak (allocated bytes).

    Steady state holds the parameters, optimizer state and state-dict cache through the
    step; gradients live from backward to the next step's zero_grad, so a save (after the
    optimizer step) finds all of them and adds what refreshing the cache allocates."""
    held = counts.parameters + counts.gradients + counts.optimizer + counts.state_dict_cache
    step_peak = counts.state_dict_cache + max(
        counts.peak_forward_backward + counts.optimizer, counts.peak_optimizer_step
    )
    memory = MemoryBreakdown(
        parameters=counts.parameters,
        gradients=counts.gradients,
        optimizer=counts.optimizer,
        state_dict_cache=counts.state_dict_cache,
        activations=max(0, step_peak - held),
    )
    return memory, held + counts.state_dict_refresh


def reserved_peaks(
    counts: Any, compiled: bool, c: TimeConstants, loss_logits: int = 0
) -> tuple[int, int, Any]:
    """(step, save) reserved peaks of `counts` and the step's allocated `MemoryBreakdown`:
    what the plan judges and the published-runs check compares (one home for both);
    `loss_logits`: `train.plan.time_model.compiled_loss_logits`."""
    from train.plan.time_model import reserved_bytes

    memory, save_peak = memory_of(counts)
    step = reserved_bytes(counts, memory.total, compiled, c, loss_logits)
    return step, reserved_bytes(counts, save_peak, False, c), memory


@dataclass
class PhasePlan:
    """One seq_len phase of a schedule: its step and its memory."""

    seq_len: int
    step_s: float
    tokens_per_s_per_gpu: float
    reserved_peak: int


@dataclass(kw_only=True)
class DryRunReport:
    world_size: int
    degrees: dict[str, int]
    gpu: GpuSpec
    ac_mode: str
    spmd_backend: str = ""  # "" where no trainer config was built (a suggestion's judge)
    local_batch_size: int
    global_batch_size: int
    seq_len: int
    compiled: bool
    counts: Any  # train.plan.step_counts.StepCounts
    traced_layers: int = 0  # 0: scaled from traced references, not traced (suggest)
    memory: MemoryBreakdown
    save_peak: int
    step_reserved: int
    save_reserved: int
    prediction: Prediction | None = None
    phases: list[PhasePlan] = field(default_factory=list)
    constants: TimeConstants = field(default_factory=TimeConstants)
    notes: list[str] = field(default_factory=list)
    budgets: list[str] = field(default_factory=list)  # train.reliability.budgets.Budgets.describe()

    @classmethod
    def of(
        cls,
        run: Any,
        counts: Any,
        world_size: int,
        degrees: dict[str, int],
        gpu: GpuSpec,
        seq_len: int,
        network: Any,
        c: TimeConstants,
        **fields: Any,
    ) -> DryRunReport:
        """The plan of `counts`, the traced step of `run` at `degrees` and `seq_len`: its
        reserved peaks and, on a GPU with peaks, its `Prediction` over `network` (a
        `train.plan.network.Network`) with the checkpoint's save (one home for the dry run
        and the suggestion's judge)."""
        from train.plan.time_model import Layout, compiled_loss_logits, predict_with_save

        local, compiled = run.training.local_batch_size, run.compile.enable
        logits = compiled_loss_logits(run, local, seq_len, degrees["tp"], degrees["cp"])
        step_reserved, save_reserved, memory = reserved_peaks(counts, compiled, c, logits)
        layout = Layout.of_run(run, world_size, degrees, seq_len, network)
        storage = run.checkpoint.storage_gb_per_s  # the checkpoint storage's bandwidth
        return cls(
            world_size=world_size,
            degrees=degrees,
            gpu=gpu,
            ac_mode=run.activation_checkpoint.mode,
            local_batch_size=local,
            global_batch_size=layout.global_batch_size,
            seq_len=seq_len,
            compiled=compiled,
            counts=counts,
            memory=memory,
            save_peak=memory_of(counts)[1],
            step_reserved=step_reserved,
            save_reserved=save_reserved,
            prediction=predict_with_save(counts, layout, gpu, c, storage) if gpu.timed else None,
            constants=c,
            **fields,
        )

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_gib * GIB * (1.0 - OUTSIDE_ALLOCATOR_FRACTION)

    @property
    def peak(self) -> int:
        """The larger reserved peak: of the step, of a save, of any seq_len phase."""
        return max(
            [self.step_reserved, self.save_reserved] + [p.reserved_peak for p in self.phases]
        )

    @property
    def peak_range(self) -> tuple[float, float]:
        """(low, high) bytes of the reserved peak from the held-out memory error."""
        return held_out_range(self.peak, HELD_OUT_MEMORY)

    @property
    def verdict(self) -> str:
        """FITS (the range's upper end fits), TIGHT (only the point), DOES NOT FIT."""
        if self.peak_range[1] <= self.usable_bytes:
            return "FITS"
        return "TIGHT" if self.peak <= self.usable_bytes else "DOES NOT FIT"

    @property
    def fits(self) -> bool:
        """Whether the upper end of the reserved peak's range fits (verdict FITS)."""
        return self.verdict == "FITS"

    @property
    def runs(self) -> bool:
        """Whether the point estimate fits (FITS or TIGHT): the plan's exit code 0."""
        return self.verdict != "DOES NOT FIT"

    def format(self) -> str:
        c, m = self.counts, self.memory
        degrees = " x ".join(f"{k}={v}" for k, v in self.degrees.items())
        scaled = (
            f"traced at {self.traced_layers - 1} and {self.traced_layers} layers, "
            f"extended linearly to {c.layers}"
            if self.traced_layers < c.layers
            else f"all {c.layers} layers traced"
        )
        per_step = c.step
        lines = [
            f"world size {self.world_size}: {degrees} (spmd_backend={self.spmd_backend})",
            f"parameters: {c.num_params:,} ({c.num_params / 1e9:.2f}B); "
            f"per GPU {c.num_local_params:,}",
            f"FLOPs per token: {c.num_flops_per_token:,} "
            f"({c.num_flops_per_token / 1e9:.1f} GFLOP, torchtitan's MFU formula)",
            f"plan applied: {c.num_float8_linears} Float8Linear, {c.num_fsdp_modules} FSDP "
            f"units, {c.num_ac_wrapped_blocks} AC-wrapped blocks (AC={self.ac_mode})",
            f"one step measured on fake tensors ({scaled}): {c.accumulation} micro-batch(es) "
            f"of local batch {self.local_batch_size} x seq {self.seq_len} per optimizer step "
            f"(global batch {self.global_batch_size}; accumulation = global / (local x "
            f"batch degree), torchtitan's, CP and TP left out of the batch degree)",
            f"  {'per GPU':<46} {'per micro-batch':>16} {'per step':>14}",
        ]
        for key in sorted(per_step.flops):
            lines.append(_row(f"TFLOP {key}", c.micro.flops.get(key, 0), per_step.flops[key], 1e12))
        lines.append(
            _row("TB moved by memory-bound ops (eager)",
                 sum(c.micro.memory_bytes.values()), sum(per_step.memory_bytes.values()), 1e12)
        )  # fmt: skip
        links = self._link_classes()
        for key in sorted(per_step.comm):
            name = f"GiB {key} [{links.get(key.split(' ')[0], '?')}]"
            lines.append(_row(name, c.micro.comm.get(key, 0), per_step.comm[key], GIB))
        lines.append("per-GPU memory (rank 0): allocated (traced) -> reserved")
        rows = [
            ("parameters (sharded)", m.parameters),
            ("gradients (sharded)", m.gradients),
            ("optimizer state", m.optimizer),
            ("checkpoint state-dict cache (own storage)", m.state_dict_cache),
            ("activations + FSDP/TP buffers + temps", m.activations),
        ]
        lines += [f"  {name:<46} {_f(value / GIB, 2):>9} GiB" for name, value in rows]
        overhead = self.constants.allocator_overhead
        lines += [
            f"  {'training-step peak':<46} {_f(m.total / GIB, 2):>9} GiB -> "
            f"{_f(self.step_reserved / GIB, 2)} GiB reserved",
            f"  {'checkpoint-save peak':<46} {_f(self.save_peak / GIB, 2):>9} GiB -> "
            f"{_f(self.save_reserved / GIB, 2)} GiB reserved",
            f"  (reserved = allocated with compiled activations x "
            f"{self.constants.compiled_activations if self.compiled else 1.0:.2f}, "
            f"+ {overhead:.0%} allocator overhead)",
            f"  {'host: async-save staging copy (pinned RAM)':<46} {_f(c.host_staging / GIB, 2):>9} GiB",
        ]
        for phase in self.phases:
            lines.append(
                f"  phase seq {phase.seq_len:>7}: reserved peak {_f(phase.reserved_peak / GIB, 2)} "
                f"GiB, step {_f(phase.step_s, 2)} s, {phase.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
            )
        low, high = self.peak_range
        usable = self.usable_bytes
        if self.verdict == "TIGHT":
            margin = f"; TIGHT: the range's upper end is {(high - usable) / GIB:.1f} GiB over"
        else:
            margin = f"; margin {(usable - high) / GIB:.1f} GiB" if self.fits else ""
        lines.append(
            f"{self.verdict} {self.gpu.name}: reserved peak {_f(self.peak / GIB, 1)} GiB "
            f"({_f(low / GIB, 1)}-{_f(high / GIB, 1)} from the held-out error of "
            f"{HELD_OUT_MEMORY:.0%}) of {self.gpu.memory_gib:.0f} GiB ({self.gpu.source}), "
            f"{usable / GIB:.1f} GiB usable after {OUTSIDE_ALLOCATOR_FRACTION:.0%} outside the "
            f"allocator{margin}"
        )
        if self.prediction is not None:
            lines += self._time_lines(self.prediction)
        lines += self.budgets
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _link_classes(self) -> dict[str, str]:
        gpn = self.gpu.gpus_per_node
        inside = "Infinity Fabric" if self.gpu.vendor == "amd" else "NVLink"
        return {
            mesh: inside if len({r // gpn for r in ranks}) == 1 else "network"
            for mesh, ranks in self.counts.groups.items()
        }

    def _time_lines(self, p: Prediction) -> list[str]:
        error = HELD_OUT_TOKENS_PER_S[self.gpu.vendor]
        low, high = held_out_range(p.tokens_per_s_per_gpu, error)
        short, long = (p.step_s * (1 + d * error) for d in (-1, 1))
        lines = [
            f"time per optimizer step on {p.gpu} (model: train/plan/time_model.py, checked against "
            "published runs in docs/bench/plan_published-2026-11-28.md):",
            f"  network {NETWORKS[p.network].describe()} (--network to change)",
            f"  {'step':<46} {_f(p.step_s, 2):>9} s ({_f(short, 2)}-{_f(long, 2)}; {p.accumulation} x "
            f"{_f(p.micro_batch_s, 3)} s micro-batch + clip/optimizer)",
            f"  {'tokens/s/GPU':<46} {p.tokens_per_s_per_gpu:9,.0f} ({low:,.0f}-{high:,.0f} from "
            f"the held-out error of {error:.0%} on {self.gpu.vendor.upper()} GPUs)",
            f"  {'MFU (bf16 peak, torchtitan FLOPs/token)':<46} {p.mfu:9.1%}",
            f"  {'exposed communication':<46} {_f(p.exposed_comm_s, 2):>9} s "
            f"({p.exposed_comm_share:.0%} of the step; {_f(p.comm_s, 2)} s in all)",
        ]
        lines += [f"    {k:<44} {_f(v, 2):>9} s" for k, v in p.breakdown.items()]
        return lines + [
            f"  {'first step (+ compile, assumed)':<46} {_f(p.first_step_s, 2):>9} s "
            f"(compile {p.compile_s:.0f} s)",
            f"  {'checkpoint save':<46} {_f(p.save_s, 1):>9} s ({p.checkpoint_bytes / 1e9:,.1f} GB at "
            f"{p.storage_gb_per_s:g} GB/s storage; staging stalls training {_f(p.save_stall_s, 1)} s)",
        ]


def _f(x: float, places: int) -> str:
    """`x` at `places` decimals, or at 2 significant digits where those decimals would print a
    positive figure as 0 (the debug model's times and GiB on a GPU)."""
    return f"{x:.{places}f}" if x == 0 or abs(x) >= 0.5 * 10**-places else f"{x:.2g}"


def _row(name: str, micro: float, step: float, unit: float) -> str:
    return f"  {name:<46} {micro / unit:16.2f} {step / unit:14.2f}"
