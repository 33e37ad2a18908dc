"""The replica-group run's `Trainer.Config`: `train.build.to_trainer_config`'s, with the
classes this wing extends picked in place of ours (as `train/build.py` picks ours in place
of torchtitan's): the trainer, the FT manager's section, the optimizers, the checkpointer
and, among the step hooks, the group's data ledger recorder. Every other field is the single-run mapping, unchanged, so a replica group
trains exactly what one launch of the same config would.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace

from common.launch_env import usable_cores
from common.run_layout import METRICS, TB_DIR, replica_dir
from train.config import RunConfig
from train.launch_rules import check_launch
from train.preflight import staged_state_dict
from train.reliability.budgets import STEP_MARGIN, TIMEOUT_MARGIN_S, Budgets

HEAL_CHUNK_BYTES = 10**9  # a heal's HTTP stream per GB of a rank's state, at most a core each
HEARTBEAT_TIMEOUT_S = 5.0  # the Lighthouse's: a group silent this long is dead (the launcher's)


@dataclass(frozen=True)
class FtTimeouts:
    """torchft's timeouts for a replica group of a run (`ft_timeouts`)."""

    heal_s: float  # a rank's state over the heal's transport at replica_groups.heal_gb_per_s
    timeout_s: float  # torchft's: the groups' sum, the commit, a heal's send, receive, lock
    rendezvous_s: float  # a quorum's process-group setup: how long it waits for a member
    quorum_timeout_s: float  # how long a step waits for its quorum
    join_timeout_s: float  # the Lighthouse's wait for a live group that has not asked yet
    quorum_retries: int  # a quorum's tries of an unreachable Lighthouse, one a heartbeat
    chunks: int  # the heal's parallel HTTP streams per rank


def ft_timeouts(run: RunConfig, world_size: int, budgets: Budgets | None = None) -> FtTimeouts:
    """The timeouts of a replica group of `world_size` ranks, from the run's budgets
    (train/reliability/budgets.py: the plan's, else the configured keys) and a rank's state
    (`train.preflight.staged_state_dict`: fp32 weights and Adam's moments, what torchft
    sends a healing peer) at `replica_groups.heal_gb_per_s`; the configured
    `replica_groups.timeout_s` and `quorum_timeout_s` are floors.

    - torchft's `timeout` bounds the groups' gradient sum, the commit and the heal's
      transfer, and the sender's lock on the state it serves (the sender waits there, at
      its commit, for its peers to finish downloading; a shorter lock raised `TimeoutError`
      out of the healthy group's commit). While a group heals, its peers wait in the sum
      for its download and its first step with compile: `STEP_MARGIN` x the heal plus the
      first step's collective timeout (`Budgets.init_timeout_s`).
    - a quorum's gloo setup waits for a member as long as the watchdog lets a live rank go
      without progress (`Budgets.hang_timeout_s`; else `timeout`): every member got the
      quorum at once, so one not come by then died after asking (the step is refused, and
      the next quorum goes on without it; `IncarnationGloo`).
    - the Lighthouse's join timeout outlasts the longest save stall (`STEP_MARGIN` x the
      plan's save, `Budgets.save_s`, plus `TIMEOUT_MARGIN_S`): a group saving still beats,
      and a quorum formed without it would make it heal;
    - a step's quorum waits for that join and a peer's first step; torchft asks an
      unreachable Lighthouse (restarting) again every quorum timeout / (retries + 1): the
      retries make that a heartbeat timeout, not minutes."""
    budgets = budgets or Budgets.of(run)
    r = run.replica_groups
    degrees = check_launch(run, world_size)
    state = staged_state_dict(run, degrees).bytes
    checkpoint = budgets.planned.checkpoint_bytes if budgets.planned else state * world_size
    heal_s = state / (r.heal_gb_per_s * 1e9)
    timeout_s = max(r.timeout_s, STEP_MARGIN * heal_s + budgets.init_timeout_s)
    join_s = STEP_MARGIN * budgets.save_s(checkpoint) + TIMEOUT_MARGIN_S
    quorum_s = max(r.quorum_timeout_s, join_s + budgets.init_timeout_s)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    chunks = max(1, min(math.ceil(state / HEAL_CHUNK_BYTES), usable_cores() // local))
    return FtTimeouts(
        heal_s=heal_s,
        timeout_s=timeout_s,
        rendezvous_s=min(timeout_s, budgets.hang_timeout_s or timeout_s),
        quorum_timeout_s=quorum_s,
        join_timeout_s=join_s,
        quorum_retries=math.ceil(quorum_s / HEARTBEAT_TIMEOUT_S),
        chunks=chunks,
    )


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
    times = ft_timeouts(run, int(os.environ.get("WORLD_SIZE", "1")), config.budgets)
    ft = ReplicaGroupsManager.Config(
        enable=enabled,
        process_group="nccl" if accelerator else "gloo",
        replica_id=replica_group_from_env() if enabled else 0,
        group_size=r.groups if enabled else 1,
        min_replica_size=run.min_replica_groups if enabled else 1,
        down_policy=r.down_policy,
        quorum_timeout_s=times.quorum_timeout_s,
        timeout_s=times.timeout_s,
        rendezvous_s=times.rendezvous_s,
        quorum_retries=times.quorum_retries,
        heal_chunks=times.chunks,
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
