"""The replica-group run's `Trainer.Config`: `train.build.to_trainer_config`'s, with the
classes this wing extends picked in place of ours (as `train/build.py` picks ours in place
of torchtitan's): the trainer, the FT manager's section, the optimizers, the checkpointer
and, among the step hooks, the group's data ledger recorder. Every other field is the single-run mapping, unchanged, so a replica group
trains exactly what one launch of the same config would.
"""

from __future__ import annotations

from dataclasses import fields, replace

from common.run_layout import METRICS, TB_DIR, replica_dir
from train.config import RunConfig


def one_group(run: RunConfig) -> tuple[RunConfig, str]:
    """What `python -m train --dry-run` plans for a run of replica groups: one group's run
    (its share of the global batch, on the launch's world size, which is one group's), and
    the line that says so with the down policy in force. The time budgets the plan writes
    are per micro-batch (train/reliability/budgets.py), so they hold under either policy:
    a step of k live groups is a smaller step ("shrink") or N/k x the micro-batches
    ("accumulate"), each micro-batch the planned one."""
    r = run.replica_groups
    share = run.training.global_batch_size // r.groups
    line = (
        f"replica groups: {r.groups} groups, each planned below ({share} of the "
        f"{run.training.global_batch_size} sequences a step), a quorum of at least "
        f"{run.min_replica_groups}; down_policy = {r.down_policy}: with k groups live a step "
        + (
            "trains k of the groups' slices in one group's step time"
            if r.down_policy == "shrink"
            else f"keeps all {run.training.global_batch_size} sequences and takes "
            f"{r.groups}/k of one group's step time"
        )
    )
    single = replace(
        run,
        replica_groups=replace(r, groups=0),
        training=replace(run.training, global_batch_size=share),
    )
    return single, line


def _as(cls, config, **overrides):
    """`config` as an instance of its subclass `cls`, every field carried over."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return cls(**(values | overrides))


def replica_trainer_config(config, run: RunConfig, accelerator: bool):
    """`config` (our `RunTrainer.Config` for `run`) for a replica group of `run`, or the
    one-group reference run of `replica_groups.reference_slices`."""
    from train.ledger.recorder import DataLedgerRecorder
    from train.replica_groups.checkpoint import ReplicaCheckpointManager
    from train.replica_groups.manager import ReplicaGroupsManager, replica_group_from_env
    from train.replica_groups.optimizer import ReplicaOptimizersContainer
    from train.replica_groups.recorder import ReplicaLedgerRecorder
    from train.replica_groups.trainer import ReplicaGroupTrainer

    r = run.replica_groups
    enabled = r.groups > 0
    ft = ReplicaGroupsManager.Config(
        enable=enabled,
        process_group="nccl" if accelerator else "gloo",
        replica_id=replica_group_from_env() if enabled else 0,
        group_size=r.groups if enabled else 1,
        min_replica_size=run.min_replica_groups if enabled else 1,
        down_policy=r.down_policy,
        quorum_timeout_s=r.quorum_timeout_s,
        timeout_s=r.timeout_s,
        reference_slices=list(r.reference_slices) or None,
    )
    optimizer, metrics = _as(ReplicaOptimizersContainer.Config, config.optimizer), config.metrics
    if enabled:  # each group logs its own metrics.jsonl and TensorBoard scalars
        folder = replica_dir("", ft.replica_id)
        metrics = replace(
            metrics, jsonl_name=str(folder / METRICS), save_tb_folder=str(folder / TB_DIR)
        )
    return _as(
        ReplicaGroupTrainer.Config,
        config,
        replica_groups=ft,
        fingerprint_every=r.fingerprint_every,
        max_retries=r.max_retries,
        optimizer=optimizer,
        metrics=metrics,
        checkpoint=_as(ReplicaCheckpointManager.Config, config.checkpoint),
        hooks=tuple(
            ReplicaLedgerRecorder if hook is DataLedgerRecorder else hook for hook in config.hooks
        ),
    )
