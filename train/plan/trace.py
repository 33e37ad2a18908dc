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
here. What the plan changes is the config, and one torchtitan hook by subclass; no method
of a built object is replaced:

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
- context parallelism is traced with the head-tail load balancer whatever the config
  picks: `ptrr` orders documents by a block mask the plan does not build. Every
  balancer hands each rank seq_len / cp tokens, so the counts and peaks are the same.

What it runs, and how it is counted: one micro-batch (`forward_backward_step`), then what
runs once per optimizer step (torchtitan's `clip_grad_norm_`, and torchtitan's
`OptimizersContainer.step` without our veto: the per-step health check reads values, which
fake tensors lack, and moves a few scalars), measured by `train.plan.trackers` into
`train.plan.step_counts.StepCounts`, with torchtitan's own accumulation count
(`Trainer.gradient_accumulation_steps`).

Layers are identical (the same FSDP unit, TP plan and AC wrapper), so a model of more than
`TRACED_LAYERS` layers is traced at 2 and 3 layers and every count is extended linearly
(`StepCounts.extend`); tests/train/plan/test_dry_run.py checks this against tracing all layers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from train.plan.step_counts import GIB, StepCounts
from train.plan.trackers import (
    NoTracker,
    fresh_bytes,
    local_bytes,
    local_tensor,
    mem_tracker,
    mesh_groups,
    sharding_propagation_not_counted,
    step_counter,
    storages,
)

__all__ = ["GIB", "TRACED_LAYERS", "StepCounts", "measure", "trace_step", "traced_config"]

# Models deeper than this are traced at this many layers and one fewer, and extended
# linearly. Not 1 and 2: with one block, FSDP prefetches the output norm and lm_head where a
# deeper model prefetches the next block, so one block is not "a layer".
TRACED_LAYERS = 3


# --------------------------------------------------------------------------- the config


def traced_config(run: Any) -> Any:
    """`run` as the traced step runs it: eager, attention as torch's SDPA (module doc)."""
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

        def __init__(self, config: Config, *, dp_rank, seq_len, local_batch_size, **_):
            # the rest of the trainer's arguments (world size, tokenizer, snapshots) are unused
            self.config, self.dp_rank = config, dp_rank
            self.shape = (local_batch_size, seq_len)

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


def planned_trainer_config(run: Any, world_size: int, accelerator: bool, folder: str) -> Any:
    """The launch's `Trainer.Config` for `run` (`train.build.to_trainer_config`) with the
    plan's stand-ins (module doc); `run` is already `traced_config`'s. The loss is the
    launch's too (`training.loss_chunks`: chunked, or the whole logits)."""
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
    if config.parallelism.context_parallel_load_balancer is not None:
        # ptrr needs the block mask the plan does not build (module doc); every balancer
        # gives each rank seq_len / cp tokens
        config.parallelism.context_parallel_load_balancer = "headtail"
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

        @_unfaked
        def init_distributed(self):
            parallel_dims = super().init_distributed()
            parallel_dims.build_mesh()
            return parallel_dims

    return PlannedTrainer


@contextlib.contextmanager
def _launch_environment(world_size: int, fake: bool) -> Iterator[None]:
    """What torchrun would set for rank 0 (torchtitan's fake backend reads NGPU), and
    torchtitan's construction logs kept down to errors: they describe the stand-ins (no
    tokenizer folder, a CPU with no peak FLOPs), not the run."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "NGPU": str(world_size)} if fake else {}
    with (
        contextlib.ExitStack() as levels,
        mock.patch.dict(os.environ, env),
        warnings.catch_warnings(),
    ):
        # torchtitan.tools.logging.logger is the root logger; torch's DTensor warns on its own
        for logger in (logging.getLogger(), logging.getLogger("torch.distributed.tensor")):
            levels.callback(logger.setLevel, logger.level)
            logger.setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message=".*may not have complete support on cpu")
        warnings.filterwarnings("ignore", message="Accessing the data pointer")
        yield


# --------------------------------------------------------------------------- tracing


def trace_step(
    run: Any,
    world_size: int,
    accelerator: bool,
    fake: bool = True,
    track_memory: bool = True,
) -> StepCounts:
    """Build `run`'s trainer as a launch does (module doc) and run one micro-batch, the
    gradient clipping and the optimizer step on rank 0; `run` is `traced_config`'s.

    `fake`: on fake tensors on torchtitan's fake comm backend (the plan: nothing is
    allocated). Otherwise on real tensors in the caller's process group (the
    tracker-vs-reality test runs this on 2 gloo ranks). `track_memory=False` leaves the
    peaks 0 and takes less time (the suggestion's tp 1 trace, which reads no memory)."""
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
    with tempfile.TemporaryDirectory(prefix="plan-") as folder:  # the run folder
        try:
            with (
                _launch_environment(world_size, fake),
                sharding_propagation_not_counted(),
            ):
                config = planned_trainer_config(run, world_size, accelerator, folder)
                assert type(config) is RunTrainer.Config, "the plan builds what a launch builds"
                if fake:
                    config.comm.mode = "fake_backend"  # torchtitan's dry-run comm mode, NGPU ranks
                with fake_mode:
                    trainer = _planned_trainer_cls()(config)
                model = trainer.model_parts[0]
                params = list(model.parameters())
                recipe = run.fp8.recipe if run.fp8.enable and not run.fp8.emulate else ""
                groups = mesh_groups(trainer.parallel_dims)
                counter = step_counter(groups, recipe, _weight_cast_share(run, groups))
                batches = iter(trainer.dataloader)
                with fake_mode:
                    input_dict, labels = next(batches)
                    tokens = torch.tensor(labels.numel())
                    tracker = mem_tracker() if track_memory else NoTracker()
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
                    gradients = local_bytes(p.grad for p in params if p.grad is not None)
                    step_tracker = mem_tracker() if track_memory else NoTracker()
                    step_tracker.track_external(model)
                    with step_tracker, counter:
                        # torchtitan's container step; our veto reads values, which fake
                        # tensors lack, and moves a few scalars
                        OptimizersContainer.step(trainer.optimizers)
                    # the tracker counts the gradients itself (MemTracker.track_external
                    # tracks a module's parameters and their .grad): nothing to add
                    peak_optimizer_step = step_tracker.peak_bytes()
                    states = [
                        v
                        for opt in trainer.optimizers.optimizers
                        for s in opt.state.values()
                        for v in s.values()
                        if isinstance(v, torch.Tensor)
                    ]
                    optimizer = local_bytes(states)
                    # the checkpointer's model state dict, built once and held for the run,
                    # refreshed in place at each save (torchtitan's ModelWrapper): it allocates
                    # only what does not share a parameter's storage
                    owned = {ref for p in params for ref, _ in storages(p)}
                    wrapper = ModelWrapper(trainer.model_parts)
                    cached = [v for v in wrapper.cached_state_dict.values() if torch.is_tensor(v)]
                    state_dict_cache = fresh_bytes(cached, owned)
                    # a save's refresh rebuilds the model state dict (ModelWrapper.state_dict)
                    refreshed = [
                        v
                        for m in trainer.model_parts
                        for v in m.state_dict().values()
                        if torch.is_tensor(v)
                    ]
                    state_dict_refresh = fresh_bytes(refreshed, owned)
                    host_staging = local_bytes(cached) + optimizer
                counts = StepCounts(
                    layers=run.model.n_layers,
                    accumulation=trainer.gradient_accumulation_steps,
                    groups=dict(sorted(counter.used.items())),
                    num_params=sum(p.numel() for p in params),
                    num_flops_per_token=int(trainer.metrics_processor.num_flops_per_token),
                    num_local_params=sum(local_tensor(p).numel() for p in params),
                    num_float8_linears=sum(
                        type(m).__name__ == "Float8Linear" for m in model.modules()
                    ),
                    num_fsdp_modules=sum(isinstance(m, FSDPModule) for m in model.modules()),
                    num_ac_wrapped_blocks=sum(
                        "Checkpoint" in type(b).__name__ for b in model.layers.values()
                    ),
                    parameters=local_bytes(params),
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


def _weight_cast_share(run: Any, groups: dict) -> float:
    """The share of each FP8 weight a rank casts: its FSDP shard's under the FP8 all-gather
    (tensorwise, where torchtitan casts the shard before gathering it), else all of it."""
    fp8 = run.fp8
    if not (fp8.enable and fp8.recipe == "tensorwise" and fp8.fsdp_float8_all_gather):
        return 1.0
    fsdp = [ranks for dim, ranks in groups.values() if dim in ("fsdp", "dp_shard")]
    return 1.0 / len(fsdp[0]) if fsdp else 1.0


def measure(run: Any, world_size: int, accelerator: bool, traced_layers: int) -> StepCounts:
    """`trace_step` on a fake world: all layers, or `traced_layers` - 1 and `traced_layers`
    extended to all; `run` is `traced_config`'s."""

    def trace(n_layers: int) -> StepCounts:
        shallow = copy.deepcopy(run)
        shallow.model.n_layers = n_layers
        return trace_step(shallow, world_size, accelerator)

    n_layers = run.model.n_layers
    if n_layers <= traced_layers:
        return trace(n_layers)
    return trace(traced_layers).extend(trace(traced_layers - 1), n_layers)
