"""The one mapping from our `RunConfig` onto torchtitan's `Trainer.Config`.

Why a module of its own: torchtitan keeps its schema (`config/configs.py`) apart from the
wiring that turns a schema into components (`models/llama3/config_registry.py`). We do the
same: `train.config` is the torch-free schema a TOML file is checked against, and this is
the wiring. Training and the dry-run planner both call `to_trainer_config`, so the plan is
made from exactly the config the trainer will build (activation checkpointing, compile,
loss, parallelism), not from a copy of it that drifts.

How "auto" is resolved: five fields may say "auto", and they are resolved here and only
here (the `resolve_*` functions), never in the saved `RUN/config.toml`, so one config moves
between a laptop and a GPU cluster, and between vendors. Three depend on the device: the
attention kernel (`resolve_attention`: flex on a GPU, sdpa without one), the FSDP parameter
dtype (`resolve_param_dtype`: bfloat16 on a GPU, float32 without one) and the FP8 encoding
(`resolve_fp8_format`: fnuz on an AMD MI300X/MI325X, fn elsewhere). Two are the same on every
device: the spmd backend depends on the mesh (`resolve_spmd_backend`), and the async
checkpoint mode is always `async_with_pinned_mem` (`train.preflight.resolve_async_checkpoint`; only the
staging copy differs, in `train.components.dcp_workarounds`). The device facts behind them are
`train.compat.cpu_compat`'s (see its numbered list). `accelerator` says which device to resolve
for; it defaults to this machine (`target_has_accelerator`), and the dry run passes the
*target* GPU's answer (a plan for an H100 made on a laptop must cost bf16 compute copies,
not the CPU's fp32 ones).

Which component class each `Config` names is picked here too, as torchtitan's registry
picks them. Where we extend a torchtitan component, our subclass and its `Config` replace
torchtitan's, so the trainer never swaps a method of a built component:
- the checkpointer: `RunCheckpointManager`, with its save window (`SaveWindowConfig`);
- the metrics: `RunMetricsProcessor`;
- the loaders, training and validation: `TokenShardDataLoader`;
- the optimizers: `SkipStepOptimizersContainer`, whose veto (`train.reliability.health`'s per-step
  check) may skip an update;
- the LR schedulers: `RollbackLRSchedulersContainer` (a rollback's LR windows);
- the validator: `RunValidator`, in a watchdog window with a beat per batch;
- the loss: torchtitan's own `ChunkedLossWrapper` around `CrossEntropyLoss`
  (`training.loss_chunks` chunks; 0: `CrossEntropyLoss` on the whole logits), or
  `SpikedLoss` when a test injects a loss spike (`train.reliability.faults`).

Nothing here patches torch or torchtitan: entry points call
`train.runtime.prepare_runtime()` first (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from common import run_layout
from train.components.hf_import import is_hf_folder
from train.config import ParallelismConfig, RunConfig
from train.preflight import resolve_async_checkpoint


def target_has_accelerator(accelerator: bool | None = None) -> bool:
    """The device "auto" is resolved for: `accelerator` if given, else this machine's."""
    from train.compat import cpu_compat

    return cpu_compat.has_accelerator() if accelerator is None else accelerator


def resolve_attention(requested: str, accelerator: bool | None = None) -> str:
    """ "auto" -> flex on GPU, sdpa on CPU: both apply the same causal + document mask
    (`train.attention.DocumentMaskedSDPA` runs FlexAttention's own mask through SDPA, which
    has a CPU backward; cpu_compat #6). flex and varlen are refused without a GPU."""
    accelerator = target_has_accelerator(accelerator)
    if requested == "auto":
        return "flex" if accelerator else "sdpa"
    if requested in ("flex", "varlen") and not accelerator:
        raise ValueError(
            f"model.attention = '{requested}' has no CPU backward pass; "
            "use attention = 'auto' or 'sdpa' on a machine without a GPU"
        )
    return requested


def resolve_param_dtype(requested: str, accelerator: bool | None = None) -> str:
    """ "auto" -> bfloat16 on GPU, float32 on CPU (bf16 parameters are ~20x slower there;
    cpu_compat #8)."""
    if requested != "auto":
        return requested
    return "bfloat16" if target_has_accelerator(accelerator) else "float32"


def resolve_fp8_format(requested: str) -> str:
    """ "auto" -> the FP8 encoding of this machine's GPU: fnuz on AMD gfx942 (MI300X,
    MI325X), fn elsewhere (train/compat/amd_compat.py). A forced "fn" or "fnuz" must be
    the GPU's (ValueError, one line); on a CPU either is taken (both run in software).
    Always this machine's device, also in a plan for another GPU: the encoding changes no
    byte or FLOP the planner counts."""
    from train.compat import amd_compat

    return amd_compat.check_fp8_format(requested, amd_compat.gcn_arch(), target_has_accelerator())


def resolve_spmd_backend(
    requested: str, dp_shard: int, tp: int, world_size: int, cp: int = 1, dp_replicate: int = 1
) -> str:
    """ "auto" -> partial_dtensor on more than one rank, else torchtitan's default spmd_types.

    The same on every device. Under spmd_types, torchtitan's `resolve_fsdp_mesh`
    (distributed/full_dtensor.py) hands FSDP a `DataParallelMeshDims` whenever the dense
    mesh (dp_replicate x dp_shard x cp x tp) has more than one rank, and FSDP then refuses
    the plain-tensor parameters ("all parameters must be DTensors on the full SPMD mesh"):
    pure DDP (dp_replicate > 1, dp_shard = 1) included, not only sharded meshes.
    partial_dtensor takes FSDP's plain mesh path (["dp_replicate", "fsdp"])."""
    if requested != "auto":
        return requested
    if dp_shard == -1:  # the rest of the world
        dp_shard = world_size // max(1, dp_replicate * tp * cp)
    multi_rank = dp_replicate * dp_shard * tp * cp > 1
    return "partial_dtensor" if multi_rank else "spmd_types"


def step_hooks(run: RunConfig) -> tuple[type, ...]:
    """The trainer's step hooks (`train.step_hooks`), in the step's order (train/trainer.py
    says why this one): each is called at every point of the step in this order, so the
    loss is judged by the format switch's gate before the spike rule, the data ledger
    records a step before a rollback loads a checkpoint, and the step's compute ends in
    the watchdog once the rollback is done. Faults and FP8 telemetry only when asked for."""
    from train.components.fp8_stats import Fp8Telemetry
    from train.ledger.recorder import DataLedgerRecorder
    from train.reliability.faults import FaultInjector
    from train.reliability.format_switch import FormatSwitchGate
    from train.reliability.health import TrainingHealth
    from train.reliability.rollback import LossSpikeRollback
    from train.reliability.time_limit import EndInTime
    from train.reliability.watchdog import StepWindows

    faults = (FaultInjector,) if run.health.inject_faults else ()
    fp8_stats = (Fp8Telemetry,) if run.fp8.enable and run.fp8.stats_freq else ()
    return (
        *faults,
        TrainingHealth,
        *fp8_stats,
        FormatSwitchGate,
        DataLedgerRecorder,
        LossSpikeRollback,
        StepWindows,
        EndInTime,
    )


def to_parallelism_config(p: ParallelismConfig, world_size: int):
    """Our [parallelism] section as torchtitan's ParallelismConfig, "auto" resolved."""
    from torchtitan.config import ParallelismConfig as TTParallelismConfig

    return TTParallelismConfig(
        data_parallel_replicate_degree=p.dp_replicate,
        data_parallel_shard_degree=p.dp_shard,
        tensor_parallel_degree=p.tp,
        context_parallel_degree=p.cp,
        enable_sequence_parallel=p.enable_sequence_parallel,
        spmd_backend=resolve_spmd_backend(
            p.spmd_backend, p.dp_shard, p.tp, world_size, cp=p.cp, dp_replicate=p.dp_replicate
        ),
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        context_parallel_load_balancer=(
            None if p.context_parallel_load_balancer == "none" else p.context_parallel_load_balancer
        ),
    )


def to_trainer_config(
    run: RunConfig,
    world_size: int | None = None,
    accelerator: bool | None = None,
    budgets=None,
    fresh: bool = False,
):
    """torchtitan's `Trainer.Config` (our `RunTrainer.Config`) for `run`.

    `world_size` defaults to torchrun's WORLD_SIZE (1 without torchrun); `accelerator` to
    whether this machine has one. `budgets` (`train.reliability.budgets.Budgets`, the
    training's; None for a plan) raise every collective timeout to outlast the watchdog's
    windows and go to the trainer; `fresh` is the CLI's --fresh (the checkpointer deletes
    old steps). Every field is mapped here, once: the caller changes nothing after. Building
    the config reads no file and starts nothing."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import CommConfig as TTCommConfig
    from torchtitan.config import CompileConfig as TTCompileConfig
    from torchtitan.config import TrainingConfig as TTTrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from dataloader import TokenShardDataLoader
    from dataloader.global_order import longest_seq_len, schedule_from_steps
    from train.components.checkpoint import RunCheckpointManager
    from train.components.metrics import RunMetricsProcessor
    from train.components.optimizer import SkipStepOptimizersContainer
    from train.components.save_window import SaveWindowConfig
    from train.components.validator import RunValidator
    from train.fp8 import check_fp8_converts
    from train.model import build_model_spec
    from train.reliability.faults import SpikedLoss, parse_faults
    from train.reliability.rollback import RollbackLRSchedulersContainer
    from train.trainer import RunTrainer

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    t = run.training
    initial = run.checkpoint.initial_load_path
    max_seq_len = longest_seq_len(t.seq_len, run.dataloader.schedule)
    faults = list(run.health.inject_faults)  # tests only; empty in every shipped config
    # an injected loss spike needs the loss itself; without one, torchtitan's loss class
    spiked = any(f.kind == "spike" for f in parse_faults(faults))
    cross_entropy = CrossEntropyLoss.Config(global_vocab_size=run.model.vocab_size)
    if spiked:  # the spike scales the chunked loss (a test's fault; at least one chunk)
        loss = SpikedLoss.Config(loss_fn=cross_entropy, num_chunks=max(1, t.loss_chunks))
    elif t.loss_chunks:
        loss = ChunkedLossWrapper.Config(loss_fn=cross_entropy, num_chunks=t.loss_chunks)
    else:
        loss = cross_entropy

    init_timeout_s, train_timeout_s = run.comm.init_timeout_seconds, run.comm.train_timeout_seconds
    collective_timeout_s = train_timeout_s
    if budgets is not None:
        init_timeout_s = math.ceil(budgets.init_timeout_s)
        train_timeout_s = math.ceil(budgets.collective_timeout_s)
        collective_timeout_s = budgets.collective_timeout_s

    model_spec = build_model_spec(
        run,
        attention=resolve_attention(run.model.attention, accelerator),
        fp8_format=resolve_fp8_format(run.fp8.format),
    )
    check_fp8_converts(run, model_spec.model)  # an FP8 run that converts nothing: refused
    config = RunTrainer.Config(
        model_spec=model_spec,
        hf_assets_path=run.dataloader.tokenizer,
        dump_folder=run.job.folder,
        loss=loss,
        # a veto (train.reliability.health's per-step check) may skip an update:
        # train/components/optimizer.py
        optimizer=SkipStepOptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name=run.optimizer.name,
                    optimizer_kwargs={
                        "lr": run.optimizer.lr,
                        "betas": (run.optimizer.beta1, run.optimizer.beta2),
                        "eps": run.optimizer.eps,
                        "weight_decay": run.optimizer.weight_decay,
                    },
                )
            ]
        ),
        # torchtitan's schedule, times the LR windows of rollbacks: train/reliability/rollback.py
        lr_scheduler=RollbackLRSchedulersContainer.Config(**dataclasses.asdict(run.lr_scheduler)),
        training=TTTrainingConfig(
            local_batch_size=t.local_batch_size,
            global_batch_size=t.global_batch_size,
            # torchtitan sizes RoPE's precomputed table to training.seq_len: the longest
            # phase; the loaders get the run's own seq_len (start_seq_len below). The
            # dry run plans activations at this longest length too.
            seq_len=max_seq_len,
            max_norm=t.max_norm,
            steps=t.steps,
            mixed_precision_param=resolve_param_dtype(t.param_dtype, accelerator),
            gc_freq=t.gc_freq,
            # CUDA graphs need static shapes and no host syncs; our loader and the
            # step's exchange (the update veto's read) are host-side, so keep
            # torchtitan's graphs off.
            disable_cuda_graphs=True,
        ),
        parallelism=to_parallelism_config(run.parallelism, world_size),
        dataloader=TokenShardDataLoader.Config(
            mix=list(run.dataloader.mix),
            seed=run.dataloader.seed,
            start_seq_len=t.seq_len,
            # the schema counts optimizer steps (what a user plans); the loader counts
            # global sequences, which stay put when the number of ranks changes. A step is
            # global_batch_size sequences whatever their length, so a seq_len phase starts
            # on a step boundary (a round boundary of the loader on any number of ranks)
            schedule=schedule_from_steps(run.dataloader.schedule, t.global_batch_size),
            infinite=True,
            allow_dataset_change=run.dataloader.allow_dataset_change,
            block_tokens=run.dataloader.block_tokens,
            shuffle_blocks=run.dataloader.shuffle_blocks,
            skip_sequences=[list(r) for r in run.dataloader.skip_sequences],
        ),
        validator=RunValidator.Config(
            enable=run.validation.enable,
            inject_faults=faults,
            freq=run.validation.freq,
            steps=run.validation.steps,
            dataloader=TokenShardDataLoader.Config(
                mix=list(run.validation.mix or run.dataloader.mix),
                seed=run.dataloader.seed,
                start_seq_len=t.seq_len,
                infinite=False,
                block_tokens=run.dataloader.block_tokens,
                shuffle_blocks=run.dataloader.shuffle_blocks,
            ),
        ),
        checkpoint=RunCheckpointManager.Config(
            enable=run.checkpoint.enable,
            folder=run_layout.CHECKPOINT_DIR,
            interval=run.checkpoint.interval,
            keep_latest_k=run.checkpoint.keep_last,
            async_mode=resolve_async_checkpoint(run.checkpoint.async_mode),
            last_save_model_only=run.checkpoint.last_save_model_only,
            export_dtype=run.checkpoint.export_dtype,
            # torchtitan wants an absolute path; ours is relative to the cwd like every
            # path in the config. An HF Llama folder is read through torchtitan's own HF
            # loader (train/components/hf_import.py); either way only the model is loaded.
            initial_load_path=str(Path(initial).resolve()) if initial else None,
            initial_load_model_only=True,
            initial_load_in_hf=bool(initial) and is_hf_folder(initial),
            save_window=SaveWindowConfig(
                hang_timeout_s=run.fault_tolerance.hang_timeout_s,
                min_save_gb_per_s=run.fault_tolerance.min_save_gb_per_s,
                train_timeout_s=collective_timeout_s,
                storage_gb_per_s=run.checkpoint.storage_gb_per_s,
                inject_faults=faults,
            ),
            fresh=fresh,
        ),
        activation_checkpoint={
            "none": None,
            "selective": SelectiveAC.Config(),
            "full": FullAC.Config(),
        }[run.activation_checkpoint.mode],
        compile=TTCompileConfig(
            enable=run.compile.enable,
            components=list(run.compile.components),
            enable_async_tensor_parallel=run.compile.async_tp,
        ),
        metrics=RunMetricsProcessor.Config(
            log_freq=run.metrics.log_freq,
            enable_tensorboard=run.metrics.tensorboard,
            save_tb_folder=run_layout.TB_DIR,
        ),
        # every group's collective timeout outlasts the watchdog's windows
        # (train/reliability/budgets.py)
        comm=TTCommConfig(
            init_timeout_seconds=init_timeout_s,
            train_timeout_seconds=train_timeout_s,
        ),
        debug=DebugConfig(seed=t.seed, deterministic=t.deterministic),
        health=run.health,
        fault_tolerance=run.fault_tolerance,
        fp8=run.fp8,
        budgets=budgets,
        hooks=step_hooks(run),
    )
    if run.replica_groups.groups or run.replica_groups.reference_slices:
        # torchft replica groups: train/replica_groups/ picks its subclasses
        from train.replica_groups.build import replica_trainer_config

        return replica_trainer_config(config, run, target_has_accelerator(accelerator))
    return config
