"""`train.build`, the one mapping onto torchtitan: every shipped config becomes torchtitan's
own `Trainer.Config`, and "auto" is resolved for the device asked for, not the machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.build import to_trainer_config
from train.config import load_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_configs_map_to_torchtitans_trainer_config(path):
    from torchtitan.components.quantization import Float8Linear
    from torchtitan.trainer import Trainer

    run = load_config(path)
    trainer_config = to_trainer_config(run)
    assert isinstance(trainer_config, Trainer.Config)
    assert trainer_config.training.steps == run.training.steps
    assert trainer_config.parallelism.tensor_parallel_degree == run.parallelism.tp
    ac = trainer_config.activation_checkpoint
    assert (ac is None) == (run.activation_checkpoint.mode == "none")
    assert trainer_config.compile.enable == run.compile.enable
    model = trainer_config.model_spec.model
    assert (model.dim, len(model.layers), model.vocab_size) == (
        run.model.dim,
        run.model.n_layers,
        run.model.vocab_size,
    )
    fp8_linears = [fqn for fqn, *_ in model.traverse(Float8Linear.Config)]
    assert bool(fp8_linears) == run.fp8.enable
    if run.fp8.enable:
        assert "lm_head" not in fp8_linears and "layers.0.feed_forward.w1" in fp8_linears


@pytest.mark.parametrize(
    ("accelerator", "param_dtype", "attention"),
    [(True, "bfloat16", "FlexAttention"), (False, "float32", "DocumentMaskedSDPA")],
)
def test_auto_is_resolved_for_the_device_asked_for(accelerator, param_dtype, attention):
    run = load_config(REPO / "configs" / "debug.toml")
    assert (run.training.param_dtype, run.model.attention) == ("auto", "auto")
    config = to_trainer_config(run, world_size=4, accelerator=accelerator)
    assert config.training.mixed_precision_param == param_dtype
    inner = config.model_spec.model.layers[0].attention.inner_attention
    assert attention in type(inner).__qualname__.split(".")
    # a sharded mesh resolves the spmd backend the same way on any device
    assert config.parallelism.spmd_backend == "partial_dtensor"
    assert config.checkpoint.async_mode == "async_with_pinned_mem"


def test_schedule_start_steps_become_global_sequences(tmp_path):
    run = load_config(
        REPO / "configs" / "debug.toml",
        [
            "--training.global_batch_size",
            "8",
            "--set",
            'dataloader.mix=[{path="a"}, {path="b"}]',
            "--set",
            "dataloader.schedule=[{start_step=11, weights=[0.0, 1.0]}]",
        ],
    )
    (phase,) = to_trainer_config(run).dataloader.schedule
    assert (phase.start_sequence, phase.weights) == (80, [0.0, 1.0])


@pytest.mark.parametrize(
    ("dp_replicate", "dp_shard", "tp", "world_size", "backend"),
    [
        (8, 1, 1, 8, "partial_dtensor"),  # pure DDP: spmd_types makes FSDP refuse the params
        (2, -1, 1, 2, "partial_dtensor"),  # dp_shard -1 resolves to 1: DDP again
        (2, 2, 1, 4, "partial_dtensor"),  # HSDP
        (1, -1, 1, 8, "partial_dtensor"),  # FSDP
        (1, 1, 2, 2, "partial_dtensor"),  # TP only
        (1, -1, 1, 1, "spmd_types"),  # one rank: torchtitan's default
    ],
)
def test_auto_spmd_backend_is_partial_dtensor_on_any_multi_rank_mesh(
    dp_replicate, dp_shard, tp, world_size, backend
):
    from train.build import resolve_spmd_backend

    resolved = resolve_spmd_backend("auto", dp_shard, tp, world_size, dp_replicate=dp_replicate)
    assert resolved == backend
    assert resolve_spmd_backend("spmd_types", dp_shard, tp, world_size) == "spmd_types"


def test_the_budgets_and_fresh_are_mapped_here_not_after():
    """The training's budgets raise every collective timeout over the watchdog's windows,
    and --fresh reaches the checkpointer, in the one mapping: `train.runtime.train` changes
    no field of the config it builds."""
    import math

    from train.reliability.budgets import Budgets, PlannedTimes

    run = load_config(REPO / "configs" / "debug.toml")
    plain = to_trainer_config(run)
    assert plain.budgets is None and not plain.checkpoint.fresh
    assert plain.comm.train_timeout_seconds == run.comm.train_timeout_seconds
    planned = PlannedTimes(
        fingerprint="x", world_size=1, gpu="h100", accumulation=1, step_s={256: 200.0},
        compile_s=900.0, checkpoint_bytes=0, storage_gb_per_s=1.0, save_s=1.0,
    )  # fmt: skip
    budgets = Budgets.of(run, planned)
    config = to_trainer_config(run, budgets=budgets, fresh=True)
    assert config.budgets is budgets and config.checkpoint.fresh
    assert config.comm.init_timeout_seconds == math.ceil(budgets.init_timeout_s)
    assert config.comm.train_timeout_seconds == math.ceil(budgets.collective_timeout_s)
    assert config.checkpoint.save_window.train_timeout_s == budgets.collective_timeout_s
    assert budgets.collective_timeout_s > run.comm.train_timeout_seconds  # the plan raised it


def test_training_loss_chunks_picks_the_loss_the_run_trains_and_plans():
    """8 (the default): torchtitan's ChunkedLossWrapper in 8 chunks; 0: its CrossEntropyLoss
    on the whole logits (what the published runs computed, docs/dry_run.md); negative: a
    config error naming the key."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from train.config import ConfigError

    path = REPO / "configs" / "debug.toml"
    chunked = to_trainer_config(load_config(path), accelerator=False).loss
    assert type(chunked) is ChunkedLossWrapper.Config and chunked.num_chunks == 8
    whole = to_trainer_config(load_config(path, ["--training.loss_chunks", "0"]), accelerator=False)
    assert type(whole.loss) is CrossEntropyLoss.Config
    with pytest.raises(ConfigError, match=r"training\.loss_chunks = -1 must be >= 0"):
        load_config(path, ["--training.loss_chunks", "-1"])
