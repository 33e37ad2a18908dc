"""A replica group's commit, in process: the project's trainer and manager, built as
`python -m train` builds them, over torchft's real Manager and a real Lighthouse; one
group (a quorum of one), one rank.

- A process group registered for `cuda` only, as NCCL's is: on this CPU machine every
  collective is refused, so every step is refused (on a GPU the same group must commit,
  which the GPU check's replica part shows). torchft retries such a step forever; the
  run must end after `max_retries` refusals with one line naming torchft's error.
- A group whose cross-group reduction fails from step 3 on (torchft's `report_error`, what
  a group dying mid-reduction causes) and a SIGUSR1 then: steps 1 and 2 commit, and the
  refused step 3 still honours the signal: the run saves step 2 and stops.
- A group restarted to rejoin when no group with the run's state is left: it asks the
  quorum again for a bounded time (a live peer may be late), then ends in one line.

A relaunch from a checkpoint is a launch of groups of two ranks
(test_replica_groups.py `test_groups_of_two_ranks_heal_and_a_relaunch_continues_the_count`).
"""

from __future__ import annotations

import os
import signal
from dataclasses import fields
from pathlib import Path

import pytest

from tests.utils.distributed import run_distributed_test
from tests.utils.runs import replica_ledger, run_config, write_config


def _as(cls, config, **overrides):
    return cls(**({f.name: getattr(config, f.name) for f in fields(config) if f.init} | overrides))


def _managers():
    """The two test managers: the project's, with a cuda-only group or a failing reduction."""
    from dataclasses import dataclass

    import torch
    import torchft
    from torchft.process_group import BaseProcessGroup, BaseProcessGroupGloo, ProcessGroup

    from train.replica_groups.manager import ReplicaGroupsManager

    class CudaOnlyGloo(torchft.ProcessGroupGloo):
        """torchft's gloo group with its backend registered for `cuda` only, as NCCL's."""

        def _create_pg(self, store, rank, world_size):
            pg = BaseProcessGroup(store, rank, world_size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            backend = BaseProcessGroupGloo(store, rank, world_size, self._timeout)
            pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, backend)
            return pg

    class CudaOnlyManager(ReplicaGroupsManager):
        @dataclass(kw_only=True, slots=True)
        class Config(ReplicaGroupsManager.Config):
            pass

        def _build(self):
            manager = super()._build()
            # before the first quorum configures it: the Manager holds no other reference
            manager._pg = CudaOnlyGloo(timeout=manager._timeout)
            return manager

    class FailingManager(ReplicaGroupsManager):
        @dataclass(kw_only=True, slots=True)
        class Config(ReplicaGroupsManager.Config):
            pass

        calls = 0

        def sum_across(self, tensor):
            FailingManager.calls += 1
            if FailingManager.calls > 2:  # one reduction a step (the ledger's): from step 3 on
                os.kill(os.getpid(), signal.SIGUSR1)  # the preemption arrives mid-step
                self.manager.report_error(RuntimeError("a peer died mid-reduction"))
            return super().sum_across(tensor)

    return CudaOnlyManager, FailingManager


def _train(config_path: str, manager_cls, ft: dict | None = None, **trainer_overrides):
    from torchft.coordination import LighthouseServer

    from common.io import free_port
    from train.build import to_trainer_config
    from train.config import load_config
    from train.replica_groups.trainer import ReplicaGroupTrainer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.address()
    os.environ["MASTER_PORT"] = str(free_port())  # a fresh rendezvous for each trainer
    config = to_trainer_config(load_config(config_path), world_size=1, accelerator=False)
    config = _as(
        ReplicaGroupTrainer.Config,
        config,
        replica_groups=_as(manager_cls.Config, config.replica_groups, **(ft or {})),
        **trainer_overrides,
    )
    trainer = config.build()
    try:
        try:
            trainer.train()
        finally:
            trainer.close()
        return trainer
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        lighthouse.shutdown()


def _commit_rank(rank, world_size, cuda_only_config, failing_config, first, rejoin):
    from train.runtime import prepare_runtime

    prepare_runtime()
    from torchtitan.tools.logging import init_logger

    from train.reliability.time_limit import install_preemption_handlers

    init_logger()
    install_preemption_handlers()
    os.environ["TRAIN_REPLICA_GROUP"] = "0"
    cuda_only, failing = _managers()

    with pytest.raises(ValueError) as refused:
        _train(cuda_only_config, cuda_only, max_retries=3)
    line = str(refused.value)
    assert "step 1 was refused by the quorum 3 times in a row (max_retries)" in line, line
    assert "No backend type associated with device type cpu" in line, line

    from train.replica_groups.manager import ReplicaGroupsManager

    assert _train(first, ReplicaGroupsManager).step == 3

    # the run trained, then died; the launcher restarts a group to rejoin (it reads no
    # checkpoint), but no group with the run's state is left: it asks again for the
    # quorum's and the collectives' timeouts (2 + 2 s here, set on the manager: the run's
    # own are derived from its plan, train.replica_groups.build.ft_timeouts), then ends in
    # one line naming the relaunch
    os.environ["TRAIN_REPLICA_REJOIN"] = "1"
    with pytest.raises(ValueError, match="no live group with its state joined a quorum in 4 s"):
        _train(rejoin, ReplicaGroupsManager, ft={"timeout_s": 2, "quorum_timeout_s": 2})
    del os.environ["TRAIN_REPLICA_REJOIN"]

    # last: the signal stays received in this process
    trainer = _train(failing_config, failing)
    assert trainer.preempted_signal == signal.SIGUSR1 and trainer.step == 2
    folder = Path(trainer.config.dump_folder) / trainer.config.checkpoint.folder
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"], list(folder.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_refused_step_is_bounded_and_still_honours_preemption(shakespeare_data, tmp_path):
    sections = {
        "validation": {"enable": False},
        "training": {"steps": 6, "seq_len": 64, "global_batch_size": 4},
        "checkpoint": {"interval": 100},
        "replica_groups": {"groups": 2, "min_groups": 1, "timeout_s": 10},
    }
    paths = []
    for name, steps in [("cuda_only", 6), ("failing", 6), ("first", 3)]:
        config = run_config(shakespeare_data, tmp_path / name, sections, training={"steps": steps})
        paths.append(str(write_config(tmp_path / f"{name}-{steps}.toml", config)))
    rejoin = run_config(
        shakespeare_data,
        tmp_path / "first",
        sections,
        replica_groups={"timeout_s": 2, "quorum_timeout_s": 2},
    )
    paths.append(str(write_config(tmp_path / "rejoin.toml", rejoin)))
    run_distributed_test(_commit_rank, 1, *paths, init=False)
    committed = [r["step"] for r in replica_ledger(tmp_path / "first", 0) if r["kind"] == "step"]
    assert committed == [1, 2, 3]
