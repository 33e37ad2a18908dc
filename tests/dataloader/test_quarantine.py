"""Quarantined documents (`TokenShardDataLoader.add_quarantine`): never trained again.

A loss-spike rollback skips global sequences; a document that caused the spike comes back
the next epoch in another window. The quarantine names documents by their on-disk token
range instead, and each dataset passes over every window overlapping one, in any epoch.
What must hold: each dataset's stream is its unquarantined stream with exactly those
windows taken out, in the same order, and the mix picks the same dataset for every global
sequence (nothing else moves: the rest stays exact-once); from the point the quarantine is
added on, across resumes on other world sizes; the windows passed over are counted. With
nothing quarantined the stream is unchanged: tests/dataloader/test_order_golden.py pins it.

The data is the golden test's (`write_split`) with small blocks and groups, so the
quarantined documents cross block and group boundaries and every epoch cuts them anew.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataloader import MixEntry, TokenShardDataLoader
from dataloader.manifest import Manifest
from tests.dataloader.test_order_golden import DATASETS, SEQ_LEN, write_split

SMALL = {"block_tokens": 1024, "shuffle_blocks": 4}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("quarantine")
    for name, (documents, shards, salt) in DATASETS.items():
        write_split(root / name / "train", documents, shards, salt)
    return [root / "a" / "train", root / "b" / "train"]


def build(paths, world=1, rank=0, batch=2):
    config = TokenShardDataLoader.Config(
        mix=[MixEntry(str(p), 2.0 - i) for i, p in enumerate(paths)], seed=3, **SMALL
    )
    return config.build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=SEQ_LEN, local_batch_size=batch
    )


def document_ranges(path, documents) -> list[tuple[str, int, int]]:
    """(content_sha256, first token, end token) of these documents of a split."""
    manifest = Manifest.load(path)
    starts = np.load(manifest.documents_path)
    return [(manifest.content_sha256, int(starts[d]), int(starts[d + 1])) for d in documents]


def rows(loaders, steps: int) -> list[tuple[int, int, int]]:
    """(dataset, epoch, on-disk start) of every row the ranks yield, in global order."""
    found = []
    for _ in range(steps):
        for loader in loaders:
            next(loader)
            found += loader.last_origins
    return found


def quarantined(row, ranges_by_dataset) -> bool:
    """Whether a row's window (tokens [start, start + L + 1)) meets a quarantined range."""
    d, _, start = row
    return any(start < end and start + SEQ_LEN + 1 > a for a, end in ranges_by_dataset[d])


def expected_after(plain, got, ranges_by_dataset, start: int = 0) -> int:
    """Check `got` against the unquarantined stream `plain` (the module docstring's rule),
    quarantined from row `start` on; the number of windows passed over to yield `got`."""
    assert got[:start] == plain[:start]
    assert [r[0] for r in got] == [r[0] for r in plain[: len(got)]]  # the mix is unchanged
    dropped = 0
    for d in ranges_by_dataset:
        before = sum(r[0] == d for r in got[:start])
        mine = [r for r in got[start:] if r[0] == d]
        theirs = [r for r in plain if r[0] == d][before:]
        kept = [i for i, r in enumerate(theirs) if not quarantined(r, ranges_by_dataset)]
        assert mine == [theirs[i] for i in kept[: len(mine)]], d
        if mine:  # passed over: the quarantined windows before the last one yielded
            dropped += sum(quarantined(r, ranges_by_dataset) for r in theirs[: kept[len(mine) - 1]])
    return dropped


def check_counts(loader) -> None:
    """Each dataset's skipped tokens are its closed groups' tails plus L per window passed
    over, as the state records them."""
    state = json.loads(loader.state_dict()["state_json"])
    for stream, entry in zip(loader.datasets, state["datasets"], strict=True):
        epoch, group, _, _ = entry["block_position"]
        tails = 0
        for e in range(epoch + 1):
            for g in range(stream.num_groups if e < epoch else group):
                layout = stream.group_layout(e, g, SEQ_LEN)
                tails += layout.input_tokens - layout.num_windows * SEQ_LEN
        dropped = entry.get("quarantined_windows", 0)
        assert entry["skipped_tokens"] == tails + dropped * SEQ_LEN


def test_quarantined_windows_are_never_yielded_and_nothing_else_moves(paths):
    # a long document (every 9th from 4 has 700 more tokens: it spans blocks), a short
    # one, and one of the second dataset
    entries = document_ranges(paths[0], [13, 40]) + document_ranges(paths[1], [7])
    ranges = {0: [e[1:] for e in entries[:2]], 1: [entries[2][1:]]}
    loader = build(paths)
    assert loader.add_quarantine(entries) == 3
    assert loader.add_quarantine([("0" * 64, 0, 10)]) == 0  # data this mix does not train
    got = rows([loader], 300)  # ~3 epochs of dataset a, 2 of b
    plain = rows([build(paths)], 400)
    assert {epoch for d, epoch, _ in got if d == 0} >= {0, 1, 2}
    assert not [r for r in got if quarantined(r, ranges)]
    dropped = expected_after(plain, got, ranges)
    assert dropped >= 3 * 2  # each document in some window of each epoch
    assert loader.quarantined_windows == dropped
    assert loader.metrics()["data/quarantined_windows"] == dropped
    check_counts(loader)
    plain_loader = build(paths)
    rows([plain_loader], 10)
    assert "data/quarantined_windows" not in plain_loader.metrics()
    assert "quarantined_windows" not in plain_loader.state_dict()["state_json"]


def test_quarantine_added_at_a_resume_holds_across_world_sizes(paths):
    """As a run resumes: the quarantine is added when the trainer is built
    (train/reliability/rollback.py reads RUN/incidents.jsonl), before the checkpoint's
    loader state is loaded."""
    entries = document_ranges(paths[0], [22, 31]) + document_ranges(paths[1], [4])
    ranges = {0: [e[1:] for e in entries[:2]], 1: [entries[2][1:]]}
    state, got = {}, []
    for world, batch, steps, quarantine in [(2, 2, 10, False), (3, 1, 40, True), (1, 4, 40, True)]:
        loaders = [build(paths, world, rank, batch) for rank in range(world)]
        for loader in loaders:
            if quarantine:
                loader.add_quarantine(entries)
            loader.load_state_dict(state)
        got += rows(loaders, steps)
        states = [loader.state_dict() for loader in loaders]
        assert all(s == states[0] for s in states)
        state = states[0]
    plain = rows([build(paths, batch=4)], 250)
    dropped = expected_after(plain, got, ranges, start=10 * 2 * 2)
    assert dropped > 0 and loaders[0].quarantined_windows == dropped
    check_counts(loaders[0])


def test_bad_quarantine_range_is_refused(paths):
    loader = build(paths)
    content = Manifest.load(paths[0]).content_sha256
    with pytest.raises(ValueError, match="outside the dataset"):
        loader.add_quarantine([(content, 10, 10**9)])
