"""Plan a training run without GPUs: does this config fit, and how is it laid out?

Why: a 70B FP8 job that dies after queueing for a day on 64 GPUs because the degrees do not
multiply to the world size, or because the optimizer state does not fit an H100, is an
expensive way to learn arithmetic. This planner answers those questions on a laptop in
seconds, using the *same* code path the trainer uses rather than a spreadsheet that drifts
from it.

How:
1. The rules that need the world size are checked first by `train.config.check_launch`,
   the same function a real launch calls (one message per rule, naming the keys and the
   fix). The torchtitan config is `train.build.to_trainer_config`, the trainer's own, with
   "auto" resolved for the target GPU rather than for this machine.
2. A fake process group (`torch.testing._internal.distributed.fake_pg`, backend "fake") of
   the requested world size stands in for NCCL: collectives are no-ops, but meshes, DTensor
   placements and FSDP sharding are computed exactly as on rank 0 of the real job.
3. The model is built on the meta device from `train.model.build_model_spec` (FP8
   conversion included: torchtitan's `Float8LinearConverter`, its capability check passed
   by `train.cpu_compat` on a machine without an SM89+ GPU), counted with torchtitan's
   `get_nparams_and_flops`, and then handed to the spec's real `parallelize_fn` (TP/SP,
   activation checkpointing, compile wrapping, FSDP2). No weight is ever allocated.
4. Per-GPU memory for parameters, gradients and AdamW state is read off the sharded meta
   parameters (their local shard sizes), so uneven shards are counted as rank 0 holds them.
   Activations cannot be measured without running a forward pass, so they are estimated
   analytically from the layer shapes, the AC mode, seq_len and the local batch (the
   formula is in `docs/dry_run.md`); the output says which numbers are measured on the meta
   model and which are estimated.

`run_dry(run, world_size, gpu)` returns the exit code for `python -m train --dry-run`:
0 when the plan fits the chosen GPU, 1 when it does not. User errors raise `ValueError`.
This module plans and reports; it holds no rule and no mapping of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3

# Activations are kept in the FSDP mixed-precision dtype; the master weights, their
# gradients and both AdamW moments stay in fp32 (torchtitan's `training.dtype`).
BYTES_ACTIVATION = 2
# What the CUDA context, NCCL buffers and allocator fragmentation typically take: a plan
# must leave this share of the card free to count as fitting.
HEADROOM_FRACTION = 0.10


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    source: str


def _host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


# Capacities as sold (HBM is built in GiB-sized stacks); `nvidia-smi` shows slightly less
# (e.g. 81559 MiB on an H100 80GB), which the 10% headroom absorbs.
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 SXM5 80GB", 80.0, "NVIDIA H100 datasheet (80 GB HBM3)"),
    "h200": GpuSpec("NVIDIA H200 SXM 141GB", 141.0, "NVIDIA H200 datasheet (141 GB HBM3e)"),
    "a100": GpuSpec("NVIDIA A100 SXM4 80GB", 80.0, "NVIDIA A100 datasheet (80 GB HBM2e)"),
    "b200": GpuSpec("NVIDIA B200 180GB", 180.0, "NVIDIA DGX B200 datasheet (1,440 GB over 8 GPUs)"),
    "cpu": GpuSpec("this machine's RAM", _host_memory_gib(), "os.sysconf physical pages"),
}


@dataclass
class MemoryBreakdown:
    """Bytes per GPU (rank 0) for each consumer."""

    parameters: int
    gradients: int
    optimizer: int
    fsdp_buffers: int
    activations: int
    loss_chunk: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


@dataclass
class DryRunReport:
    world_size: int
    degrees: dict[str, int]
    gpu: GpuSpec
    num_params: int
    num_flops_per_token: int
    num_local_params: int
    num_float8_linears: int
    num_fsdp_modules: int
    num_ac_wrapped_blocks: int
    ac_mode: str
    spmd_backend: str
    memory: MemoryBreakdown
    notes: list[str] = field(default_factory=list)

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_gib * GIB * (1.0 - HEADROOM_FRACTION)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    def format(self) -> str:
        m = self.memory
        degrees = " x ".join(f"{k}={v}" for k, v in self.degrees.items())
        rows = [
            ("parameters (fp32 shards, measured)", m.parameters),
            ("gradients (fp32 shards, measured)", m.gradients),
            ("optimizer AdamW 2 x fp32 (measured)", m.optimizer),
            ("FSDP all-gather/reduce buffers (est.)", m.fsdp_buffers),
            (f"activations, AC={self.ac_mode} (est.)", m.activations),
            ("lm_head + loss chunk (est.)", m.loss_chunk),
        ]
        lines = [
            f"world size {self.world_size}: {degrees} (spmd_backend={self.spmd_backend})",
            f"parameters: {self.num_params:,} ({self.num_params / 1e9:.2f}B); "
            f"per GPU {self.num_local_params:,}",
            f"FLOPs per token: {self.num_flops_per_token:,} "
            f"({self.num_flops_per_token / 1e9:.1f} GFLOP)",
            f"plan applied on meta: {self.num_float8_linears} Float8Linear, "
            f"{self.num_fsdp_modules} FSDP units, {self.num_ac_wrapped_blocks} AC-wrapped blocks",
            "per-GPU memory (rank 0):",
        ]
        lines += [f"  {name:<40} {value / GIB:9.2f} GiB" for name, value in rows]
        lines.append(f"  {'total':<40} {m.total / GIB:9.2f} GiB")
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        lines.append(
            f"{verdict} {self.gpu.name}: {self.gpu.memory_gib:.0f} GiB "
            f"({self.gpu.source}), {self.usable_bytes / GIB:.1f} GiB usable after "
            f"{HEADROOM_FRACTION:.0%} headroom"
        )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------- planning


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A process group of `world_size` ranks whose collectives do nothing (we are rank 0)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "dry run needs a fresh process (no process group yet)"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layer_shapes(model: Any) -> dict[str, int]:
    """Widths the activation estimate needs, read off the (unsharded) meta model."""
    import torch.nn as nn

    block = model.layers["0"]
    qkv = sum(
        m.out_features
        for name, m in block.attention.named_modules()
        if isinstance(m, nn.Linear) and not name.endswith("wo")
    )
    return {
        "dim": model.tok_embeddings.weight.shape[1],
        "vocab": model.tok_embeddings.weight.shape[0],
        "n_layers": len(model.layers),
        "qkv_width": qkv,
        "ffn_hidden": block.feed_forward.w1.out_features,
        "block_params": sum(p.numel() for p in block.parameters()),
        "lm_head_params": model.lm_head.weight.numel(),
    }


def activation_bytes_per_token_per_layer(shapes: dict[str, int], ac_mode: str) -> int:
    """Saved-for-backward bytes of one Llama block per token (bf16), see docs/dry_run.md.

    none:      norm inputs 2h + linear inputs 2h + q,k,v (qkv) + attention out h
               + FFN: w1 out, w3 out, silu(w1 out), w1*w3 (4f)      = 6h + qkv + 4f values
    selective: block input h + saved matmul/attention outputs (every other mm: qkv, w1,
               w2; plus the attention output)                        = 3h + qkv + f values
    full:      block input only                                      = h values
    """
    h, qkv, f = shapes["dim"], shapes["qkv_width"], shapes["ffn_hidden"]
    values = {"none": 6 * h + qkv + 4 * f, "selective": 3 * h + qkv + f, "full": h}[ac_mode]
    return values * BYTES_ACTIVATION


def estimate_activations(
    shapes: dict[str, int], ac_mode: str, tokens_per_gpu: int, tp: int, sp: bool
) -> int:
    """All blocks' saved activations plus one block recomputed during backward (AC)."""
    per_layer = activation_bytes_per_token_per_layer(shapes, ac_mode) * tokens_per_gpu
    # With sequence parallelism every saved tensor is split over tp; without it the norm
    # and residual tensors are replicated, which we conservatively do not split.
    per_layer //= tp if (sp or tp == 1) else 1
    total = per_layer * shapes["n_layers"]
    if ac_mode != "none":
        total += activation_bytes_per_token_per_layer(shapes, "none") * tokens_per_gpu // tp
    return total


def plan(run: Any, world_size: int, gpu: str) -> DryRunReport:
    """Build, convert and parallelize `run`'s model on meta, as the trainer would on `gpu`."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims

    from train.build import to_trainer_config
    from train.config import check_launch

    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not known; choose one of {', '.join(GPUS)}")
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    check_launch(run, world_size)
    # the trainer's own config, with "auto" resolved for the target device
    tt_config = to_trainer_config(run, world_size, accelerator=gpu != "cpu")
    notes: list[str] = []
    if run.parallelism.spmd_backend == "auto":
        notes.append(
            f"parallelism.spmd_backend=auto resolves to {tt_config.parallelism.spmd_backend}"
        )
    spec = tt_config.model_spec
    parallelism = tt_config.parallelism
    training = tt_config.training

    with fake_world(world_size):
        parallel_dims = ParallelDims.from_config(parallelism, world_size)
        parallel_dims.build_mesh()
        model_config = spec.model
        model_config.update_from_config(config=tt_config)
        with torch.device("meta"), _default_dtype(TORCH_DTYPE_MAP[training.dtype]):
            model = model_config.build()
        num_params, num_flops_per_token = model_config.get_nparams_and_flops(
            model, training.seq_len
        )
        shapes = _layer_shapes(model)
        model = _parallelize(spec, model, parallel_dims, tt_config)

        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        num_local_params = sum(t.numel() for t in local)
        param_bytes = sum(t.numel() * t.element_size() for t in local)
        num_float8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        num_fsdp = sum(isinstance(m, FSDPModule) for m in model.modules())
        num_ac = sum("Checkpoint" in type(b).__name__ for b in model.layers.values())
        degrees = {
            "dp_replicate": parallel_dims.dp_replicate,
            "dp_shard": parallel_dims.dp_shard,
            "tp": parallel_dims.tp,
            "cp": parallel_dims.cp,
        }

    ac_mode = run.activation_checkpoint.mode
    tp, cp = degrees["tp"], degrees["cp"]
    sp = parallelism.enable_sequence_parallel
    tokens_per_gpu = training.local_batch_size * training.seq_len // cp
    compute_bytes = TORCH_DTYPE_MAP[training.mixed_precision_param].itemsize
    # FSDP2 holds the unsharded bf16 params of the current and the prefetched unit, and the
    # unsharded fp32 gradient of one unit before its reduce-scatter; the largest unit is a
    # transformer block or the lm_head (kept unsharded across the chunked loss).
    largest_unit = max(shapes["block_params"], shapes["lm_head_params"]) // tp
    fsdp_buffers = largest_unit * (2 * compute_bytes + 4)
    # ChunkedLossWrapper: one chunk of logits in bf16, its fp32 upcast and fp32 gradient,
    # vocab-sharded under TP (loss parallel), plus the fp32 hidden-state gradient.
    num_chunks = getattr(tt_config.loss, "num_chunks", 1)
    vocab_local = shapes["vocab"] // tp
    loss_chunk = tokens_per_gpu * vocab_local * (2 + 4 + 4) // num_chunks
    loss_chunk += tokens_per_gpu * shapes["dim"] * 4
    notes.append(
        "activations are estimated analytically (no forward pass runs on meta); "
        "see docs/dry_run.md for the formula"
    )
    memory = MemoryBreakdown(
        parameters=param_bytes,
        gradients=param_bytes,
        optimizer=2 * param_bytes,
        fsdp_buffers=fsdp_buffers,
        activations=estimate_activations(shapes, ac_mode, tokens_per_gpu, tp, sp),
        loss_chunk=loss_chunk,
    )
    return DryRunReport(
        world_size=world_size,
        degrees=degrees,
        gpu=GPUS[gpu],
        num_params=num_params,
        num_flops_per_token=num_flops_per_token,
        num_local_params=num_local_params,
        num_float8_linears=num_float8,
        num_fsdp_modules=num_fsdp,
        num_ac_wrapped_blocks=num_ac,
        ac_mode=ac_mode,
        spmd_backend=parallelism.spmd_backend,
        memory=memory,
        notes=notes,
    )


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _parallelize(spec: Any, model: Any, parallel_dims: Any, tt_config: Any) -> Any:
    return spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=tt_config.training,
        parallelism=tt_config.parallelism,
        compile_config=tt_config.compile,
        ac_config=tt_config.activation_checkpoint,
        dump_folder=tt_config.dump_folder,
    )


def run_dry(run: Any, world_size: int, gpu: str) -> int:
    """`python -m train --dry-run`: print the plan; 0 if it fits `gpu`, 1 if it does not.

    The caller has run `train.__main__.prepare_runtime()` (as every entry point does)."""
    report = plan(run, world_size, gpu)
    print(report.format(), flush=True)
    return 0 if report.fits else 1
