"""Fixtures for the training tests: `run_toml(folder, **sections)` writes a config through
tests/utils/runs.py `run_config` (configs/debug.toml on the session's prepared Shakespeare
data, shrunk to seconds per step) and returns its path; `short_docs_data`, a prepared
dataset of many short documents (several per training sequence, so document masks
matter); `chaos_run`, one gloo run through a kill -9 (a torn save left behind), a resize
2 -> 3 -> 1, a loss-spike rollback over poisoned documents and seq_len changes
(tests/utils/chaos.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.utils.chaos import ChaosRun, build_chaos_run
from tests.utils.runs import REPO, run_config, write_config


@pytest.fixture(scope="session")
def short_docs_data(shakespeare_data, tmp_path_factory) -> Path:
    """DATA dir (train/ only) of 400 documents of 2-12 words (README.md's), tokenized with
    the Shakespeare tokenizer: a 128-token sequence packs several of them."""
    from dataloader.prepare import PrepareConfig, prepare

    tmp = tmp_path_factory.mktemp("short_docs")
    lines = (REPO / "README.md").read_text().split()
    rng = random.Random(0)
    with (tmp / "docs.jsonl").open("w") as fh:
        for _ in range(400):
            start = rng.randrange(len(lines) - 60)
            fh.write(json.dumps({"text": " ".join(lines[start : start + rng.randint(2, 12)])}))
            fh.write("\n")
    prepare(
        PrepareConfig(
            inputs=[str(tmp / "docs.jsonl")],
            out=tmp / "data",
            tokenizer=str(shakespeare_data / "tokenizer"),
            num_workers=1,
            progress=False,
        )
    )
    return tmp / "data"


@pytest.fixture
def run_toml(shakespeare_data, tmp_path):
    """Write a small test config; returns its path. Sections given override the defaults."""

    def write(folder: Path | None = None, name: str = "test.toml", **sections) -> Path:
        config = run_config(shakespeare_data, folder or tmp_path / "run", **sections)
        return write_config(tmp_path / name, config)

    return write


@pytest.fixture(scope="session")
def chaos_run(tmp_path_factory) -> ChaosRun:
    """The chaos run's RUN folder, data, poisoned documents and incident (built once)."""
    return build_chaos_run(tmp_path_factory.mktemp("chaos"))
