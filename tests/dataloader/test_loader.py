"""TokenShardDataLoader: exact-once across resharding, determinism, mixing, checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dataloader import MixEntry, TokenShardDataLoader
from dataloader.manifest import Manifest
from tests.utils.distributed import backends, rank_device, run_distributed_test

SEQ_LEN = 64
REPO = Path(__file__).resolve().parents[2]


def build(paths, *, world=1, rank=0, batch=2, seq_len=SEQ_LEN, seed=7, weights=None, **config_kw):
    weights = weights or [1.0] * len(paths)
    config = TokenShardDataLoader.Config(
        mix=[MixEntry(str(p), w) for p, w in zip(paths, weights, strict=True)],
        seed=seed,
        **config_kw,
    )
    # torchtitan's exact build() kwargs (trainer.py)
    return config.build(
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=None,
        seq_len=seq_len,
        local_batch_size=batch,
        snapshot_every_n_steps=None,
    )


def windows(batch) -> list[tuple[int, ...]]:
    """Each row as its L+1 tokens (inputs plus the final label): the sequence's identity."""
    inputs, labels = batch[0]["input"], batch[1]
    return [tuple(inputs[i].tolist()) + (int(labels[i, -1]),) for i in range(inputs.shape[0])]


def run_phase(paths, state, world, batch, num_steps, **kw):
    """Simulate `world` ranks for `num_steps` steps; return (sequences in global order, state)."""
    loaders = [build(paths, world=world, rank=r, batch=batch, **kw) for r in range(world)]
    for loader in loaders:
        loader.load_state_dict(state)
    sequences = []
    for _ in range(num_steps):
        for loader in loaders:  # rank r holds the r-th block of B in each round
            sequences += windows(next(loader))
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), "state must be global (identical on every rank)"
    return sequences, states[0]


@pytest.fixture(scope="module")
def train(shakespeare_data) -> Path:
    return shakespeare_data / "train"


def test_batch_layout_labels_and_positions(train):
    manifest = Manifest.load(train)
    loader = build([train], batch=4, seq_len=256)
    for _ in range(20):
        x, y = next(loader)
        inputs, positions = x["input"], x["positions"]
        assert inputs.shape == positions.shape == y.shape == (4, 256)
        assert inputs.dtype == positions.dtype == y.dtype == torch.long
        assert torch.equal(inputs[:, 1:], y[:, :-1])
        assert torch.all(positions[:, 0] == 0) and int(positions.max()) < 256
        is_bos = inputs == manifest.bos_id
        # Positions restart exactly at document starts (BOS) and count up by one otherwise.
        restart = torch.zeros_like(is_bos)
        restart[:, 1:] = positions[:, 1:] == 0
        assert torch.equal(restart[:, 1:], is_bos[:, 1:])
        step = positions[:, 1:] - positions[:, :-1]
        assert torch.all((step == 1) | is_bos[:, 1:])


def test_first_epoch_covers_every_window_once(train):
    """Epoch 0 is a permutation of the N = (T-1)//L windows of the on-disk token stream:
    every window exactly once (same token multiset as tokens [0, N*L]), in shuffled order,
    and epoch 1 is again every window, in another order."""
    manifest = Manifest.load(train)
    all_tokens = np.concatenate(
        [np.fromfile(train / s.file, dtype=manifest.dtype) for s in manifest.shards]
    )
    seq_len = 1024
    num_windows = (manifest.num_tokens - 1) // seq_len
    in_order = {
        tuple(all_tokens[i * seq_len : i * seq_len + seq_len + 1].tolist())
        for i in range(num_windows)
    }
    loader = build([train], batch=1, seq_len=seq_len)
    epoch0 = [windows(next(loader))[0] for _ in range(num_windows)]
    epoch1 = [windows(next(loader))[0] for _ in range(num_windows)]
    assert set(epoch0) == in_order and len(set(epoch0)) == num_windows
    assert set(epoch1) == in_order and epoch1 != epoch0  # reshuffled every epoch
    stream = np.array([w[:-1] for w in epoch0]).ravel()
    assert np.array_equal(
        np.bincount(stream, minlength=2048),
        np.bincount(all_tokens[: num_windows * seq_len], minlength=2048),
    )
    first = [
        tuple(all_tokens[i * seq_len : i * seq_len + seq_len + 1].tolist())
        for i in range(num_windows)
    ]
    assert epoch0 != first  # shuffled, not the on-disk order


@pytest.mark.parametrize(
    "phases",
    [
        [(1, 2, 5), (3, 2, 4)],  # 1 -> 3 ranks
        [(4, 2, 3), (3, 2, 4)],  # 4 -> 3
        [(2, 3, 4), (5, 1, 3)],  # 2 -> 5, batch size changes too
        [(8, 1, 2), (1, 4, 3)],  # 8 -> 1
        [(2, 2, 2), (3, 1, 3), (1, 5, 2)],  # several preemptions
    ],
)
def test_exact_once_across_resume_and_resharding(train, phases):
    total = sum(w * b * s for w, b, s in phases)
    reference, _ = run_phase([train], {}, 1, 1, total)
    resumed, state = [], {}
    for world, batch, steps in phases:
        sequences, state = run_phase([train], json.loads(json.dumps(state)), world, batch, steps)
        resumed += sequences
    assert resumed == reference  # same order, hence same multiset: nothing repeated or skipped
    assert state["num_sequences_consumed"] == total
    assert len(set(reference)) == len(reference)


def _rank_phase(rank, world_size, train, state_in, out_file, batch, steps):
    import torch.distributed as dist

    loader = build([train], world=world_size, rank=dist.get_rank(), batch=batch)
    loader.load_state_dict(json.loads(state_in))
    mine = [windows(next(loader)) for _ in range(steps)]
    # the global count through a tensor collective on the rank's device (NCCL: its GPU)
    consumed = torch.tensor([sum(len(step) for step in mine)], device=rank_device())
    dist.all_reduce(consumed)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (mine, loader.state_dict()))
    if rank == 0:
        sequences = [
            seq for step in range(steps) for r in range(world_size) for seq in gathered[r][0][step]
        ]
        states = [g[1] for g in gathered]
        assert all(s == states[0] for s in states)
        assert consumed.item() == len(sequences) == world_size * batch * steps
        Path(out_file).write_text(json.dumps({"sequences": sequences, "state": states[0]}))


@pytest.mark.parametrize("backend", backends(3))
def test_exact_once_with_real_processes(train, tmp_path, backend):
    """2 real ranks, then resume on 3 real ranks with another batch size."""
    out1, out2 = tmp_path / "phase1.json", tmp_path / "phase2.json"
    run_distributed_test(_rank_phase, 2, str(train), "{}", str(out1), 3, 2, backend=backend)
    phase1 = json.loads(out1.read_text())
    state = json.dumps(phase1["state"])
    run_distributed_test(_rank_phase, 3, str(train), state, str(out2), 2, 2, backend=backend)
    phase2 = json.loads(out2.read_text())
    reference, _ = run_phase([train], {}, 1, 1, 2 * 3 * 2 + 3 * 2 * 2)
    assert [tuple(s) for s in phase1["sequences"] + phase2["sequences"]] == reference


def test_order_is_identical_in_a_fresh_process(train):
    code = (
        "import hashlib, sys; sys.path.insert(0, '.');"
        "from tests.dataloader.test_loader import build;"
        f"loader = build([{str(train)!r}], batch=3, seed=11);"
        "h = hashlib.sha256();"
        "[h.update(next(loader)[0]['input'].numpy().tobytes()) for _ in range(5)];"
        "print(h.hexdigest())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    loader = build([train], batch=3, seed=11)
    digest = hashlib.sha256()
    for _ in range(5):
        digest.update(next(loader)[0]["input"].numpy().tobytes())
    assert result.stdout.strip().splitlines()[-1] == digest.hexdigest()
    other_seed = build([train], batch=3, seed=12)
    assert not torch.equal(
        next(other_seed)[0]["input"], next(build([train], batch=3, seed=11))[0]["input"]
    )


def test_mixing_follows_weights_deterministically(shakespeare_data):
    paths = [shakespeare_data / "train", shakespeare_data / "val"]
    loader = build(paths, batch=4, weights=[3.0, 1.0])
    for step in range(1, 101):
        next(loader)
        counts = json.loads(loader.state_dict()["state_json"])["datasets"]
        n = 4 * step
        # Error feedback keeps every dataset within one sequence of its share.
        assert abs(counts[0]["sequences_consumed"] - 0.75 * n) <= 1
        assert abs(counts[1]["sequences_consumed"] - 0.25 * n) <= 1
    again = build(paths, batch=4, weights=[3.0, 1.0])
    assert windows(next(again)) == windows(next(build(paths, batch=4, weights=[3.0, 1.0])))


def test_validation_mode_is_one_pass_with_equal_batches_per_rank(shakespeare_data):
    val = shakespeare_data / "val"
    manifest = Manifest.load(val)
    num_windows = (manifest.num_tokens - 1) // SEQ_LEN
    config = TokenShardDataLoader.Config(mix=[MixEntry(str(val))], seed=7)
    config = dataclasses.replace(config, infinite=False)  # what torchtitan's Validator does
    world, batch = 3, 4
    per_rank = []
    for rank in range(world):
        loader = config.build(
            dp_world_size=world,
            dp_rank=rank,
            tokenizer=None,
            seq_len=SEQ_LEN,
            local_batch_size=batch,
        )
        per_rank.append([w for b in loader for w in windows(b)])
    assert len({len(r) for r in per_rank}) == 1
    assert len(per_rank[0]) * world == num_windows // (world * batch) * world * batch
    single = [
        w
        for b in config.build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SEQ_LEN, local_batch_size=1
        )
        for w in windows(b)
    ]
    assert len(single) == num_windows and len(set(single)) == num_windows
    assert set().union(*map(set, per_rank)) <= set(single)


def test_on_exhausted_stop(shakespeare_data, tiny_corpus, tmp_path):
    from dataloader.prepare import PrepareConfig, prepare

    src = tiny_corpus.jsonl([f"document number {i} " * 20 for i in range(30)])
    manifest = prepare(
        PrepareConfig(
            inputs=[str(src)],
            out=tmp_path / "d",
            tokenizer=str(shakespeare_data / "tokenizer"),
            on_exhausted="stop",
            num_workers=1,
            progress=False,
        )
    )["train"]
    assert manifest.on_exhausted == "stop"
    loader = build([tmp_path / "d" / "train"], batch=1, seq_len=16)
    assert len(list(loader)) == (manifest.num_tokens - 1) // 16
    mixed = build([tmp_path / "d" / "train", shakespeare_data / "train"], batch=1, seq_len=16)
    assert 0 < len(list(mixed)) < 4 * (manifest.num_tokens - 1) // 16


def test_state_reflects_yielded_batches_and_empty_state_is_fresh(train):
    loader = build([train], world=3, rank=1, batch=2)
    loader.load_state_dict({})
    assert loader.state_dict()["num_sequences_consumed"] == 0
    for step in range(1, 4):
        next(loader)
        assert loader.state_dict()["num_sequences_consumed"] == 6 * step
    assert loader.data_wait_seconds > 0


def test_format2_state_refuses_seq_len_change(train):
    """A format-2 state (written before seq_len could change) fixes its order to its
    seq_len: changing it is refused with the fix; format 3 accepts it (test_seq_len_change)."""
    state = run_phase([train], {}, 1, 2, 2)[1]
    build([train], seq_len=128).load_state_dict(state)  # format 3: accepted
    format2 = dict(
        state, state_json=state["state_json"].replace('"format_version": 3', '"format_version": 2')
    )
    with pytest.raises(ValueError, match="saved with seq_len 64, this run uses 128.*format 2"):
        build([train], seq_len=128).load_state_dict(format2)


def test_a_state_position_outside_the_order_is_refused(train):
    """A position no `advance` makes (a damaged or edited checkpoint) is refused in one line,
    not looped on (a group past the last), counted as negative skipped tokens (more windows
    taken than the group has) or indexed out of range."""
    state = run_phase([train], {}, 1, 2, 2)[1]
    for position in ([0, 1, 64, 0], [0, 0, 64, 10**6], [0, -1, 64, 0], [0, 0, 0, 3]):
        saved = json.loads(state["state_json"])
        saved["datasets"][0]["block_position"] = position
        with pytest.raises(ValueError, match=r"lies outside this dataset's 1 group\(s\)"):
            build([train]).load_state_dict({**state, "state_json": json.dumps(saved)})


def test_resume_refuses_dataset_change_unless_allowed(shakespeare_data):
    train, val = shakespeare_data / "train", shakespeare_data / "val"
    state = run_phase([train], {}, 1, 2, 3)[1]
    with pytest.raises(ValueError, match=r"dataset .*val.* is new.*allow_dataset_change"):
        build([train, val]).load_state_dict(state)
    with pytest.raises(ValueError, match="seed 7 -> 8"):
        build([train], seed=8).load_state_dict(state)
    loader = build([train, val], allow_dataset_change=True)
    loader.load_state_dict(state)
    # Unchanged dataset keeps its position, the new one starts at 0, new weights from here.
    next(loader)
    counts = [
        d["sequences_consumed"] for d in json.loads(loader.state_dict()["state_json"])["datasets"]
    ]
    assert counts == [7, 1]
    reference, _ = run_phase([train], {}, 1, 1, 7)
    assert windows(next(build([train, val])))[0] == reference[0]  # fresh: from the start
    resumed = build([train, val], allow_dataset_change=True)
    resumed.load_state_dict(state)
    assert windows(next(resumed))[0] == reference[6]


def test_refuses_other_tokenizer(shakespeare_data, tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from dataloader.tokenizer import install_tokenizer, train_bpe

    install_tokenizer(None, train_bpe(["some other corpus text"] * 20, 300), tmp_path / "tok")
    other = HuggingFaceTokenizer(tokenizer_path=str(tmp_path / "tok"))
    with pytest.raises(ValueError, match="prepared with a different tokenizer"):
        TokenShardDataLoader.Config(mix=[MixEntry(str(shakespeare_data / "train"))]).build(
            dp_world_size=1, dp_rank=0, tokenizer=other, seq_len=SEQ_LEN, local_batch_size=1
        )
    same = HuggingFaceTokenizer(tokenizer_path=str(shakespeare_data / "tokenizer"))
    TokenShardDataLoader.Config(mix=[MixEntry(str(shakespeare_data / "train"))]).build(
        dp_world_size=1, dp_rank=0, tokenizer=same, seq_len=SEQ_LEN, local_batch_size=1
    )


def test_plugs_into_trainer_config(train):
    from torchtitan.trainer import Trainer

    config = Trainer.Config(
        dataloader=TokenShardDataLoader.Config(mix=[MixEntry(str(train))], seed=3)
    )
    loader = config.dataloader.build(
        dp_world_size=2,
        dp_rank=1,
        tokenizer=None,
        seq_len=SEQ_LEN,
        local_batch_size=2,
        snapshot_every_n_steps=10,
    )
    assert isinstance(loader, TokenShardDataLoader) and next(loader)[0]["input"].shape == (
        2,
        SEQ_LEN,
    )


def test_state_round_trips_through_dcp(train, tmp_path):
    """torchtitan stores the state with DCP: the strings and ints must come back intact."""
    import torch.distributed.checkpoint as dcp

    saved = build([train], batch=2)
    for _ in range(5):
        next(saved)
    dcp.save({"dataloader": saved}, checkpoint_id=str(tmp_path / "ckpt"))
    restored = build([train], world=2, rank=1, batch=1)
    dcp.load({"dataloader": restored}, checkpoint_id=str(tmp_path / "ckpt"))
    assert restored.state_dict() == saved.state_dict()
    assert windows(next(restored)) == windows(next(saved))[1:]


def _counts(state) -> list[int]:
    return [d["sequences_consumed"] for d in json.loads(state["state_json"])["datasets"]]


def test_schedule_phases_are_exact_across_a_reshard_that_straddles_them(shakespeare_data):
    """Phase boundaries at global sequences 10 and 27 fall inside rounds of the resumed runs;
    the resharded run must still equal one uninterrupted W=1, B=1 stream."""
    from dataloader.loader import SchedulePhase

    paths = [shakespeare_data / "train", shakespeare_data / "val"]
    kw = dict(
        weights=[1.0, 1.0],
        schedule=[SchedulePhase(10, [0.2, 0.8]), SchedulePhase(27, [1.0, 0.0])],
    )
    phases = [(2, 2, 2), (3, 1, 4), (5, 1, 3)]  # cursors 0 -> 8 -> 20 -> 35
    total = sum(w * b * s for w, b, s in phases)
    reference, _ = run_phase(paths, {}, 1, 1, total, **kw)
    resumed, state = [], {}
    for world, batch, steps in phases:
        sequences, state = run_phase(
            paths, json.loads(json.dumps(state)), world, batch, steps, **kw
        )
        resumed += sequences
    assert resumed == reference and len(set(reference)) == total
    # Each phase follows its own weights (error feedback restarts at the boundary).
    at = {n: _counts(run_phase(paths, {}, 1, 1, n, **kw)[1]) for n in (10, 27, 35)}
    assert at[10] == [5, 5]
    span = [b - a for a, b in zip(at[10], at[27], strict=True)]
    assert abs(span[0] - 0.2 * 17) <= 1 and abs(span[1] - 0.8 * 17) <= 1
    assert at[35][1] == at[27][1]  # weight 0: no more sequences from val
    # The schedule is part of the stream's identity.
    with pytest.raises(ValueError, match="schedule"):
        build(paths, weights=[1.0, 1.0]).load_state_dict(state)
    with pytest.raises(ValueError, match="one weight per mix entry"):
        build(paths, weights=[1.0, 1.0], schedule=[SchedulePhase(5, [1.0])])
    with pytest.raises(ValueError, match="increasing order"):
        build(
            paths, weights=[1.0, 1.0], schedule=[SchedulePhase(5, [1, 1]), SchedulePhase(5, [1, 2])]
        )


def test_prefetched_batches_are_not_consumed(train):
    """The prefetch thread runs ahead; the state is still the batches returned, and a
    resume from it continues with exactly the next batch."""
    import time

    reference = [windows(next(build([train], batch=3, prefetch=0))) for _ in range(1)]
    plain = build([train], batch=3, prefetch=0)
    expected = [windows(next(plain)) for _ in range(6)]
    assert reference[0] == expected[0]
    ahead = build([train], batch=3, prefetch=4)
    got = [windows(next(ahead)) for _ in range(2)]
    deadline = time.monotonic() + 60  # the thread fills its queue: 4 batches beyond the 2 returned
    while ahead._prefetcher._queue.qsize() < 4:
        assert time.monotonic() < deadline, "the prefetch thread did not run ahead"
        time.sleep(0.01)
    state = ahead.state_dict()
    assert state["num_sequences_consumed"] == 6 and ahead._prefetcher._queue.qsize() == 4
    resumed = build([train], world=2, rank=0, batch=1, prefetch=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    peer = build([train], world=2, rank=1, batch=1, prefetch=0)
    peer.load_state_dict(state)
    for _ in range(4):
        got.append(windows(next(resumed)) + windows(next(peer)))
    flat = [w for b in got for w in b]
    assert flat == [w for b in expected for w in b][: len(flat)]
    ahead.load_state_dict(state)  # discards the prefetched batches, continues at 6
    assert windows(next(ahead)) == expected[2]


def loader_from_git(commit: str, tmp_path: Path):
    """dataloader/loader.py as of `commit` (an older state format), as a module.

    It imports this tree's dataloader modules (its Manifest reads today's prepared data),
    except `legacy_order`, whose interface was the loader's own: that one comes from the
    same commit."""
    import importlib.util

    def show(path: str) -> str:
        shown = subprocess.run(
            ["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True
        )
        if shown.returncode != 0:
            pytest.skip(f"{path} of commit {commit} is not in this clone's git history")
        return shown.stdout

    def load(name: str, source: str, imports: tuple[str, ...] = ()):
        (tmp_path / f"{name}.py").write_text(source)
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through it
        try:
            spec.loader.exec_module(module)
        finally:
            for loaded in (name, *imports):
                del sys.modules[loaded]
        return module

    name, source = f"loader_{commit}", show("dataloader/loader.py")
    legacy_import = "from dataloader.legacy_order import"
    if legacy_import not in source:
        return load(name, source)
    legacy = f"{name}_legacy_order"
    sys.modules[legacy] = load(legacy, show("dataloader/legacy_order.py"))
    return load(name, source.replace(legacy_import, f"from {legacy} import"), (legacy,))


def _resume_legacy(module, train) -> tuple[dict, dict]:
    """A legacy loader (`module`, seed 7) reads 2 batches of 2; its state, resumed by this
    loader resharded to 3 ranks x batch 1, goes on in the legacy order exactly (against
    the legacy loader's own batch-1 order). (the saved state, the resumed one's state)"""

    def old(batch):
        config = module.TokenShardDataLoader.Config(mix=[module.MixEntry(str(train))], seed=7)
        return config.build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SEQ_LEN, local_batch_size=batch
        )

    reference = old(1)
    expected = [windows(next(reference))[0] for _ in range(4 + 9)]
    first = old(2)
    got = [w for _ in range(2) for w in windows(next(first))]
    saved = first.state_dict()
    resumed = [build([train], world=3, rank=r, batch=1) for r in range(3)]
    for loader in resumed:
        loader.load_state_dict(json.loads(json.dumps(saved)))
    for _ in range(3):
        got += [windows(next(loader))[0] for loader in resumed]
    assert got == expected
    return saved, resumed[0].state_dict()


def test_format2_state_resumes_in_format2_order(train, tmp_path):
    """A state of the format-2 loader (window shuffle over the epoch, commit e22de0e)
    resumes exactly in format 2's order, resharded 1 -> 3 ranks, and stays format 2."""
    saved, after = _resume_legacy(loader_from_git("e22de0e", tmp_path), train)
    assert json.loads(saved["state_json"])["format_version"] == 2
    assert json.loads(after["state_json"])["format_version"] == 2
    assert after == saved | {"num_sequences_consumed": 13, "state_json": after["state_json"]}


def test_state_format_version_and_format1_migration(train, tmp_path):
    """States carry format_version 3. A state without one was written by the format-1
    loader (document shuffle): it resumes in format 1's order, exactly (resharded to 3
    ranks x batch 1); newer is refused."""
    state = run_phase([train], {}, 1, 2, 2)[1]
    assert json.loads(state["state_json"])["format_version"] == 3
    future = dict(
        state, state_json=state["state_json"].replace('"format_version": 3', '"format_version": 4')
    )
    with pytest.raises(ValueError, match="format_version 4.*newer version"):
        build([train]).load_state_dict(future)

    saved, after = _resume_legacy(loader_from_git("8166cc5", tmp_path), train)
    assert "format_version" not in saved["state_json"]
    assert json.loads(after["state_json"])["format_version"] == 1  # the run stays format 1
    assert after["num_sequences_consumed"] == 13


def test_schedule_in_the_training_toml_maps_to_global_sequences(tmp_path):
    """[[dataloader.schedule]] start_step S -> global sequence (S-1) x global_batch_size."""
    from train.build import to_trainer_config
    from train.config import ConfigError, load_config
    from train.launch_rules import check_launch

    toml = (REPO / "configs" / "debug.toml").read_text() + (
        '\n[[dataloader.mix]]\npath = "data/a/train"\n[[dataloader.mix]]\npath = "data/b/train"\n'
        "\n[[dataloader.schedule]]\nstart_step = 11\nweights = [1, 0]\n"
    )
    path = tmp_path / "run.toml"
    path.write_text(toml.replace('extends = "', f'extends = "{REPO / "configs"}/'))
    run = load_config(path)
    schedule = to_trainer_config(run).dataloader.schedule
    assert [(p.start_sequence, p.weights) for p in schedule] == [
        (10 * run.training.global_batch_size, [1, 0])
    ]
    with pytest.raises(ConfigError, match="fixed training.global_batch_size"):
        load_config(path, [("training.global_batch_size", -1)])
    # a phase may change seq_len, with or without weights; the loader gets both
    seq_len_phases = path.read_text() + (
        "\n[[dataloader.schedule]]\nstart_step = 21\nseq_len = 512\n"
        "\n[[dataloader.schedule]]\nstart_step = 31\nseq_len = 128\nweights = [1, 1]\n"
    )
    path.write_text(seq_len_phases)
    trainer_config = to_trainer_config(load_config(path))
    # torchtitan sizes RoPE to training.seq_len: the longest phase; the loaders start at 256
    assert trainer_config.training.seq_len == 512
    assert trainer_config.dataloader.start_seq_len == 256
    assert trainer_config.validator.dataloader.start_seq_len == 256
    schedule = trainer_config.dataloader.schedule
    assert [(p.start_sequence, p.weights, p.seq_len) for p in schedule] == [
        (10 * run.training.global_batch_size, [1, 0], None),
        (20 * run.training.global_batch_size, None, 512),
        (30 * run.training.global_batch_size, [1, 1], 128),
    ]
    with pytest.raises(ConfigError, match=r"schedule\[1\].seq_len 4096 .*max_seq_len = 2048"):
        path.write_text(seq_len_phases.replace("seq_len = 512", "seq_len = 4096"))
        load_config(path)
    # context parallelism shards every length the run trains at in 128-token blocks per rank
    path.write_text(seq_len_phases.replace("seq_len = 128", "seq_len = 130"))
    with pytest.raises(ConfigError, match=r"schedule\[2\].seq_len=130 is not divisible by 256"):
        check_launch(load_config(path, [("parallelism.cp", 2)]), 2)
    path.write_text(seq_len_phases.replace("seq_len = 512", "seq_len = 0"))
    with pytest.raises(ConfigError, match=r"schedule\[1\] changes nothing"):
        load_config(path)
    path.write_text(seq_len_phases.replace("weights = [1, 0]", "weights = [1]"))
    with pytest.raises(ConfigError, match="one weight per mix entry"):
        load_config(path)


# --------------------------------------------------------------------------- skip ranges


def _yielded(paths, ranges, phases, **kw):
    """Run `phases` of (world, batch, steps) with skip ranges; (sequences, global indices
    of each, final state, skipped count)."""
    sequences, indices, state, skipped = [], [], {}, 0
    for world, batch, steps in phases:
        loaders = [
            build(paths, world=world, rank=r, batch=batch, skip_sequences=ranges, **kw)
            for r in range(world)
        ]
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(state)))
        for _ in range(steps):
            for loader in loaders:
                sequences += windows(next(loader))
                indices += loader.last_sequences
        state, skipped = loaders[0].state_dict(), loaders[0].skipped_sequences
    return sequences, indices, state, skipped


@pytest.mark.parametrize("mixed", [False, True])
def test_skip_ranges_are_exact_across_resharding(shakespeare_data, mixed):
    """Skipped global sequences are never yielded, everything else is yielded once in the
    uninterrupted order, and after the ranges the state is the one of a run that trained
    them: ranges straddling rounds of several world sizes, one at the start of a round."""
    paths = [shakespeare_data / "train"] + ([shakespeare_data / "val"] if mixed else [])
    kw = {"weights": [1.0, 0.5]} if mixed else {}
    ranges = [[5, 9], [16, 20], [21, 23]]
    skipped = {n for a, b in ranges for n in range(a, b)}
    phases = [(2, 2, 2), (3, 1, 3), (1, 4, 2)]  # 16 used sequences
    total = sum(w * b * s for w, b, s in phases)
    reference, ref_state = run_phase(paths, {}, 1, 1, total + len(skipped), **kw)
    sequences, indices, state, count = _yielded(paths, ranges, phases, **kw)
    kept = [n for n in range(total + len(skipped)) if n not in skipped]
    assert indices == kept
    assert sequences == [reference[n] for n in kept]
    assert state == ref_state  # the counters of a run that consumed every sequence
    assert count == len(skipped)


def test_skip_range_across_a_seq_len_phase_matches_a_run_that_trained_it(train):
    """A rollback skips what was trained at each phase's seq_len: a range over a phase
    boundary advances each part at its own length, so the stream after it is unchanged."""
    from dataloader.loader import SchedulePhase

    kw = {"schedule": [SchedulePhase(8, None, 32)]}
    reference, ref_state = run_phase([train], {}, 1, 2, 8, **kw)  # sequences 0-15
    sequences, indices, state, _ = _yielded([train], [[6, 10]], [(1, 2, 6)], **kw)
    assert indices == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]
    assert sequences == reference[:6] + reference[10:]
    assert state == ref_state


def test_skip_ranges_added_to_a_live_loader_and_bad_ranges(train):
    loader = build([train], batch=2)
    next(loader)
    loader.add_skip_ranges([[4, 6], [2, 4]])  # merged with each other
    assert loader.skip_ranges == ((2, 6),)
    next(loader)
    assert loader.last_sequences == [6, 7] and loader.skipped_sequences == 4
    assert loader.metrics()["data/skipped_sequences"] == 4
    for bad in ([5, 5], [-1, 3], [1, 2, 3]):
        with pytest.raises(ValueError, match=r"dataloader.skip_sequences: bad range"):
            build([train], skip_sequences=[bad])
