"""Weight fingerprints: the replica groups prove, every few steps, that they still hold the
same weights.

Why: torchft averages the groups' gradients, and every group applies the average to its
own copy of the weights. Nothing in that keeps the copies equal if one drifts: a bit
flipped in memory (silent data corruption), a group that rolled back alone, an update one
group skipped. From then on every group applies the same update to different weights, and
the run trains on without a sign. So every `fingerprint_every` steps each rank checksums
its local shards (the bytes, summed as int32 words into an int64 on the device: any single
flipped bit changes the sum), and the checksum rides the step's cross-group reduction of
integers (`ReplicaGroupTrainer._sum_across_groups`): one int64 lane per group, group g
writes slot g, the others 0, so after the SUM every group sees every live group's
checksum of the same shard (torchft connects the same rank of each group). Equal: nothing
more. Different: the groups off the majority are named (with two groups, both), and a
second reduction of one checksum per parameter names the first parameter that differs;
the run stops with one line naming the group, the rank and the parameter.

Gradients are not fingerprinted: before the cross-group sum each group's gradient is of
its own data, so replicas never hold equal gradients to compare; naming a rank whose
gradients are wrong needs the same batch computed twice, which costs a step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch


def checksums(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor on its device: its bytes summed as int32 words (or bytes)."""
    sums = []
    for t in shards:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        sums.append(words.sum(dtype=torch.int64))
    return torch.stack(sums)


def slots(total: torch.Tensor, group: int, groups: int) -> torch.Tensor:
    """`groups` int64 lanes, this group's checksum `total` in slot `group`, 0 elsewhere."""
    lanes = torch.zeros(groups, dtype=torch.int64, device=total.device)
    lanes[group] = total
    return lanes


def off_majority(summed: Sequence[int], members: Sequence[int]) -> list[int]:
    """The live groups whose checksum differs from the most common one (all of them on a
    tie): [] when every live group agrees."""
    ranked = Counter(summed[g] for g in members).most_common(2)  # (checksum, its groups)
    if len(ranked) <= 1:
        return []
    if ranked[0][1] == ranked[1][1]:  # a tie: no majority
        return list(members)
    return [g for g in members if summed[g] != ranked[0][0]]


def name_divergence(
    named: Sequence[tuple[str, torch.Tensor]],
    *,
    group: int,
    groups: int,
    members: Sequence[int],
    bad: Sequence[int],
    rank: int,
    step: int,
    sum_across: Callable[[torch.Tensor], object],
) -> str:
    """The second pass, on a mismatch: one checksum per parameter, per group, summed across
    the groups (every live group calls it); the line naming the first differing one."""
    mine = checksums([t for _, t in named])
    table = torch.zeros(groups, len(named), dtype=torch.int64, device=mine.device)
    table[group] = mine
    sum_across(table)
    rows = table.tolist()
    first = next((i for i in range(len(named)) if len({rows[g][i] for g in members}) > 1), None)
    where = f"parameter {named[first][0]}" if first is not None else "no single parameter"
    others = [g for g in members if g not in bad]
    return (
        f"replica group(s) {', '.join(map(str, bad))} rank {rank}: weights differ from "
        f"group(s) {', '.join(map(str, others)) or 'the others'} at step {step}, first at "
        f"{where} (checksums of the local shards; this group is {group})"
    )
