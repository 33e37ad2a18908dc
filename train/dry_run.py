"""Plan a training run without GPUs: does this config fit, and how is it laid out?

Why: a 70B FP8 job that dies after queueing for a day on 64 GPUs because the degrees do not
multiply to the world size, or because the first checkpoint save does not fit an H100, is
an expensive way to learn arithmetic. This planner answers on a laptop, by *running* what
rank 0 of the real job runs, on tensors that hold no memory.

How (torchtitan's own `scripts/estimate/estimation.py` is the anchor: FakeTensorMode and
torch's memory tracker on a fake process group):
1. `train.launch_rules.check_launch` (the rules a real launch checks, one message each) and
   `train.build.to_trainer_config` (the trainer's own config, "auto" resolved for the
   target GPU).
2. A fake process group (`torch.testing._internal.distributed.fake_pg`, backend "fake") of
   the requested world size: meshes, DTensor placements and FSDP sharding are those of
   rank 0 of the real job; collectives move nothing.
3. The model is built on meta and handed to the spec's real `parallelize_fn` (FP8
   conversion, TP/SP, AC, FSDP2), then materialised as fake tensors (FakeTensorMode).
4. One training step runs as the trainer runs it: `Trainer.post_dataloading_process` and
   `Trainer._forward_backward_body` (forward, chunked loss, backward), torchtitan's
   `clip_grad_norm_`, the optimizer's step; then torchtitan's checkpoint `ModelWrapper`
   caches the model state dict (held for the whole run) and is asked for it again (a save).
   torch's `MemTracker` (`torch.distributed._tools`) measures every allocation of rank 0;
   a dispatch mode counts FLOPs (torch's flop formulas) and the bytes of each collective.
5. Layers are identical (the same FSDP unit, TP plan and AC wrapper), so a model of more
   than `TRACED_LAYERS` (3) layers is traced at 2 and 3 layers and every count is extended
   linearly: count(n) = count(3) + (n - 3) * (count(3) - count(2)). The output says so.
   tests/train/test_dry_run.py checks this against tracing all layers.

What differs from the GPU run, and why (also in docs/dry_run.md): the step runs eagerly
(torch.compile cannot trace fake tensors here; compiled kernels fuse and save less, so the
eager peak is an upper bound), and attention is traced as SDPA without the document mask
(FlexAttention's compiled kernel cannot run under FakeTensorMode; both save the output and
the log-sum-exp, never the L x L scores). Under context parallelism the same goes for the
block mask CP shards (a compiled create_block_mask); the K/V all-gather and its backward
reduce-scatter run and are counted.

`run_dry(run, world_size, gpu)` returns the exit code for `python -m train --dry-run`:
0 when the plan fits the chosen GPU, 1 when it does not. User errors raise `ValueError`.
This module plans and reports; it holds no rule and no mapping of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3

# Models deeper than this are traced at this many layers and one fewer, and extended
# linearly (module doc). Not 1 and 2: with one block, FSDP prefetches the output norm and
# lm_head where a deeper model prefetches the next block, so one block is not "a layer".
TRACED_LAYERS = 3
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
class StepCounts:
    """What one traced training step holds and does on rank 0 (bytes, FLOPs, counts).

    Every field is a count that grows linearly with the number of identical layers, so
    `extend` can carry a trace of few layers to the whole model."""

    layers: int
    num_params: int
    num_flops_per_token: int
    num_local_params: int
    num_float8_linears: int
    num_fsdp_modules: int
    num_ac_wrapped_blocks: int
    parameters: int
    gradients: int
    optimizer: int
    # MemTracker peaks: forward + backward + clipping (params, grads, activations, FSDP
    # buffers, temporaries), and the optimizer step (params, states, temporaries; + grads)
    peak_forward_backward: int
    peak_optimizer_step: int
    state_dict_cache: int  # what ModelWrapper's cache holds beyond the parameters
    state_dict_refresh: int  # what a save's `ModelWrapper.state_dict()` allocates on top
    host_staging: int  # pinned host copy an async save stages (model + optimizer state)
    flops: int  # executed in the step (AC recompute included)
    comm: dict[str, int] = field(default_factory=dict)  # "kind dtype" -> bytes

    def extend(self, fewer: StepCounts, layers: int) -> StepCounts:
        """count(layers) = count(self) + (layers - self.layers) * per-layer difference."""
        step = self.layers - fewer.layers
        assert step > 0 and layers >= self.layers

        def scale(a: int, b: int) -> int:
            per_layer, rest = divmod(a - b, step)
            assert rest == 0, "identical layers must cost the same"
            return a + (layers - self.layers) * per_layer

        values = {
            f.name: scale(getattr(self, f.name), getattr(fewer, f.name))
            for f in dataclasses.fields(self)
            if f.name not in ("layers", "comm")
        }
        comm = {k: scale(v, fewer.comm.get(k, 0)) for k, v in self.comm.items()}
        return StepCounts(layers=layers, comm=comm, **values)


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


@dataclass
class DryRunReport:
    world_size: int
    degrees: dict[str, int]
    gpu: GpuSpec
    ac_mode: str
    spmd_backend: str
    local_batch_size: int
    seq_len: int
    counts: StepCounts
    traced_layers: int
    memory: MemoryBreakdown
    save_peak: int
    notes: list[str] = field(default_factory=list)

    @property
    def num_params(self) -> int:
        return self.counts.num_params

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_gib * GIB * (1.0 - HEADROOM_FRACTION)

    @property
    def peak(self) -> int:
        return max(self.memory.total, self.save_peak)

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable_bytes

    def to_dict(self) -> dict:
        """The plan as plain data (benchmarks and tests read it; bytes, FLOPs, counts)."""
        return {
            "world_size": self.world_size,
            "degrees": self.degrees,
            "gpu": self.gpu.name,
            "counts": dataclasses.asdict(self.counts),
            "traced_layers": self.traced_layers,
            "memory": {**dataclasses.asdict(self.memory), "total": self.memory.total},
            "save_peak": self.save_peak,
            "peak": self.peak,
            "usable_bytes": int(self.usable_bytes),
            "fits": self.fits,
        }

    def format(self) -> str:
        c, m = self.counts, self.memory
        degrees = " x ".join(f"{k}={v}" for k, v in self.degrees.items())
        scaled = (
            f"traced at {self.traced_layers - 1} and {self.traced_layers} layers, "
            f"extended linearly to {c.layers}"
            if self.traced_layers < c.layers
            else f"all {c.layers} layers traced"
        )
        lines = [
            f"world size {self.world_size}: {degrees} (spmd_backend={self.spmd_backend})",
            f"parameters: {c.num_params:,} ({c.num_params / 1e9:.2f}B); "
            f"per GPU {c.num_local_params:,}",
            f"FLOPs per token: {c.num_flops_per_token:,} "
            f"({c.num_flops_per_token / 1e9:.1f} GFLOP, torchtitan's MFU formula)",
            f"plan applied: {c.num_float8_linears} Float8Linear, {c.num_fsdp_modules} FSDP "
            f"units, {c.num_ac_wrapped_blocks} AC-wrapped blocks (AC={self.ac_mode})",
            f"one step measured on fake tensors ({scaled}), local batch "
            f"{self.local_batch_size} x seq {self.seq_len}:",
            f"  {'FLOPs per GPU (executed, AC recompute included)':<44} "
            f"{c.flops / 1e12:9.1f} TFLOP",
        ]
        for kind in sorted(c.comm):
            lines.append(f"  {kind:<44} {c.comm[kind] / GIB:9.2f} GiB")
        lines.append("per-GPU memory (rank 0, MemTracker):")
        rows = [
            ("parameters (sharded)", m.parameters),
            ("gradients (sharded)", m.gradients),
            ("optimizer state", m.optimizer),
            ("checkpoint state-dict cache", m.state_dict_cache),
            ("activations + FSDP/TP buffers + temps", m.activations),
        ]
        lines += [f"  {name:<44} {value / GIB:9.2f} GiB" for name, value in rows]
        lines.append(f"  {'total (training-step peak)':<44} {m.total / GIB:9.2f} GiB")
        lines.append(f"  {'checkpoint-save peak':<44} {self.save_peak / GIB:9.2f} GiB")
        lines.append(
            f"  {'host: async-save staging copy (pinned RAM)':<44} {c.host_staging / GIB:9.2f} GiB"
        )
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        lines.append(
            f"{verdict} {self.gpu.name}: peak {self.peak / GIB:.1f} GiB of "
            f"{self.gpu.memory_gib:.0f} GiB ({self.gpu.source}), "
            f"{self.usable_bytes / GIB:.1f} GiB usable after {HEADROOM_FRACTION:.0%} headroom"
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


def traced_config(run: Any) -> Any:
    """`run` as the traced step runs it: eager, attention as plain causal SDPA.

    torch.compile and FlexAttention's compiled kernel cannot run on fake tensors; SDPA and
    FlexAttention save the same tensors for backward (output and log-sum-exp)."""
    import copy

    run = copy.deepcopy(run)
    run.model.attention = "sdpa"
    run.compile.enable = False
    run.compile.async_tp = False
    return run


_PROPAGATING = [0]


class _ShardingPropagation:
    """Stands in for DTensor's `ShardingPropagator._fake_mode_lock`, which wraps exactly the
    fake run of an op at *global* shape that DTensor makes to learn its output's metadata.
    Under our FakeTensorMode that run would be counted as memory and FLOPs; the trackers
    skip ops while it is entered."""

    def __enter__(self) -> None:
        _PROPAGATING[0] += 1

    def __exit__(self, *exc: object) -> None:
        _PROPAGATING[0] -= 1


@contextlib.contextmanager
def _sharding_propagation_not_counted() -> Iterator[None]:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    previous = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = _ShardingPropagation()
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = previous


def _mem_tracker() -> Any:
    """torch's MemTracker, with two accommodations for torchtitan's step: DTensor's shape
    propagation is skipped (see `_ShardingPropagation`), and a module called again in one
    forward (the chunked loss calls lm_head once per chunk) keeps its first call's stats
    instead of raising "multiple iterative calls" (only the per-module table is affected;
    every allocation is still counted)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor

    class StepMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                return
            super()._pre_fw_hook(module, inputs)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _PROPAGATING[0] and not any(t is DTensor for t in types):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def peak_bytes(self) -> int:
            return sum(snap["Total"] for snap in self.get_tracker_snapshot("peak").values())

        def current_bytes(self) -> int:
            return sum(snap["Total"] for snap in self.get_tracker_snapshot().values())

    return StepMemTracker()


def _collective_kind(namespace: str, name: str) -> str | None:
    """FSDP2's collectives reach c10d ops (its all-gather through a functional collective
    that runs one); DTensor's (TP/SP redistributions, loss parallel, the gradient-norm
    reduction) stay functional collectives. Other namespaces are local ops (FSDP's
    `fsdp::all_gather_copy_in` only copies). Context parallelism's K/V exchange is one
    custom op each way (torch's `cplib::flex_cp_allgather`, and its backward's
    reduce-scatter of the K/V gradients), whose collectives run inside the op, unseen."""
    if namespace == "cplib":
        return {
            "flex_cp_allgather": "CP all-gather (K, V)",
            "flex_cp_allgather_backward": "CP reduce-scatter (dK, dV)",
        }.get(name)
    if namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
        return None
    for op, label in (
        ("allgather", "all-gather"),
        ("all_gather", "all-gather"),
        ("reduce_scatter", "reduce-scatter"),
        ("allreduce", "all-reduce"),
        ("all_reduce", "all-reduce"),
        ("all_to_all", "all-to-all"),
        ("alltoall", "all-to-all"),
        ("broadcast", "broadcast"),
    ):
        if name.startswith(op) or name.startswith("_" + op):
            return f"{'FSDP' if namespace == 'c10d' else 'DTensor'} {label}"
    return None


def _step_counter() -> Any:
    """FLOPs (torch's own flop formulas, `torch.utils.flop_counter`) and bytes per
    collective kind and dtype. Bytes are the larger of a collective's input and output: the
    gathered buffer of an all-gather, the reduced input of a reduce-scatter."""
    import torch
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class StepCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.flops = 0
            self.comm: dict[str, int] = {}
            self._open: list[bool] = []  # collectives being run: did one run inside?

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented  # count the local ops DTensor runs
            kwargs = kwargs or {}
            packet = func._overloadpacket
            kind = _collective_kind(func.namespace, packet.__name__)
            if kind is not None:
                self._open.append(False)
            out = func(*args, **kwargs)
            if _PROPAGATING[0]:
                if kind is not None:
                    self._open.pop()
                return out
            if packet in flop_registry:
                self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
            if kind is None:
                return out
            # FSDP2's all-gather is a functional collective that runs the c10d one inside:
            # count the innermost collective once
            ran_inner = self._open.pop()
            if self._open:
                self._open[-1] = True
            if ran_inner:
                return out
            sizes = {
                id(t): (t.numel() * t.element_size(), t.dtype)
                for t in pytree.tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor)
            }
            if sizes and func.namespace == "cplib":  # K and V at once: gathered or reduced
                gathered = out if packet.__name__ == "flex_cp_allgather" else args[:2]
                nbytes = sum(t.numel() * t.element_size() for t in gathered)
                key = f"{kind} {str(gathered[0].dtype).removeprefix('torch.')}"
                self.comm[key] = self.comm.get(key, 0) + nbytes
            elif sizes:
                nbytes, dtype = max(sizes.values(), key=lambda s: s[0])
                key = f"{kind} {str(dtype).removeprefix('torch.')}"
                self.comm[key] = self.comm.get(key, 0) + nbytes
            return out

    return StepCounter()


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def trace_step(run: Any, world_size: int, accelerator: bool, fake: bool = True) -> StepCounts:
    """Build `run`'s model as the trainer does and run one training step on rank 0.

    `fake`: on fake tensors under a process group the caller opened (the plan: a fake one;
    nothing is allocated). Otherwise on real tensors in the caller's real process group (the
    tracker-vs-reality test runs this on 2 gloo ranks)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from train.build import to_trainer_config
    from train.trainer import RunTrainer

    tt_config = to_trainer_config(run, world_size, accelerator=accelerator)
    spec, training = tt_config.model_spec, tt_config.training
    # what Trainer.__init__ does before it builds anything
    dist_utils.set_spmd_backend(tt_config.parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(tt_config.parallelism, world_size)
    parallel_dims.build_mesh()
    model_config = spec.model
    model_config.update_from_config(config=tt_config)
    # Built and parallelized on meta outside FakeTensorMode: FSDP builds device meshes,
    # which cannot be made of fake tensors (torchtitan's estimation script does the same).
    with torch.device("meta"), _default_dtype(TORCH_DTYPE_MAP[training.dtype]):
        model = model_config.build()
    num_params, num_flops_per_token = model_config.get_nparams_and_flops(model, training.seq_len)
    model = _parallelize(spec, model, parallel_dims, tt_config)
    num_float8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    num_fsdp = sum(isinstance(m, FSDPModule) for m in model.modules())
    num_ac = sum("Checkpoint" in type(b).__name__ for b in model.layers.values())

    device = torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with fake_mode, _sharding_propagation_not_counted():
        model.to_empty(device=device)
        if not fake:
            with torch.no_grad():
                model.init_weights(buffer_device=None)
        model.train()
        loss_fn = tt_config.loss.build(compile_config=tt_config.compile)
        loss_fn.set_lm_head(model.lm_head)  # as Trainer.__init__ does
        model._skip_lm_head = True
        optimizers = tt_config.optimizer.build(model_parts=[model])

        # a trainer holding only what its step reads: the step is torchtitan's own code
        trainer = RunTrainer.__new__(RunTrainer)
        trainer.model_parts, trainer.loss_fn, trainer.model_config = [model], loss_fn, model_config
        if parallel_dims.cp_enabled:
            # CP shards FlexAttention's block mask with a compiled create_block_mask, which
            # cannot run on fake tensors; traced without the mask (it changes no activation
            # size, as for the document mask below), CP still shards tokens, labels and
            # positions, and each attention still all-gathers K and V (counted as "CP ...")
            trainer.model_config = None
        trainer.parallel_dims, trainer.config, trainer.device = parallel_dims, tt_config, device
        trainer.ntokens_seen = 0
        trainer.train_context = dist_utils.get_spmd_context(
            parallel_dims=parallel_dims, spmd_typechecking=False
        )
        shape = (training.local_batch_size, training.seq_len)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, run.model.vocab_size, shape, generator=generator)
        labels = torch.randint(0, run.model.vocab_size, shape, generator=generator)
        # what the loader yields beside the tokens (dataloader/loader.py): positions, which
        # restart at document starts; context parallel shards them with the tokens
        positions = torch.arange(training.seq_len).expand(shape).contiguous()
        params = list(model.parameters())

        counter = _step_counter()
        tracker = _mem_tracker()
        tracker.track_external(model, tokens, labels)
        with tracker, counter:
            inputs, labels, extra = trainer.post_dataloading_process(
                {"input": tokens, "positions": positions}, labels
            )
            valid_tokens = torch.tensor(labels.numel(), dtype=torch.int64)
            trainer._forward_backward_body(inputs, labels, valid_tokens, extra)
            dist_utils.clip_grad_norm_(params, training.max_norm, foreach=True)
        peak_forward_backward = tracker.peak_bytes()
        gradients = _local_bytes(p.grad for p in params if p.grad is not None)

        step_tracker = _mem_tracker()
        step_tracker.track_external(model)
        with step_tracker, counter:
            optimizers.step()
        peak_optimizer_step = step_tracker.peak_bytes() + gradients
        optimizer = _local_bytes(
            v
            for opt in optimizers.optimizers
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )

        # the checkpointer's model state dict: built once, held for the run, refreshed in
        # place at every save (torchtitan components/checkpointer/base.py ModelWrapper)
        # (its storage-sharing check reads data pointers, which fake tensors warn about;
        # a refresh copies in place either way, so what it allocates is what it builds)
        cache_tracker, save_tracker = _mem_tracker(), _mem_tracker()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer")
            with cache_tracker:
                wrapper = ModelWrapper([model])
            with save_tracker:
                wrapper.state_dict()
        state_dict_cache = cache_tracker.current_bytes()
        state_dict_refresh = save_tracker.peak_bytes()
        host_staging = _local_bytes(
            v for v in wrapper.cached_state_dict.values() if isinstance(v, torch.Tensor)
        )
        del wrapper

    parameters = _local_bytes(params)
    return StepCounts(
        layers=run.model.n_layers,
        num_params=num_params,
        num_flops_per_token=num_flops_per_token,
        num_local_params=sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in params
        ),
        num_float8_linears=num_float8,
        num_fsdp_modules=num_fsdp,
        num_ac_wrapped_blocks=num_ac,
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        peak_forward_backward=peak_forward_backward,
        peak_optimizer_step=peak_optimizer_step,
        state_dict_cache=state_dict_cache,
        state_dict_refresh=state_dict_refresh,
        host_staging=host_staging + optimizer,
        flops=int(counter.flops),
        comm=dict(counter.comm),
    )


def measure(run: Any, world_size: int, accelerator: bool, traced_layers: int) -> StepCounts:
    """`trace_step` on a fake world: all layers, or `traced_layers` - 1 and `traced_layers`
    extended to all."""
    import copy

    def trace(n_layers: int) -> StepCounts:
        shallow = copy.deepcopy(run)
        shallow.model.n_layers = n_layers
        with fake_world(world_size):
            return trace_step(shallow, world_size, accelerator)

    n_layers = run.model.n_layers
    if n_layers <= traced_layers:
        return trace(n_layers)
    return trace(traced_layers).extend(trace(traced_layers - 1), n_layers)


def memory_of(counts: StepCounts) -> tuple[MemoryBreakdown, int]:
    """The step peak by consumer, and the checkpoint-save peak.

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


def plan(run: Any, world_size: int, gpu: str, traced_layers: int = TRACED_LAYERS) -> DryRunReport:
    """Measure one step of `run` at `world_size` on fake tensors, as the trainer on `gpu`."""
    from train.build import to_trainer_config
    from train.launch_rules import check_launch

    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not known; choose one of {', '.join(GPUS)}")
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    degrees = check_launch(run, world_size)
    accelerator = gpu != "cpu"
    tt_config = to_trainer_config(run, world_size, accelerator=accelerator)
    notes: list[str] = []
    if run.parallelism.spmd_backend == "auto":
        notes.append(
            f"parallelism.spmd_backend=auto resolves to {tt_config.parallelism.spmd_backend}"
        )
    traced = traced_config(run)
    if run.compile.enable or traced.model.attention != run.model.attention:
        notes.append(
            "traced eagerly with attention as causal SDPA (compile and FlexAttention "
            "cannot run on fake tensors; docs/dry_run.md)"
        )
    if run.parallelism.cp > 1:
        notes.append(
            "context parallel: K/V all-gather and its backward reduce-scatter traced and "
            "counted; the sharded block mask (int32 block indices, a few MiB at 128K) "
            "is not built (docs/dry_run.md)"
        )
    counts = measure(traced, world_size, accelerator, traced_layers)
    memory, save_peak = memory_of(counts)
    p = tt_config.parallelism
    return DryRunReport(
        world_size=world_size,
        degrees={
            "dp_replicate": p.data_parallel_replicate_degree,
            "dp_shard": degrees.get("dp_shard", p.data_parallel_shard_degree),
            "tp": p.tensor_parallel_degree,
            "cp": p.context_parallel_degree,
        },
        gpu=GPUS[gpu],
        ac_mode=run.activation_checkpoint.mode,
        spmd_backend=p.spmd_backend,
        local_batch_size=tt_config.training.local_batch_size,
        seq_len=tt_config.training.seq_len,
        counts=counts,
        traced_layers=min(traced_layers, run.model.n_layers),
        memory=memory,
        save_peak=save_peak,
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
