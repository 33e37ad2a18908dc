"""Fixtures for the training tests: `run_toml(folder, **sections)` writes a config that
extends configs/debug.toml, points it at the session's prepared Shakespeare data
(`shakespeare_data`) and shrinks it to a few seconds per step on 2 shared CPU cores (seq 128,
batch 2, a handful of steps). The launch and read helpers are in tests/utils/runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w

from tests.utils.runs import merge_sections, small_overrides


@pytest.fixture
def run_toml(shakespeare_data, tmp_path):
    """Write a small test config; returns its path. Sections given override the defaults."""

    def write(folder: Path | None = None, name: str = "test.toml", **sections) -> Path:
        folder = folder or tmp_path / "run"
        config = merge_sections(small_overrides(Path(shakespeare_data), folder), sections)
        path = tmp_path / name
        path.write_text(tomli_w.dumps(config))
        return path

    return write
