"""common.run_layout: the one answer to "which checkpoints are complete" and the one
metrics.jsonl reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import run_layout
from common.run_layout import checkpoint_dir, list_checkpoints, parse_step_dir, read_metrics


def test_complete_incomplete_and_dcp_only(tmp_path):
    run = tmp_path / "run"
    for step, last_file in [(2, ".metadata"), (4, "model.safetensors.index.json"), (6, None)]:
        folder = checkpoint_dir(run, step)
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"")
        if last_file:
            (folder / last_file).write_bytes(b"")
    (run / "checkpoint" / "step-8").write_text("")  # a file, not a checkpoint
    (run / "checkpoint" / "step-x").mkdir()  # not a step folder
    folder = run / "checkpoint"
    # the trainer resumes from DCP and HF-format saves; export and eval.watch need DCP
    assert list_checkpoints(folder) == ([2, 4], [6])
    assert list_checkpoints(folder, dcp_only=True) == ([2], [4, 6])
    assert list_checkpoints(tmp_path / "missing") == ([], [])
    assert parse_step_dir("step-10") == 10 and parse_step_dir("step-1a") is None


def test_read_metrics_skips_and_counts_a_torn_line(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl does not exist"):
        read_metrics(tmp_path)
    (tmp_path / run_layout.METRICS).write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo\n')
    assert read_metrics(tmp_path) == ([{"step": 1, "loss": 5.0}], 1)


def test_the_sbatch_script_spells_the_same_names():
    """train.sbatch (bash) reads RUN/'s outcome files; it cannot import this module."""
    sbatch = (Path(__file__).resolve().parents[2] / "scripts/slurm/train.sbatch").read_text()
    for name in (
        run_layout.PREEMPTED,
        run_layout.DIVERGED,
        f"{run_layout.HANG_DIR}/hang.json",
    ):
        assert f"$TRAIN_RUN_DIR/{name}" in sbatch, name
