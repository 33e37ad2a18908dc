"""Weight fingerprints across replica groups (`train.replica_groups.fingerprint`) on three
real gloo processes, each playing one group's rank 0 (torchft's group connects the same
rank of every group; its SUM is a plain all_reduce): one bit flipped in one group's
weights is named with its group, rank and parameter, equal weights pass."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.utils.distributed import run_distributed_test
from train.replica_groups import fingerprint


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # every group builds the same weights, as a run does from its seed
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3, bias=False))


def _check(model: torch.nn.Module, group: int, groups: int, step: int) -> str:
    named = list(model.named_parameters())
    total = fingerprint.checksums([p for _, p in named]).sum()
    lanes = fingerprint.slots(total, group, groups)
    dist.all_reduce(lanes)
    members = list(range(groups))
    bad = fingerprint.off_majority(lanes.tolist(), members)
    if not bad:
        return ""
    return fingerprint.name_divergence(
        named,
        group=group,
        groups=groups,
        members=members,
        bad=bad,
        rank=0,
        step=step,
        sum_across=dist.all_reduce,
    )


def _groups_rank(rank: int, world_size: int) -> None:
    model = _model()
    assert _check(model, rank, world_size, step=1) == ""  # identical replicas: nothing to say
    if rank == 1:  # silent data corruption: bit 3 of one word of the last weight
        with torch.no_grad():
            model[1].weight.view(torch.int32)[2, 5] ^= 1 << 3
    line = _check(model, rank, world_size, step=2)
    assert line.startswith("replica group(s) 1 rank 0: weights differ from group(s) 0, 2"), line
    assert "at step 2, first at parameter 1.weight" in line, line


def test_a_flipped_bit_in_one_group_is_named():
    run_distributed_test(_groups_rank, 3)


def test_two_groups_that_differ_are_both_named():
    assert fingerprint.off_majority([5, 7], [0, 1]) == [0, 1]  # no majority: both
    assert fingerprint.off_majority([5, 7, 5], [0, 2]) == []  # group 1 not live
    assert fingerprint.off_majority([5, 5, 9], [0, 1, 2]) == [2]
