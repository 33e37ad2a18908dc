"""seq_len changes mid-run (at a resume and at a schedule phase), with DP reshards:
exactly once at the token level.

The property checked, per dataset: over one epoch, the input positions of the windows
trained on never overlap (no token twice), and the positions not covered add up to the
loader's `skipped_tokens` counter (every other token is trained on), which stays within
the documented bound. Each row's tokens are compared with the on-disk stream at the
position the loader reports, so the positions cannot lie, and a window is a contiguous
span of the stream (a long document's window holds consecutive tokens of it).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from dataloader import MixEntry, TokenShardDataLoader
from dataloader.loader import SchedulePhase
from dataloader.manifest import Manifest
from tests.utils.distributed import run_distributed_test

BLOCK, GROUP = 1024, 4  # small shuffle blocks and groups, so that changes cut groups short


def build(paths, *, world=1, rank=0, batch=2, seq_len=256, weights=None, **kw):
    weights = weights or [1.0] * len(paths)
    config = TokenShardDataLoader.Config(
        mix=[MixEntry(str(p), w) for p, w in zip(paths, weights, strict=True)],
        seed=5,
        block_tokens=BLOCK,
        shuffle_blocks=GROUP,
        **kw,
    )
    return config.build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=seq_len, local_batch_size=batch
    )


def stream(path) -> np.ndarray:
    manifest = Manifest.load(path)
    return np.concatenate(
        [np.fromfile(Path(path) / s.file, dtype=manifest.dtype) for s in manifest.shards]
    ).astype(np.int64)


def rows_of(loader, batch, streams) -> list[tuple[int, int, int, int]]:
    """(dataset, epoch, start, seq_len) of each row, after checking its tokens on disk."""
    inputs, labels = batch[0]["input"].numpy(), batch[1].numpy()
    rows = []
    for row, (d, epoch, start) in enumerate(loader.last_origins):
        length = inputs.shape[1]
        on_disk = streams[d][start : start + length + 1]
        assert np.array_equal(inputs[row], on_disk[:-1]) and labels[row, -1] == on_disk[-1]
        rows.append((d, epoch, start, length))
    return rows


def skipped_per_dataset(state) -> list[int]:
    return [d["skipped_tokens"] for d in json.loads(state["state_json"])["datasets"]]


def run_phase(paths, state, world, batch, streams, *, steps=None, until_epoch1=None, **kw):
    """Simulate `world` ranks from `state`: for `steps` steps, or until every dataset in
    `until_epoch1` has yielded a row of epoch 1. Returns (rows, state, skipped at epoch end)."""
    loaders = [build(paths, world=world, rank=r, batch=batch, **kw) for r in range(world)]
    for loader in loaders:
        loader.load_state_dict(json.loads(json.dumps(state)))
    rows, at_epoch_end = [], {}
    for _ in range(steps if steps is not None else 10_000):
        for loader in loaders:
            rows += rows_of(loader, next(loader), streams)
        state = loaders[0].state_dict()
        assert all(loader.state_dict() == state for loader in loaders)
        for d, epoch, _, _ in rows:
            if epoch >= 1 and d not in at_epoch_end:
                # epoch 0 of d closed in this round; no epoch-1 group can have closed yet
                at_epoch_end[d] = skipped_per_dataset(state)[d]
        if until_epoch1 is not None and set(until_epoch1) <= set(at_epoch_end):
            break
    else:
        assert until_epoch1 is None, "did not reach the end of the epoch"
    return rows, state, at_epoch_end


def check_one_pass(rows, streams, skipped, bound):
    """Per dataset: epoch-0 windows disjoint, and uncovered input tokens == skipped <= bound."""
    for d, data in enumerate(streams):
        coverage = np.zeros(len(data) - 1, dtype=np.int64)  # input positions 0 .. T-2
        for dd, epoch, start, length in rows:
            if dd == d and epoch == 0:
                coverage[start : start + length] += 1
        assert coverage.max() == 1, f"dataset {d}: a token was trained on twice"
        uncovered = int((coverage == 0).sum())
        assert uncovered == skipped[d], f"dataset {d}: {uncovered} untrained, {skipped[d]} counted"
        assert 0 < skipped[d] <= bound


@pytest.fixture(scope="module")
def two_datasets(shakespeare_data, tmp_path_factory) -> list[Path]:
    """Two small datasets (~40K and ~30K tokens) with short and long (>512 token) documents."""
    from dataloader.prepare import PrepareConfig, prepare

    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    paths = []
    for name, num_docs in (("a", 60), ("b", 45)):
        docs = [
            " ".join(rng.choice(words) for _ in range(rng.choice([40, 150, 900])))
            for _ in range(num_docs)
        ]
        root = tmp_path_factory.mktemp(f"seqlen_{name}")
        (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        prepare(
            PrepareConfig(
                inputs=[str(root / "docs.jsonl")],
                out=root / "data",
                tokenizer=str(shakespeare_data / "tokenizer"),
                num_workers=1,
                progress=False,
            )
        )
        paths.append(root / "data" / "train")
    return paths


def test_resume_with_seq_len_and_dp_changes_is_one_pass(two_datasets):
    """seq_len 256 -> 512 -> 128 at resumes, on 2 -> 3 -> 1 ranks."""
    paths = two_datasets[:1]
    streams = [stream(p) for p in paths]
    rows, state, _ = run_phase(paths, {}, 2, 2, streams, steps=7, seq_len=256)
    assert state["seq_len"] == 256
    more, state, _ = run_phase(paths, state, 3, 1, streams, steps=5, seq_len=512)
    rows += more
    more, state, at_end = run_phase(paths, state, 1, 4, streams, until_epoch1=[0], seq_len=128)
    rows += more
    assert {length for _, _, _, length in rows} == {256, 512, 128}
    # two changes: each drops at most the rest of one group; the last block's tail < L
    check_one_pass(rows, streams, at_end, bound=2 * GROUP * BLOCK + 512)
    assert json.loads(state["state_json"])["format_version"] == 3
    # long documents stay contiguous: some window lies inside one document of > 512 tokens
    starts = np.asarray(Manifest.load(paths[0]).load_document_starts())
    inside = [
        start
        for _, _, start, length in rows
        if length == 512
        and np.searchsorted(starts, start, "right") == np.searchsorted(starts, start + 512, "right")
    ]
    assert inside


def test_mix_phase_changing_weights_and_seq_len_with_reshards(two_datasets):
    """Two datasets; a schedule phase changes the mix and seq_len together (256 -> 512 at
    sequence 48, mid-run), a seq_len-only phase goes to 128 at 140; ranks 2 -> 3 -> 1."""
    streams = [stream(p) for p in two_datasets]
    kw = dict(
        weights=[1.0, 1.0],
        schedule=[SchedulePhase(48, [1.0, 3.0], 512), SchedulePhase(140, seq_len=128)],
    )
    rows, state, _ = run_phase(two_datasets, {}, 2, 2, streams, steps=20, **kw)  # 0 -> 80
    more, state, _ = run_phase(two_datasets, state, 3, 2, streams, steps=15, **kw)  # -> 170
    rows += more
    more, state, at_end = run_phase(two_datasets, state, 1, 4, streams, until_epoch1=[0, 1], **kw)
    rows += more
    assert {length for _, _, _, length in rows} == {256, 512, 128}
    check_one_pass(rows, streams, at_end, bound=2 * GROUP * BLOCK + 512)
    # the same stream as one uninterrupted single-rank run (pure function of the counters)
    reference, _, _ = run_phase(two_datasets, {}, 1, 4, streams, steps=len(rows) // 4, **kw)
    assert reference == rows[: len(reference)]
    # a seq_len phase must start at a round boundary: one length per batch
    with pytest.raises(ValueError, match="inside the round"):  # 48 is not a multiple of 10
        run_phase(two_datasets, {}, 5, 2, streams, steps=5, **kw)
    with pytest.raises(ValueError, match="exceeds dataloader.block_tokens"):
        build(two_datasets, seq_len=2048)


def test_seq_len_changes_do_not_change_the_fingerprint(two_datasets):
    """A seq_len phase is not a data change: adding one at a resume needs no
    allow_dataset_change, and the mix schedule's identity is unchanged by it."""
    paths = two_datasets
    state = build(paths, schedule=[SchedulePhase(8, [1.0, 2.0])]).state_dict()
    with_seq_len = build(paths, schedule=[SchedulePhase(8, [1.0, 2.0], 512)])
    with_seq_len.load_state_dict(state)
    assert with_seq_len.fingerprint == state["fingerprint"]
    # the block layout is what positions index: refused even with allow_dataset_change
    for allow in (False, True):
        config = TokenShardDataLoader.Config(
            mix=[MixEntry(str(p)) for p in paths],
            seed=5,
            block_tokens=2048,
            shuffle_blocks=4,
            allow_dataset_change=allow,
        )
        loader = config.build(dp_world_size=1, dp_rank=0, seq_len=256, local_batch_size=1)
        with pytest.raises(
            ValueError, match=r"block_tokens, shuffle_blocks.*\[1024, 4\] -> \[2048, 4\]"
        ):
            loader.load_state_dict(build(paths).state_dict())


def _rank_consume(rank, world_size, path, state_in, seq_len, batch, steps, out_file):
    import torch.distributed as dist

    streams = [stream(path)]
    loader = build([path], world=world_size, rank=dist.get_rank(), batch=batch, seq_len=seq_len)
    loader.load_state_dict(json.loads(state_in))
    mine = [rows_of(loader, next(loader), streams) for _ in range(steps)]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (mine, loader.state_dict()))
    if rank == 0:
        rows = [
            row for step in range(steps) for r in range(world_size) for row in gathered[r][0][step]
        ]
        assert all(g[1] == gathered[0][1] for g in gathered)
        Path(out_file).write_text(json.dumps({"rows": rows, "state": gathered[0][1]}))


@pytest.mark.slow  # ~80 s on 2 shared cores: five spawned processes import torch
def test_seq_len_change_across_real_processes(two_datasets, tmp_path):
    """Real gloo ranks: 2 ranks at seq_len 256, then 3 ranks at 512, then 1 at 128 to the
    end of the epoch: one pass, the skipped tokens counted."""
    path = two_datasets[1]
    streams = [stream(path)]
    out1, out2 = tmp_path / "p1.json", tmp_path / "p2.json"
    run_distributed_test(_rank_consume, 2, str(path), "{}", 256, 2, 6, str(out1))
    phase1 = json.loads(out1.read_text())
    state = json.dumps(phase1["state"])
    run_distributed_test(_rank_consume, 3, str(path), state, 512, 1, 4, str(out2))
    phase2 = json.loads(out2.read_text())
    rows = [tuple(r) for r in phase1["rows"] + phase2["rows"]]
    more, _, at_end = run_phase(
        [path], phase2["state"], 1, 4, streams, until_epoch1=[0], seq_len=128
    )
    check_one_pass(rows + more, streams, at_end, bound=2 * GROUP * BLOCK + 512)


def test_start_seq_len_overrides_the_build_seq_len(two_datasets):
    """The trainer gives torchtitan the longest phase (RoPE range) as training.seq_len and
    the loader its own first length: batches start at that length."""
    config = TokenShardDataLoader.Config(
        mix=[MixEntry(str(two_datasets[0]))],
        start_seq_len=128,
        schedule=[SchedulePhase(4, seq_len=512)],
        block_tokens=BLOCK,
    )
    loader = config.build(dp_world_size=1, dp_rank=0, seq_len=512, local_batch_size=2)
    assert [next(loader)[0]["input"].shape[1] for _ in range(3)] == [128, 128, 512]
