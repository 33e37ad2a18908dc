"""Console logs: rank 0 by default, every rank with TRAIN_LOG_RANKS=all, each line tagged."""

from __future__ import annotations

import re

import pytest

from tests.utils.runs import check_ok, torchrun
from train.console import ranks_shown

STEP_LINE = re.compile(r"^\[titan\] \[rank(\d+)\] .*step:\s+(\d+)", re.M)


def test_ranks_shown_parses_the_env_value():
    assert ranks_shown(None, 4) == {0}
    assert ranks_shown("all", 3) == {0, 1, 2}
    assert ranks_shown("0, 2", 4) == {0, 2}
    with pytest.raises(ValueError, match="TRAIN_LOG_RANKS='first'.*comma-separated"):
        ranks_shown("first", 4)


@pytest.mark.slow
@pytest.mark.parametrize("spec, ranks", [(None, ["0"]), ("all", ["0", "1"])])
def test_step_lines_come_from_the_ranks_asked_for(run_toml, monkeypatch, spec, ranks):
    if spec:
        monkeypatch.setenv("TRAIN_LOG_RANKS", spec)
    config = run_toml(
        training={"steps": 2}, validation={"enable": False}, checkpoint={"enable": False}
    )
    proc = torchrun(config, 2, timeout=300)
    check_ok(proc)
    lines = STEP_LINE.findall(proc.stdout + proc.stderr)
    assert sorted(lines) == sorted((rank, step) for rank in ranks for step in ("1", "2"))
    # import-time warnings every rank would repeat are printed once, by a shown rank
    assert (proc.stdout + proc.stderr).count("is an Enum subclass") <= 2 * len(ranks)
