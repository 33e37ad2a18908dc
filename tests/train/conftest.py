"""Fixtures for the training tests: `run_toml(folder, **sections)` writes a config through
tests/utils/runs.py `run_config` (configs/debug.toml on the session's prepared Shakespeare
data, shrunk to seconds per step) and returns its path."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.runs import run_config, write_config


@pytest.fixture
def run_toml(shakespeare_data, tmp_path):
    """Write a small test config; returns its path. Sections given override the defaults."""

    def write(folder: Path | None = None, name: str = "test.toml", **sections) -> Path:
        config = run_config(shakespeare_data, folder or tmp_path / "run", **sections)
        return write_config(tmp_path / name, config)

    return write
