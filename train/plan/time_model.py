"""The planner's time model: how long an optimizer step takes on the target GPUs.

Why a model and not a measurement: the plan runs on a CPU, before any GPU hour is spent, and
every time budget of a run (the watchdog's windows, the NCCL timeouts, SLURM's signal lead,
vLLM's start) must come from a predicted time rather than a constant sized for toy models.
Published step-time simulators (vTrain, Echo, Lumos) reach 3-15 % with kernel timings
profiled on the target GPU; this model has only the traced counts of the step
(`train.plan.trace`) and the GPU's datasheet (`train.plan.gpu_specs`), plus few constants,
each named below with its source, and is checked against published runs
(`train.plan.calibration`, docs/bench/plan_published-2026-11-24.md).

How (per micro-batch, then per optimizer step):
- **Compute.** GEMMs: FLOPs / (the dtype's peak x `gemm_efficiency`), FP8 GEMMs against
  the FP8 peak. Attention: the FLOPs its kernel executes (causal blocks, 2.5x forward in
  backward) / (bf16 peak x `attention_efficiency`). Everything else is memory-bound: the
  bytes the ops read and write / (HBM bandwidth x torchao's achievable share). Compiled,
  the FP8 casts move what torchao's roofline model says (`train.plan.step_counts.fp8_cast_bytes`)
  and the rest `compiled_traffic` of the traced eager bytes (inductor fuses elementwise
  chains and norms); eager, `eager_traffic` of them.
- **Collectives.** A ring per collective: an all-gather or reduce-scatter moves
  (n-1)/n of its buffer over each GPU's link, an all-reduce twice that; NVLink inside a
  node, the GPU's network adapter between nodes (a group spanning nodes runs at the
  adapter's bandwidth), at `link_efficiency` of the link's peak, plus a latency per call
  (a tree's log2(n) hops for small messages).
- **Overlap.** FSDP's all-gathers (prefetched) and reduce-scatters run beside compute:
  only what exceeds the compute of the micro-batch, plus one unit's gather that nothing
  hides, is exposed. Tensor-parallel collectives sit between the GEMMs that need them:
  exposed, except the share async TP hides (`async_tp_hidden`). CP's K/V exchange and the
  small reductions (loss, gradient norm, FP8 amax) are exposed. Activation-checkpoint
  recompute is in the traced counts already.
- **Step.** accumulation x micro-batch + what runs once (clipping, the optimizer step),
  torchtitan's accumulation count (global batch / (local batch x batch degree); the batch
  degree leaves CP and TP out).
- **First step.** The step plus compile: `COMPILE_S`, a stated assumption (no GPU was
  available to measure it); a run with a seq_len schedule compiles again at each new
  seq_len.
- **Output.** `Prediction`: step time, tokens/s/GPU, MFU against the bf16 peak with
  torchtitan's FLOP formula (as torchtitan and Megatron report it), the exposed
  communication share, the save time of the checkpoint's bytes at a stated storage
  bandwidth, and per seq_len phase. The time budgets are derived from it (watchdog, NCCL,
  SLURM, vLLM): read `step_s`, `first_step_s`, `phase_step_s(seq_len)` and `save_s`.

Memory has its own two constants here (`allocator_overhead`, `compiled_activations`): the
tracer measures what is allocated on eager fake tensors, a GPU run reports what its
caching allocator reserved, and compiled code keeps fewer activations.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from train.plan.gpu_specs import GpuSpec

# Stated assumptions (not fitted; each with its source)
MEMORY_EFFICIENCY = 0.92  # torchao roofline_utils.py 'pct_achievable_mem_bw' (H100)
LATENCY_NVLINK_S = 5e-6  # per hop, NCCL inside a node (order of magnitude of nccl-tests)
LATENCY_NETWORK_S = 10e-6  # per hop across nodes (RDMA; order of magnitude of nccl-tests)
COMPILE_S = 120.0  # torch.compile of the first step (blocks + loss): an assumption, unmeasured
STORAGE_GB_PER_S = (
    5.0  # checkpoint storage, all ranks together: the run's checkpoint.storage_gb_per_s
)
PCIE_GB_PER_S = 25.0  # device-to-host staging of an async save, per GPU (PCIe Gen5 x16, ~50 %)


@dataclass(frozen=True)
class TimeConstants:
    """The fitted constants (`train.plan.calibration.fit`, leave-one-out checked there).

    The defaults are the fit to every exact published row of docs/bench/
    plan_published-2026-11-24.md, from the priors named in `train.plan.calibration.PRIORS`
    (tests/train/plan/test_plan_published.py holds them to it)."""

    gemm_efficiency: float = 0.7979
    """Achieved share of the GEMM peak (bf16 and FP8). Prior: torchao's
    'pct_achievable_gemm_tops' 0.78 for large GEMMs on an H100."""
    rowwise_gemm_efficiency: float = 0.2487
    """Achieved share of the FP8 peak by GEMMs with per-row scales (other kernels than
    tensorwise's)."""
    attention_efficiency: float = 0.2012
    """Achieved share of the bf16 peak by the attention kernels (SDPA / FlexAttention)."""
    compiled_traffic: float = 0.8329
    """Share of the traced eager memory-bound traffic (FP8 casts apart) that compiled code
    still moves (inductor fuses elementwise chains and norms)."""
    eager_traffic: float = 1.3
    """Traffic of an eager GPU run / the traced eager traffic (the GPU's kernels are not the
    CPU trace's decompositions, one for one)."""
    link_efficiency: float = 0.8219
    """Achieved bus bandwidth / link peak for NCCL rings (NVLink and network)."""
    async_tp_hidden: float = 0.2969
    """Share of the TP collectives async TP hides behind GEMMs."""
    allocator_overhead: float = 0.1937
    """Reserved / allocated - 1 of the caching allocator at the step peak."""
    compiled_activations: float = 0.9719
    """Activations + buffers of compiled code / of the eager trace."""

    def replace(self, **changes: float) -> TimeConstants:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Layout:
    """What the time model needs to know about the run beyond the traced counts."""

    world_size: int
    global_batch_size: int  # sequences per optimizer step
    seq_len: int
    compile: bool
    async_tp: bool
    fp8_all_gather: bool = False

    @classmethod
    def of_run(cls, run, world_size: int, degrees: dict[str, int], seq_len: int) -> Layout:
        """The layout of `run` (a `train.config.RunConfig`) at `degrees` (`check_launch`'s)
        and `seq_len`; a global batch of -1 is the local batch x the data-parallel degree."""
        t = run.training
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        glob = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
        fp8 = run.fp8
        return cls(
            world_size=world_size,
            global_batch_size=glob,
            seq_len=seq_len,
            compile=run.compile.enable,
            async_tp=run.compile.async_tp and degrees["tp"] > 1,
            fp8_all_gather=fp8.enable and fp8.recipe == "tensorwise" and fp8.fsdp_float8_all_gather,
        )


@dataclass(frozen=True)
class Prediction:
    """One optimizer step on the target GPUs (seconds, tokens, shares)."""

    gpu: str
    step_s: float
    micro_batch_s: float
    accumulation: int
    tokens_per_s_per_gpu: float
    mfu: float  # torchtitan's FLOPs per token x tokens/s / bf16 peak
    compute_s: float  # per step: GEMMs + attention + memory-bound ops
    exposed_comm_s: float  # per step
    comm_s: float  # per step, exposed or not
    breakdown: dict[str, float] = field(default_factory=dict)  # per step, by part
    compile_s: float = 0.0
    first_step_s: float = 0.0
    checkpoint_bytes: int = 0
    storage_gb_per_s: float = STORAGE_GB_PER_S
    save_s: float = 0.0  # the checkpoint's bytes at storage_gb_per_s
    save_stall_s: float = 0.0  # an async save's device-to-host staging, training waits
    phases: tuple[tuple[int, float], ...] = ()  # (seq_len, step_s) of each seq_len phase

    @property
    def exposed_comm_share(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    def phase_step_s(self, seq_len: int) -> float:
        """The step time at `seq_len` (a schedule phase), else the planned step's."""
        return dict(self.phases).get(seq_len, self.step_s)

    def save_s_at(self, storage_gb_per_s: float) -> float:
        return self.checkpoint_bytes / (storage_gb_per_s * 1e9)


def _link(gpu: GpuSpec, ranks: list[int]) -> tuple[float, float]:
    """(bandwidth, latency per hop) of a group: NVLink if it stays in one node."""
    nodes = {r // gpu.gpus_per_node for r in ranks}
    if len(nodes) == 1:
        return gpu.nvlink_bandwidth, LATENCY_NVLINK_S
    return gpu.network_bandwidth, LATENCY_NETWORK_S


def collective_s(
    gpu: GpuSpec, ranks: list[int], kind: str, nbytes: int, calls: int, c: TimeConstants
) -> float:
    """Ring time of `calls` collectives moving `nbytes` in all (module doc)."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    bandwidth, latency = _link(gpu, ranks)
    share = (n - 1) / n
    if kind.startswith("all-reduce"):
        share *= 2
    elif kind.startswith("broadcast"):
        share = 1.0
    hops = math.ceil(math.log2(n)) * (2 if kind.startswith("all-reduce") else 1)
    return share * nbytes / (bandwidth * c.link_efficiency) + calls * hops * latency


def _compute_s(flops: dict, memory_bytes: dict, gpu: GpuSpec, c: TimeConstants, fused: bool):
    gemm = attention = 0.0
    for key, value in flops.items():
        if key == "attention":
            attention += value / (gpu.bf16_flops * c.attention_efficiency)
        elif "rowwise" in key:
            gemm += value / (gpu.fp8_flops * c.rowwise_gemm_efficiency)
        elif "float8" in key:
            gemm += value / (gpu.fp8_flops * c.gemm_efficiency)
        else:
            gemm += value / (gpu.bf16_flops * c.gemm_efficiency)
    other = memory_bytes.get("eager other", 0)
    if fused:  # compiled: inductor's fusion; FP8 casts as torchao's roofline has them
        traffic = other * c.compiled_traffic + memory_bytes.get("compiled fp8 casts", 0)
    else:
        traffic = (other + memory_bytes.get("eager fp8 casts", 0)) * c.eager_traffic
    memory = traffic / (gpu.memory_bandwidth * MEMORY_EFFICIENCY)
    return gemm, attention, memory


def _comm_s(ops, groups: dict, gpu: GpuSpec, c: TimeConstants) -> dict[str, float]:
    """Seconds per mesh dimension ("fsdp", "tp", "cp", ...) for one phase's collectives."""
    by_mesh: dict[str, float] = {}
    for key, nbytes in ops.comm.items():
        mesh, _, rest = key.partition(" ")
        kind = rest.rsplit(" ", 1)[0]
        ranks = groups.get(mesh, [0])
        seconds = collective_s(gpu, ranks, kind, nbytes, ops.comm_calls.get(key, 1), c)
        by_mesh[mesh] = by_mesh.get(mesh, 0.0) + seconds
    return by_mesh


def predict(counts, layout: Layout, gpu: GpuSpec, c: TimeConstants | None = None) -> Prediction:
    """`Prediction` for the traced `counts` (a `train.plan.step_counts.StepCounts`)."""
    c = c or TimeConstants()
    assert gpu.timed, f"{gpu.name}: no peaks to time a step against"
    micro = counts.micro
    gemm, attention, memory = _compute_s(micro.flops, micro.memory_bytes, gpu, c, layout.compile)
    compute = gemm + attention + memory
    comm = _comm_s(micro, counts.groups, gpu, c)
    # FSDP (and HSDP's replicate dimension): prefetched and overlapped with compute; one
    # unit's gather is not hidden
    fsdp = sum(comm.pop(dim, 0.0) for dim in ("fsdp", "dp_shard", "dp_replicate"))
    units = max(1, counts.num_fsdp_modules)
    fsdp_exposed = max(0.0, fsdp - compute) + fsdp / units
    tp = comm.pop("tp", 0.0)
    tp_exposed = tp * (1.0 - c.async_tp_hidden) if layout.async_tp else tp
    other = sum(comm.values())  # cp's K/V exchange, loss and amax reductions: exposed
    micro_s = compute + fsdp_exposed + tp_exposed + other
    # once per step: clipping and the optimizer step (eager foreach ops) and their reductions
    once = counts.once
    o_gemm, o_attention, o_memory = _compute_s(once.flops, once.memory_bytes, gpu, c, False)
    once_comm = sum(_comm_s(once, counts.groups, gpu, c).values())
    once_s = o_gemm + o_attention + o_memory + once_comm
    a = counts.accumulation
    step_s = a * micro_s + once_s
    tokens = layout.global_batch_size * layout.seq_len / layout.world_size
    tokens_per_s = tokens / step_s
    exposed = a * (fsdp_exposed + tp_exposed + other) + once_comm
    compile_s = COMPILE_S if layout.compile else 0.0
    return Prediction(
        gpu=gpu.name,
        step_s=step_s,
        micro_batch_s=micro_s,
        accumulation=a,
        tokens_per_s_per_gpu=tokens_per_s,
        mfu=counts.num_flops_per_token * tokens_per_s / gpu.bf16_flops,
        compute_s=a * compute + o_gemm + o_attention + o_memory,
        exposed_comm_s=exposed,
        comm_s=a * (fsdp + tp + other) + once_comm,
        breakdown={
            "GEMMs": a * gemm + o_gemm,
            "attention": a * attention,
            "memory-bound ops": a * memory + o_memory,
            "FSDP exposed": a * fsdp_exposed,
            "TP exposed": a * tp_exposed,
            "other collectives": a * other + once_comm,
        },
        compile_s=compile_s,
        first_step_s=step_s + compile_s,
    )


def predict_with_save(
    counts,
    layout: Layout,
    gpu: GpuSpec,
    c: TimeConstants,
    storage_gb_per_s: float = STORAGE_GB_PER_S,
) -> Prediction:
    """`predict`, and the step's checkpoint: model + optimizer state at every rank's global
    size (bytes per parameter as this rank holds them), the local share staged to host,
    written at `storage_gb_per_s` (the run's `checkpoint.storage_gb_per_s`)."""
    per_param = (counts.parameters + counts.optimizer) / max(1, counts.num_local_params)
    checkpoint_bytes = int(per_param * counts.num_params)
    prediction = predict(counts, layout, gpu, c)
    return with_checkpoint(prediction, checkpoint_bytes, counts.host_staging, storage_gb_per_s)


def with_checkpoint(
    prediction: Prediction,
    checkpoint_bytes: int,
    local_bytes: int,
    storage_gb_per_s: float = STORAGE_GB_PER_S,
) -> Prediction:
    """`prediction` with the save of `checkpoint_bytes` (all ranks) at `storage_gb_per_s`,
    and the stall of staging this rank's `local_bytes` to host memory."""
    return dataclasses.replace(
        prediction,
        checkpoint_bytes=checkpoint_bytes,
        storage_gb_per_s=storage_gb_per_s,
        save_s=checkpoint_bytes / (storage_gb_per_s * 1e9),
        save_stall_s=local_bytes / (PCIE_GB_PER_S * 1e9),
    )


def reserved_bytes(counts, allocated: int, compiled: bool, c: TimeConstants | None = None) -> int:
    """What the caching allocator reserves at the step peak: the traced allocation with
    compiled code's smaller activations, plus the allocator's overhead."""
    c = c or TimeConstants()
    states = counts.parameters + counts.gradients + counts.optimizer + counts.state_dict_cache
    activations = max(0, allocated - states)
    if compiled:
        activations = int(activations * c.compiled_activations)
    return int((states + activations) * (1.0 + c.allocator_overhead))
