"""`ReplicaGroupTrainer`: our `RunTrainer`, one replica group of a torchft run.

Why this class: the replicate dimension is torchft's (a `ReplicaGroupsManager`, torchtitan's
`TorchFTManager` extended), FSDP and TP stay inside a group, and our `RunTrainer` keeps
health, rollback, preemption, FP8 and the ledger. Why not torchtitan's
`FaultTolerantTrainer`: in torchtitan 0.3.0 its `__init__` is a stale copy of `Trainer`'s
(it never hands `ChunkedLossWrapper` its `lm_head`, so the first step fails with "Set
lm_head before calling ChunkedLossWrapper", and it skips `set_spmd_backend`); the rest of
it (an async quorum and the FSDP all-reduce hook) is what this class replaces. So the
trainer is `Trainer`'s own start-up plus `init_distributed`, which builds the manager as
torchtitan's FT trainer does. This class adds what exact-once data needs of a step whose
groups can change:

1. The quorum first (`train_step`): torchft's quorum is formed before the step draws its
   data; a group that heals loads its peer's model, optimizer, schedule, step and loader
   cursor there (`train.replica_groups.checkpoint`), then trains the step like the others.
   The step number is the quorum's: committed steps + 1.
2. The step's slices (`_deal`): a *slice* is one round of the global order for one
   group (its data-parallel ranks x local batch); a full step is groups x accumulation
   slices. With k groups live, the step trains S slices: k x accumulation under
   `down_policy = "shrink"` (a smaller batch), the full count under "accumulate" (the live
   groups train the missing groups' slices too). Slice i goes to the group ranked i mod k,
   in rounds of k slices (`TokenShardDataLoader.deal`); a group with no slice in the last,
   partial round moves past it (`pass_round`). So the step holds exactly the next S slices
   of the global order, whichever groups are live.
3. The sums across groups (`GradientSum`, `_sum_across_groups`): the gradients, each
   scaled by this group's share of the step's tokens (its slices / S: every window is
   full, the loader packs documents), in place, in buckets sent from the parameters'
   hooks during the backward of the group's last micro-batch, the loss in the last bucket
   (the one the spike rule judges, so every group rolls back alike); then the ledger's row
   digest and a bit per group (who took part), as integers. SUMs, through torchft's
   managed process group, every tensor on the group's device (NCCL refuses a host tensor;
   torchft would swallow the error and refuse every step): a group that dies mid-step
   fails it for everyone.
4. The commit (`train_step`): torchft's `should_commit`, inside the optimizer step. A step
   that commits moves the loader's cursor past its S slices; one that does not is served
   again: the loader goes back to the step's start, the LR schedule is restored, and nothing
   is saved; its preemption flags still count (`_after_refusal`), and `max_retries`
   refusals in a row end the run. The ledger records both (`train.replica_groups.recorder`).

Without torchft (`replica_groups.reference_slices`, tests only) the same trainer is one
group that trains a given number of slices each step: the reference a replica run's losses
are compared with, given its participant schedule read from its ledger.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchft.utils import get_stream_context
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from common.run_layout import LEDGER, replica_dir
from train.preflight import REPLICA_BUCKET_BYTES, REPLICA_BUCKETS_IN_FLIGHT
from train.reliability import watchdog
from train.reliability.health import TrainingHealth
from train.replica_groups import fingerprint
from train.replica_groups.manager import ReplicaGroupsManager
from train.replica_groups.recorder import ReplicaLedgerRecorder
from train.shards import local_shard
from train.trainer import RunTrainer


class ReplicaGroupTrainer(RunTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(RunTrainer.Config):
        replica_groups: ReplicaGroupsManager.Config = field(
            default_factory=ReplicaGroupsManager.Config
        )
        fingerprint_every: int = 50
        """`train.config.ReplicaGroupsConfig.fingerprint_every` (`train.replica_groups.fingerprint`)."""
        max_retries: int = 10
        """`train.config.ReplicaGroupsConfig.max_retries` (torchft's own retries are
        unbounded: a group whose collectives always fail would serve a step forever)."""

    ft_manager: ReplicaGroupsManager

    def __init__(self, config: Config):
        super().__init__(config)
        ft = config.replica_groups
        self.optimizers.attach(self.ft_manager)
        self.checkpointer.attach(self.ft_manager)
        self.groups = max(1, ft.group_size)
        self.group = ft.replica_id
        self.policy = ft.down_policy
        self.reference_slices = list(ft.reference_slices or [])
        # this group's data-parallel share, as torchtitan built the loader (no round dealt yet)
        self.group_dp, self.group_dp_rank = self.dataloader.dp_world_size, self.dataloader.dp_rank
        # torchtitan counted a full step's slices over this group alone: groups x accumulation
        # (any other batch is refused before start-up: train.launch_rules.check_launch)
        assert self.gradient_accumulation_steps % self.groups == 0, "see train.launch_rules"
        self.accumulation = self.gradient_accumulation_steps // self.groups
        self._rounds: list[tuple[int, bool]] = []  # this step: (slices in round, mine?)
        self._slices = 0
        self._micro_losses: list[torch.Tensor] = []
        # the group's ledger recorder (a step hook, picked in train/replica_groups/build.py)
        self.ledger = next(h for h in self.hooks if isinstance(h, ReplicaLedgerRecorder))
        self._refused = 0  # the quorum's refusals of this step in a row
        params = [p for m in self.model_parts for p in m.parameters() if p.requires_grad]
        self._grad_sum = GradientSum(self.ft_manager, params)

    def judge(self, step: int, loss: float) -> bool:
        """The spike rule judges the step's loss over every group (the cross-group sum,
        the same number in each group), never this group's own share: every group then
        rolls back alike, and no replica diverges from the others."""
        if self.ft_manager.enabled and self.ledger.step_loss is not None:
            health = next(h for h in self.hooks if isinstance(h, TrainingHealth))
            loss = self.ledger.step_loss / health.loss_copies
        return super().judge(step, loss)

    def init_distributed(self) -> ParallelDims:
        """torchtitan's start-up of this group's own world (its torchrun), then the manager
        that connects the groups (as torchtitan's FT trainer builds it)."""
        parallel_dims = super().init_distributed()
        self.ft_manager = self.config.replica_groups.build()
        return parallel_dims

    # ---- 1 and 4: the quorum, then the step, then the commit
    def train_step(self, data_iterator):
        ft = self.ft_manager
        if ft.enabled:
            self._quorum()
            self._check_rejoined()
            self.step = ft.committed_steps() + 1
        live, rank = ft.participants()
        self._plan_step(live, rank)
        start = self.dataloader.cursor
        lr_state = self.lr_schedulers.state_dict()
        tokens_seen = self.ntokens_seen
        super().train_step(data_iterator)
        if not self.optimizers.committed:
            logger.warning(
                f"step {self.step} was not committed by the quorum ({live} group(s)); "
                "its data is served again"
            )
            self.dataloader.deal(self.dataloader.dp_world_size, self.dataloader.dp_rank, start)
            # the schedule and the LR it already set for the next step (torchtitan steps
            # the schedule whether or not the update was applied)
            self.lr_schedulers.load_state_dict(lr_state)
            self.lr_schedulers.refresh()
            self.ntokens_seen = tokens_seen
            self.checkpointer.skip_next_save()
            self.step = ft.committed_steps()  # the loop's next step is this one again
            self._after_refusal(live)
        else:
            self._refused = 0

    def _after_refusal(self, live: int) -> None:
        """A refused step made no exchange (the optimizers asked torchft first), yet a
        preemption signal or the end time must still stop the run with a save: the
        group's exchange ran anyway, empty, for its flags (`RunTrainer.train_step`; read
        at the step boundary, which then saves the committed state). Refused
        `max_retries` times in a row, the step ends the run, naming torchft's error."""
        if self.exchange.last.signal:
            return
        self._refused += 1
        if self._refused < self.config.max_retries:
            return
        error = self.ft_manager.manager.errored()
        cause = (
            f"torchft's error: {error.original_exception!r}"
            if error is not None
            else f"another group's error, or fewer live groups ({live}) than the quorum's minimum"
        )
        raise ValueError(
            f"replica group {self.group}: step {self.step + 1} was refused by the quorum "
            f"{self._refused} times in a row (max_retries); {cause}"
        )

    def _quorum(self) -> None:
        """torchft's quorum for the step; a state loaded in it is a peer's (a heal). It
        may wait the quorum's timeout, then up to torchft's timeout for the process group's
        setup (a group that died just after joining the quorum never comes to it) and
        again for a heal's transfer: the hang watchdog allows that, or it would end this
        group, maybe the last one holding the run's state, while it waits."""
        ft = self.ft_manager
        wait_s = ft.config.quorum_timeout_s + 2 * ft.config.timeout_s
        self.ledger.healing = True
        try:
            with watchdog.phase("waiting for the quorum", ft.committed_steps(), extra_s=wait_s):
                ft.manager.start_quorum()
        finally:
            self.ledger.healing = False
        self.ledger.healed_to(self.ft_manager.committed_steps())

    def _check_rejoined(self) -> None:
        """A group restarted to rejoin (it read no checkpoint) must heal from a live peer;
        alone at step 0 it would train the run again from its start. A quorum without
        one is not the end: a live peer may be late (a second group died while it
        requested the quorum, and it sits out its process-group setup), so the
        group asks again for as long as a peer can take to come back (the quorum's and
        the collectives' timeouts), then ends: no group holds the state any more."""
        if not self.checkpointer.rejoining:
            return
        self.checkpointer.rejoining = False
        ledger = replica_dir(self.config.dump_folder, self.group) / LEDGER
        if not (ledger.is_file() and ledger.stat().st_size > 0):
            return  # the run had not trained: step 0 is its start
        ft = self.ft_manager
        wait_s = ft.config.quorum_timeout_s + ft.config.timeout_s
        if ft.committed_steps() == 0:
            logger.warning(
                f"replica group {self.group}: no live group with the run's state in its "
                f"quorum yet; asking again for up to {wait_s:.0f} s"
            )
        # a count of 1 s rounds, not a clock: every rank of the group asks as often
        with watchdog.phase("waiting for a peer to heal from", self.step, extra_s=wait_s):
            for _ in range(math.ceil(wait_s)):
                if ft.committed_steps() > 0:
                    break
                time.sleep(1.0)
                watchdog.beat("quorum")
                self._quorum()
        if ft.committed_steps() == 0:
            raise ValueError(
                f"replica group {self.group} restarted to rejoin the run, but no live group "
                f"with its state joined a quorum in {wait_s:.0f} s "
                f"({ft.participants()[0]} group(s) at step 0); relaunch the run to resume "
                "from its last checkpoint"
            )

    # ---- 2: the step's slices
    def _plan_step(self, live: int, rank: int) -> None:
        if self.reference_slices:
            slices = self.reference_slices[min(self.step, len(self.reference_slices)) - 1]
        elif self.policy == "accumulate":
            slices = self.groups * self.accumulation
        else:
            slices = live * self.accumulation
        counts = [min(live, slices - first) for first in range(0, slices, live)]
        rounds = [(count, rank < count) for count in counts]
        self._rounds, self._slices, self._rank, self._live = rounds, slices, rank, live
        self.gradient_accumulation_steps = sum(mine for _, mine in rounds)
        self.ledger.sequences = slices * self.group_dp * self.dataloader.local_batch_size
        self._micro_losses = []

    def _deal(self, count: int) -> None:
        """The loader's next round: `count` slices, this rank's part of slice `_rank`."""
        self.dataloader.deal(count * self.group_dp, self._rank * self.group_dp + self.group_dp_rank)

    def batch_generator(self, data_iterable):
        inner = super().batch_generator(data_iterable)
        while True:
            # the rounds before this rank's next slice that it has no part of: none but
            # the last round can be partial, so this is only ever a round of this step
            while self._rounds and not self._rounds[0][1]:
                self._deal(self._rounds.pop(0)[0])
                self.dataloader.pass_round()
            if self._rounds:
                self._deal(self._rounds.pop(0)[0])
            yield next(inner)

    # ---- 3: the sums across groups, from the backward of this group's last micro-batch
    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        # this group's last micro-batch: its backward sends each final gradient across
        last = len(self._micro_losses) == self.gradient_accumulation_steps - 1
        self._grad_sum.arm(self.gradient_accumulation_steps / self._slices if last else None)
        loss = super().forward_backward_step(**kwargs)
        self._micro_losses.append(loss.detach())
        if len(self._micro_losses) == self.gradient_accumulation_steps:
            for count, _ in self._rounds:  # the step's rounds this group has no slice of
                self._deal(count)
                self.dataloader.pass_round()
            self._rounds = []
            self._sum_across_groups()
        return loss

    def _sum_across_groups(self) -> None:
        ft = self.ft_manager
        tap = self.dataloader.ledger_tap
        # on the group's device, as every tensor a collective sees: NCCL refuses a host one
        ints = torch.tensor(tap.lanes + [1 << self.group], dtype=torch.int64, device=self.device)
        every = self.config.fingerprint_every
        check = ft.enabled and every > 0 and self.step % every == 0
        shards = self._named_shards() if check else []
        if check:  # this group's weights' checksum in its slot of `groups` more lanes
            total = fingerprint.checksums([t for _, t in shards]).sum()
            ints = torch.cat([ints, fingerprint.slots(total, self.group, self.groups)])
        ft.sum_across(ints)
        values = ints.tolist()  # the step's one read of them
        if check:
            prints, values = values[-self.groups :], values[: -self.groups]
        tap.lanes = values[:-1]
        members = values[-1]
        self.ledger.quorum = {
            "live": self._live,
            "rank": self._rank,
            "groups": [g for g in range(63) if members >> g & 1],
        }
        if check and ft.manager.errored() is None:
            self._compare_replicas(shards, prints, self.ledger.quorum["groups"])
        loss = torch.stack([x.float().reshape(1) for x in self._micro_losses]).sum(0)
        # the loss rides the gradients' last bucket, scaled by the share as they are
        step_loss = self._grad_sum.finish(loss) if ft.enabled else loss * self._grad_sum.share
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(step_loss)  # the group's ranks each hold a part of its loss
        self.ledger.step_loss = float(step_loss)

    def _named_shards(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, local_shard(p)) for m in self.model_parts for n, p in m.named_parameters()]

    def _compare_replicas(self, shards, prints: list[int], members: list[int]) -> None:
        """Stop the run, naming the group, rank and parameter, if the live groups' weights
        differ (`train.replica_groups.fingerprint`)."""
        bad = fingerprint.off_majority(prints, members)
        if not bad:
            return
        line = fingerprint.name_divergence(
            shards,
            group=self.group,
            groups=self.groups,
            members=members,
            bad=bad,
            rank=dist.get_rank() if dist.is_initialized() else 0,
            step=self.step,
            sum_across=self.ft_manager.sum_across,
        )
        logger.error(line)  # this rank may not be its group's rank 0, which prints errors
        raise ValueError(line)

    def close(self) -> None:
        super().close()
        self.ft_manager.close()


class GradientSum:
    """The cross-group SUM of a group's gradients, each times the group's share, in place,
    overlapped with the backward of the group's last micro-batch (`arm`ed only then, so
    every group sends the same collectives in the same order). Each parameter's
    post-accumulate-grad hook sends its final gradient: FSDP calls the sharded parameter's
    once it has accumulated the reduce-scatter output, autograd a plain one's (FSDP's
    all-reduce hook, torchtitan's path, sees one micro-batch's output, and a one-rank group
    has no FSDP). Through torchft's `Manager.allreduce`: an error makes `should_commit`
    say no. A gradient of `REPLICA_BUCKET_BYTES` or more goes alone; smaller ones are
    packed in buckets of about that size, at most `REPLICA_BUCKETS_IN_FLIGHT` in flight:
    all the memory the sum adds (`train.preflight.state_floor`). The loss rides the last
    bucket. On a GPU a collective's wait and copy-back run on the stream its gradient was
    made on (FSDP's reduce stream), and `finish` makes the caller's stream wait for it."""

    def __init__(self, ft: ReplicaGroupsManager, params: list[torch.Tensor]) -> None:
        self.ft = ft
        self.share = 1.0
        self._params = params if ft.enabled else []
        self._armed = False
        self._pending: list[torch.Tensor] = []  # gradients waiting for a bucket
        self._works: list[tuple] = []  # (work, stream, bucket or None, its gradients)
        self._sent: set[int] = set()
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._ready)

    def arm(self, share: float | None) -> None:
        """Send the gradients of the coming backward, times `share` (None: do not)."""
        self._armed = share is not None
        self.share = share if self._armed else self.share

    def _ready(self, param: torch.Tensor) -> None:
        if self._armed:
            self._sent.add(id(param))
            self._add(local_shard(param.grad))

    def _add(self, grad: torch.Tensor) -> None:
        if grad.is_contiguous() and grad.numel() * grad.element_size() >= REPLICA_BUCKET_BYTES:
            self._issue(grad.mul_(self.share), None, [])
            return
        self._pending.append(grad)  # (a bucket of mixed dtypes sums in the widest)
        if sum(g.numel() * g.element_size() for g in self._pending) >= REPLICA_BUCKET_BYTES:
            self._flush()

    def _flush(self) -> None:
        buckets = [w for w in self._works if w[2] is not None]
        if len(buckets) >= REPLICA_BUCKETS_IN_FLIGHT:  # bound the copies: land the oldest
            self._works.remove(buckets[0])
            self._land(*buckets[0])
        grads, self._pending = self._pending, []
        bucket = torch.cat([g.reshape(-1) for g in grads]).mul_(self.share)
        self._issue(bucket, bucket, grads)

    def _issue(self, tensor: torch.Tensor, bucket: torch.Tensor | None, grads: list) -> None:
        stream = torch.accelerator.current_stream() if torch.accelerator.is_available() else None
        work = self.ft.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)
        self._works.append((work, stream, bucket, grads))

    @staticmethod
    def _land(work, stream, bucket, grads) -> None:
        with get_stream_context(stream):
            work.wait()
            if bucket is not None:
                for g, part in zip(grads, bucket.split([g.numel() for g in grads]), strict=True):
                    g.copy_(part.view_as(g))

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        """The last bucket (any gradient no hook sent, then the loss) and every wait; the
        loss summed across groups, times the share, is returned."""
        for p in self._params:  # in the parameters' order: the same in every group
            if p.grad is not None and id(p) not in self._sent:
                self._add(local_shard(p.grad))
        lane = loss.detach().reshape(1).clone()
        self._pending.append(lane)
        self._flush()
        works, self._works, self._sent, self._armed = self._works, [], set(), False
        for work in works:
            self._land(*work)
            if work[1] is not None:
                torch.accelerator.current_stream().wait_stream(work[1])
        return lane
