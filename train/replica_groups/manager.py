"""`ReplicaGroupsManager`: torchtitan's `TorchFTManager`, with the quorum formed before a
step draws its data.

Why a subclass: torchtitan's manager runs torchft's quorum asynchronously, overlapped with
the forward pass, and lets FSDP's all-reduce hook average the gradients over a fixed
number of groups. Exact-once data needs the quorum *first*: which groups train a step
decides which slices of the global order the step holds, so the quorum must be known
before the first batch is drawn. So this manager asks torchft for a synchronous quorum
(`use_async_quorum=False`): `start_quorum` returns with the participants known, and a
group that heals has already loaded its peer's model, optimizer, schedule, step and loader
cursor, so it trains the step like any other participant.

The sums across groups go through torchft's `Manager.allreduce` (SUM): the gradients in
buckets from their hooks (`train.replica_groups.trainer.GradientSum`), the ledger's row
digest and the group bits here, by `sum_across`; a group that dies mid-reduction fails the
step for all (torchft's `should_commit` then says no, and the step is served again), and a
step that commits carries the digest of every row that went into its gradient. FSDP's
all-reduce hook (torchtitan's path) is not used: it sees one micro-batch's reduce-scatter
output, not the accumulated gradient, and a one-rank group has no FSDP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import ReduceOp
from torchtitan.experiments.torchft.manager import TorchFTManager
from torchtitan.tools.logging import logger

REPLICA_GROUP_ENV = "TRAIN_REPLICA_GROUP"
"""The launcher's environment variable naming this process's replica group (0..N-1)."""


def replica_group_from_env() -> int:
    """This process's replica group, as the launcher set it (0 when none)."""
    value = os.environ.get(REPLICA_GROUP_ENV, "0")
    if not value.isdigit():
        raise ValueError(
            f"{REPLICA_GROUP_ENV}={value!r}: the launcher sets it to the group's number "
            "(0, 1, ...); launch with scripts/train_local.sh --replica-groups N"
        )
    return int(value)


class ReplicaGroupsManager(TorchFTManager):
    @dataclass(kw_only=True, slots=True)
    class Config(TorchFTManager.Config):
        """torchtitan's FT manager section, plus the replica-group policy
        (`train.config.ReplicaGroupsConfig`)."""

        down_policy: str = "shrink"
        """"shrink" or "accumulate" (`train.config.ReplicaGroupsConfig.down_policy`)."""
        quorum_timeout_s: float = 120  # `train.replica_groups.build.ft_timeouts`
        timeout_s: float = 60
        rendezvous_s: float = 60
        quorum_retries: int = 24
        heal_chunks: int = 1  # torchft's HTTP transport: parallel streams of a heal
        reference_slices: list[int] | None = None
        """Tests only: a one-group run without torchft, training these many slices a step."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.use_async_quorum = False  # the quorum is known before a step draws data
        self.group_size = config.group_size
        self.replica_id = config.replica_id
        self._manager = None

    @property
    def enabled(self) -> bool:
        return self.config.enable

    @property
    def manager(self):
        """torchft's `Manager`, built at first use (the checkpointer's registration, once
        the model and optimizer are): from then on the group beats to the Lighthouse, whose
        join timeout waits for a beating group that has not asked for the quorum yet (it
        outlasts a save). Built earlier, a restarting group's start-up would hold its
        peers' quorums."""
        if self._manager is None:
            self._manager = self._build()
        return self._manager

    def _build(self):
        import torchft
        from torchft.checkpointing import HTTPTransport

        config = self.config
        timeout = timedelta(seconds=config.timeout_s)
        if config.process_group == "nccl":
            pg = torchft.ProcessGroupNCCL(timeout=timeout)
        else:  # torchft's gloo group, safe across a Lighthouse restart
            from train.replica_groups.torchft_workarounds import IncarnationGloo

            pg = IncarnationGloo(timeout, rendezvous=timedelta(seconds=config.rendezvous_s))
        return torchft.Manager(
            pg=pg,
            min_replica_size=config.min_replica_size,
            load_state_dict=None,
            state_dict=None,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timeout,
            # the state a healing peer fetches, in parallel chunks; its lock waits `timeout`
            checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=config.heal_chunks),
            replica_id=f"group_{config.replica_id}",
            # every group builds the same initial weights from the seed; a group that
            # joins late heals from a peer instead
            init_sync=False,
            # the Lighthouse may be restarting: the launcher brings it back
            quorum_retries=config.quorum_retries,
        )

    # ---- the step's quorum
    def participants(self) -> tuple[int, int]:
        """(number of groups training this step, this group's rank among them); (1, 0)
        without torchft. The quorum must have been started."""
        if not self.enabled:
            return 1, 0
        rank = self.manager.participating_rank()
        assert rank is not None, "a synchronous quorum always gives a participating rank"
        return self.manager.num_participants(), rank

    def committed_steps(self) -> int:
        """Steps the quorum has committed so far (torchft's step count)."""
        return self.manager.current_step() if self.enabled else 0

    def should_commit(self) -> bool:
        """torchft's commit vote; a `TimeoutError` (a peer that never voted, or a healing
        peer still downloading this group's state when the lock's `timeout` ran out) is a
        step that did not commit: reported to torchft, the step is served again, and a
        group left behind heals at the next quorum."""
        try:
            return self.manager.should_commit()
        except TimeoutError as e:
            logger.warning(
                f"replica group {self.replica_id}: the commit timed out ({e}): the step is served again"
            )
            self.manager.report_error(e)
            return False

    def sum_across(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM `tensor` over the groups of the step, in place. A failure (a group died
        mid-reduction) is reported to torchft, which then refuses to commit the step."""
        if self.enabled:
            self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    def close(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)
