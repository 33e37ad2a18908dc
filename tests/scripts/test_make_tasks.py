"""scripts/make_tasks.py regenerates the shipped task files exactly (a deterministic recipe)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_regenerated_tasks_equal_the_shipped_ones(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tasks.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    shipped = sorted((REPO / "eval" / "tasks").glob("shakespeare_*.jsonl"))
    assert [p.name for p in shipped] == sorted(p.name for p in tmp_path.iterdir())
    for path in shipped:
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name
