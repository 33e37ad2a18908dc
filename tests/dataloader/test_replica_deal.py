"""`TokenShardDataLoader.deal` and `pass_round`: the loader side of torchft replica groups
(train/replica_groups/trainer.py). A step of S slices dealt to k live groups round by round,
slice i to group i mod k, must hold exactly the next S slices of the global order, the same
rows a single rank with a local batch of the whole step reads, with skip ranges in between;
every group must end the step at the same position; and a step served again from its start
(not committed) must read the same rows."""

from __future__ import annotations

import pytest

from dataloader import MixEntry, TokenShardDataLoader

B = 2  # local batch: one slice of a one-rank group


def _loader(train, batch: int, skip=()) -> TokenShardDataLoader:
    config = TokenShardDataLoader.Config(
        mix=[MixEntry(str(train), 1.0)], seed=3, skip_sequences=[list(r) for r in skip]
    )
    return config.build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=64, local_batch_size=batch
    )


def _rows(batch) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for row in batch[0]["input"]]


def _step(loaders, slices: int, start=None) -> list[tuple[int, ...]]:
    """One step of `slices` slices dealt to len(loaders) live groups: the rows in slice order."""
    live = len(loaders)
    by_slice: dict[int, list] = {}
    for rank, loader in enumerate(loaders):
        if start is not None:
            loader.deal(live, rank, start)
        for first in range(0, slices, live):
            count = min(live, slices - first)
            loader.deal(count, rank)
            if rank < count:
                by_slice[first + rank] = _rows(next(loader))
            else:
                loader.pass_round()
    cursors = {loader.cursor for loader in loaders}
    assert len(cursors) == 1, "every group ends the step at the same position"
    return [row for i in sorted(by_slice) for row in by_slice[i]]


@pytest.mark.parametrize("skip", [(), ((7, 11),)])
def test_a_step_holds_the_next_slices_whichever_groups_are_live(shakespeare_data, skip):
    train = shakespeare_data / "train"
    groups = [_loader(train, B, skip) for _ in range(3)]
    schedule = [3, 2, 3, 1, 2]  # slices per step: live groups change between steps
    live_per_step = [3, 2, 2, 1, 2]  # accumulate: 3 slices over 2 groups in step 3
    seen = []
    for slices, live in zip(schedule, live_per_step, strict=True):
        seen += _step(groups[:live], slices, start=groups[0].cursor)
        for loader in groups[live:]:  # a group that sat out is healed to the cursor
            loader.deal(1, 0, groups[0].cursor)
    reference = _loader(train, B * sum(schedule), skip)
    assert seen == _rows(next(reference))
    assert groups[0].cursor == reference.cursor


def test_a_step_served_again_reads_the_same_rows(shakespeare_data):
    train = shakespeare_data / "train"
    groups = [_loader(train, B) for _ in range(2)]
    start = groups[0].cursor
    first = _step(groups, 3, start=start)
    again = _step(groups, 3, start=start)  # not committed: dealt again from its start
    assert first == again
    assert len(set(first)) == 3 * B
