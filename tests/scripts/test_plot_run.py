"""scripts/plot_run.py on a folder that holds no run: one line, and nothing written there."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from plot_run import main  # noqa: E402


def test_a_folder_without_a_run_gets_one_line_and_no_plots_folder(tmp_path, capsys):
    """plots/ was made before metrics.jsonl was looked for: a non-run was left a folder."""
    assert main([str(tmp_path / "no_run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no_run/metrics.jsonl does not exist" in err, err
    assert not (tmp_path / "no_run").exists()
