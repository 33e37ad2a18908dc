"""The planner's time model: how long an optimizer step takes on the target GPUs.

Why a model and not a measurement: the plan runs on a CPU, before any GPU hour is spent, and
every time budget of a run (the watchdog's windows, the NCCL timeouts, SLURM's signal lead,
vLLM's start) must come from a predicted time rather than a constant sized for toy models.
Published step-time simulators (vTrain, Echo, Lumos) reach 3-15 % with kernel timings
profiled on the target GPU; this model has only the traced counts of the step
(`train.plan.trace`), the GPU's datasheet (`train.plan.gpu_specs`), the network's preset
(`train.plan.network`), and few constants, each named below with its source and with the
published rows that pin it (`train.plan.calibration`,
docs/bench/plan_published-2026-11-28.md).

Physics before fitting: what a measurement or a datasheet can fix is fixed, and the fitted
constants are held inside what is physically possible. FP8 GEMMs run at the bf16 rate x
`fp8_gemm_speedup`, a speed-up of at least 1 and at most the ratio of the two peaks (this
project's H100: 1.69 for the 8B linears, 1.85 for the 70B's, docs/bench/gpu/2026-11-26-h100.md);
rowwise-scaled FP8 GEMMs at `ROWWISE_SHARE` of tensorwise's, measured there too (never below
bf16). AMD's achieved share of its peak is its own constant (`amd_gemm_efficiency`):
hipBLASLt on CDNA 3 is not cuBLAS on Hopper. Attention runs at the efficiency of its kernel:
flash (SDPA) and FlexAttention share one, ring attention over SDPA (torchtitan's context
parallelism of 2024) has its own, and a ring hides its K/V exchange behind the attention it
feeds.

How (per micro-batch, then per optimizer step):
- **Compute.** GEMMs: FLOPs / (bf16 peak x the vendor's GEMM efficiency, x the FP8 speed-up
  for FP8 GEMMs). Attention: the FLOPs its kernel executes (causal blocks, 2.5x forward in
  backward) / (bf16 peak x the kernel's efficiency). Everything else is memory-bound: the
  bytes the ops read and write / (HBM bandwidth x torchao's achievable share). Compiled,
  the FP8 casts move what torchao's roofline model says (`train.plan.step_counts.fp8_cast_bytes`)
  and the rest `compiled_traffic` of the traced eager bytes (inductor fuses elementwise
  chains and norms); eager, `eager_traffic` of them.
- **Collectives.** `train.plan.network.collective_terms`: rings (and NCCL's tree for
  all-reduces) over the scale-up link inside a node and the node's NICs across nodes, a
  group getting its share of the node, at `link_efficiency` of the links' peaks.
- **Overlap.** FSDP's all-gathers (prefetched) and reduce-scatters run beside compute:
  only what exceeds the compute of the micro-batch, plus one unit's gather that nothing
  hides, is exposed. Tensor-parallel collectives sit between the GEMMs that need them:
  exposed, except the share async TP hides (`async_tp_hidden`). CP's K/V exchange is
  exposed (this trainer's all-gather) or hidden behind attention (a ring); the small
  reductions (loss, gradient norm, FP8 amax) are exposed. Activation-checkpoint recompute
  is in the traced counts already.
- **Step.** accumulation x micro-batch + what runs once (clipping, the optimizer step),
  torchtitan's accumulation count (global batch / (local batch x batch degree); the batch
  degree leaves CP and TP out).
- **First step.** The step plus compile: `COMPILE_S`, a stated assumption (the one GPU
  check measured 15-64 s for a 2-layer 8B); a run with a seq_len schedule compiles again at
  each new seq_len.
- **Output.** `Prediction`: step time, tokens/s/GPU, MFU against the bf16 peak with
  torchtitan's FLOP formula (as torchtitan and Megatron report it), the exposed
  communication share, the save time of the checkpoint's bytes at the storage bandwidth,
  and per seq_len phase. The time budgets are derived from it (watchdog, NCCL, SLURM,
  vLLM): read `step_s`, `first_step_s`, `phases` (the step at each seq_len) and `save_s`.

Memory has its own three constants here: the tracer measures what is allocated on eager
fake tensors, a GPU run reports what its caching allocator reserved
(`allocator_overhead`), compiled code keeps fewer activations (`compiled_activations`), and
a compiled whole-logits loss never writes the fp32 log-probabilities the eager loss keeps
(`compiled_loss_saving`, per byte of the bf16 logits: `compiled_loss_logits`). The last is
physics before the fit: torchtitan compiles the loss with the model since April 2025, and
publications from before and after it reserved 8-9 GiB apart at the same 8B layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from train.plan.gpu_specs import GpuSpec
from train.plan.network import NETWORKS, Network, collective_terms

# Stated assumptions and measurements (not fitted; each with its source)
MEMORY_EFFICIENCY = 0.92  # torchao roofline_utils.py 'pct_achievable_mem_bw' (H100)
# rowwise-scaled FP8 GEMMs / tensorwise's, FLOP-weighted over the linears at 8,192 tokens:
# 0.93 (8B), 0.87 (70B) on this project's H100 (docs/bench/gpu/2026-11-26-h100.md, part b)
ROWWISE_SHARE = 0.90
COMPILE_S = 120.0  # torch.compile of the first step (blocks + loss): an assumption, unmeasured
# checkpoint storage, all ranks together: the default of the run's storage_gb_per_s
STORAGE_GB_PER_S = 5.0
PCIE_GB_PER_S = 25.0  # device-to-host staging of an async save, per GPU (PCIe Gen5 x16, ~50 %)


@dataclass(frozen=True)
class TimeConstants:
    """The fitted constants (`train.plan.calibration.fit`, checked there holding out whole
    publications); the rows that pin each and its prior: docs/bench/plan_published-2026-11-28.md.

    The defaults are the fit to every row of that record that is not excluded, from the
    priors named in `train.plan.calibration.PRIORS` (tests/train/plan/test_plan_published.py
    holds them to it)."""

    gemm_efficiency: float = 0.72
    """NVIDIA: achieved share of the bf16 peak by bf16 GEMMs, measured, not fitted (this
    project's H100 SXM5, FLOP-weighted: 0.75 for the 8B linears, 0.70 for the 70B's)."""
    unknown_clock_share: float = 0.845
    """Share of its datasheet's peak a card whose clock is unknown reaches
    (`GpuSpec.peak_known` False: Meta's 96 GB, 500 W H100; prior 912 / 989, the midpoint of
    the SXM's and the NVL's peaks)."""
    amd_stack_share: float = 0.4719
    """AMD: the share of the efficiencies above (GEMMs, attention, memory-bound kernels)
    that the ROCm stack (hipBLASLt, its SDPA and inductor's Triton kernels) reaches on an
    Instinct GPU (prior 0.7, an assumption)."""
    fp8_gemm_speedup: float = 1.719
    """Tensorwise FP8 GEMM rate / bf16's, between 1 and the ratio of the peaks (prior: this
    project's H100, 1.69 and 1.85)."""
    attention_efficiency: float = 0.2
    """Achieved share of the bf16 peak by flash (SDPA) and FlexAttention kernels."""
    ring_attention_efficiency: float = 0.2166
    """The same for ring attention over SDPA (torchtitan's context parallelism of 2024)."""
    compiled_traffic: float = 0.5612
    """Share of the traced eager memory-bound traffic (FP8 casts apart) that compiled code
    still moves (inductor fuses elementwise chains and norms)."""
    eager_traffic: float = 1.0
    """Traffic of an eager GPU run / the traced eager traffic (the GPU's kernels are not the
    CPU trace's decompositions, one for one)."""
    link_efficiency: float = 0.8383
    """Achieved bus bandwidth / link peak for NCCL (scale-up links and RDMA networks)."""
    async_tp_hidden: float = 0.4141
    """Share of the TP collectives async TP hides behind GEMMs."""
    allocator_overhead: float = 0.3364
    """Reserved / allocated - 1 of the caching allocator at the step peak (prior: this
    project's H100, 31.57 / 26.11 GiB)."""
    compiled_activations: float = 0.8315
    """Activations + buffers of compiled code / of the eager trace."""
    compiled_loss_saving: float = 3.328
    """What a compiled whole-logits loss holds less than the eager one the trace runs, in
    units of the bf16 logits (`compiled_loss_logits`): the eager cross-entropy keeps fp32
    log-probabilities and their fp32 gradient (up to 4 units); the compiled one fuses them."""


# How far a prediction may be off: the 90th percentile of the absolute leave-one-publication-
# out error over the published rows (pred / published - 1; train.plan.calibration,
# docs/bench/plan_published-2026-11-28.md, held by tests/train/plan/test_plan_published.py),
# rounded up to the percent; tokens/s per vendor (AMD's constants are pinned by one
# publication), memory over all rows (its model has no vendor constant). The plan prints
# the ranges and judges memory by the upper end (train.plan.report).
HELD_OUT_TOKENS_PER_S = {"nvidia": 0.16, "amd": 0.52}
HELD_OUT_MEMORY = 0.11


def held_out_range(point: float, error: float) -> tuple[float, float]:
    """(low, high) of the true value when predictions are off by at most `error` either
    way (predicted / true - 1 in [-error, error])."""
    return point / (1 + error), point / (1 - error)


@dataclass(frozen=True)
class Layout:
    """What the time model needs to know about the run beyond the traced counts."""

    world_size: int
    global_batch_size: int  # sequences per optimizer step
    seq_len: int
    compile: bool
    async_tp: bool
    fp8_all_gather: bool = False
    network: Network = NETWORKS["ndr-ib"]
    # the attention kernel: this trainer's FlexAttention ("flex"; its CP: a K/V all-gather),
    # flash kernels through SDPA ("flash"), or ring attention ("ring": CP over SDPA)
    attention: str = "flex"

    @classmethod
    def of_run(
        cls, run, world_size: int, degrees: dict[str, int], seq_len: int, network: Network
    ) -> Layout:
        """The layout of `run` (a `train.config.RunConfig`) at `degrees` (`check_launch`'s)
        and `seq_len` over `network`; a global batch of -1 is the local batch x the
        data-parallel degree."""
        from train.build import resolve_attention

        t = run.training
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        glob = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
        fp8 = run.fp8
        attention = resolve_attention(run.model.attention, accelerator=True)
        return cls(
            world_size=world_size,
            global_batch_size=glob,
            seq_len=seq_len,
            compile=run.compile.enable,
            async_tp=run.compile.async_tp and degrees["tp"] > 1,
            fp8_all_gather=fp8.enable and fp8.recipe == "tensorwise" and fp8.fsdp_float8_all_gather,
            network=network,
            attention="flex" if attention == "flex" else "flash",
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
    network: str = ""  # the train.plan.network.NETWORKS preset the collectives were timed over

    @property
    def exposed_comm_share(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0


def peak_bf16(gpu: GpuSpec, c: TimeConstants) -> float:
    """The bf16 peak the card reaches: its datasheet's, or a share of it where its clock is
    unknown (`GpuSpec.peak_known`)."""
    share = c.amd_stack_share if gpu.vendor == "amd" else 1.0
    return gpu.bf16_flops * share * (1.0 if gpu.peak_known else c.unknown_clock_share)


def gemm_rates(gpu: GpuSpec, c: TimeConstants) -> dict[str, float]:
    """Achieved FLOP/s of bf16, tensorwise FP8 and rowwise FP8 GEMMs on `gpu` (module doc:
    FP8 never below bf16, at most its peak's share)."""
    bf16 = peak_bf16(gpu, c) * c.gemm_efficiency
    tensorwise = bf16 * min(c.fp8_gemm_speedup, gpu.fp8_flops / gpu.bf16_flops)
    return {
        "bf16": bf16,
        "tensorwise": tensorwise,
        "rowwise": max(bf16, tensorwise * ROWWISE_SHARE),
    }


@dataclass(frozen=True)
class PhaseTerms:
    """One phase's counts as the time model reads them, before any fitted constant: FLOPs by
    GEMM rate class and attention, bytes by traffic class, and per mesh dimension the
    collectives' (bandwidth seconds at a link efficiency of 1, latency seconds)."""

    gemm: dict[str, float]  # "bf16", "tensorwise", "rowwise" -> FLOPs
    attention: float
    traffic: dict[str, float]  # "other", "compiled casts", "eager casts" -> bytes
    comm: dict[str, tuple[float, float]]

    @classmethod
    def of(cls, ops, groups: dict, gpu: GpuSpec, network: Network) -> PhaseTerms:
        gemm = {"bf16": 0.0, "tensorwise": 0.0, "rowwise": 0.0}
        for key, value in ops.flops.items():
            if key != "attention":
                kind = (
                    "rowwise" if "rowwise" in key else "tensorwise" if "float8" in key else "bf16"
                )
                gemm[kind] += value
        memory = ops.memory_bytes
        comm: dict[str, tuple[float, float]] = {}
        for key, nbytes in ops.comm.items():
            mesh, _, rest = key.partition(" ")
            calls = ops.comm_calls.get(key, 1)
            bandwidth, latency = collective_terms(
                gpu, network, groups.get(mesh, [0]), rest.rsplit(" ", 1)[0], nbytes, calls
            )
            before = comm.get(mesh, (0.0, 0.0))
            comm[mesh] = (before[0] + bandwidth, before[1] + latency)
        return cls(
            gemm=gemm,
            attention=float(ops.flops.get("attention", 0)),
            traffic={
                "other": float(memory.get("eager other", 0)),
                "compiled casts": float(memory.get("compiled fp8 casts", 0)),
                "eager casts": float(memory.get("eager fp8 casts", 0)),
            },
            comm=comm,
        )

    def times(self, gpu: GpuSpec, c: TimeConstants, attention_kernel: str, fused: bool):
        """(GEMM, attention, memory-bound seconds, {mesh: collective seconds})."""
        rates = gemm_rates(gpu, c)
        gemm = sum(flops / rates[kind] for kind, flops in self.gemm.items() if flops)
        efficiency = (
            c.ring_attention_efficiency if attention_kernel == "ring" else c.attention_efficiency
        )
        attention = self.attention / (peak_bf16(gpu, c) * efficiency)
        t = self.traffic
        if fused:  # compiled: inductor's fusion; FP8 casts as torchao's roofline has them
            traffic = t["other"] * c.compiled_traffic + t["compiled casts"]
        else:
            traffic = (t["other"] + t["eager casts"]) * c.eager_traffic
        stack = c.amd_stack_share if gpu.vendor == "amd" else 1.0
        memory = traffic / (gpu.memory_bandwidth * MEMORY_EFFICIENCY * stack)
        comm = {mesh: bw / c.link_efficiency + lat for mesh, (bw, lat) in self.comm.items()}
        return gemm, attention, memory, comm


@dataclass(frozen=True)
class StepTerms:
    """A traced step on a GPU over a network, before any fitted constant (`PhaseTerms` of
    the micro-batch and of what runs once): `predict` is `assemble` of these, and the fit
    (`train.plan.calibration`) assembles them again for each trial of the constants."""

    micro: PhaseTerms
    once: PhaseTerms

    @classmethod
    def of(cls, counts, layout: Layout, gpu: GpuSpec) -> StepTerms:
        net = layout.network
        return cls(
            PhaseTerms.of(counts.micro, counts.groups, gpu, net),
            PhaseTerms.of(counts.once, counts.groups, gpu, net),
        )


def predict(counts, layout: Layout, gpu: GpuSpec, c: TimeConstants | None = None) -> Prediction:
    """`Prediction` for the traced `counts` (a `train.plan.step_counts.StepCounts`)."""
    assert gpu.timed, f"{gpu.name}: no peaks to time a step against"
    return assemble(StepTerms.of(counts, layout, gpu), counts, layout, gpu, c or TimeConstants())


def assemble(
    terms: StepTerms, counts, layout: Layout, gpu: GpuSpec, c: TimeConstants
) -> Prediction:
    """The step's `Prediction` from its `terms` and the constants `c` (module doc)."""
    gemm, attention, memory, comm = terms.micro.times(gpu, c, layout.attention, layout.compile)
    compute = gemm + attention + memory
    # FSDP (and HSDP's replicate dimension): prefetched and overlapped with compute; one
    # unit's gather is not hidden
    fsdp = sum(comm.pop(dim, 0.0) for dim in ("fsdp", "dp_shard", "dp_replicate"))
    units = max(1, counts.num_fsdp_modules)
    fsdp_exposed = max(0.0, fsdp - compute) + fsdp / units
    tp = comm.pop("tp", 0.0)
    tp_exposed = tp * (1.0 - c.async_tp_hidden) if layout.async_tp else tp
    cp = comm.pop("cp", 0.0)  # a ring passes K/V beside the attention it feeds
    cp_exposed = max(0.0, cp - attention) if layout.attention == "ring" else cp
    rest = sum(comm.values())  # the loss and amax reductions: exposed
    other = cp_exposed + rest
    micro_s = compute + fsdp_exposed + tp_exposed + other
    # once per step: clipping and the optimizer step (eager foreach ops) and their reductions
    o_gemm, o_attention, o_memory, o_comm = terms.once.times(gpu, c, layout.attention, False)
    once_comm = sum(o_comm.values())
    once_s = o_gemm + o_attention + o_memory + once_comm
    a = counts.accumulation
    step_s = a * micro_s + once_s
    tokens = layout.global_batch_size * layout.seq_len / layout.world_size
    tokens_per_s = tokens / step_s
    compile_s = COMPILE_S if layout.compile else 0.0
    return Prediction(
        gpu=gpu.name,
        step_s=step_s,
        micro_batch_s=micro_s,
        accumulation=a,
        tokens_per_s_per_gpu=tokens_per_s,
        mfu=counts.num_flops_per_token * tokens_per_s / gpu.bf16_flops,
        exposed_comm_s=a * (fsdp_exposed + tp_exposed + other) + once_comm,
        comm_s=a * (fsdp + tp + cp + rest) + once_comm,
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
        network=layout.network.name,
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
    return dataclasses.replace(
        predict(counts, layout, gpu, c),
        checkpoint_bytes=checkpoint_bytes,
        storage_gb_per_s=storage_gb_per_s,
        save_s=checkpoint_bytes / (storage_gb_per_s * 1e9),
        save_stall_s=counts.host_staging / (PCIE_GB_PER_S * 1e9),
    )


def compiled_loss_logits(run, local_batch: int, seq_len: int, tp: int, cp: int) -> int:
    """Bytes of the bf16 logits on one rank when the loss is compiled on the whole logits
    (torchtitan compiles it with the model since pytorch/torchtitan#1033, April 2025:
    `compile.components` holds "loss"); 0 otherwise (eager, or chunked: the trace holds a
    chunk's copies only). Vocab-parallel under TP, a rank's tokens under CP."""
    c = run.compile
    if not (c.enable and "loss" in c.components) or run.training.loss_chunks:
        return 0
    return 2 * local_batch * (seq_len // cp) * (run.model.vocab_size // tp)


def reserved_bytes(
    counts, allocated: int, compiled: bool, c: TimeConstants, loss_logits: int = 0
) -> int:
    """What the caching allocator reserves at the step peak: the traced allocation with
    compiled code's smaller activations (the layers' at `compiled_activations`, a compiled
    whole-logits loss `compiled_loss_saving` x its `loss_logits` bytes below the eager
    loss the trace ran), plus the allocator's overhead."""
    states = counts.parameters + counts.gradients + counts.optimizer + counts.state_dict_cache
    activations = max(0, allocated - states)
    if compiled:
        activations = activations * c.compiled_activations - c.compiled_loss_saving * loss_logits
        activations = max(0, int(activations))
    return int((states + activations) * (1.0 + c.allocator_overhead))
