"""scripts/make_tasks.py regenerates the shipped task files and their lm-eval task YAML
exactly (a deterministic recipe)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_regenerated_tasks_equal_the_shipped_ones(tmp_path):
    out, lm_eval_out = tmp_path / "tasks", tmp_path / "lm_eval_tasks"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tasks.py")]
        + ["--out", str(out), "--lm-eval-out", str(lm_eval_out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for shipped_dir, pattern, made in (
        (REPO / "eval" / "tasks", "shakespeare_*.jsonl", out),
        (REPO / "eval" / "lm_eval_tasks", "shakespeare_*.yaml", lm_eval_out),
    ):
        shipped = sorted(shipped_dir.glob(pattern))
        assert [p.name for p in shipped] == sorted(p.name for p in made.iterdir())
        for path in shipped:
            assert (made / path.name).read_bytes() == path.read_bytes(), path.name
