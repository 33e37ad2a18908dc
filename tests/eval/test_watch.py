"""eval.watch --once on a real trained run: exports the complete checkpoint in shards and
evaluates it (one more vLLM server start), reports the incomplete one, and a restart does
not redo finished steps. And which trainer val_loss an eval compares against when the
run died between a checkpoint and its validation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _watch(run: Path, max_shard_size: str = "1MB") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "eval.watch",
            str(run),
            "--once",
            "--max-model-len",
            "512",
            "--max-shard-size",
            max_shard_size,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
@pytest.mark.e2e
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
    hf = run / "eval" / "hf" / f"step-{trained_steps}"
    assert len(list(hf.glob("model-*-of-*.safetensors"))) > 1  # streamed in 1MB shards
    assert (hf / "model.safetensors.index.json").is_file()
    assert done[str(trained_steps)]["trainer_val_step"] == trained_steps
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == [
        f"step-{trained_steps}",
        "step-99",
    ]

    second = _watch(run)  # restart: nothing left to do, no server started
    assert second.returncode == 0, second.stderr[-3000:]
    assert "export, serve, evaluate" not in second.stderr
    assert json.loads((run / "eval" / "done.json").read_text()) == done


def test_trainer_val_loss_falls_back_to_nearest_earlier_validation(tmp_path):
    """A run validating every 100 steps, killed right after checkpoint 300 was saved (before
    its validation), then resumed; metrics.jsonl as train/ writes it, with a torn line."""
    from eval.runner import trainer_val_loss

    rows = [
        {"step": 100, "loss": 4.0},
        {"step": 100, "time": 1.0, "val_loss": 3.9},
        {"step": 200, "time": 2.0, "val_loss": 3.5},
        {"step": 300, "loss": 3.2},
    ]
    lines = [json.dumps(r) for r in rows] + ['{"step": 300, "val_lo']
    # the resumed run redoes step 200 and logs its validation again: the later line wins
    lines += [json.dumps({"step": 200, "time": 3.0, "val_loss": 3.4})]
    lines += [json.dumps({"step": 400, "time": 4.0, "val_loss": 3.1})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert trainer_val_loss(tmp_path, 300) == (200, 3.4)
    assert trainer_val_loss(tmp_path, 400) == (400, 3.1)
    assert trainer_val_loss(tmp_path, 100) == (100, 3.9)
    assert trainer_val_loss(tmp_path, 99) is None
    assert trainer_val_loss(tmp_path, None) is None
    assert trainer_val_loss(tmp_path / "missing", 300) is None


def test_bad_input_is_one_line_before_any_work(tmp_path):
    """The exporter is imported only once a watch starts (so --help stays torch-free); its size
    check still refuses a bad --max-shard-size up front, before any scan or server."""
    run = tmp_path / "run"
    (run / "checkpoint" / "step-5").mkdir(parents=True)
    (run / "checkpoint" / "step-5" / ".metadata").write_bytes(b"")
    (run / "config.toml").write_text("")
    bad_size = _watch(run, max_shard_size="5XB")
    assert bad_size.returncode == 2, bad_size.stderr[-2000:]
    assert bad_size.stderr.strip().splitlines() == [
        "error: --max-shard-size '5XB': expected a positive size such as 5GB, 500MB or 2GiB"
    ]
    assert not (run / "eval").exists()  # nothing exported, nothing recorded
    not_a_run = _watch(tmp_path / "nowhere")
    assert not_a_run.returncode == 2
    assert "not a run folder (no config.toml)" in not_a_run.stderr
    assert len(not_a_run.stderr.strip().splitlines()) == 1
