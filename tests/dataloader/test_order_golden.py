"""The loader's exact sample stream, pinned: any change to the order fails here.

Why: the order is a contract with every checkpoint ever written. A run resumed from a
state of format 1, 2 or 3 must go on with exactly the sequences it would have had, so a
refactor of the loader must leave the stream byte-identical, not merely "still
exact-once" (the other tests in this folder prove the properties; this one pins the
bytes). Each case below runs ranks of `TokenShardDataLoader` in-process through phases
(resumes on other world sizes, batch sizes and seq_lens) and hashes everything they
yield: every batch's token ids, positions and labels per rank, `last_sequences`,
`last_origins`, and after each phase the state dict and `metrics()`. The digests are in
`tests/assets/loader_order_golden.json` (see tests/assets/README.md).

The data is built here, not prepared with a tokenizer: two small splits whose token at
on-disk position i is `(i * 40503 + salt) % 65521`, so a token id names its position
(a window's ids say exactly where it was cut), with documents of varied lengths over
several shards. The paths are relative (the test runs in its temp folder), so the state's
fingerprint, which hashes the paths, is the same on every machine.

Formats 1 and 2 start from states the format-1 and format-2 loaders wrote (commits
8166cc5 and e22de0e, loaded from git history) on the same data; they are stored in the
golden file, so the test needs no git history. Regenerate (only for a deliberate change
of the order, in the same commit, saying why):

    REGEN_TEST_ASSETS=1 .venv/bin/python -m pytest tests/dataloader/test_order_golden.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np

from dataloader import MixEntry, TokenShardDataLoader
from dataloader.loader import SchedulePhase
from dataloader.manifest import write_token_split

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "assets" / "loader_order_golden.json"
REGEN = os.environ.get("REGEN_TEST_ASSETS") == "1"
FORMAT1_COMMIT, FORMAT2_COMMIT = "8166cc5", "e22de0e"
SEQ_LEN = 64
SMALL = {"block_tokens": 1024, "shuffle_blocks": 4}  # several groups: seq_len changes cut them

# (documents, shards, salt) of each split: ~12K and ~7K tokens
DATASETS = {"a": (90, 3, 11), "b": (55, 2, 29)}


def write_split(root: Path, num_documents: int, num_shards: int, salt: int) -> None:
    """A prepared split in the real on-disk format (manifest, documents.npy, shards)."""
    lengths = [3 + (i * 37) % 151 + (700 if i % 9 == 4 else 0) for i in range(num_documents)]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = ((np.arange(starts[-1], dtype=np.int64) * 40503 + salt) % 65521).astype(np.uint16)
    bounds = np.linspace(0, num_documents, num_shards + 1).astype(int).tolist()
    write_token_split(root, tokens, starts, bounds, vocab_size=65521)


def mix(*names_and_weights) -> list[tuple[str, float]]:
    return [(f"{name}/train", weight) for name, weight in names_and_weights]


ONE, TWO = mix(("a", 1.0)), mix(("a", 2.0), ("b", 1.0))
# Each case: build parameters, a start state (None: fresh; else a stored old-format state),
# and phases of (world, batch, steps; None: until the data ends) with per-phase overrides.
CASES: dict[str, dict] = {
    "one/format3/reshard": {
        "build": {"mix": ONE, "seed": 3, **SMALL},
        "phases": [(2, 2, 5), (3, 1, 6), (1, 5, 50)],  # past the end of epoch 0
    },
    "one/format3/default_blocks_prefetch": {
        "build": {"mix": ONE, "seed": 4, "prefetch": 3, "read_threads": 2},
        "phases": [(1, 3, 4), (4, 2, 30, {"prefetch": 0})],
    },
    "one/format3/seq_len_phases_and_skips": {
        "build": {
            "mix": ONE,
            "seed": 5,
            "schedule": [(24, None, 128), (60, None, 32)],
            "skip_sequences": [[6, 10], [20, 22], [52, 64]],  # the last spans a phase start
            **SMALL,
        },
        "phases": [(2, 2, 3), (3, 2, 3), (2, 4, 8, {"seq_len": 32}), (1, 4, 20)],
    },
    "one/format3/resume_at_other_seq_len": {
        "build": {"mix": ONE, "seed": 6, **SMALL},
        "phases": [(2, 2, 4), (3, 1, 5, {"seq_len": 128}), (1, 4, 30, {"seq_len": 32})],
    },
    "one/format3/one_pass": {
        "build": {"mix": ONE, "seed": 7, "infinite": False, **SMALL},
        "phases": [(2, 2, 3), (3, 2, None)],  # the last, incomplete round is dropped
    },
    "one/format3/one_pass_to_the_last_window": {
        "build": {"mix": ONE, "seed": 7, "infinite": False, **SMALL},
        "phases": [(1, 1, None)],
    },
    "mix/format3/schedule_skips_reshard": {
        "build": {
            "mix": TWO,
            "seed": 8,
            "schedule": [(24, [1.0, 3.0], None), (48, [1.0, 1.0], 128)],
            "skip_sequences": [[10, 14], [41, 50]],  # the last spans a phase start
            **SMALL,
        },
        "phases": [(2, 2, 4), (3, 1, 5), (2, 3, 4), (1, 6, 30)],
    },
    "mix/format3/one_pass": {
        "build": {"mix": TWO, "seed": 9, "infinite": False, **SMALL},
        "phases": [(3, 2, None)],
    },
    "mix/format3/one_pass_to_the_last_window": {
        "build": {"mix": TWO, "seed": 9, "infinite": False, **SMALL},
        "phases": [(1, 1, None)],
    },
    "mix/format3/dataset_added_at_resume": {
        "build": {"mix": ONE, "seed": 10, **SMALL},
        "phases": [(2, 2, 3), (3, 1, 8, {"mix": TWO, "allow_dataset_change": True})],
    },
}
# Old formats: a stored state of the old loader (key: "format{1,2}/{one,mix}"), continued.
for fmt in (1, 2):
    CASES |= {
        f"one/format{fmt}/reshard_and_skips": {
            "build": {"mix": ONE, "seed": 3},
            "state": f"format{fmt}/one",
            "phases": [(3, 1, 4), (1, 3, 10, {"skip_sequences": [[20, 25]]}), (2, 5, 30)],
        },
        f"one/format{fmt}/one_pass": {
            "build": {"mix": ONE, "seed": 3, "infinite": False},
            "state": f"format{fmt}/one",
            "phases": [(2, 3, None)],
        },
        f"one/format{fmt}/one_pass_to_the_last_window": {
            "build": {"mix": ONE, "seed": 3, "infinite": False},
            "state": f"format{fmt}/one",
            "phases": [(1, 1, None)],
        },
        f"one/format{fmt}/refuses_seq_len_change": {
            "build": {"mix": ONE, "seed": 3},
            "state": f"format{fmt}/one",
            "phases": [(1, 2, 1, {"seq_len": 128})],
        },
        f"one/format{fmt}/refuses_seq_len_phase": {
            "build": {"mix": ONE, "seed": 3, "schedule": [(40, None, 128)]},
            "state": f"format{fmt}/one",
            "phases": [(1, 4, 20)],
        },
        f"mix/format{fmt}/reshard_and_skips": {
            "build": {"mix": TWO, "seed": 8},
            "state": f"format{fmt}/mix",
            "phases": [(2, 2, 4), (3, 1, 6, {"skip_sequences": [[30, 33], [36, 40]]}), (1, 4, 25)],
        },
        f"mix/format{fmt}/one_pass": {
            "build": {"mix": TWO, "seed": 8, "infinite": False},
            "state": f"format{fmt}/mix",
            "phases": [(2, 2, None)],
        },
        f"mix/format{fmt}/dataset_removed_at_resume": {
            "build": {"mix": ONE, "seed": 8, "allow_dataset_change": True},
            "state": f"format{fmt}/mix",
            "phases": [(2, 3, 6)],
        },
    }


def build(params: dict, world: int, rank: int, batch: int) -> TokenShardDataLoader:
    params = dict(params)
    seq_len = params.pop("seq_len", SEQ_LEN)
    params["mix"] = [MixEntry(path, weight) for path, weight in params["mix"]]
    params["schedule"] = [SchedulePhase(*p) for p in params.get("schedule", [])]
    return TokenShardDataLoader.Config(**params).build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=seq_len, local_batch_size=batch
    )


def run_case(case: dict, states: dict) -> dict:
    """Run the case's phases; the sha256 of everything yielded and saved, and the count of
    batches (an error, e.g. a refused seq_len change, is hashed as its message)."""
    digest, num_batches = hashlib.sha256(), 0
    state = states[case["state"]] if "state" in case else {}
    for world, batch, steps, *overrides in case["phases"]:
        params = case["build"] | (overrides[0] if overrides else {})
        loaders = [build(params, world, rank, batch) for rank in range(world)]
        try:
            for loader in loaders:
                loader.load_state_dict(json.loads(json.dumps(state)))
            step = 0
            while steps is None or step < steps:
                try:
                    batches = [next(loader) for loader in loaders]
                except StopIteration:
                    assert steps is None and all(next(x, None) is None for x in loaders[1:])
                    break
                for rank, (loader, (inputs, labels)) in enumerate(
                    zip(loaders, batches, strict=True)
                ):
                    digest.update(f"{step}/{rank}".encode())
                    for tensor in (inputs["input"], inputs["positions"], labels):
                        digest.update(tensor.numpy().astype("<i8").tobytes())
                    digest.update(json.dumps([loader.last_sequences, loader.last_origins]).encode())
                step += 1
                num_batches += 1
            saved = [loader.state_dict() for loader in loaders]
            assert all(s == saved[0] for s in saved), "the state is global"
            state = saved[0]
            digest.update(json.dumps([state, loaders[0].metrics()], sort_keys=True).encode())
        except ValueError as err:
            digest.update(f"ValueError: {err}".encode())
            return {"sha256": digest.hexdigest(), "batches": num_batches, "error": str(err)[:80]}
        finally:
            for loader in loaders:
                loader.close()
    return {"sha256": digest.hexdigest(), "batches": num_batches}


def old_format_states() -> dict:
    """States written by the format-1 and format-2 loaders (from git history)."""
    from tests.dataloader.test_loader import loader_from_git

    states = {}
    for fmt, commit in ((1, FORMAT1_COMMIT), (2, FORMAT2_COMMIT)):
        module = loader_from_git(commit, Path.cwd())
        for name, entries, seed, (world, batch, steps) in (
            ("one", ONE, 3, (2, 2, 3)),
            ("mix", TWO, 8, (1, 3, 5)),
        ):
            config = module.TokenShardDataLoader.Config(
                mix=[module.MixEntry(path, weight) for path, weight in entries], seed=seed
            )
            loaders = [
                config.build(
                    dp_world_size=world,
                    dp_rank=rank,
                    tokenizer=None,
                    seq_len=SEQ_LEN,
                    local_batch_size=batch,
                )
                for rank in range(world)
            ]
            for _ in range(steps):
                for loader in loaders:
                    next(loader)
            states[f"format{fmt}/{name}"] = loaders[0].state_dict()
            for loader in loaders:
                getattr(loader, "close", lambda: None)()  # the format-1 loader had no thread
    return states


def test_loader_order_is_byte_identical_to_the_golden(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative dataset paths: a machine-independent fingerprint
    for name, (num_documents, num_shards, salt) in DATASETS.items():
        write_split(Path(name) / "train", num_documents, num_shards, salt)
    if REGEN:
        states = old_format_states()
        written = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        cases = {name: run_case(case, states) for name, case in CASES.items()}
        golden = {"written_at_commit": written, "cases": cases, "states": states}
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden["cases"]) == sorted(CASES), "regenerate the golden for new cases"
    for name, case in CASES.items():
        assert run_case(case, golden["states"]) == golden["cases"][name], f"case {name}"
