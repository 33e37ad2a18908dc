"""The planner's tracer: one training step of rank 0, run on fake tensors, counted.

Why trace instead of a formula: a formula for memory, FLOPs and traffic of a torchtitan step
restates the trainer (FSDP2's buffers, the FP8 casts, what activation checkpointing keeps,
the chunked loss, the K/V exchange of context parallelism), and drifts from it with each
upstream release. Running the step itself on tensors that hold no memory cannot drift: the
counts are those of the code that will run.

Why through the trainer's own constructor: the traced trainer is built by the constructor a
launch runs (`RunTrainer.__init__`, which runs torchtitan's `Trainer.__init__`: meshes,
model on meta, `parallelize_fn`, materialisation, loss, optimizers, schedulers, metrics),
from the config `train.build.to_trainer_config` makes for the launch. An attribute the step
starts to read is set by that constructor, so the plan keeps working without a copy of it
here. What the plan changes is the config, never a method of a built object:

- torchtitan's own dry-run comm mode (`comm.mode = "fake_backend"`): a fake process group of
  the real world size; we are rank 0, collectives move nothing.
- the components that read or write files are stand-ins: a tokenizer that only knows the
  vocabulary size, a loader of random tokens and positions (`PlanBatches`),
  checkpointing, validation and TensorBoard off, the run folder a temporary one.
- every parameter's initialiser is torchtitan's `skip_param_init` (values are not planned:
  torch's truncated-normal initialiser reads the values it draws, which fake tensors do
  not have).
- eager (`traced_config`), and attention is `PlanAttention`: torch.compile and
  FlexAttention's compiled kernel cannot run on fake tensors. It runs torch's SDPA,
  causal, without the document mask (which changes no tensor's size), and saves what
  FlexAttention saves for backward (output and log-sum-exp); being a FlexAttention module
  whose config is not FlexAttention's, context parallelism all-gathers its K and V as a
  launch does, and the trainer builds no block mask (a compiled `create_block_mask`,
  which cannot run on fake tensors; a few MiB of int32 indices). Selective AC saves the
  CPU SDPA op as torchtitan's policy saves the GPU attention ops (`PlannedSelectiveAC`:
  torch's list of compute-intensive ops names the CUDA flash op, not its CPU twin).
- `PlannedTrainer` overrides one torchtitan hook, `init_distributed`, to build the device
  meshes on real (CPU) tensors, and the spec's `parallelize_fn` runs with fake mode paused:
  a DeviceMesh computes rank coordinates from tensor values, which fake tensors do not
  hold. The model is still on meta there, exactly as in a launch.
- `_host_objects_exchanged_for_real`: `torch.distributed`'s object collectives pickle host
  objects into tensors; under fake mode those tensors lose their values, so the objects
  are exchanged on real tensors (the fake group copies rank 0's in). Today that is
  `train.health`'s exchange of host names at construction; gathering them lazily would
  retire this.

How it counts (rank 0): torch's `MemTracker` measures every allocation; `StepCounter`, a
dispatch mode, sees every op below DTensor and the FP8 tensor subclasses and counts
GEMM FLOPs by dtype (torch's formulas), attention FLOPs as the GPU kernel executes them
(`attention_flops`: causal blocks only, backward 2.5x forward, CP's share per rank),
the bytes every other non-view op reads and writes (memory-bound traffic), and the bytes
and calls of each collective by mesh dimension (the group's ranks say which links it
crosses). A micro-batch (`forward_backward_step`) is counted apart from what runs once per
optimizer step (gradient clipping and the optimizer step), so a step is
`accumulation x micro + once`, with torchtitan's own accumulation count
(`Trainer.gradient_accumulation_steps`).

Layers are identical (the same FSDP unit, TP plan and AC wrapper), so a model of more than
`TRACED_LAYERS` layers is traced at 2 and 3 layers and every count is extended linearly
(`StepCounts.extend`); tests/train/test_dry_run.py checks this against tracing all layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3

# Models deeper than this are traced at this many layers and one fewer, and extended
# linearly. Not 1 and 2: with one block, FSDP prefetches the output norm and lm_head where a
# deeper model prefetches the next block, so one block is not "a layer".
TRACED_LAYERS = 3

# FlexAttention's default sparse block (torch.nn.attention.flex_attention
# _DEFAULT_SPARSE_BLOCK_SIZE); FlashAttention's tiles are as large. A causal kernel computes
# the blocks on and below the diagonal.
ATTENTION_BLOCK = 128


def attention_flops(
    batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, backward: bool = False
) -> int:
    """FLOPs a causal attention kernel executes (FlexAttention with its block mask, or
    FlashAttention with is_causal): 2 GEMMs of 2*d per (query, key) pair forward (QK^T,
    PV) and 5 backward (S recomputed, dP, dV, dQ, dK), over the causal blocks only.

    `q_len < kv_len` is context parallelism: this rank's queries (two load-balanced chunks)
    against the gathered keys; it computes 1/cp of the causal blocks of the whole sequence.
    One document per sequence: a packed batch's document mask skips more blocks (the plan
    does not know the documents; this is the bound the published runs, causal SDPA, match).
    """
    blocks = -(-kv_len // ATTENTION_BLOCK)
    causal_pairs = ATTENTION_BLOCK**2 * blocks * (blocks + 1) // 2
    pairs = causal_pairs * q_len // kv_len
    gemms = 5 if backward else 2
    return gemms * 2 * batch * heads * head_dim * pairs


@dataclass
class OpCounts:
    """What one phase of the step does on rank 0; each dict grows linearly with layers.

    flops: "gemm bfloat16", "gemm float8", "attention", ... -> FLOPs executed
    memory_bytes: bytes read + written by ops that are neither GEMMs, attention nor
        collectives (elementwise, norms, casts, copies, the loss, the optimizer's foreach
        ops), eager: torch.compile fuses part of them
    comm: "MESH KIND DTYPE" -> bytes (the gathered buffer of an all-gather, the input of a
        reduce-scatter, the tensor of an all-reduce); comm_calls: the same keys -> calls
    """

    flops: dict[str, int] = field(default_factory=dict)
    memory_bytes: dict[str, int] = field(default_factory=dict)
    comm: dict[str, int] = field(default_factory=dict)
    comm_calls: dict[str, int] = field(default_factory=dict)

    def add(self, table: str, key: str, value: int) -> None:
        counts = getattr(self, table)
        counts[key] = counts.get(key, 0) + int(value)

    def scaled(self, factor: int) -> OpCounts:
        return OpCounts(
            **{
                f.name: {k: v * factor for k, v in getattr(self, f.name).items()}
                for f in dataclasses.fields(self)
            }
        )

    def plus(self, other: OpCounts) -> OpCounts:
        merged = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            merged[f.name] = {k: mine.get(k, 0) + theirs.get(k, 0) for k in {*mine, *theirs}}
        return OpCounts(**merged)

    def extend(self, fewer: OpCounts, step: int, more_layers: int) -> OpCounts:
        out = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(fewer, f.name)
            out[f.name] = {
                k: _extend(mine.get(k, 0), theirs.get(k, 0), step, more_layers)
                for k in {*mine, *theirs}
            }
        return OpCounts(**out)


def _extend(a: int, b: int, step: int, more_layers: int) -> int:
    per_layer, rest = divmod(a - b, step)
    assert rest == 0, "identical layers must cost the same"
    return a + more_layers * per_layer


@dataclass
class StepCounts:
    """What one traced training step holds and does on rank 0 (bytes, FLOPs, counts).

    Every int and OpCounts field grows linearly with the number of identical layers, so
    `extend` carries a trace of few layers to the whole model; `accumulation` (micro-batches
    per optimizer step) and `groups` (mesh dimension -> rank 0's group) do not."""

    layers: int
    accumulation: int
    groups: dict[str, list[int]]
    num_params: int
    num_flops_per_token: int  # torchtitan's MFU formula (6N + 12 l h q t)
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
    state_dict_cache: int  # what the checkpointer's cached state dict allocates
    state_dict_refresh: int  # what a save's `ModelWrapper.state_dict()` allocates on top
    host_staging: int  # pinned host copy an async save stages (model + optimizer state)
    micro: OpCounts  # one micro-batch: forward_backward_step
    once: OpCounts  # once per optimizer step: clip_grad_norm_ + optimizer step

    @property
    def step(self) -> OpCounts:
        """One optimizer step: accumulation x micro-batch + once."""
        return self.micro.scaled(self.accumulation).plus(self.once)

    def extend(self, fewer: StepCounts, layers: int) -> StepCounts:
        """count(layers) = count(self) + (layers - self.layers) * per-layer difference."""
        step = self.layers - fewer.layers
        assert step > 0 and layers >= self.layers
        assert (self.accumulation, self.groups) == (fewer.accumulation, fewer.groups)
        more = layers - self.layers
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(fewer, f.name)
            if f.name in ("layers", "accumulation", "groups"):
                continue
            if isinstance(mine, OpCounts):
                values[f.name] = mine.extend(theirs, step, more)
            else:
                values[f.name] = _extend(mine, theirs, step, more)
        return StepCounts(
            layers=layers, accumulation=self.accumulation, groups=self.groups, **values
        )

    @classmethod
    def from_dict(cls, data: dict) -> StepCounts:
        data = dict(data)
        data["micro"], data["once"] = OpCounts(**data["micro"]), OpCounts(**data["once"])
        return cls(**data)


# --------------------------------------------------------------------------- the config


def traced_config(run: Any) -> Any:
    """`run` as the traced step runs it: eager, attention as torch's SDPA (module doc)."""
    import copy

    run = copy.deepcopy(run)
    run.model.attention = "sdpa"
    run.compile.enable = False
    run.compile.async_tp = False
    return run


def _plan_components():
    """The stand-ins for what reads or writes files (module doc), built lazily (torch)."""
    import torch
    import torch.nn.functional as F
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.protocols.module import Module

    class PlanTokenizer(BaseTokenizer):
        """Knows the vocabulary size; the plan encodes nothing."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Config, tokenizer_path: str | None = None):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("the plan encodes no text")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("the plan decodes no text")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class PlanBatches(BaseDataLoader):
        """Random tokens of the trainer's local batch and seq_len, as the trainer asks its
        loader for them (built with torchtitan's batch degree, like the real loader)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 0

        def __init__(
            self,
            config: Config,
            *,
            dp_world_size,
            dp_rank,
            tokenizer,
            seq_len,
            local_batch_size,
            snapshot_every_n_steps=None,
        ):
            self.config = config
            self.shape = (local_batch_size, seq_len)
            self.dp_world_size, self.dp_rank = dp_world_size, dp_rank

        def __iter__(self):
            generator = torch.Generator().manual_seed(self.dp_rank)
            # positions as the real loader yields them (context parallelism shards them)
            positions = torch.arange(self.shape[1]).expand(self.shape).contiguous()
            while True:
                tokens, labels = (
                    torch.randint(0, self.config.vocab_size, self.shape, generator=generator)
                    for _ in range(2)
                )
                yield {"input": tokens, "positions": positions}, labels

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    class PlannedSelectiveAC(SelectiveAC):
        """torchtitan's per-op SAC, also saving the CPU SDPA op that stands in for the
        GPU's attention (which its policy saves)."""

        @dataclass(kw_only=True, slots=True)
        class Config(SelectiveAC.Config):
            pass

        def get_save_ops(self) -> set:
            cpu_sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
            return super().get_save_ops() | {cpu_sdpa}

    class PlanAttention(FlexAttention):
        """Causal SDPA in FlexAttention's place (module doc). A FlexAttention, so context
        parallelism all-gathers its K and V as it does FlexAttention's; its config is not
        FlexAttention's, so the trainer builds no block mask for it."""

        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            kernel_options: dict = field(default_factory=dict)

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, scale=None, enable_gqa=False, **kwargs):
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
            return out.transpose(1, 2)

    return PlanTokenizer, PlanBatches, PlannedSelectiveAC, PlanAttention


def planned_trainer_config(
    run: Any, world_size: int, accelerator: bool, folder: str, full_logits_loss: bool = False
) -> Any:
    """The launch's `Trainer.Config` for `run` (`train.build.to_trainer_config`) with the
    plan's stand-ins (module doc); `run` is already `traced_config`'s.

    `full_logits_loss`: torchtitan's plain cross-entropy on the whole logits instead of our
    chunked loss, as torchtitan trained before its `ChunkedLossWrapper` (the published runs
    the plan is checked against, `train.plan_calibration`)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.param_init import skip_param_init
    from torchtitan.protocols.module import Module

    from train.build import to_trainer_config

    tokenizer, batches, selective_ac, attention = _plan_components()
    config = to_trainer_config(run, world_size, accelerator=accelerator)
    config.tokenizer = tokenizer.Config(vocab_size=run.model.vocab_size)
    config.dataloader = batches.Config(vocab_size=run.model.vocab_size)
    config.validator.enable = False
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    config.dump_folder = folder
    if full_logits_loss:
        from torchtitan.components.loss import CrossEntropyLoss

        config.loss = CrossEntropyLoss.Config(global_vocab_size=run.model.vocab_size)
    if isinstance(config.activation_checkpoint, SelectiveAC.Config):
        config.activation_checkpoint = selective_ac.Config()
    model = config.model_spec.model
    for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
        setattr(parent, attr, attention.Config())
    for _, module_config, _, _ in model.traverse(Module.Config, recurse=True):
        if module_config.param_init:
            module_config.param_init = {k: skip_param_init for k in module_config.param_init}
    config.model_spec = dataclasses.replace(
        config.model_spec, parallelize_fn=_unfaked(config.model_spec.parallelize_fn)
    )
    return config


def _unfaked(fn):
    """`fn` with fake mode paused (it sees meta and real CPU tensors only)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return run


def _planned_trainer_cls():
    from train.trainer import RunTrainer

    class PlannedTrainer(RunTrainer):
        """`RunTrainer` whose meshes are built on real CPU tensors (module doc)."""

        def init_distributed(self):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                parallel_dims = super().init_distributed()
                parallel_dims.build_mesh()
            return parallel_dims

    return PlannedTrainer


@contextlib.contextmanager
def _host_objects_exchanged_for_real() -> Iterator[None]:
    """torch.distributed's object collectives run with fake mode paused (module doc)."""
    import torch.distributed as dist

    names = ("all_gather_object", "broadcast_object_list", "gather_object")
    originals = {name: getattr(dist, name) for name in names}
    for name, fn in originals.items():
        setattr(dist, name, _unfaked(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _launch_environment(world_size: int, fake: bool) -> Iterator[None]:
    """What torchrun would set for rank 0 (torchtitan's fake backend reads NGPU), and
    torchtitan's construction logs kept down to errors: they describe the stand-ins (no
    tokenizer folder, a CPU with no peak FLOPs), not the run."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "NGPU": str(world_size)} if fake else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # torchtitan.tools.logging.logger is the root logger; torch's DTensor warns on its own
    loggers = [logging.getLogger(), logging.getLogger("torch.distributed.tensor")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*may not have complete support on cpu")
            warnings.filterwarnings("ignore", message="Accessing the data pointer")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- the trackers

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

    return StepMemTracker()


class _NoTracker(contextlib.nullcontext):
    """MemTracker's interface, measuring nothing."""

    def track_external(self, *tensors: Any) -> None:
        pass

    def peak_bytes(self) -> int:
        return 0


_COLLECTIVES = (
    ("allgather", "all-gather"),
    ("all_gather", "all-gather"),
    ("reduce_scatter", "reduce-scatter"),
    ("allreduce", "all-reduce"),
    ("all_reduce", "all-reduce"),
    ("all_to_all", "all-to-all"),
    ("alltoall", "all-to-all"),
    ("broadcast", "broadcast"),
)
# context parallelism's K/V exchange: one custom op each way, its collectives run inside it
_CP_OPS = {"flex_cp_allgather": "all-gather", "flex_cp_allgather_backward": "reduce-scatter"}
_ATTENTION_FORWARD = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "flex_attention",
)


def _collective_kind(namespace: str, name: str) -> str | None:
    """FSDP2's collectives reach c10d ops; DTensor's (TP/SP redistributions, loss
    parallel, the gradient-norm reduction) and torchao's amax reductions stay functional
    collectives; CP's K/V exchange is `cplib`. Other namespaces are local ops."""
    if namespace == "cplib":
        return _CP_OPS.get(name)
    if namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
        return None
    for op, label in _COLLECTIVES:
        if name.startswith(op) or name.startswith("_" + op):
            return label
    return None


def mesh_groups(parallel_dims: Any) -> dict[str, tuple[str, list[int]]]:
    """Process-group name -> (mesh dimension, rank 0's group ranks), the model-parallel
    dimensions first where several share a group."""
    import torch.distributed as dist

    groups: dict[str, tuple[str, list[int]]] = {}
    for dim in ("tp", "cp", "dp_replicate", "fsdp", "dp_shard", "batch", "loss"):
        try:
            mesh = parallel_dims.get_optional_mesh(dim)
        except ValueError:  # a dimension this SPMD backend's meshes do not have
            continue
        if mesh is not None:
            group = mesh.get_group()
            groups.setdefault(group.group_name, (dim, dist.get_process_group_ranks(group)))
    world = dist.group.WORLD
    groups.setdefault(world.group_name, ("world", dist.get_process_group_ranks(world)))
    return groups


def fp8_cast_bytes(recipe: str, m: int, k: int, n: int) -> int:
    """Bytes compiled code reads and writes to cast one FP8 linear's operands (input M x K,
    weight K x N, grad_output M x N; forward and backward), from torchao's roofline model
    (`torchao.testing.training.roofline_utils.get_tensor_memory_traffic_ovhd_s`, asked for
    bytes: bandwidth 1 B/s, fully achievable)."""
    from torchao.testing.training.roofline_utils import get_tensor_memory_traffic_ovhd_s

    as_bytes = {"peak_mem_bw_bytes_sec": 1.0, "pct_achievable_mem_bw": 1.0}
    total = 0.0
    for role, (dim0, dim1) in (("input", (m, k)), ("weight", (k, n)), ("grad_output", (m, n))):
        kernels = get_tensor_memory_traffic_ovhd_s(as_bytes, dim0, dim1, role, recipe, None)
        # each kernel is Max(bytes, launch overhead in s): the bytes are the larger
        total += sum(float(kernel) for kernel in kernels)
    return int(total)


def _step_counter(groups: dict[str, tuple[str, list[int]]], fp8_recipe: str) -> Any:
    """FLOPs, memory-bound bytes and collectives of every op that runs (module doc).

    Memory-bound bytes come in three classes: "eager fp8 casts" (ops run inside a
    Float8Linear's forward or backward: the amax, scale and cast kernels of its operands),
    "eager other" (everything else), and "compiled fp8 casts" (what torchao's roofline
    model says compiled code moves for the same casts, `fp8_cast_bytes`, counted at each
    forward FP8 GEMM, recompute included); the time model takes the compiled class in
    place of the eager one for compiled runs."""
    import torch
    import torch.distributed as dist
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    plain = (torch.Tensor, torch.nn.Parameter, FakeTensor)
    gemms = {
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        torch.ops.aten.baddbmm,
        torch.ops.aten._scaled_mm,
    }

    def group_of(args, kwargs) -> tuple[str, list[int]]:
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, str) and a in groups:
                return groups[a]
            if isinstance(a, torch.ScriptObject):
                pg = dist.ProcessGroup.unbox(a)
                return groups.get(pg.group_name, ("fsdp", dist.get_process_group_ranks(pg)))
        return groups[dist.group.WORLD.group_name]

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    class StepCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.phases = {"micro": OpCounts(), "once": OpCounts()}
            self.phase = "micro"
            self.used: dict[str, list[int]] = {}  # mesh dimension -> ranks, as met
            self._open: list[bool] = []  # collectives being run: did one run inside?
            # inside a Float8Linear: [forward (and its recompute), backward]
            self._fp8 = [0, 0]
            self._modules = ModTracker()

            def marker(index: int, step: int):
                def hook(module, *_):
                    if module is not None and type(module).__name__ == "Float8Linear":
                        self._fp8[index] += step

                return hook

            self._modules.register_user_hooks(
                marker(0, 1), marker(0, -1), marker(1, 1), marker(1, -1)
            )

        def __enter__(self):
            self._modules.__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self._modules.__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t not in plain for t in types):
                return NotImplemented  # count the local ops of DTensor and FP8 subclasses
            kwargs = kwargs or {}
            packet = func._overloadpacket
            kind = _collective_kind(func.namespace, packet.__name__)
            if kind is not None:
                self._open.append(False)
            out = func(*args, **kwargs)
            if kind is not None:
                ran_inner = self._open.pop()
                if self._open:
                    self._open[-1] = True
            if _PROPAGATING[0]:
                return out
            counts = self.phases[self.phase]
            if kind is not None:
                # FSDP2's all-gather is a functional collective that runs the c10d one
                # inside, CP's custom op runs two: count the outermost once
                if not ran_inner or func.namespace == "cplib":
                    self.count_collective(counts, func, kind, args, kwargs, out)
                return out
            name = packet.__name__
            if name in _ATTENTION_FORWARD or name.removesuffix("_backward") in _ATTENTION_FORWARD:
                q, k = args[0], args[1]
                if name.endswith("_backward"):  # (grad_out, q, k, v, ...)
                    q, k = args[1], args[2]
                b, h, lq, d = q.shape
                counts.add(
                    "flops",
                    "attention",
                    attention_flops(b, h, lq, k.shape[2], d, backward=name.endswith("_backward")),
                )
            elif packet in gemms:
                dtype = str(args[0].dtype).removeprefix("torch.")
                key = f"gemm {dtype}"
                if "float8" in dtype:  # scales per row (rowwise) run other kernels
                    dtype, key = "float8", "gemm float8" + " rowwise" * (args[2].numel() > 1)
                counts.add("flops", key, flop_registry[packet](*args, **kwargs, out_val=out))
                if dtype == "float8" and self._fp8[0] and not self._fp8[1] and fp8_recipe:
                    m, k = args[0].shape[-2:]
                    counts.add("memory_bytes", "compiled fp8 casts",
                               fp8_cast_bytes(fp8_recipe, m, k, args[1].shape[-1]))  # fmt: skip
            elif (
                # metadata (prim.device: fake tensors only), collective plumbing (waits, wraps)
                func.namespace
                not in ("prim", "c10d", "_c10d_functional", "_c10d_functional_autograd")
                and not _is_view(func)
                and not name.startswith("empty")
            ):
                seen = {
                    id(t): nbytes(t)
                    for t in pytree.tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor)
                }
                if seen:
                    kind = "eager fp8 casts" if any(self._fp8) else "eager other"
                    counts.add("memory_bytes", kind, sum(seen.values()))
            return out

        def count_collective(self, counts, func, kind, args, kwargs, out) -> None:
            mesh, ranks = group_of(args, kwargs)
            self.used[mesh] = ranks
            tensors = [
                t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
            ]
            if not tensors:
                return
            if func.namespace == "cplib":  # K and V at once: gathered, or their gradients reduced
                moved = out if kind == "all-gather" else args[:2]
                size, dtype = sum(nbytes(t) for t in moved), moved[0].dtype
                kind = f"{kind} (K, V)"
            else:
                biggest = max(tensors, key=nbytes)
                size, dtype = nbytes(biggest), biggest.dtype
            key = f"{mesh} {kind} {str(dtype).removeprefix('torch.')}"
            counts.add("comm", key, size)
            counts.add("comm_calls", key, 1)

    return StepCounter()


def _is_view(func) -> bool:
    """An op whose output aliases its input without writing it: no memory traffic."""
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        t = _local(t)
        total += t.numel() * t.element_size()
    return total


def _storages(t: Any) -> Iterator[tuple[Any, int]]:
    """(storage, bytes) of the plain tensors under `t`: a DTensor's local shard, and the
    inner tensors of a wrapper subclass (torchao's FP8 weight wraps the bf16/fp32 one)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    t = _local(t)
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(t, name))
        return
    yield StorageWeakRef(t.untyped_storage()), t.numel() * t.element_size()


def _fresh_bytes(tensors: Any, owned: set) -> int:
    """Bytes of the tensors whose storage is none of `owned` (storage identity, which fake
    tensors keep: a view of a parameter shares its storage)."""
    total, seen = 0, set(owned)
    for t in tensors:
        for ref, size in _storages(t):
            if ref not in seen:
                seen.add(ref)
                total += size
    return total


# --------------------------------------------------------------------------- tracing


def trace_step(
    run: Any,
    world_size: int,
    accelerator: bool,
    fake: bool = True,
    full_logits_loss: bool = False,
    track_memory: bool = True,
) -> StepCounts:
    """Build `run`'s trainer as a launch does (module doc) and run one micro-batch, the
    gradient clipping and the optimizer step on rank 0; `run` is `traced_config`'s.

    `fake`: on fake tensors on torchtitan's fake comm backend (the plan: nothing is
    allocated). Otherwise on real tensors in the caller's process group (the
    tracker-vs-reality test runs this on 2 gloo ranks). `track_memory=False` leaves the
    peaks 0 and takes half the time (the published rows that report no memory)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.distributed import utils as dist_utils

    from train.trainer import RunTrainer

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    trainer = None
    try:
        with (
            _launch_environment(world_size, fake),
            _host_objects_exchanged_for_real(),
            _sharding_propagation_not_counted(),
        ):
            folder = tempfile.mkdtemp(prefix="plan-")
            config = planned_trainer_config(run, world_size, accelerator, folder, full_logits_loss)
            assert type(config) is RunTrainer.Config, "the plan builds what a launch builds"
            if fake:
                config.comm.mode = "fake_backend"  # torchtitan's dry-run comm mode, NGPU ranks
            with fake_mode:
                trainer = _planned_trainer_cls()(config)
            model = trainer.model_parts[0]
            params = list(model.parameters())
            recipe = run.fp8.recipe if run.fp8.enable and not run.fp8.emulate else ""
            counter = _step_counter(mesh_groups(trainer.parallel_dims), recipe)
            batches = iter(trainer.dataloader)
            with fake_mode:
                input_dict, labels = next(batches)
                tokens = torch.tensor(labels.numel())
                tracker = _mem_tracker() if track_memory else _NoTracker()
                tracker.track_external(model, input_dict["input"], labels)
                with tracker, counter:
                    trainer.forward_backward_step(
                        input_dict=input_dict, labels=labels, global_valid_tokens=tokens
                    )
                    counter.phase = "once"
                    pp_mesh = trainer.parallel_dims.get_optional_mesh("pp")
                    dist_utils.clip_grad_norm_(
                        params, config.training.max_norm, foreach=True, pp_mesh=pp_mesh
                    )
                peak_forward_backward = tracker.peak_bytes()
                gradients = _local_bytes(p.grad for p in params if p.grad is not None)
                step_tracker = _mem_tracker() if track_memory else _NoTracker()
                step_tracker.track_external(model)
                with step_tracker, counter:
                    # torchtitan's container step; our veto reads values, which fake
                    # tensors lack, and moves a few scalars
                    OptimizersContainer.step(trainer.optimizers)
                peak_optimizer_step = step_tracker.peak_bytes() + gradients
                states = [
                    v
                    for opt in trainer.optimizers.optimizers
                    for s in opt.state.values()
                    for v in s.values()
                    if isinstance(v, torch.Tensor)
                ]
                optimizer = _local_bytes(states)
                # the checkpointer's model state dict, built once and held for the run,
                # refreshed in place at each save (torchtitan's ModelWrapper): it allocates
                # only what does not share a parameter's storage
                owned = {ref for p in params for ref, _ in _storages(p)}
                wrapper = ModelWrapper(trainer.model_parts)
                cached = [v for v in wrapper.cached_state_dict.values() if torch.is_tensor(v)]
                state_dict_cache = _fresh_bytes(cached, owned)
                # a save's refresh rebuilds the model state dict (ModelWrapper.state_dict)
                refreshed = [
                    v
                    for m in trainer.model_parts
                    for v in m.state_dict().values()
                    if torch.is_tensor(v)
                ]
                state_dict_refresh = _fresh_bytes(refreshed, owned)
                host_staging = _local_bytes(cached) + optimizer
            counts = StepCounts(
                layers=run.model.n_layers,
                accumulation=trainer.gradient_accumulation_steps,
                groups=dict(sorted(counter.used.items())),
                num_params=sum(p.numel() for p in params),
                num_flops_per_token=int(trainer.metrics_processor.num_flops_per_token),
                num_local_params=sum(_local(p).numel() for p in params),
                num_float8_linears=sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
                num_fsdp_modules=sum(isinstance(m, FSDPModule) for m in model.modules()),
                num_ac_wrapped_blocks=sum(
                    "Checkpoint" in type(b).__name__ for b in model.layers.values()
                ),
                parameters=_local_bytes(params),
                gradients=gradients,
                optimizer=optimizer,
                peak_forward_backward=peak_forward_backward,
                peak_optimizer_step=peak_optimizer_step,
                state_dict_cache=state_dict_cache,
                state_dict_refresh=state_dict_refresh,
                host_staging=host_staging,
                micro=counter.phases["micro"],
                once=counter.phases["once"],
            )
    finally:
        if trainer is not None:
            trainer.close()
        if fake and dist.is_initialized():
            dist.destroy_process_group()
    return counts


def measure(
    run: Any,
    world_size: int,
    accelerator: bool,
    traced_layers: int,
    full_logits_loss: bool = False,
    track_memory: bool = True,
) -> StepCounts:
    """`trace_step` on a fake world: all layers, or `traced_layers` - 1 and `traced_layers`
    extended to all; `run` is `traced_config`'s."""
    import copy

    def trace(n_layers: int) -> StepCounts:
        shallow = copy.deepcopy(run)
        shallow.model.n_layers = n_layers
        return trace_step(shallow, world_size, accelerator, full_logits_loss=full_logits_loss,
                          track_memory=track_memory)  # fmt: skip

    n_layers = run.model.n_layers
    if n_layers <= traced_layers:
        return trace(n_layers)
    return trace(traced_layers).extend(trace(traced_layers - 1), n_layers)
