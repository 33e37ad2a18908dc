"""eval.watch --once on a real trained run: evaluates the complete checkpoint (one more vLLM
server start), reports the incomplete one, and a restart does not redo finished steps."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _watch(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eval.watch", str(run), "--once", "--max-model-len", "512"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def test_watch_once_then_restart(trained, trained_steps, tmp_path):
    src, _ = trained
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.toml", "metrics.jsonl", "checkpoint"):
        (shutil.copytree if (src / name).is_dir() else shutil.copy2)(src / name, run / name)
    torn = run / "checkpoint" / "step-99"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half a save")

    first = _watch(run)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "incomplete checkpoint(s) (no .metadata yet), not evaluated: steps [99]" in first.stderr
    done = json.loads((run / "eval" / "done.json").read_text())
    assert list(done) == [str(trained_steps)]
    assert done[str(trained_steps)]["export_ok"] is True
    summary = json.loads((run / "eval" / f"step-{trained_steps}" / "summary.json").read_text())
    assert summary["attention_backend"] == "CPU_ATTN"
    assert summary["step"] == trained_steps
    assert (run / "eval" / "hf" / f"step-{trained_steps}" / "model.safetensors").is_file()
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == [
        f"step-{trained_steps}",
        "step-99",
    ]

    second = _watch(run)  # restart: nothing left to do, no server started
    assert second.returncode == 0, second.stderr[-3000:]
    assert "export, serve, evaluate" not in second.stderr
    assert json.loads((run / "eval" / "done.json").read_text()) == done
